"""Several versions on one instance in the cost model and the simulator: LoRA adapter bytes, loads and the
multi-adapter decode step against hand-computed cases, and a simulated run that mixes versions in one batch."""
from __future__ import annotations

import dataclasses

import pytest

from dora_tasks.core.config_emulation import EmulationConfig
from dora_tasks.emulation.cost_model import CostModel
from dora_tasks.emulation.lengths import LengthModel
from pipelines.simulator import SimConfig, SimulatorError
from pipelines.simulator.core import Simulation
from pipelines.simulator.engine import Engine, Seq

FULL = CostModel.named("H800", "qwen2.5-32b")  # tp 2, bandwidth efficiency 0.5
LORA = dataclasses.replace(FULL, lora_rank=8)  # lora_step_s 2 ms (Punica)
HBM = 2 * 3.35e12 * 0.5  # bytes/s an instance of two H800 reads in decode
# rank 8 on q, k, v, o, gate, up, down of Qwen2.5-32B (hidden 5120, KV width 8 x 128, MLP 27648), 64 layers, BF16
ADAPTER = 64 * 8 * (2 * (5120 + 5120) + 2 * (5120 + 1024) + 2 * (5120 + 27648) + (27648 + 5120)) * 2


def test_adapter_bytes_and_its_loads_are_bytes_over_bandwidth():
    assert LORA.adapter_bytes == ADAPTER == 134_217_728
    assert LORA.weights_from_peer_s(adapter=True) == pytest.approx(ADAPTER / (2 * 50e9), rel=1e-12)
    assert LORA.weights_from_store_s(adapter=True) == pytest.approx(ADAPTER / (2 * 2e9), rel=1e-12)
    assert LORA.weights_from_peer_s() == FULL.weights_from_peer_s(adapter=True) == pytest.approx(65e9 / (2 * 50e9))


def test_a_decode_step_pays_a_flat_lora_cost_and_one_read_per_distinct_adapter():
    base = FULL.decode_step_s(64, 100_000)
    assert LORA.decode_step_s(64, 100_000, adapters=3) == pytest.approx(base + 2e-3 + 3 * ADAPTER / HBM, rel=1e-12)
    assert LORA.decode_step_s(64, 100_000, adapters=0) == base == FULL.decode_step_s(64, 100_000, adapters=3)
    one, two = (LORA.decode_step_s(64, 100_000, adapters=a) for a in (1, 2))
    assert two - one == pytest.approx(ADAPTER / HBM, rel=1e-9)  # ~40 us: 0.2% of a ~20 ms step


@pytest.mark.parametrize("rows,context,steps,adapters", [(256, 46_000, 700, 2), (1, 200, 3000, 1), (600, 0, 90, 4)])
def test_decode_steps_with_adapters_in_closed_form_equal_their_sum(rows, context, steps, adapters):
    one_by_one = sum(LORA.decode_step_s(rows, context + i * rows, adapters) for i in range(steps))
    assert LORA.decode_steps_s(rows, context, steps, adapters) == pytest.approx(one_by_one, rel=1e-9)


def test_one_batch_decodes_rows_of_two_versions_at_the_two_adapter_cost():
    engine = Engine("e", LORA, max_rows=8)
    engine.load(1, 0.0)
    engine.submit([Seq(0, 0, 100, 50, version=0), Seq(1, 0, 100, 50, version=1)])
    ended = []
    while not engine.idle:
        ended += engine.advance_to(engine.next_change)
    assert sorted(s.versions for s in ended) == [[[0, 50]], [[1, 50]]]  # each row on its own version only
    prefill = LORA.chunked_prefill_s(200, 0, 0)
    assert engine.t == pytest.approx(prefill + LORA.decode_steps_s(2, 200, 50, adapters=2), rel=1e-9)


SMALL = dict(gpus=16, prompts_per_step=32, group_size=8, train_batch_size=8, rollout_batch_size=32, max_rows=64,
             steps=4, warmup_steps=1, max_staleness=3, switching="drain", check=True)


@pytest.mark.parametrize("m", [2, 3])
def test_a_simulated_run_mixes_versions_in_a_batch_and_keeps_c1_to_c3(m, monkeypatch):
    most = [0]
    settle = Engine._settle

    def watched(self, steps, ended):
        most[0] = max(most[0], self.adapters)
        settle(self, steps, ended)

    monkeypatch.setattr(Engine, "_settle", watched)
    sim = Simulation(SimConfig(versions_per_instance=m, **SMALL), LORA, LengthModel(response_p50=300, cap=6000))
    r = sim.run().result()  # check=True: the gate and the orchestrator validate after every decision
    assert r.c1_mixed_trajectories == 0 and r.c2_ok and r.c3_ok
    assert most[0] == m  # some batch decoded rows of m versions at once


def test_several_versions_need_adapters_drain_and_dora():
    with pytest.raises(SimulatorError, match="emulation.lora_rank"):
        Simulation(SimConfig(versions_per_instance=2, **SMALL), FULL, LengthModel(response_p50=300, cap=6000))
    with pytest.raises(SimulatorError, match="versions_per_instance: 2 .*switching 'migrate'"):
        SimConfig(versions_per_instance=2, **{**SMALL, "switching": "migrate"}).validate()


# ---- the emulated engine ---------------------------------------------------------------------------------------------
def emulated_engine(*overrides: str):
    from dora_tasks.core.config import load_config
    from dora_tasks.engines.rollout_factory import make_rollout_engine

    cfg = load_config(None, ["rollout.engine=emulated", "train.engine=emulated", "task.name=emulated",
                             "rollout.group_size=2", "rollout.max_new_tokens=30720", "emulation.speedup=1e6",
                             "emulation.lora_rank=8", "rollout.versions_per_instance=2", *overrides])
    return make_rollout_engine("", cfg.rollout, 0, emulation=cfg.emulation, seed=cfg.dora.seed)


def test_the_emulated_engine_keeps_m_adapters_and_loads_a_new_one_for_its_bytes(tmp_path):
    from dora_tasks.emulation.task import write_model_folder

    e = emulated_engine()
    for v in (1, 2):
        write_model_folder(str(tmp_path / f"v{v}"), "qwen2.5-32b", v)
    e.load_version(1, str(tmp_path / "v1"))
    assert e.emulated_s == pytest.approx(e.cost.weights_from_peer_s(adapter=True)) and e.resident.versions == (0, 1)
    e.load_version(0, "unused: resident")  # resident: no cost
    assert e.emulated_s == pytest.approx(e.cost.weights_from_peer_s(adapter=True)) and e.version == 0
    e.resident.running = frozenset({0})
    e.load_version(2, str(tmp_path / "v2"))  # evicts version 1, the least recently used not running
    assert e.resident.versions == (0, 2)


def test_rows_of_two_versions_decode_in_one_batch_at_its_cost_each_under_its_own_version(tmp_path):
    from dora_tasks.emulation.rollout import decode_cost
    from dora_tasks.emulation.task import emulated_prompts, write_model_folder

    e = emulated_engine()
    write_model_folder(str(tmp_path / "v1"), "qwen2.5-32b", 1)
    e.load_version(1, str(tmp_path / "v1"))
    start = e.emulated_s
    (p0, p1), _ = emulated_prompts(2, 0, EmulationConfig(lora_rank=8), 0)
    views = {0: e.open_session(0), 1: e.open_session(1)}
    for v, p in ((0, p0), (1, p1)):
        views[v].add((v, 0), p.token_ids)
    shared = views[0].shared
    assert views[1].shared is shared
    rows = [(r.context, min(64, r.target)) for r in shared.rows.values()]
    expected = sum(e.cost.prefill_s(c) for c, _ in rows) + decode_cost(e.cost, rows, [0, 1])
    out = {v: views[v].decode({(v, 0): 64}, seed=0)[(v, 0)] for v in (0, 1)}  # a chunk: each version in turn
    assert e.emulated_s - start == pytest.approx(expected, rel=1e-12)  # one batch of both, paid once
    assert set(out[0].versions) == {0} and set(out[1].versions) == {1}
    assert decode_cost(e.cost, rows, [0, 1]) > decode_cost(e.cost, rows, [1, 1])  # two adapters read, not one


def test_dora_simulate_takes_versions_per_instance_and_switches_by_drain(capsys):
    import json

    from pipelines.cli import main

    assert main(["simulate", "--gpus", "16", "--prompts-per-step", "32", "--group-size", "8", "--steps", "3",
                 "--warmup-steps", "1", "--versions-per-instance", "2", "--json", "emulation.response_p50=300",
                 "emulation.lora_rank=8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["c1_mixed_trajectories"] == 0 and out["c2_ok"] and out["c3_ok"] and out["load_share"] > 0


def test_the_rollout_servers_session_of_several_versions_pays_one_batch_on_the_emulated_engine(tmp_path):
    from dora_tasks.emulation.rollout import decode_cost
    from dora_tasks.emulation.task import emulated_prompts, write_model_folder
    from dora_tasks.server_sessions import open_versions_session

    e = emulated_engine()
    write_model_folder(str(tmp_path / "v1"), "qwen2.5-32b", 1)
    e.load_version(1, str(tmp_path / "v1"))
    prompts, _ = emulated_prompts(2, 0, EmulationConfig(lora_rank=8), 0)
    session = open_versions_session(e, keep_kv_cache=True)
    for v, p in enumerate(prompts):
        session.add_on(v, ("row", v), p.token_ids)
    rows = [(len(p.token_ids), min(64, e.lengths.response_tokens(p.prompt_id, 0))) for p in prompts]
    start = e.emulated_s
    out = session.decode({("row", 0): 64, ("row", 1): 64}, seed=0)
    expected = sum(e.cost.prefill_s(c) for c, _ in rows) + decode_cost(e.cost, rows, [0, 1])
    assert e.emulated_s - start == pytest.approx(expected, rel=1e-12)
    assert [set(out[("row", v)].versions) for v in (0, 1)] == [{0}, {1}]
