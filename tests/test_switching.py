"""The orchestrator's switching strategies (drain, queue, migrate), driven without a cluster by random event orders."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from dora_tasks.core.config import load_config

from pipelines.gate import VersionGate
from pipelines.orchestrator import Load, Migrate, Orchestrator, Start
from pipelines.switching import Migrate as Migrating
from pipelines.switching import proportional_shares, switching_named


class Ledger:
    """What the engines would hold, rebuilt from the actions alone: checks that no request is on two instances, none is
    lost, none moves across versions, and no instance serves two versions' requests at once."""

    def __init__(self, group_size: int, versions_per_instance: int):
        self.g, self.per_instance = group_size, versions_per_instance
        self.where: dict[int, str] = {}  # group -> instance
        self.version: dict[int, int] = {}  # group -> dispatch version
        self.left: dict[int, set[int]] = {}  # group -> unfinished requests
        self.loaded: dict[str, int] = {}  # instance -> version it serves

    def apply(self, action) -> None:
        if isinstance(action, Load):
            held = {self.version[g] for g, w in self.where.items() if w == action.instance}
            assert len(held | {action.version}) <= self.per_instance, f"{action} while holding {held}"
            if action.source:
                assert self.loaded.get(action.source) == action.version, f"{action}: the peer holds another version"
            self.loaded[action.instance] = action.version
        elif isinstance(action, Start):
            assert self.loaded[action.instance] == action.version
            assert self.version.setdefault(action.group_id, action.version) == action.version
            assert action.group_id not in self.where
            self.where[action.group_id] = action.instance
            self.left[action.group_id] = set(range(self.g))
        elif isinstance(action, Migrate):
            assert self.where[action.group_id] == action.source, f"{action}: the group is not on its source"
            assert self.version[action.group_id] == action.version == self.loaded[action.target]
            assert set(action.samples) == self.left[action.group_id], f"{action}: requests left behind or invented"
            self.where[action.group_id] = action.target

    def request_done(self, group_id: int, sample: int) -> None:
        self.left[group_id].discard(sample)

    def group_done(self, group_id: int) -> None:
        del self.where[group_id], self.left[group_id]

    def lose(self, instance: str) -> list[int]:
        lost = sorted(g for g, w in self.where.items() if w == instance)
        for g in lost:
            del self.where[g], self.left[g]
        self.loaded.pop(instance, None)
        return lost


def drive(strategy: str, seed: int, K: int = 3, tbs: int = 3, rbs: int = 8, updates: int = 6, instances: int = 4,
          slots: int = 2, group_size: int = 4, kill_rate: float = 0.0, kv_budget: int = 0, batch_rows: int = 0):
    rng = random.Random(seed)
    gate = VersionGate(K, tbs)
    orch = Orchestrator(rbs, updates * tbs, switching=switching_named(strategy), group_size=group_size)
    ledger = Ledger(group_size, orch.switching.versions_per_instance)
    names = iter(f"w{i:03d}" for i in range(10_000))
    for _ in range(instances):
        orch.add_instance(next(names), slots, kv_budget, batch_rows)
    migrations, steps = [], 0
    while gate.next_update < updates:
        steps += 1
        assert steps < 20_000, "no progress: deadlock"
        for action in orch.decide(gate.capacity()):
            ledger.apply(action)
            if isinstance(action, Start) and action.new:
                gate.on_dispatch(action.group_id, action.version)
            migrations += [action] if isinstance(action, Migrate) else []
        orch.validate()
        assert set(orch.running) == set(ledger.where)
        assert all(orch.running[g][1] == w for g, w in ledger.where.items())
        assert all(orch.unfinished[g] == left for g, left in ledger.left.items())
        _random_event(rng, orch, gate, ledger, kill_rate, slots, kv_budget, batch_rows, names)
        while gate.decide() is not None:
            pass
        if gate.running is not None and (not ledger.where or rng.random() < 0.3):
            gate.on_update_done(gate.running.update)
            orch.on_publish(gate.newest)
    return gate, orch, migrations


def _random_event(rng, orch, gate, ledger, kill_rate, slots, kv_budget, batch_rows, names) -> None:
    running = sorted(ledger.where)
    choice = rng.random()
    if kill_rate and choice < kill_rate and orch.instances:
        dead = rng.choice(sorted(orch.instances))
        assert orch.remove_instance(dead) == ledger.lose(dead)
        orch.add_instance(next(names), slots, kv_budget, batch_rows)
    elif running and choice < 0.8:
        g = rng.choice(running)
        left = sorted(ledger.left[g])
        if left and rng.random() < 0.8:  # one request ends; its KV use changes
            sample = rng.choice(left)
            orch.on_request_done(g, sample)
            ledger.request_done(g, sample)
            orch.on_progress(g, rng.randrange(0, 50) * len(ledger.left[g]))
        else:
            orch.on_group_done(g)
            ledger.group_done(g)
            gate.on_complete(g)


@settings(max_examples=80, deadline=None)
@given(strategy=st.sampled_from(["drain", "queue", "migrate"]), seed=st.integers(0, 10_000), K=st.integers(0, 4),
       tbs=st.integers(1, 4), extra=st.integers(0, 6), instances=st.integers(1, 5), slots=st.integers(1, 3),
       group_size=st.integers(1, 4), kill=st.sampled_from([0.0, 0.05]), kv=st.sampled_from([0, 120]),
       batch=st.sampled_from([0, 1, 4]))
def test_random_event_orders_keep_every_request_on_one_instance_of_its_own_version(
        strategy, seed, K, tbs, extra, instances, slots, group_size, kill, kv, batch):
    gate, orch, migrations = drive(strategy, seed, K, tbs, tbs + extra, 5, instances, slots, group_size, kill, kv,
                                   batch)
    assert len(gate.consumed) == 5 * tbs and not gate.unconsumed  # C2: every group trained once, none left behind
    assert strategy == "migrate" or not migrations


def test_migration_happens_when_an_older_version_holds_more_instances_than_its_remaining_work():
    _, _, migrations = drive("migrate", seed=3, K=3, instances=4, slots=2, group_size=4, updates=8, batch_rows=4)
    assert migrations  # stragglers on several instances of older versions, newest groups queued beyond batches


def two_stragglers(group_size: int, kv_budget: int = 0) -> Orchestrator:
    """Instances a and b, one slot each, start groups 0 and 1 on version 0, which then keep 1 request (a) and half
    of theirs (b); version 1 is published."""
    orch = Orchestrator(rollout_batch_size=4, group_budget=100, switching=Migrating(), group_size=group_size)
    orch.add_instance("a", 1, kv_budget)
    orch.add_instance("b", 1, kv_budget)
    first = orch.decide(capacity=2)
    assert [a for a in first if isinstance(a, Start)] == [Start("a", 0, 0, True), Start("b", 1, 0, True)]
    for sample in range(group_size - 1):
        orch.on_request_done(0, sample)
    for sample in range(group_size // 2):
        orch.on_request_done(1, sample)
    orch.on_publish(1)
    return orch


def newest_backlog(orch: Orchestrator, capacity: int) -> list:
    """Instance z joins, takes the newest version and queues groups beyond its batch (one group's rows): the first
    decodes (it holds KV tokens), the others wait."""
    orch.add_instance("z", 2, batch_rows=orch.group_size)
    actions = orch.decide(capacity)
    orch.on_progress(min(orch.instances["z"].running), 100)
    assert orch.queued_rows(orch.instances["z"]) > 0 and not [a for a in actions if isinstance(a, Migrate)]
    return actions


def test_a_straggler_moves_to_the_other_instance_of_its_version_and_its_instance_takes_the_newest_backlog():
    orch = two_stragglers(group_size=4)
    assert newest_backlog(orch, capacity=4)[0] == Load("z", 1)  # no peer holds version 1 yet: from the store
    actions = orch.decide(capacity=0)
    assert actions[0] == Migrate(0, (3,), 0, "a", "b")  # fewest remaining leaves; b has room for it
    assert actions[1] == Load("a", 1, source="z")  # from the peer that holds it
    assert actions[2] == Migrate(3, (0, 1, 2, 3), 1, "z", "a")  # a queued group of z's moves to a's free batch
    orch.validate()


def test_an_instance_a_group_is_on_its_way_to_does_not_leave_its_version_until_the_group_arrives():
    orch = two_stragglers(group_size=4)
    orch.arriving[0] = "a"  # group 0 was moved to a and its requests are not there yet
    newest_backlog(orch, capacity=4)
    held = orch.decide(capacity=0)  # a (fewest remaining) would leave: b leaves instead, to a
    assert not [m for m in held if isinstance(m, Migrate) and m.source == "a"]
    assert held[:2] == [Migrate(1, (2, 3), 0, "b", "a"), Load("b", 1, source="z")]
    assert orch.instances["a"].version == 0 and orch.arriving == {0: "a", 1: "a", 3: "b"}
    orch.on_arrived(0)
    orch.on_group_done(1)
    assert orch.arriving == {3: "b"}
    orch.validate()


def test_a_leaver_drains_while_no_request_of_the_newest_version_waits_for_a_batch_row():
    orch = two_stragglers(group_size=4)
    actions = orch.decide(capacity=4)  # new groups may start, but none waits: a would idle, its straggler slow b
    assert not [a for a in actions if isinstance(a, Migrate)]
    assert orch.instances["a"].running == {0} and orch.instances["b"].running == {1}
    newest_backlog(orch, capacity=4)
    assert [a for a in orch.decide(capacity=0) if isinstance(a, Migrate)][0] == Migrate(0, (3,), 0, "a", "b")


def test_a_leaver_whose_requests_fit_nowhere_drains_instead():
    orch = Orchestrator(rollout_batch_size=4, group_budget=100, switching=Migrating(), group_size=4)
    orch.add_instance("a", 1)
    orch.add_instance("b", 1)
    orch.decide(capacity=2)
    orch.on_request_done(1, 0)  # b has 1 free row, a's group needs 4
    orch.on_publish(1)
    newest_backlog(orch, capacity=4)
    assert not [a for a in orch.decide(capacity=0) if isinstance(a, Migrate)]


def test_the_kv_budget_of_the_receiving_instance_is_respected():
    def straggler_case(b_tokens: int) -> list:
        orch = two_stragglers(group_size=2, kv_budget=1000)  # a and b each keep one request
        orch.on_progress(0, 400)  # a's straggler holds 400 KV tokens
        orch.on_progress(1, b_tokens)
        newest_backlog(orch, capacity=4)
        return [a for a in orch.decide(capacity=0) if isinstance(a, Migrate) and a.version == 0]

    assert straggler_case(b_tokens=500) == [Migrate(0, (1,), 0, "a", "b")]  # 500 + 400 fit in 1000
    assert straggler_case(b_tokens=700) == []  # 700 + 400 would not: a drains instead


def test_shares_are_proportional_and_every_version_with_work_keeps_an_instance():
    assert proportional_shares({0: 10, 1: 30}, 4) == {0: 1, 1: 3}
    assert proportional_shares({0: 1, 1: 1000}, 4) == {0: 1, 1: 3}
    assert proportional_shares({0: 0, 1: 5}, 3) == {1: 3}
    assert sum(proportional_shares({0: 7, 1: 5, 2: 11}, 6).values()) == 6


def test_groups_queued_beyond_an_engines_batch_move_to_an_instance_of_their_version_with_room():
    orch = Orchestrator(rollout_batch_size=8, group_budget=100, switching=Migrating(), group_size=2)
    orch.add_instance("a", 3, batch_rows=2)  # a takes 3 groups, its engine decodes one at a time
    starts = [a for a in orch.decide(capacity=3) if isinstance(a, Start)]
    assert [s.instance for s in starts] == ["a", "a", "a"]
    orch.on_progress(0, 500)  # group 0 is decoding; 1 and 2 wait in a's queue
    orch.add_instance("b", 3, batch_rows=2)
    actions = orch.decide(capacity=0)
    moved = [a for a in actions if isinstance(a, Migrate)]
    assert moved == [Migrate(1, (0, 1), 0, "a", "b")]  # a queued group (no KV yet), and only one: b's batch is full
    orch.validate()


def test_the_default_switching_migrates_wherever_a_response_can_move_and_drains_elsewhere():
    assert load_config(None, []).switching == "migrate"
    assert load_config(None, ["rollout.switching=queue"]).switching == "queue"
    for cannot_move in (["rollout.partial_rollout=true"], ["rollout.chunk_tokens=0"],
                        ["rollout.versions_per_instance=2", "train.lora.rank=4"]):
        cfg = load_config(None, cannot_move)
        assert (cfg.rollout.switching, cfg.switching) == ("auto", "drain"), cannot_move
    assert load_config(None, ["rollout.switching=drain"]).rollout.per_row_streams is False
