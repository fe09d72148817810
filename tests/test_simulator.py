"""The cost model's formulas against hand-computed cases, the simulator's analytic engine against a step-by-step
reference, and the simulated modes' guarantees (C1-C3) with the real VersionGate and Orchestrator."""
from __future__ import annotations

import json
import math
import random

import pytest

from dora_tasks.emulation.cost_model import CostModel
from dora_tasks.emulation.lengths import LengthModel
from pipelines.cli import main
from pipelines.gate import VersionGate
from pipelines.orchestrator import Orchestrator
from pipelines.simulator import SimConfig, simulate
from pipelines.simulator.core import Simulation
from pipelines.simulator.engine import Engine, Seq
from pipelines.simulator.modes import Split, searched_split

COST = CostModel.named("H800", "qwen2.5-32b")  # tp 2, bandwidth efficiency 0.5, MFUs 0.5 / 0.5 / 0.25
SMALL = dict(gpus=16, prompts_per_step=32, group_size=8, train_batch_size=32, rollout_batch_size=64, max_rows=64,
             steps=5, warmup_steps=1)
LONG_TAIL = LengthModel(response_p50=300, cap=6000)


# ---- cost model ----------------------------------------------------------------------------------------------------
def test_kv_capacity_of_qwen32b_on_two_h800():
    assert COST.kv_capacity_tokens() == int((2 * 80e9 * 0.9 - 65e9) // (2 * 64 * 8 * 128 * 2))  # 301,361


def test_decode_step_memory_bound_at_small_batch():
    weights = 65e9 / (2 * 3.35e12 * 0.5)
    kv = 10_000 * 262_144 / (2 * 3.35e12 * 0.5)
    all_reduce = 2 * 64 * 1 * 5120 * 2 * 1.0 / 200e9  # two per layer, ring share 2(tp-1)/tp = 1
    assert COST.decode_step_s(1, 10_000) == pytest.approx(weights + kv + all_reduce, rel=1e-12)


def test_decode_step_compute_bound_at_large_batch():
    compute = 2 * 32.5e9 * 4096 / (2 * 989.4e12 * 0.5)  # 0.269 s > 0.019 s of weights
    all_reduce = 2 * 64 * 4096 * 5120 * 2 / 200e9
    assert COST.decode_step_s(4096, 0) == pytest.approx(compute + all_reduce, rel=1e-12)


def test_prefill_train_and_weight_loads():
    prefill = (2 * 32.5e9 * 1000 + 2 * 64 * 5120 * 1000**2) / (2 * 989.4e12 * 0.5) + 1000 * 2 * 64 * 5120 * 2 / 200e9
    assert COST.prefill_s(1000) == pytest.approx(prefill, rel=1e-12)
    train = 8 * (32.5e9 * 8000 + 64 * 5120 * 8 * 1000**2) / (32 * 989.4e12 * 0.25)
    assert COST.train_s([1000] * 8, 32) == pytest.approx(train, rel=1e-12)
    alone = 8 * (32.5e9 * 30000 + 64 * 5120 * 30000**2) / (989.4e12 * 0.25)  # one 30K sequence on one accelerator
    assert COST.straggler_train_s([30000, 1000], 32) == pytest.approx(alone, rel=1e-12)
    assert COST.straggler_train_s([1000] * 64, 32) == pytest.approx(COST.train_s([1000] * 64, 32), rel=1e-12)
    assert COST.weights_from_peer_s() == pytest.approx(65e9 / (2 * 50e9))
    assert COST.weights_from_store_s() == pytest.approx(65e9 / (2 * 2e9))


@pytest.mark.parametrize("rows,context,steps", [(256, 46_000, 700), (1, 200, 3000), (600, 0, 900), (2048, 10, 40)])
def test_decode_steps_in_closed_form_equal_their_sum(rows, context, steps):
    one_by_one = sum(COST.decode_step_s(rows, context + i * rows) for i in range(steps))
    assert COST.decode_steps_s(rows, context, steps) == pytest.approx(one_by_one, rel=1e-9)


def test_chunked_prefill_is_free_in_a_memory_bound_step_and_costs_its_flops_beyond():
    assert COST.chunked_prefill_s(20, 8, 1000) == 0.0
    assert COST.chunked_prefill_s(50_000, 8, 1000) > 0.9 * COST.prefill_s(50_000) - COST.decode_step_s(8, 1000)


# ---- the analytic engine against a step-by-step reference ------------------------------------------------------------
class SteppedEngine:
    """The engine's rules, one decode step at a time."""

    def __init__(self, cost, max_rows, capacity):
        self.cost, self.max_rows, self.capacity, self.t = cost, max_rows, capacity, 0.0
        self.running, self.waiting, self.ends = [], [], {}

    def context(self):
        return sum(s.prompt + s.tokens for s in self.running)

    def fits(self, seq):
        held = self.context() + seq.prompt + seq.tokens + 1 + (self.capacity // 100) * bool(self.running)
        return len(self.running) < self.max_rows and held <= self.capacity

    def run(self):
        while self.running or self.waiting:
            rows, context, tokens = len(self.running), self.context(), 0
            while self.waiting and self.fits(self.waiting[0]):
                seq = self.waiting.pop(0)
                tokens += seq.prompt + seq.tokens
                self.running.append(seq)
            self.t += self.cost.chunked_prefill_s(tokens, rows, context) if tokens else 0.0
            self.t += self.cost.decode_step_s(len(self.running), self.context())
            for s in self.running:
                s.tokens += 1
            for s in [s for s in self.running if s.tokens >= s.target]:
                self.running.remove(s)
                self.ends[(s.group, s.sample)] = self.t
            while self.running and self.context() + len(self.running) > self.capacity:
                self.waiting.insert(0, self.running.pop())
        return self.ends


def workload():
    return [Seq(g, s, 100 + 7 * g, 50 + (g * 37 + s * 101) % 900) for g in range(12) for s in range(4)]


def test_analytic_engine_equals_step_by_step_reference_with_preemption():
    capacity, max_rows = 12_000, 32  # small enough that the cache overflows and rows are preempted
    engine = Engine("e", COST, max_rows)
    engine.capacity, engine.watermark = capacity, capacity // 100
    engine.load(0, 0.0)
    engine.submit(workload())
    ends = {}
    while not engine.idle:
        for seq in engine.advance_to(engine.next_change):
            ends[(seq.group, seq.sample)] = engine.t
    reference = SteppedEngine(COST, max_rows, capacity)
    reference.waiting = workload()
    expected = reference.run()
    assert ends.keys() == expected.keys()
    for key, t in expected.items():
        assert ends[key] == pytest.approx(t, rel=1e-9), key


def recounted_held_tokens(engine: Engine) -> dict[int, int]:
    held: dict[int, int] = {}
    for seq in engine.running.values():
        held[seq.group] = held.get(seq.group, 0) + seq.prompt + engine.tokens_of(seq)
    for seq in engine.waiting:
        held[seq.group] = held.get(seq.group, 0) + seq.prompt + seq.tokens
    return held


def test_held_token_totals_equal_a_recount_through_submits_takes_preemptions_and_reprefills():
    rng = random.Random(7)
    engine, other = Engine("e", COST, 16), Engine("f", COST, 16)
    engine.capacity, engine.watermark = 9_000, 90  # small: rows are preempted
    engine.load(0, 0.0)
    other.load(0, 0.0)
    now, next_group = 0.0, 0
    for _ in range(300):
        now += rng.uniform(0.0, 0.3)
        engine.sync(now)
        other.sync(now)
        action = rng.random()
        if action < 0.4:
            engine.submit([Seq(next_group, s, rng.randint(20, 400), rng.randint(1, 2000)) for s in range(4)])
            next_group += 1
        elif action < 0.7 and engine.held_tokens():
            other.submit(engine.take(rng.choice(sorted(engine.held_tokens()))), migrated=True)
        elif action < 0.75:
            engine.reprefill(1)
        assert engine.held_tokens() == recounted_held_tokens(engine)
        assert other.held_tokens() == recounted_held_tokens(other)


def test_migrating_run_keeps_the_orchestrators_running_totals():
    sim, result = run("dora", switching="migrate", max_rows=16)  # check=True: validate() recounts them every turn
    assert sim.record.migrations[0] > 0
    # a move carries the group's running responses, at least one: counted over the whole run, as the Dask store does
    assert sim.record.migrations[0] <= result.moved_responses <= sim.record.migrations[0] * SMALL["group_size"]


def test_group_reports_tell_the_orchestrator_only_what_task_ends_say():
    told = {"request_done": set(), "progress": 0}
    changes = {"switching": "migrate", "max_rows": 16, "reports": "group"}
    sim = Simulation(SimConfig(mode="dora", check=True, **{**SMALL, **changes}), COST, LONG_TAIL)
    done, progress = sim.orchestrator.on_request_done, sim.orchestrator.on_progress
    sim.orchestrator.on_request_done = lambda g, s: (told["request_done"].add(g), done(g, s))
    sim.orchestrator.on_progress = lambda g, t: (told.__setitem__("progress", told["progress"] + 1), progress(g, t))
    moved = []
    act = sim._act
    sim._act = lambda a: (moved.append(getattr(a, "group_id", None)) if type(a).__name__ == "Migrate" else None, act(a))
    r = sim.run().result()
    assert moved and r.c2_ok and r.c3_ok and r.c1_mixed_trajectories == 0
    assert told["request_done"] and told["request_done"] <= set(moved) and told["progress"] == 0


def test_moved_requests_decode_nowhere_while_in_transit():
    """With a hand-over time a moved group reaches its target that much later, is "arriving" until then, and the
    run still trains every group once within K."""
    sent, arrived = {}, {}
    changes = {"switching": "migrate", "max_rows": 16, "handover_s": 30.0}
    sim = Simulation(SimConfig(mode="dora", check=True, **{**SMALL, **changes}),
                     COST, LONG_TAIL)
    act, on_arrived = sim._act, sim.orchestrator.on_arrived
    sim._act = lambda a: (sent.setdefault(a.group_id, sim.now) if type(a).__name__ == "Migrate" else None, act(a))
    sim.orchestrator.on_arrived = lambda g: (arrived.setdefault(g, sim.now), on_arrived(g))
    r = sim.run().result()
    assert sent and r.c2_ok and r.c3_ok and r.c1_mixed_trajectories == 0
    assert arrived and arrived.keys() <= sent.keys() and all(arrived[g] - sent[g] >= 30.0 for g in arrived)
    with pytest.raises(ValueError, match="handover_s"):
        SimConfig(handover_s=-1.0).validate()


# ---- simulated runs ------------------------------------------------------------------------------------------------
def run(mode, **changes):
    sim = Simulation(SimConfig(mode=mode, check=True, **{**SMALL, **changes}), COST, LONG_TAIL)
    return sim, sim.run().result()


def test_sync_has_zero_staleness_and_trains_every_group_once():
    sim, r = run("sync")
    assert r.staleness_hist == {0: SMALL["steps"] * SMALL["prompts_per_step"]} and r.c2_ok and r.c3_ok
    assert sorted(sim.gate.consumed) == list(range(len(sim.gate.consumed)))
    assert r.c1_mixed_trajectories == 0


def test_dora_keeps_staleness_within_k_and_beats_sync_on_a_long_tail():
    _, sync = run("sync")
    _, dora = run("dora", max_staleness=3)
    assert dora.staleness_max <= 3 and dora.c2_ok and dora.c3_ok and dora.c1_mixed_trajectories == 0
    assert dora.tokens_per_s > 1.2 * sync.tokens_per_s


def test_partial_rollout_mixes_versions_within_trajectories_and_stays_in_the_window():
    _, r = run("partial", max_staleness=2)
    assert r.c1_mixed_trajectories > 0 and r.c2_ok and r.staleness_max <= 2


def test_queued_switching_loads_a_version_only_after_the_older_rows_end():
    loaded_over_rows = []
    original = Engine.load

    def load(engine, version, seconds):
        loaded_over_rows.append(engine.holds_rows())
        original(engine, version, seconds)

    Engine.load = load
    try:
        sim, r = run("dora", max_staleness=3, switching="queue", max_rows=16)  # rows queue inside engines
    finally:
        Engine.load = original
    assert r.c1_mixed_trajectories == 0 and r.c2_ok and r.c3_ok
    assert len(loaded_over_rows) > len(sim.engines) and not any(loaded_over_rows)


def test_open_bubble_leaves_out_the_drain_after_the_last_dispatch():
    sim, own = run("dora", max_staleness=3)  # its budget outlasts the window: open = whole window, prefill busy
    assert own.open_rollout_bubble == pytest.approx(own.rollout_bubble - own.prefill_share - own.transfer_share)
    exact = Simulation(SimConfig(mode="dora", max_staleness=3, **SMALL), COST, LONG_TAIL)
    exact.orchestrator.group_budget = exact.updates * exact.tbs  # a run that trains every group it dispatches
    r = exact.run().result()
    assert r.open_rollout_bubble < r.rollout_bubble - r.prefill_share - r.transfer_share


def test_the_open_bubble_splits_into_idle_while_the_gate_held_dispatch_and_idle_while_it_admitted_groups():
    _, sync = run("sync")  # instances wait for every publish with the gate closed
    _, dora = run("dora", max_staleness=3)
    for r in (sync, dora):
        assert 0.0 <= r.open_rollout_bubble_held <= r.open_rollout_bubble + 1e-9 and 0.0 <= r.gate_closed_share <= 1
    assert sync.open_rollout_bubble_held > sync.open_rollout_bubble - sync.open_rollout_bubble_held
    assert sync.gate_closed_share > dora.gate_closed_share


def test_streamed_updates_keep_the_constraints_and_the_trainer_computes_while_stragglers_run():
    _, plain = run("dora", max_staleness=1)
    sim, streamed = run("dora", max_staleness=1, stream_updates=True)
    assert streamed.c1_mixed_trajectories == 0 and streamed.c2_ok and streamed.c3_ok and streamed.staleness_max <= 1
    assert any(u.pending for u in sim.record.updates)  # some batches were handed over before their stragglers ended
    gpus, spans = sim.split.trainer_gpus, sim.record.trainer_busy
    for u in (u for u in sim.record.updates if u.published):  # the run stops at its last publish
        mine = [(a, b, groups, streamed) for a, b, groups, streamed in spans if a >= u.start and b <= u.end]
        assert sorted(g for *_, groups, _ in mine for g in groups) == sorted(u.group_ids) and u.end == u.published
        for a, b, groups, streamed_in in mine:  # each span: its groups' training time, streamed ones at least
            lengths = [s.prompt + s.target for g in groups for s in sim.groups[g]]  # their longest sequence's
            floor = COST.train_s([max(lengths)], 1) if streamed_in else 0.0
            assert b - a == pytest.approx(max(COST.train_s(lengths, gpus), floor), rel=1e-9)
            assert streamed_in == bool(set(groups) & set(u.pending))
    assert any(len(groups) > 1 for _, _, groups, streamed in spans if streamed)  # stragglers taken together
    assert streamed.non_overlapped_share < plain.non_overlapped_share
    steady = [u for u in sim.record.updates[sim.record.warmup:sim.updates] if u.pending]
    assert streamed.trainer_parts_per_update == pytest.approx(sum(len(u.parts) for u in steady) / len(steady))
    assert all(sum(u.parts) == len(u.group_ids) for u in steady) and 0 < streamed.first_part_group_share < 1
    assert math.isnan(plain.trainer_parts_per_update)


def test_the_steady_window_counts_only_the_updates_published_in_it():
    sim, r = run("dora", max_staleness=3)
    rec = sim.record
    assert len(rec.updates) > sim.updates  # the gate handed one more batch over as the last update published
    steady = rec.updates[rec.warmup:sim.updates]
    start, end = rec.window
    assert all(start < u.published <= end for u in steady)
    tokens = sum(s.prompt + s.target for u in steady for g in u.group_ids for s in sim.groups[g])
    assert r.tokens_per_s == pytest.approx(tokens / (end - start))
    assert r.step_s == pytest.approx((end - start) / len(steady) * sim.cfg.prompts_per_step / sim.tbs)


def test_streamed_updates_need_a_trainer_of_their_own():
    from pipelines.simulator import SimulatorError
    with pytest.raises(SimulatorError, match="stream_updates: .*mode dora only"):
        SimConfig(mode="sync", stream_updates=True).validate()


def test_simulator_drives_the_real_gate_and_orchestrator():
    sim, _ = run("one-step")  # check=True: both validate() after every decision
    assert type(sim.gate) is VersionGate and type(sim.orchestrator) is Orchestrator
    assert sim.gate.next_update == sim.updates


def test_cli_prints_json(capsys):
    assert main(["simulate", "--mode", "sync", "--gpus", "16", "--prompts-per-step", "32", "--group-size", "8",
                 "--steps", "3", "--warmup-steps", "1", "--json", "emulation.response_p50=300"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "sync" and out["staleness_max"] == 0 and out["step_s"] > 0


def test_cli_streams_updates_only_in_dora(capsys):
    small = ["--gpus", "16", "--prompts-per-step", "32", "--group-size", "8", "--steps", "3", "--warmup-steps", "1",
             "--json", "--stream-updates", "emulation.response_p50=300"]
    assert main(["simulate", "--mode", "dora", "--max-staleness", "1", *small]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["c2_ok"] and out["c3_ok"] and out["staleness_max"] <= 1
    assert main(["simulate", "--mode", "sync", *small]) == 2
    assert "stream_updates: streams a batch into a trainer of its own: mode dora only" in capsys.readouterr().err


# ---- the searched split --------------------------------------------------------------------------------------------
def test_searched_split_climbs_to_the_best_whole_instance_split():
    asked = []

    def tokens_per_s(trainer):  # one peak, at 40 trainer accelerators
        asked.append(trainer)
        return -abs(trainer - 40)

    split = searched_split(128, 2, Split(58, 70, 0.0), tokens_per_s)
    assert (split.rollout_gpus, split.trainer_gpus) == (88, 40)
    assert all((128 - t) % 2 == 0 and 2 <= 128 - t < 128 for t in asked)


def test_searched_split_is_at_least_the_rules_on_a_long_tail():
    short = dict(SMALL, steps=4, warmup_steps=1)  # the search's own length: its runs are the ones compared
    _, rule = run("dora", **short)
    _, searched = run("dora", split="searched", **short)
    assert searched.tokens_per_s >= rule.tokens_per_s
    assert searched.rollout_gpus % COST.tp == 0 and searched.rollout_gpus + searched.trainer_gpus == SMALL["gpus"]
    assert searched.trainer_gpus >= 1 and searched.c2_ok and searched.c3_ok
