"""The version gate and the orchestrator, driven without a cluster by random event orders (hypothesis)."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.gate import GateInvariantError, VersionGate
from pipelines.orchestrator import Load, Orchestrator, Start
from pipelines.switching import Queue, switching_named


def drive(K: int, tbs: int, rbs: int, updates: int, instances: int, slots: int, seed: int, kill_rate: float = 0.0,
          lookahead: int = 0, order: str = "completion", queued: bool = False, stream: bool = False):
    """Run gate + orchestrator to the end with random completion orders; return the consumption record."""
    rng = random.Random(seed)
    gate = VersionGate(K, tbs, lookahead=lookahead, order=order, stream=stream)
    orch = Orchestrator(rbs, updates * tbs, switching=switching_named("queue" if queued else "drain"))
    for i in range(instances):
        orch.add_instance(f"w{i}", slots)
    started_version: dict[int, int] = {}
    running: list[int] = []
    batches = []
    live_sets = []
    spare = instances
    steps = 0
    while gate.next_update < updates:
        steps += 1
        assert steps < 5_000, "no progress: deadlock"
        for action in orch.decide(gate.capacity()):
            if isinstance(action, Start):
                if action.new:
                    gate.on_dispatch(action.group_id, action.version)
                assert started_version.setdefault(action.group_id, action.version) == action.version
                running.append(action.group_id)
        live_sets.append(set(orch.live_versions()))
        orch.validate()
        gate.validate()
        choice = rng.random()
        if kill_rate and choice < kill_rate and orch.instances:
            dead = rng.choice(sorted(orch.instances))
            for g in orch.remove_instance(dead):
                running.remove(g)
            orch.add_instance(f"w{spare}", slots)
            spare += 1
        elif running and (choice < 0.7 or gate.running is None):
            g = running.pop(rng.randrange(len(running)))
            orch.on_group_done(g)
            gate.on_complete(g)
        while (decision := gate.decide()) is not None:
            batches.append(decision)
        streamed_in = gate.running is not None and set(gate.running.group_ids) <= gate.complete
        if streamed_in and (not running or rng.random() < 0.5):
            gate.on_update_done(gate.running.update)
            orch.on_publish(gate.newest)
        gate.validate()
    return gate, orch, batches, started_version, live_sets


@settings(max_examples=60, deadline=None)
@given(K=st.integers(0, 4), tbs=st.integers(1, 6), extra=st.integers(0, 8), updates=st.integers(1, 8),
       instances=st.integers(1, 4), slots=st.integers(1, 4), seed=st.integers(0, 10_000),
       kill=st.sampled_from([0.0, 0.05]), lookahead=st.integers(0, 2),
       order=st.sampled_from(["dispatch", "completion"]), queued=st.booleans(), stream=st.booleans())
def test_random_event_orders_keep_all_three_constraints(K, tbs, extra, updates, instances, slots, seed, kill,
                                                        lookahead, order, queued, stream):
    gate, orch, batches, started, _ = drive(K, tbs, tbs + extra, updates, instances, slots, seed, kill, lookahead,
                                            order, queued, stream)
    consumed = [g for b in batches for g in b.group_ids]
    # C2: every dispatched group trained exactly once, nothing left behind, exactly N * TBS groups
    assert len(consumed) == len(set(consumed)) == updates * tbs
    assert set(consumed) == set(started) == set(gate.consumed)
    assert not gate.unconsumed
    # C3: staleness within K; C1 (scheduling side): each group started on a single version, the one it was dispatched on
    for b in batches:
        assert len(b.group_ids) == tbs
        assert all(0 <= b.update - v <= K for v in b.versions)
        assert all(started[g] == v for g, v in zip(b.group_ids, b.versions))
    assert [b.update for b in batches] == list(range(updates))
    if K == 0:
        assert all(len(set(b.versions)) == 1 and b.versions[0] == b.update for b in batches)
    if order == "dispatch":  # batches take the groups in the order they were dispatched
        assert consumed == sorted(consumed, key=lambda g: (started[g], g))


def test_lookahead_hands_over_the_next_batch_while_an_update_trains_and_never_at_K0():
    for K, expect_early in ((0, False), (2, True)):
        gate = VersionGate(K, 2, lookahead=1)
        for g in range(2 * (K + 1)):
            gate.on_dispatch(g, 0)
            gate.on_complete(g)
        assert gate.decide().update == 0
        early = gate.decide()  # update 0 still training
        assert (early is not None) == expect_early
        if early is not None:
            assert early.update == 1 and not set(early.group_ids) & set(gate.running.group_ids)
            assert gate.decide() is None  # lookahead 1: at most two batches handed over
        gate.validate()
        gate.on_update_done(0)
        gate.validate()
        assert (gate.running is not None) == expect_early


@pytest.mark.parametrize("K", [1, 2, 3])
def test_several_versions_are_live_at_once_when_K_allows(K):
    _, _, batches, _, live_sets = drive(K, tbs=4, rbs=12, updates=8, instances=3, slots=2, seed=1)
    assert max(len(s) for s in live_sets) >= 2
    assert max(b.max_staleness for b in batches) <= K


def test_K0_never_has_two_versions_live():
    _, _, _, _, live_sets = drive(0, tbs=4, rbs=12, updates=6, instances=3, slots=2, seed=3)
    assert max(len(s) for s in live_sets) == 1


def test_gate_waits_for_stragglers_at_the_window_edge_and_takes_them():
    gate = VersionGate(max_staleness=1, train_batch_size=2)  # order="completion"
    for g in range(2):
        gate.on_dispatch(g, 0)
    gate.on_complete(0)
    assert gate.decide() is None  # update 0 needs TBS complete groups
    gate.on_complete(1)
    d0 = gate.decide()
    assert d0.group_ids == (0, 1)
    gate.on_update_done(0)
    for g in range(2, 6):  # capacity at newest=1, K=1: (1 + 1 + 1) * 2 = 6 groups in total
        gate.on_dispatch(g, 1)
    assert gate.capacity() == 0
    for g in (3, 4, 5):
        gate.on_complete(g)
    d1 = gate.decide()  # version 1 >= 1 - K: nothing forces group 2 in yet
    assert set(d1.group_ids) == {3, 4}
    gate.on_update_done(1)
    assert gate.decide() is None  # update 2: group 2 (version 1 = 2 - K) is a straggler and must come first
    gate.on_complete(2)
    with pytest.raises(GateInvariantError):
        gate.on_dispatch(99, 0)  # old version
    for g in (6, 7):
        gate.on_dispatch(g, 2)
    gate.on_complete(6)
    assert gate.decide().group_ids == (2, 5)
    gate.validate()


def test_a_streamed_update_is_handed_over_before_its_stragglers_and_ends_only_after_them():
    for stream in (False, True):
        gate = VersionGate(max_staleness=1, train_batch_size=2, stream=stream)
        for g in range(4):  # capacity at newest 0, K 1: (0 + 1 + 1) * 2
            gate.on_dispatch(g, 0)
        gate.on_complete(1)
        gate.on_complete(2)
        d0 = gate.decide()  # nothing is a straggler yet (version 0 >= 0 - K): the complete groups, in either mode
        assert d0.group_ids == (1, 2) and d0.pending == ()
        gate.on_update_done(0)
        gate.on_dispatch(4, 1)
        gate.on_complete(4)
        d1 = gate.decide()  # update 1 must take groups 0 and 3 (version 0 = 1 - K), both still running
        if not stream:
            assert d1 is None
            continue
        assert d1.group_ids == (0, 3) and d1.pending == (0, 3)
        gate.validate()
        gate.on_complete(3)
        with pytest.raises(GateInvariantError, match=r"before its groups \[0\] completed"):
            gate.on_update_done(1)
        gate.on_complete(0)
        gate.on_update_done(1)
        assert gate.consumed == {1: 0, 2: 0, 0: 1, 3: 1}
        gate.validate()


def test_a_batch_streams_in_only_its_stragglers():
    gate = VersionGate(max_staleness=2, train_batch_size=2, stream=True)
    for g in range(4):
        gate.on_dispatch(g, 0)
    gate.on_complete(0)
    assert gate.decide() is None  # update 0's floor is version -2: no straggler, and only one group is complete
    gate.on_complete(1)
    assert gate.decide().pending == ()


def test_dispatch_order_waits_for_the_oldest_groups_however_many_others_are_complete():
    gate = VersionGate(max_staleness=3, train_batch_size=2, order="dispatch")
    for g in range(6):
        gate.on_dispatch(g, 0)
    for g in (2, 3, 4, 5):  # the short ones finished first
        gate.on_complete(g)
    assert gate.decide() is None  # groups 0 and 1 were dispatched first: the batch waits for them
    gate.on_complete(1)
    assert gate.decide() is None
    gate.on_complete(0)
    assert gate.decide().group_ids == (0, 1)
    gate.validate()


def test_orchestrator_drains_an_old_version_before_switching():
    orch = Orchestrator(rollout_batch_size=4, group_budget=100)
    orch.add_instance("a", 2)
    first = orch.decide(capacity=2)
    assert first[0] == Load("a", 0) and [a.group_id for a in first[1:]] == [0, 1]
    orch.on_publish(1)
    orch.on_group_done(0)
    assert orch.decide(capacity=10) == []  # group 1 still runs on version 0: no swap, no new prompt on old weights
    orch.on_group_done(1)
    actions = orch.decide(capacity=10)
    assert actions[0] == Load("a", 1)
    assert all(a.version == 1 for a in actions[1:]) and len(actions) == 3


def test_queued_switching_starts_new_groups_behind_the_draining_ones():
    """With queued switching the draining instance takes new prompts of the newest version at once (its engine
    starts them when the older group ends); the older group keeps its version; no third version joins."""
    orch = Orchestrator(rollout_batch_size=4, group_budget=100, switching=Queue())
    orch.add_instance("a", 2)
    orch.decide(capacity=2)
    orch.on_publish(1)
    orch.on_group_done(0)
    actions = orch.decide(capacity=10)
    assert actions == [Load("a", 1), Start("a", 2, 1, True)]
    assert orch.running[1] == (0, "a") and orch.running[2] == (1, "a")
    orch.validate()
    orch.on_publish(2)
    assert orch.decide(capacity=10) == []  # versions 0 and 1 on it: version 2 waits for a free instance
    orch.on_group_done(2)
    assert orch.decide(capacity=10) == [Load("a", 2), Start("a", 3, 2, True)]  # version 0 still drains
    orch.validate()
    orch.on_group_done(1)
    assert orch.decide(capacity=10) == [Start("a", 4, 2, True)]
    orch.validate()


def test_a_lost_instance_restarts_its_groups_on_their_own_version():
    orch = Orchestrator(rollout_batch_size=2, group_budget=2)
    orch.add_instance("a", 2)
    orch.decide(capacity=2)
    orch.on_publish(1)
    assert orch.remove_instance("a") == [0, 1]
    orch.add_instance("b", 2)
    actions = orch.decide(capacity=0)
    assert actions[0] == Load("b", 0)  # the only remaining work is on version 0
    assert [(a.group_id, a.version, a.new) for a in actions[1:]] == [(0, 0, False), (1, 0, False)]
    orch.validate()


def test_gate_state_round_trips():
    gate = VersionGate(2, 3)
    for g in range(3):
        gate.on_dispatch(g, 0)
    gate.on_complete(1)
    again = VersionGate.from_state(gate.to_state())
    assert again.to_state() == gate.to_state()
    again.validate()


def test_a_lost_instance_also_restarts_the_groups_it_generated_but_which_were_not_yet_scored():
    """Their rollout output may have died with the instance before the reward task fetched it: they restart too,
    on their own version; groups of the other instance and groups already scored are left alone."""
    from dora_tasks.core.config import load_config
    from pipelines.driver import Driver, InFlight

    class Client:
        def __init__(self):
            self.cancelled = []

        def cancel(self, futures):
            self.cancelled += futures

    orch = Orchestrator(rollout_batch_size=4, group_budget=8)
    orch.add_instance("a", 2)
    orch.add_instance("b", 2)
    starts = [s for s in orch.decide(capacity=4) if isinstance(s, Start)]
    assert [(s.instance, s.group_id) for s in starts] == [("a", 0), ("a", 1), ("b", 2), ("b", 3)]
    driver = Driver(load_config(None, []), Client(), VersionGate(1, 4), orch, None, None, "", [], [])
    for s in starts:
        driver.in_flight[s.group_id] = InFlight(s.group_id, 0, 0, [f"futures of {s.group_id}"], s.instance)
    driver.on_rolled_out(0)  # group 0 generated on "a", still being scored
    driver.on_rolled_out(2)  # group 2 generated on "b", still being scored
    driver.restart_groups_of("a")
    assert sorted(driver.in_flight) == [2, 3]
    assert sorted(driver.client.cancelled) == ["futures of 0", "futures of 1"]
    assert sorted(orch.queued[0]) == [0, 1]
    orch.add_instance("c", 2)
    restarts = [s for s in orch.decide(capacity=0) if isinstance(s, Start)]
    assert sorted((s.group_id, s.version, s.new) for s in restarts) == [(0, 0, False), (1, 0, False)]
    orch.validate()


def ends(*rows) -> dict:
    """A server's chunk report (as `RolloutPlugin` sends it) of ended responses only."""
    return {"instance": "a", "ended": [list(r) for r in rows], "held": []}


def test_request_ends_the_servers_report_free_rows_and_stale_reports_change_nothing():
    from dora_tasks.core.config import load_config
    from pipelines.driver import Driver, InFlight

    orch = Orchestrator(rollout_batch_size=4, group_budget=8, group_size=4)
    orch.add_instance("a", 1)
    orch.add_instance("b", 1)
    starts = [s for s in orch.decide(capacity=4) if isinstance(s, Start)]
    assert [(s.instance, s.group_id) for s in starts] == [("a", 0), ("b", 1)]
    driver = Driver(load_config(None, []), None, VersionGate(1, 4), orch, None, None, "", [], [])
    for s in starts:
        driver.in_flight[s.group_id] = InFlight(s.group_id, 0, 1, [], s.instance)  # attempt 1
    driver._server_reports.put(ends([0, 1, 2], [0, 1, 3], [1, 0, 0], [7, 1, 0]))  # group 1's attempt 0, 7: gone
    driver._server_reports.put(ends([0, 1, 2]))  # reported again
    driver.take_server_reports()
    assert orch.unfinished == {0: {0, 1}, 1: {0, 1, 2, 3}} and orch.rows_used == {"a": 2, "b": 4}
    driver._server_reports.put(ends([0, 1, 0], [0, 1, 1]))
    driver.take_server_reports()
    assert orch.rows_used["a"] == 0 and 0 in orch.running  # its rollout task has not answered yet
    assert not [s for s in orch.decide(capacity=4) if isinstance(s, Start)]  # it still holds "a"'s one slot
    orch.validate()


def test_kv_tokens_the_servers_report_count_on_the_instance_a_group_is_on_and_no_other():
    from dora_tasks.core.config import load_config
    from pipelines.driver import Driver, InFlight

    orch = Orchestrator(rollout_batch_size=4, group_budget=8, group_size=4)
    orch.add_instance("a", 1, kv_budget=1000)
    orch.add_instance("b", 1, kv_budget=1000)
    starts = [s for s in orch.decide(capacity=4) if isinstance(s, Start)]
    driver = Driver(load_config(None, []), None, VersionGate(1, 4), orch, None, None, "", [], [])
    for s in starts:
        driver.in_flight[s.group_id] = InFlight(s.group_id, 0, 1, [], s.instance)  # attempt 1
    driver._server_reports.put({"instance": "a", "ended": [], "held": [[0, 1, 300], [1, 1, 50], [0, 0, 900]]})
    driver._server_reports.put({"instance": "b", "ended": [], "held": [[1, 1, 200], [7, 1, 10]]})
    driver.take_server_reports()  # group 1 is on "b": "a"'s word on it, attempt 0 and group 7 change nothing
    assert orch.tokens == {0: 300, 1: 200} and orch.kv_held == {"a": 300, "b": 200}
    assert orch.free_kv(orch.instances["a"]) == 700
    driver._server_reports.put({"instance": "a", "ended": [], "held": [[0, 1, 420]]})
    driver.take_server_reports()
    assert orch.kv_held == {"a": 420, "b": 200}
    orch.validate()


def test_retaining_weights_keeps_a_version_the_trainer_published_ahead_of_the_driver(tmp_path):
    """With update lookahead the trainer can publish v+1 before the driver has taken in v's publish: the driver's
    clean-up after v must not delete v+1, which a rollout may be about to load (a run failed on exactly this:
    `no *.safetensors file in .../v000008`). On resume (`drop_unseen`) such versions go: they are published again."""
    from dora_tasks.core.config import load_config
    from pipelines.driver import Driver
    from storage.weight_store import WeightStore

    weights = WeightStore(str(tmp_path / "weights"))
    for v in range(9):
        weights.publish(v, lambda folder: open(f"{folder}/model.safetensors", "w").close())
    gate = VersionGate(3, 2, newest=7, next_update=7)
    gate.unconsumed = {40: 5, 41: 7}
    driver = Driver(load_config(None, []), None, gate, None, None, weights, "", [], [])
    driver.retain_weights()
    assert weights.versions() == [5, 7, 8]
    driver.retain_weights(drop_unseen=True)
    assert weights.versions() == [5, 7]
