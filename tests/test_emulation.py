"""Emulated engines: their contracts (lengths, versions, time = cost / speedup, KV-budget waiting) and a 16-instance
emulated run through the real driver, gate, orchestrator, store and an embedded Dask cluster, audited, with
torch-free workers."""
from __future__ import annotations

import time

import numpy as np
import pytest

from dora_tasks.core.clock import Clock
from dora_tasks.core.config import ConfigError, load_config
from dora_tasks.core.records import Group, TrainBatch, Trajectory
from dora_tasks.emulation.rollout import SYNTHETIC_LOGPROB, EmulatedRolloutEngine, decode_cost
from dora_tasks.emulation.task import (SAMPLE_BASE, SyntheticTokenizer, emulated_prompts, is_emulated_model,
                                       synthetic_reward)
from dora_tasks.emulation.trainer import EmulatedTrainEngine
from dora_tasks.engines.factory import make_train_engine
from dora_tasks.engines.rollout_factory import make_rollout_engine

EMULATED = ["rollout.engine=emulated", "train.engine=emulated", "task.name=emulated"]


def emulated_config(*overrides: str):
    return load_config(None, EMULATED + ["rollout.group_size=4", "rollout.max_new_tokens=30720"] + list(overrides))


def engine(*overrides: str) -> EmulatedRolloutEngine:
    cfg = emulated_config(*overrides)
    return make_rollout_engine("", cfg.rollout, 0, emulation=cfg.emulation, seed=cfg.dora.seed)


def test_the_three_settings_go_together_and_the_synthetic_reward_is_the_default():
    with pytest.raises(ConfigError, match="all 'emulated' or none"):
        load_config(None, ["rollout.engine=emulated"])
    cfg = emulated_config()
    assert cfg.emulated and cfg.task.reward_fn.endswith("synthetic_reward")
    assert cfg.clock(5.0) == Clock(cfg.emulation.speedup, 5.0) and not load_config(None, []).clock(5.0).emulated


def test_responses_have_the_length_model_lengths_and_the_loaded_version():
    e = engine("emulation.speedup=1e6")
    prompts, _ = emulated_prompts(4, 0, e_cfg := emulated_config().emulation, 0)
    assert all(len(p.token_ids) == e.lengths.prompt_tokens(p.prompt_id) for p in prompts) and e_cfg
    e.version = 3
    out = e.generate([p.token_ids for p in prompts], 4, seed=0)
    for p, gens in zip(prompts, out):
        for sample, g in enumerate(gens):
            expected = e.lengths.response_tokens(p.prompt_id, sample)
            assert len(g.token_ids) == expected and g.finished == (expected < e.lengths.cap)
            assert g.token_ids[0] == SAMPLE_BASE + sample and set(g.versions.tolist()) == {3}
            assert np.all(g.logprobs == SYNTHETIC_LOGPROB)
            reward = synthetic_reward(p.text, SyntheticTokenizer().decode(g.token_ids), p.answer)
            assert reward in (0.0, 1.0)


def test_a_capped_budget_cuts_responses_unfinished():
    e = engine("emulation.speedup=1e6", "rollout.max_new_tokens=64")
    prompts, _ = emulated_prompts(8, 0, emulated_config().emulation, 0)
    gens = [g for gs in e.generate([p.token_ids for p in prompts], 4, 0) for g in gs]
    assert max(len(g.token_ids) for g in gens) == 64 and not all(g.finished for g in gens)


def test_a_decode_call_sleeps_its_cost_over_the_speedup():
    speedup = 200.0
    e = engine(f"emulation.speedup={speedup}")
    prompts, _ = emulated_prompts(8, 0, emulated_config().emulation, 0)
    session = e.open_session()
    for p in prompts:
        for _ in range(4):
            session.add((p.prompt_id, _), p.token_ids)
    steps = dict.fromkeys(session.rows, 1024)
    rows = [(r.context, min(1024, r.target)) for r in session.rows.values()]
    cost = sum(e.cost.prefill_s(c) for c, _ in rows) + decode_cost(e.cost, rows)
    start = time.perf_counter()
    session.decode(steps, 0)
    wall = time.perf_counter() - start
    assert e.emulated_s == pytest.approx(cost)
    assert cost / speedup <= wall <= cost / speedup * 1.2 + 0.05


def test_decode_cost_sums_every_step_as_rows_end():
    e = engine()
    rows = [(300, 5), (1200, 40), (50, 40), (9000, 77)]
    loop = sum(e.cost.decode_step_s(len(run), sum(c + s for c, _ in run))
               for s in range(77) for run in [[r for r in rows if r[1] > s]])
    assert decode_cost(e.cost, rows) == pytest.approx(loop, rel=1e-12)


def three_row_session():
    """A fast engine and a session holding three prompts' first rows."""
    e = engine("emulation.speedup=1e6")
    prompts, _ = emulated_prompts(3, 0, emulated_config().emulation, 0)
    session = e.open_session()
    for p in prompts:
        session.add(p.prompt_id, p.token_ids)
    return e, session


def test_a_row_ending_within_a_call_gives_its_place_to_a_waiting_row_for_the_steps_left():
    e, session = three_row_session()
    for key, target in zip(session.rows, (10, 100, 100)):
        session.rows[key].target = target
    e.max_rows = 2
    context = [r.context for r in session.rows.values()]
    out = session.decode({k: 50 for k in session.rows}, 0)
    assert [len(out[k].token_ids) for k in session.rows] == [10, 50, 40]  # the third joins at step 10
    assert out[0].finished and not out[2].finished
    loop = sum(e.cost.decode_step_s(len(run), sum(c + s - first for c, first, _ in run))
               for s in range(50) for run in [[r for r in [(context[0], 0, 10), (context[1], 0, 50),
                                                           (context[2], 10, 50)] if r[1] <= s < r[2]]])
    assert e.emulated_s == pytest.approx(sum(e.cost.prefill_s(c) for c in context) + loop, rel=1e-9)


def test_rows_beyond_the_kv_budget_wait_and_are_prefilled_again():
    e, session = three_row_session()
    first = session.rows[0]
    e.capacity = first.context + 8  # room for one row and 8 tokens of it
    out = session.decode({k: 8 for k in session.rows}, 0)
    assert len(out[0].token_ids) == 8 and all(len(out[k].token_ids) == 0 and not out[k].finished for k in (1, 2))
    session.drop([0])
    spent = e.emulated_s
    e.capacity = 10**9
    out = session.decode({k: 8 for k in session.rows}, 0)
    assert all(len(out[k].token_ids) == min(8, session.rows[k].target) for k in (1, 2))
    assert e.emulated_s - spent >= sum(e.cost.prefill_s(session.rows[k].context - 8) for k in (1, 2))


def test_weight_load_sleeps_the_transfer_time(tmp_path):
    from dora_tasks.emulation.task import write_model_folder

    e = engine("emulation.speedup=1000", "emulation.weight_source=store")
    write_model_folder(str(tmp_path / "v1"), "qwen2.5-32b", 1)
    start = time.perf_counter()
    e.load_version(1, str(tmp_path / "v1"))
    assert e.version == 1 and time.perf_counter() - start >= e.cost.weights_from_store_s() / 1000
    with pytest.raises(OSError):
        e.load_version(2, str(tmp_path / "missing"))


def test_the_emulated_trainer_sleeps_train_time_and_publishes_an_emulated_model(tmp_path):
    cfg = emulated_config("emulation.speedup=2000")
    t: EmulatedTrainEngine = make_train_engine("", cfg.train, version=2, emulation=cfg.emulation)
    trajectories = [Trajectory(0, i, np.ones(200, np.int32), np.ones(1000 * (i + 1), np.int32),
                               np.full(1000 * (i + 1), 2, np.int32), np.zeros(1000 * (i + 1), np.float32), True)
                    for i in range(4)]
    batch = TrainBatch(2, [Group(0, None, 2, trajectories=trajectories)], 1)
    expected = t.cost.train_s([1200, 2200, 3200, 4200], cfg.emulation.trainer_gpus)
    start = time.perf_counter()
    metrics = t.train_step(batch)
    assert time.perf_counter() - start >= expected / 2000 and metrics["emulated_train_s"] == pytest.approx(expected)
    assert t.version == 3
    t.save_weights(str(tmp_path / "w"))
    assert is_emulated_model(str(tmp_path / "w"))
    t.save_checkpoint(str(tmp_path / "ckpt"))
    restored = make_train_engine("", cfg.train, version=0, emulation=cfg.emulation)
    restored.load_checkpoint(str(tmp_path / "ckpt"))
    assert restored.version == 3 and restored.load_optimizer_state(str(tmp_path / "ckpt"))


def test_a_streamed_update_sleeps_its_parts_and_stragglers_at_least_their_longest_sequence():
    cfg = emulated_config("emulation.speedup=2000")
    t: EmulatedTrainEngine = make_train_engine("", cfg.train, version=2, emulation=cfg.emulation)

    def batch(*lengths):
        trajectories = [Trajectory(0, i, np.ones(200, np.int32), np.ones(n, np.int32), np.full(n, 2, np.int32),
                                   np.zeros(n, np.float32), True) for i, n in enumerate(lengths)]
        return TrainBatch(2, [Group(0, None, 2, trajectories=trajectories)], 1)

    gpus = cfg.emulation.trainer_gpus
    t.accumulate(batch(1000, 2000), stragglers=False)
    t.accumulate(batch(30000), stragglers=True)
    assert t.version == 2  # no step before `finish_update`
    metrics = t.finish_update()
    rest, straggler = t.cost.train_s([1200, 2200], gpus), t.cost.train_s([30200], 1)
    assert straggler > t.cost.train_s([30200], gpus)
    assert metrics["emulated_train_s"] == pytest.approx(rest + straggler) and metrics["tokens_trained"] == 33600
    assert t.version == 3 and t.finish_update()["tokens_trained"] == 0  # the next update starts from nothing


# ---- a real emulated run -----------------------------------------------------------------------------------------
def worker_probe(dask_worker):
    import sys

    import psutil

    return "torch" in sys.modules, psutil.Process().memory_info().rss, sorted(dask_worker.state.total_resources)


def test_an_emulated_16_instance_run_is_audited_clean_on_torch_free_workers(tmp_path):
    from dora_tasks.plugins import engine_pace
    from pipelines.run import open_run
    from pipelines.streaming import stream
    from storage.trajectory_store import TrajectoryStore

    speedup = 100.0
    cfg = load_config(None, EMULATED + [
        "rollout.instances=16", "rollout.slots=2", "rollout.group_size=4", "rollout.max_new_tokens=4096",
        "rollout.chunk_tokens=512", "emulation.response_p50=300", f"emulation.speedup={speedup}",
        "dora.train_batch_size=8", "dora.rollout_batch_size=32", "dora.num_updates=5", "dora.max_staleness=2",
        "task.num_prompts=256", "task.eval_prompts=8", "cluster.cpu_workers=1", "cluster.cpu_threads=2",
        "cluster.worker_memory=1GiB", "storage.checkpoint_interval=3", "tracking.plots=false",
        "tracking.live_view=false", f"storage.run_dir={tmp_path / 'run'}",
        f"tracking.mlflow_uri=sqlite:///{tmp_path}/ml.db"])
    probes: dict = {}
    with open_run(cfg) as run:
        streamed = time.time()
        stream(run.driver, lambda d: probes or probes.update(d.client.run(worker_probe)))
        streamed = time.time() - streamed
        paces = [p for p in run.driver.client.run(engine_pace).values() if p is not None]
        summary = run.finish()
    # each instance emulated at most its serving time's worth (sleeps last at least what they are asked)
    assert len(paces) == 16 and all(0.0 < emulated <= wall * speedup * 1.001 for emulated, wall in paces)
    assert summary.audit_ok, summary.audit_text
    for clause in ("C1", "C2", "C3"):
        assert f"{clause} " in summary.audit_text and "FAIL" not in summary.audit_text
    roles = [r for _, _, r in probes.values()]
    assert roles.count(["GPU", "ROLLOUT"]) == 16 and roles.count(["GPU", "TRAINER"]) == 1
    for torch_loaded, rss, resources in probes.values():
        if "ROLLOUT" in resources or "TRAINER" in resources:
            assert not torch_loaded and rss < 200 * 2**20
    # every figure in emulated seconds: the run's span on its clock is the wall span times the speed-up
    assert 0.5 * streamed * speedup < summary.metrics["wall_s"] < 1.2 * streamed * speedup
    # the last dispatch on the run's clock, inside the steady window (else the open bubble is nan)
    assert 0.0 <= summary.metrics["open_rollout_bubble"] <= 1.0
    assert 0.0 <= summary.metrics["open_rollout_bubble_held"] <= summary.metrics["open_rollout_bubble"] + 1e-9
    # the driver's reaction to finished futures, seen on the emulated clock (nan if no turn recorded one)
    m = summary.metrics
    assert 0.0 < m["driver_reaction_lag_mean_s"] <= m["driver_reaction_lag_max_s"] < m["wall_s"]
    assert 0.0 < m["driver_trainer_lag_share"] < 1.0
    store = TrajectoryStore.open(cfg.storage.resolved("trajectory_store"))
    assert store.meta["clock"].startswith("emulated seconds")
    updates = store.read_table("updates")
    assert np.all(np.diff(updates["end"]) > 0) and updates["end"][-1] - updates["start"][0] > streamed


def test_an_emulated_migrating_run_places_moves_by_the_kv_tokens_its_servers_report(tmp_path):
    """The rollout servers' chunk reports reach the driver through Dask events: the orchestrator knows each
    instance's KV budget and the tokens its running groups hold, as the simulator does."""
    from pipelines.driver import engine_kv_budget
    from pipelines.run import open_run
    from pipelines.streaming import stream

    cfg = load_config(None, EMULATED + [
        "rollout.instances=4", "rollout.slots=3", "rollout.group_size=4", "rollout.max_new_tokens=4096",
        "rollout.chunk_tokens=256", "rollout.switching=migrate", "emulation.response_p50=300",
        "emulation.speedup=100", "emulation.max_rows=8", "dora.train_batch_size=4", "dora.rollout_batch_size=12",
        "dora.num_updates=4", "dora.max_staleness=1", "task.num_prompts=64", "task.eval_prompts=4",
        "cluster.cpu_workers=1", "cluster.cpu_threads=2", "cluster.worker_memory=1GiB", "tracking.plots=false",
        "tracking.live_view=false", f"storage.run_dir={tmp_path / 'run'}",
        f"tracking.mlflow_uri=sqlite:///{tmp_path}/ml.db"])
    seen = {"held": 0, "groups": 0}

    def probe(d) -> None:
        orch = d.orchestrator
        assert all(i.kv_budget == engine_kv_budget(cfg) > 0 for i in orch.instances.values())
        assert all(orch.kv_held[a] == sum(orch.tokens.get(g, 0) for g in i.running) for a, i in orch.instances.items())
        seen["held"] = max(seen["held"], max(orch.kv_held.values(), default=0))
        seen["groups"] = max(seen["groups"], len(orch.tokens))

    with open_run(cfg) as run:
        stream(run.driver, probe)
        summary = run.finish()
    assert summary.audit_ok, summary.audit_text
    assert seen["held"] > 0 and seen["groups"] > 1, seen


def test_a_streamed_run_trains_while_its_stragglers_run_and_keeps_the_constraints(tmp_path):
    """With dora.stream_updates the gate hands batches over before their stragglers complete; the trainer computes
    the rest in parts, the stragglers after, and publishes once: every group is still trained once within K, also
    after the trainer is killed while an update waits for its stragglers."""
    import os
    import signal

    from pipelines.events import TrainerRestored
    from pipelines.run import open_run
    from pipelines.streaming import stream
    from storage.trajectory_store import TrajectoryStore

    cfg = load_config(None, EMULATED + [
        "rollout.instances=4", "rollout.slots=3", "rollout.group_size=4", "rollout.max_new_tokens=4096",
        "rollout.chunk_tokens=256", "emulation.response_p50=300", "emulation.speedup=100",
        "dora.train_batch_size=4", "dora.rollout_batch_size=12", "dora.num_updates=6", "dora.max_staleness=1",
        "dora.stream_updates=true", "task.num_prompts=64", "task.eval_prompts=4", "cluster.cpu_workers=1",
        "cluster.cpu_threads=2", "cluster.worker_memory=1GiB", "storage.checkpoint_interval=3",
        "tracking.plots=false", "tracking.live_view=false", f"storage.run_dir={tmp_path / 'run'}",
        f"tracking.mlflow_uri=sqlite:///{tmp_path}/ml.db"])
    streamed: dict[int, int] = {}
    killed: list[int] = []

    def probe(d) -> None:
        for q in d.updates:
            if q.waiting:
                streamed[q.decision.update] = max(streamed.get(q.decision.update, 0), len(q.waiting))
                if not killed and q.decision.update >= 2 and len(q.parts) >= 3:
                    killed.append(q.decision.update)
                    os.kill(d.client.run(os.getpid, workers=[d.trainer])[d.trainer], signal.SIGKILL)

    restored: list = []
    with open_run(cfg) as run:
        run.driver.subscribe(lambda e: restored.append(e) if isinstance(e, TrainerRestored) else None)
        stream(run.driver, probe)
        timings = list(run.driver.timeline.updates)
        summary = run.finish()
    assert summary.audit_ok, summary.audit_text
    assert streamed, "no batch was handed over before its stragglers"
    assert killed and len(restored) == 1, (killed, restored)
    updates = TrajectoryStore.open(summary.store).read_table("updates")
    assert updates["published_version"].tolist() == list(range(1, 7))  # each version published once
    waited = [u for u in timings if u.busy is not None]  # streamed (one sent again whole after the kill is not)
    assert len(waited) >= 2
    assert all(0 < u.busy <= u.end - u.start for u in waited) and any(u.waiting_inside() > 0 for u in waited)
    for u in waited:  # its parts: in order within the update, their groups its batch's, their time its busy time
        assert u.start == u.parts[0][0] and all(a <= b <= c for (_, a, _), (b, c, _) in zip(u.parts, u.parts[1:]))
        assert sum(g for *_, g in u.parts) == 4 and sum(e - s for s, e, _ in u.parts) == pytest.approx(u.busy)
    assert any(len(u.parts) > 1 for u in waited)
    assert 0.0 <= summary.metrics["non_overlapped_rollout_share"] <= 1.0
    rows = TrajectoryStore.open(cfg.storage.resolved("trajectory_store")).read_table("trajectories")
    trained = set(zip(rows["group_id"].tolist(), rows["sample_idx"].tolist()))
    assert len(rows["group_id"]) == len(trained) == 6 * 4 * 4  # TBS x G a version, each response once
    assert set(rows["consumed_by"].tolist()) == set(range(6))


def test_the_run_is_tagged_emulated_for_mlflow():
    from pipelines.tracking import run_tags

    tags = run_tags(emulated_config())
    assert tags["dora.emulated"] == "true" and tags["dora.clock"].startswith("emulated seconds")


def test_the_orchestrator_knows_the_emulated_engines_batch_and_the_rows_queued_beyond_it():
    from pipelines.driver import engine_batch_rows
    from pipelines.orchestrator import Orchestrator

    cfg = emulated_config("emulation.max_rows=6")
    assert engine_batch_rows(cfg) == 6 and engine_batch_rows(load_config(None, [])) == 0
    orch = Orchestrator(rollout_batch_size=12, group_budget=12, group_size=4)
    orch.add_instance("a", slots=3, batch_rows=engine_batch_rows(cfg))  # 3 groups of 4 rows, 6 decode at once
    inst = orch.instances["a"]
    assert orch.free_batch_rows(inst) == 6 and orch.queued_rows(inst) == 0
