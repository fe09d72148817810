"""When a streamed update's stragglers go to the trainer, in the simulator: as they arrive, or all at once.

    python benchmarks/straggler_parts.py [--updates 24]

A streamed update's part costs at least its longest sequence on one accelerator (`CostModel.straggler_train_s`), so
stragglers sent as they arrive (what the Dask driver and `Simulation` do) pay that floor once per part. The other
policy holds every straggler until the last has completed and sends them as one part (`AllAtOnce`). Cells: the
switching_scale configs of the 128-GPU cell (32 instances of tp 2, trainer 64, TBS 512, RBS 1536) and of the 64-GPU
one (16 instances, trainer 32, TBS 256, RBS 768), K 3, `switching=migrate`, streamed updates, the calibrated
response_p50 and bandwidth efficiency, the Dask run's group budget (`sim_vs_emulation.dask_budget`). Simulator only:
virtual seconds, deterministic.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import switching_scale
from benchmarks.sim_vs_emulation import dask_budget, sim_settings
from benchmarks.tables import markdown_table
from pipelines.simulator.core import Simulation

CALIBRATED = ["emulation.response_p50=1286.3", "emulation.bandwidth_efficiency=0.481"]
CELLS = {"128 GPUs": (32, 64, 1536), "64 GPUs": (16, 32, 768)}  # instances, trainer GPUs, RBS


class AllAtOnce(Simulation):
    """Stragglers wait until the last of the update's has completed, then go as one part."""

    def _stream_in(self, group_id: int) -> None:
        if self.streaming - {group_id}:
            self.streaming.discard(group_id)
            self.streamed_in.append(group_id)
            return
        super()._stream_in(group_id)


def simulate(cell: tuple[int, int, int], updates: int, policy: type[Simulation]) -> dict:
    instances, trainer, rbs = cell
    argv = ["--instances", str(instances), "--slots", "48", "--trainer-gpus", str(trainer), "--updates", str(updates),
            "--out", os.devnull, *CALIBRATED, f"dora.rollout_batch_size={rbs}", f"dora.train_batch_size={rbs // 3}"]
    args = switching_scale.parse(argv)
    with tempfile.TemporaryDirectory() as folder:
        cfg = switching_scale.make_config(switching_scale.settings(args, instances), folder,
                                          [f"emulation.tp={args.tp}", *args.overrides, "rollout.switching=migrate",
                                           "dora.stream_updates=true"])
        sim = dask_budget(policy)(*sim_settings(cfg, 0.0))
        result = sim.run().result()
    spans = sim.record.trainer_busy
    return {"tokens_per_s": result.tokens_per_s, "step_s": result.step_s, "parts": len(spans) / updates,
            "train_s": sum(end - start for start, end, *_ in spans) / updates,
            "audit": result.c2_ok and result.c3_ok and not result.c1_mixed_trajectories}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=24)
    args = parser.parse_args()
    rows = []
    for name, cell in CELLS.items():
        arriving, at_once = (simulate(cell, args.updates, policy) for policy in (Simulation, AllAtOnce))
        for label, r in (("as they arrive", arriving), ("all at once", at_once)):
            ratio = r["tokens_per_s"] / arriving["tokens_per_s"]
            rows.append([name, label, f"{r['tokens_per_s']:,.0f}", f"{ratio:.3f}", f"{r['step_s']:.1f}",
                         f"{r['parts']:.2f}", f"{r['train_s']:.1f}",
                         "PASS" if r["audit"] else "FAIL"])
    print(f"{args.updates} updates, the first 2 left out\n")
    print(markdown_table(["cell", "stragglers go", "tokens/s", "/ as they arrive", "step (s)", "trainer spans / update",
                          "trainer computing (s / update)", "C1-C3"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
