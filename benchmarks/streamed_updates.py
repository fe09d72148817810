"""Streamed updates in the simulator: the trainer computes an update's complete groups while its stragglers run.

    python benchmarks/streamed_updates.py [--gpus 128] [--trainer-gpus 56 64 72] [--factors 1.0 0.999 1.001]
                                          [--steps 24] [--seed 0] [--jobs 2]

The cell is the beat-the-paper one of `paper_table.py` (DORA K=3, `switching=migrate`, RBS 1536, the paper's step of
512 prompts x 16), at each given rollout/trainer split, with `SimConfig.stream_updates` off and on, beside sync on
the same accelerators. Each row multiplies the calibrated `response_p50` by a factor (every response a hair longer
or shorter), since a run's figure moves with where the longest responses land; `--seed` draws other lengths.
Simulator only: virtual seconds, deterministic on any machine (on Dask: `dora.stream_updates=true`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import paper_table
from benchmarks.tables import markdown_table
from dora_tasks.emulation.cost_model import cost_model_from
from dora_tasks.emulation.lengths import length_model_from
from pipelines.simulator import SimConfig, simulate

CELL = {"mode": "dora", "max_staleness": 3, "switching": "migrate", "rollout_batch_size": 1536}
TARGETS = "tokens/s >= 2.5x sync, non-overlapped <= 8%, rollout bubble <= 5%, orchestration overhead <= 1%"


def one_run(em, steps: int, seed: int, settings: dict):
    cfg = SimConfig(steps=steps, warmup_steps=2, **settings)
    return simulate(cfg, cost_model_from(em), length_model_from(em, seed))


def runs(em, args) -> dict:
    """Every run of the table, keyed (factor, trainer GPUs or 0 for sync, streamed)."""
    keys = [(f, 0, False) for f in args.factors]
    keys += [(f, t, s) for f in args.factors for t in args.trainer_gpus for s in (False, True)]

    def settings(key) -> dict:
        _, trainer, streamed = key
        if not trainer:
            return {"gpus": args.gpus, "mode": "sync"}
        return {"gpus": args.gpus, **CELL, "trainer_gpus": trainer, "stream_updates": streamed}

    ems = [dataclasses.replace(em, response_p50=em.response_p50 * key[0]) for key in keys]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = pool.map(one_run, ems, [args.steps] * len(keys), [args.seed] * len(keys), [settings(k) for k in keys])
        return dict(zip(keys, results))


def met(r, sync) -> bool:
    return (r.tokens_per_s >= 2.5 * sync.tokens_per_s and r.non_overlapped_share <= 0.08
            and r.rollout_bubble <= 0.05 and paper_table.overhead(r) <= 0.01 and r.c2_ok and r.c3_ok
            and not r.c1_mixed_trajectories)


def table(res: dict, args) -> list[list[str]]:
    rows = []
    for f in args.factors:
        sync = res[(f, 0, False)]
        for t in args.trainer_gpus:
            plain, streamed = res[(f, t, False)], res[(f, t, True)]
            rows.append([f"x{f:.3f}", f"{args.gpus - t}/{t}", f"{sync.tokens_per_s:,.0f}",
                         f"{plain.tokens_per_s:,.0f}", f"{plain.tokens_per_s / sync.tokens_per_s:.2f}x",
                         f"{streamed.tokens_per_s:,.0f}", f"{streamed.tokens_per_s / sync.tokens_per_s:.2f}x",
                         f"{streamed.tokens_per_s / plain.tokens_per_s:.2f}x",
                         f"{plain.non_overlapped_share:.1%} / {streamed.non_overlapped_share:.1%}",
                         f"{plain.rollout_bubble:.1%} / {streamed.rollout_bubble:.1%}",
                         f"{paper_table.overhead(plain):.2%} / {paper_table.overhead(streamed):.2%}",
                         f"{paper_table.audit_cell(plain)} / {paper_table.audit_cell(streamed)}",
                         "yes" if met(streamed, sync) else "no"])
    return rows


def medians(res: dict, args) -> list[list[str]]:
    rows = []
    for t in args.trainer_gpus:
        ratio = {s: [res[(f, t, s)].tokens_per_s / res[(f, 0, False)].tokens_per_s for f in args.factors]
                 for s in (False, True)}
        share = {s: [res[(f, t, s)].non_overlapped_share for f in args.factors] for s in (False, True)}
        bubble = {s: [res[(f, t, s)].rollout_bubble for f in args.factors] for s in (False, True)}
        rows.append([f"{args.gpus - t}/{t}", *(f"{statistics.median(ratio[s]):.2f}x ({min(ratio[s]):.2f}-"
                                               f"{max(ratio[s]):.2f})" for s in (False, True)),
                     *(f"{statistics.median(share[s]):.1%}" for s in (False, True)),
                     *(f"{statistics.median(bubble[s]):.1%}" for s in (False, True))])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=128)
    parser.add_argument("--trainer-gpus", type=int, nargs="+", default=[56, 64, 72])
    parser.add_argument("--factors", type=float, nargs="+", default=[1.0, 0.999, 1.001])
    parser.add_argument("--steps", type=int, default=24, help="steps a run, the first 2 left out")
    parser.add_argument("--seed", type=int, default=0, help="the length model's seed (responses drawn per prompt)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one process each")
    args = parser.parse_args()
    paper_table.ARGS = SimpleNamespace(steps=8)  # the calibration's own runs, as paper_table.py does them
    t0 = time.time()
    em, log = paper_table.calibrate()
    print("; ".join(log), flush=True)
    res = runs(em, args)
    head = ["response_p50", "split", "sync tokens/s", "DORA tokens/s", "/ sync", "streamed tokens/s", "/ sync",
            "streamed / DORA", "non-overlapped (DORA / streamed)", "rollout bubble", "orchestration overhead",
            "C1 / C2 / C3", "streamed meets every target"]
    print(f"\n{args.gpus} GPUs, {args.steps} steps a run (the first 2 left out), length seed {args.seed}. "
          f"Targets: {TARGETS}.\n")
    print(markdown_table(head, table(res, args)))
    print("\nMedians over the factors (range)\n")
    print(markdown_table(["split", "DORA / sync", "streamed / sync", "non-overlapped DORA", "streamed",
                          "rollout bubble DORA", "streamed"], medians(res, args)))
    print(f"\n(simulated in {time.time() - t0:.0f} s of wall time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
