"""How stable the beat-the-paper cell at 128 GPUs is: the same cell with the calibrated response length moved by a hair.

    python benchmarks/beat_stability.py [--factors 1.0 0.999 1.001 0.997 1.003] [--steps 8]

The cell is `paper_table.py`'s "128 GPUs, DORA K=3, migrate, RBS 1536" on the searched split, against sync on the
same accelerators; each row multiplies the calibrated `response_p50` by a factor (every response a hair longer or
shorter) and runs both again. Then, at the exact calibration, each update of the DORA run: how long the trainer
waited before it and the group its batch waited for last (its version, when it was dispatched and completed, its
longest response). Simulator only: virtual seconds, deterministic on any machine.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import paper_table
from benchmarks.tables import markdown_table
from dora_tasks.emulation.cost_model import cost_model_from
from dora_tasks.emulation.lengths import length_model_from
from pipelines.simulator import SimConfig
from pipelines.simulator.core import Simulation

CELL = {"gpus": 128, "mode": "dora", "max_staleness": 3, "switching": "migrate", "rollout_batch_size": 1536}


def stability_rows(em, factors: list[float]) -> tuple[list[list[str]], dict[float, object]]:
    """The table's rows, and each factor's DORA result."""
    rows, results = [], {}
    for factor in factors:
        e = dataclasses.replace(em, response_p50=em.response_p50 * factor)
        sync = paper_table.run(e, gpus=128, mode="sync")
        r = results[factor] = paper_table.run(e, split="searched", **CELL)
        rows.append([f"x{factor:.3f}", f"{r.rollout_gpus}/{r.trainer_gpus}", f"{r.tokens_per_s:,.0f}",
                     f"{sync.tokens_per_s:,.0f}", f"{r.tokens_per_s / sync.tokens_per_s:.2f}x",
                     f"{r.non_overlapped_share:.1%}", f"{r.rollout_bubble:.1%}", f"{paper_table.overhead(r):.2%}",
                     paper_table.audit_cell(r)])
        print(" | ".join(rows[-1]), flush=True)
    return rows, results


def tail_rows(em, trainer_gpus: int, steps: int) -> list[list[str]]:
    """Per update: the trainer's wait before it and the last group its batch waited for."""
    lengths = length_model_from(em, 0)
    sim = Simulation(SimConfig(**CELL, trainer_gpus=trainer_gpus, steps=steps, warmup_steps=2),
                     cost_model_from(em), lengths)
    dispatched, completed = {}, {}
    on_dispatch, on_complete = sim.gate.on_dispatch, sim.gate.on_complete

    def note_dispatch(group_id: int, version: int) -> None:
        dispatched[group_id] = (sim.now, version)
        on_dispatch(group_id, version)

    def note_complete(group_id: int) -> None:
        completed[group_id] = sim.now
        on_complete(group_id)

    sim.gate.on_dispatch, sim.gate.on_complete = note_dispatch, note_complete
    record, rows, previous_end = sim.run(), [], 0.0
    for u in record.updates:
        last = max(u.group_ids, key=completed.__getitem__)
        start, version = dispatched[last]
        longest = max(lengths.response_tokens(last, s) for s in range(sim.cfg.group_size))
        rows.append([str(u.update), f"{u.start - previous_end:.0f}", f"{u.end - u.start:.0f}", str(last),
                     str(version), f"{start:.0f}", f"{completed[last]:.0f}", f"{completed[last] - start:.0f}",
                     f"{longest:,}"])
        previous_end = u.end
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factors", type=float, nargs="+", default=[1.0, 0.999, 1.001, 0.997, 1.003])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    paper_table.ARGS = SimpleNamespace(steps=args.steps)
    t0 = time.time()
    em, log = paper_table.calibrate()
    print("; ".join(log), flush=True)
    head = ["response_p50", "split", "DORA tokens/s", "sync tokens/s", "/ sync", "non-overlapped", "rollout bubble",
            "orchestration overhead", "C1 / C2 / C3"]
    stability, results = stability_rows(em, args.factors)
    exact = results.get(1.0) or paper_table.run(em, split="searched", **CELL)
    tail_head = ["update", "trainer waited s", "trained s", "last group", "its version", "dispatched s",
                 "completed s", "took s", "its longest response (tokens)"]
    print("\n" + markdown_table(head, stability))
    print(f"\nAt the exact calibration, split {exact.rollout_gpus}/{exact.trainer_gpus}: each update\n")
    print(markdown_table(tail_head, tail_rows(em, exact.trainer_gpus, args.steps)))
    print(f"\n(simulated in {time.time() - t0:.0f} s of wall time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
