"""Several versions on one instance (`rollout.versions_per_instance`, `pipelines.switching.Concurrent`), driven
without a cluster by random events: instances joining and leaving, publishes, requests and groups ending."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.gate import VersionGate
from pipelines.orchestrator import Load, Migrate, Orchestrator, Start
from pipelines.switching import Concurrent, Drain, switching_named
from tests.test_switching import Ledger


class AdapterLedger(Ledger):
    """What the engines would hold, rebuilt from the actions alone: each instance's adapters (the version it was
    last told to load, and every version of the requests it runs) and each group's one placement; `loaded` is the
    version an instance's new groups start on."""

    def __init__(self, group_size: int, slots: int, versions_per_instance: int):
        super().__init__(group_size, versions_per_instance)
        self.rows = slots * group_size
        self.most_versions = 0  # the most versions of running requests one instance held at once

    def held(self, instance: str) -> set[int]:
        running = {self.version[g] for g, w in self.where.items() if w == instance}
        return running | ({self.loaded[instance]} if instance in self.loaded else set())

    def apply(self, action, newest: int) -> None:
        assert not isinstance(action, Migrate), f"{action}: a group moved"
        if isinstance(action, Load):
            self.loaded[action.instance] = action.version
        else:
            assert isinstance(action, Start)
            assert action.group_id not in self.where, f"{action}: the group already runs"
            assert action.version in self.held(action.instance), f"{action}: no adapter of that version there"
            assert self.version.setdefault(action.group_id, action.version) == action.version, \
                f"{action}: a group restarted on another version"
            assert not action.new or action.version == newest, f"{action}: a new group on an older version"
            self.where[action.group_id] = action.instance
            self.left[action.group_id] = set(range(self.g))
        for instance in self.loaded:
            self.most_versions = max(self.most_versions, len({self.version[g] for g, w in self.where.items()
                                                              if w == instance}))
            assert len(self.held(instance)) <= self.per_instance, f"{instance} holds versions {sorted(self.held(instance))}"
            rows = sum(len(self.left[g]) for g, w in self.where.items() if w == instance)
            assert rows <= self.rows, f"{instance} runs {rows} requests in {self.rows} rows"


def drive(switching, seed: int, K: int = 3, tbs: int = 2, rbs: int = 6, updates: int = 5, instances: int = 3,
          slots: int = 2, group_size: int = 2, churn: float = 0.05):
    """Run a random trace to its last update; returns the orchestrator, the gate, every decision in order and the
    most versions one instance ran at once."""
    rng = random.Random(seed)
    gate = VersionGate(K, tbs)
    orch = Orchestrator(rbs, updates * tbs, switching=switching, group_size=group_size)
    ledger = AdapterLedger(group_size, slots, switching.versions_per_instance)
    names = iter(f"w{i:03d}" for i in range(10_000))
    for _ in range(instances):
        orch.add_instance(next(names), slots)
    decisions, done = [], set()
    for _ in range(20_000):
        if gate.next_update >= updates:
            return orch, gate, decisions, ledger.most_versions
        capacity = gate.capacity()
        actions = orch.decide(capacity)
        assert sum(isinstance(a, Start) and a.new for a in actions) <= capacity, "more new groups than the gate allows"
        for action in actions:
            ledger.apply(action, orch.newest)
            if isinstance(action, Start) and action.new:
                gate.on_dispatch(action.group_id, action.version)
        decisions.append(actions)
        orch.validate()
        assert orch.next_group_id <= updates * tbs and len(orch.running) <= rbs
        assert {g: v for g, (v, _) in orch.running.items()} == {g: ledger.version[g] for g in ledger.where}
        _random_event(rng, orch, gate, ledger, churn, slots, names, done)
        while gate.decide() is not None:
            pass
        if gate.running is not None and (not ledger.where or rng.random() < 0.3):
            gate.on_update_done(gate.running.update)
            orch.on_publish(gate.newest)
    raise AssertionError("no progress: deadlock")


def _random_event(rng, orch, gate, ledger, churn, slots, names, done) -> None:
    running, choice = sorted(ledger.where), rng.random()
    if choice < churn and len(orch.instances) > 1:  # an instance leaves: its groups restart on their own version
        dead = rng.choice(sorted(orch.instances))
        assert orch.remove_instance(dead) == ledger.lose(dead)
    elif choice < 2 * churn or not orch.instances:
        orch.add_instance(next(names), slots)
    elif running and choice < 0.85:
        g = rng.choice(running)
        left = sorted(ledger.left[g])
        if left and rng.random() < 0.75:
            sample = rng.choice(left)
            orch.on_request_done(g, sample)
            ledger.request_done(g, sample)
        else:
            assert g not in done, f"group {g} completed twice"
            done.add(g)
            orch.on_group_done(g)
            ledger.group_done(g)
            gate.on_complete(g)


@settings(max_examples=60, deadline=None)
@given(m=st.sampled_from([2, 3, 4]), seed=st.integers(0, 10_000), K=st.integers(0, 4), tbs=st.integers(1, 3),
       extra=st.integers(0, 5), instances=st.integers(1, 4), slots=st.integers(1, 3), group_size=st.integers(1, 3),
       churn=st.sampled_from([0.0, 0.05]))
def test_random_events_keep_each_instance_within_m_versions_and_each_group_on_its_own(
        m, seed, K, tbs, extra, instances, slots, group_size, churn):
    orch, gate, *_ = drive(Concurrent(m), seed, K, tbs, tbs + extra, 4, instances, slots, group_size, churn)
    assert len(gate.consumed) == 4 * tbs and not gate.unconsumed  # C2: every group trained once, none lost


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), K=st.integers(0, 4), tbs=st.integers(1, 3), extra=st.integers(0, 5),
       instances=st.integers(1, 4), slots=st.integers(1, 3), churn=st.sampled_from([0.0, 0.05]))
def test_one_version_per_instance_decides_as_drain(seed, K, tbs, extra, instances, slots, churn):
    _, _, concurrent, most = drive(Concurrent(1), seed, K, tbs, tbs + extra, 4, instances, slots, 2, churn)
    _, _, drain, _ = drive(Drain(), seed, K, tbs, tbs + extra, 4, instances, slots, 2, churn)
    assert concurrent == drain and most == 1


@pytest.mark.parametrize("m", [2, 3, 4])
def test_random_traces_do_reach_m_versions_on_one_instance(m):
    """The property above is not vacuous: with K >= M - 1 some instance runs requests of M versions at once."""
    most = [drive(Concurrent(m), seed, K=m, tbs=1, rbs=8, updates=8, instances=2, slots=4)[3] for seed in range(8)]
    assert max(most) == m


def test_two_versions_share_an_instance_new_groups_start_beside_old_ones():
    orch = Orchestrator(rollout_batch_size=8, group_budget=100, switching=Concurrent(2), group_size=2)
    orch.add_instance("a", 2)
    assert [a for a in orch.decide(capacity=1) if isinstance(a, Start)] == [Start("a", 0, 0, True)]
    orch.on_publish(1)
    assert orch.decide(capacity=4) == [Load("a", 1), Start("a", 1, 1, True)]  # beside group 0, in its free rows
    orch.on_publish(2)
    assert orch.decide(capacity=4) == []  # versions 0 and 1 run: a third would exceed 2
    orch.on_group_done(0)
    assert orch.decide(capacity=4) == [Load("a", 2), Start("a", 2, 2, True)]
    orch.validate()


def test_a_lost_group_restarts_on_an_instance_that_still_holds_its_version():
    orch = Orchestrator(rollout_batch_size=8, group_budget=100, switching=Concurrent(3), group_size=1)
    orch.add_instance("a", 3)
    orch.decide(capacity=2)  # groups 0 and 1 of version 0
    orch.on_publish(1)
    orch.decide(capacity=1)  # a takes version 1 beside version 0: group 2
    assert orch.versions_on(orch.instances["a"]) == {0, 1}
    orch.add_instance("c", 3)
    assert orch.remove_instance("a") == [0, 1, 2]
    first = [a for a in orch.decide(capacity=0) if isinstance(a, Start)]
    assert first == [Start("c", 0, 0, False), Start("c", 1, 0, False)]  # c loads version 0, the most queued work
    assert orch.decide(capacity=0) == [Load("c", 1), Start("c", 2, 1, False)]  # then version 1 beside it
    orch.validate()


def test_new_groups_go_to_the_least_busy_instance_first():
    orch = Orchestrator(rollout_batch_size=8, group_budget=100, switching=Concurrent(2), group_size=2)
    orch.add_instance("a", 2)
    orch.add_instance("b", 2)
    orch.decide(capacity=1)  # group 0 on a
    orch.on_request_done(0, 0)
    orch.on_publish(1)
    starts = [a for a in orch.decide(capacity=2) if isinstance(a, Start)]
    assert [(s.instance, s.version) for s in starts] == [("b", 1), ("b", 1)]  # b is idle, a still runs group 0


def test_versions_per_instance_above_one_replaces_drain_and_refuses_the_others():
    concurrent = switching_named("drain", 3)
    assert isinstance(concurrent, Concurrent) and concurrent.versions_per_instance == 3
    assert isinstance(switching_named("drain", 1), Drain) and not isinstance(switching_named("drain", 1), Concurrent)
    with pytest.raises(ValueError, match="'queue' cannot serve 2 versions"):
        switching_named("queue", 2)


@pytest.mark.parametrize("overrides, message", [
    (["rollout.versions_per_instance=0"], "must be >= 1"),
    (["rollout.versions_per_instance=2"], "set train.lora.rank > 0"),
    (["rollout.versions_per_instance=2", "train.lora.rank=8", "rollout.switching=migrate"], "keep rollout.switching"),
    (["rollout.versions_per_instance=2", "train.lora.rank=8", "rollout.partial_rollout=true"], "partial-rollout"),
    (["rollout.versions_per_instance=2", "rollout.engine=emulated", "train.engine=emulated", "task.name=emulated"],
     "emulation.lora_rank > 0"),
])
def test_config_refuses_what_several_versions_per_instance_cannot_serve(overrides, message):
    from dora_tasks.core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=f"rollout.versions_per_instance: .*{message}"):
        load_config(None, overrides)
    cfg = load_config(None, ["rollout.versions_per_instance=2", "train.lora.rank=8"])
    assert cfg.rollout.versions_per_instance == 2
