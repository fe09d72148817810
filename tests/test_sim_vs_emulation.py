"""The simulator and the Dask emulation agree on a small configuration (issue 20): 8 emulated instances on an
embedded Dask cluster through `run_pipeline`, and `pipelines.simulator` with the same settings
(`benchmarks/sim_vs_emulation.py` builds both from one config and maps the metric definitions).

Tolerances, from the measurements on the results page (benchmarks/results/sim_vs_emulation.md, 20 updates):
throughput and step time agree within 5% (the simulator faster), the trainer bubble and the non-overlapped share
within 0.01, the rollout bubble within 0.02 (4% of it). The test runs 14 updates (a shorter steady window, so more
noise) and asserts the issue's 10% on throughput and step time, and 0.05 absolute on the bubbles (~10% of them).
It runs at speed-up 5, not the benchmark's 10: every wall second the driver, the scheduler and the engines' Python
spend between two decode calls is an idle instance in emulated time, so at 10 this 2-core machine's CPU set part of
the Dask rollout bubble (the CPU-PACED case of issue 20; the gap to the simulator grows with the speed-up).
Marked slow: about 75 s of a 2-core machine.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def benchmark():
    spec = importlib.util.spec_from_file_location("sim_vs_emulation",
                                                  os.path.join(ROOT, "benchmarks", "sim_vs_emulation.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_simulator_agrees_with_the_dask_emulation_on_8_instances(tmp_path):
    b = benchmark()
    cfg = b.make_config(b.parse(["--updates", "14", "--speedup", "5"]), str(tmp_path))
    sim, _ = b.run_sim(cfg)
    dask, info = b.run_dask(cfg)
    assert info["audit_ok"]
    assert sim.tokens_per_s == pytest.approx(dask.tokens_per_s, rel=0.10)
    assert sim.step_s == pytest.approx(dask.step_s, rel=0.10)
    assert sim.trainer_bubble == pytest.approx(dask.trainer_bubble, abs=0.05)
    assert sim.non_overlapped == pytest.approx(dask.non_overlapped, abs=0.05)
    assert sim.rollout_bubble == pytest.approx(dask.rollout_bubble, abs=0.05)
    assert sim.staleness_max == dask.staleness_max == cfg.dora.max_staleness
