"""Several policy versions per rollout instance (`rollout.versions_per_instance` = M, LoRA adapters) side by side.

    python benchmarks/versions_per_instance.py               # the simulator at the paper's 64 GPUs, M = 1..4
    python benchmarks/versions_per_instance.py --dask 8      # and the Dask emulation with 8 instances, M = 1..4

Simulator: the paper's 64-GPU DORA cell (512 prompts x 16 samples a step, K=3, TBS 512, RBS 1024, the split rule),
with the calibration of `benchmarks/paper_table.py` (its `calibrate`), and a LoRA policy of rank `--rank` on every
projection: versions after 0 move as adapters and every decode step pays for its batch's adapters
(`dora_tasks/emulation/cost_model.py`). Switching is drain for M = 1 (the config's default), plus M = 1 with
migrate (DORA's request migration) for reference; M > 1 is `Concurrent(M)`.
Dask: `benchmarks/sim_vs_emulation.py`'s configuration (its `make_config` and `run_dask`) with the same LoRA rank.
Figures: rollout bubble (weight loads and prefill included), tokens/s, staleness histogram, the share of rollout
time spent loading adapters, and C1-C3 (simulator: its own checks; Dask: the run's audit). Writes
benchmarks/results/versions_per_instance.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "versions_per_instance.md")
MS = (1, 2, 3, 4)


def simulated(m: int, em, steps: int, switching: str = "drain"):
    from dora_tasks.emulation.cost_model import cost_model_from
    from dora_tasks.emulation.lengths import length_model_from
    from pipelines.simulator import SimConfig, simulate

    cfg = SimConfig(gpus=64, mode="dora", max_staleness=3, steps=steps, warmup_steps=2, switching=switching,
                    versions_per_instance=m)
    return simulate(cfg, cost_model_from(em), length_model_from(em, 0))


def simulator_rows(rank: int, steps: int) -> tuple[list[str], str]:
    import paper_table

    paper_table.ARGS = argparse.Namespace(steps=steps)  # what its calibration reads
    em, log = paper_table.calibrate()
    em = dataclasses.replace(em, lora_rank=rank)
    lines = ["| M | tokens/s | step min | rollout bubble | adapter-load share | staleness histogram | C1 mixed | C2 "
             "| C3 |", "|---|---|---|---|---|---|---|---|---|"]
    for m, switching in [(m, "drain") for m in MS] + [(1, "migrate")]:  # migrate: the paper's switching, M = 1
        r = simulated(m, em, steps, switching)
        label = f"{m}" if switching == "drain" else f"{m} ({switching})"
        lines.append(f"| {label} | {r.tokens_per_s:,.0f} | {r.step_s / 60:.2f} | {r.rollout_bubble:.1%} | "
                     f"{r.load_share:.4%} | {dict(sorted(r.staleness_hist.items()))} | {r.c1_mixed_trajectories} | "
                     f"{'ok' if r.c2_ok else 'BROKEN'} | {'ok' if r.c3_ok else 'BROKEN'} |")
        print(lines[-1], flush=True)
    return lines, "; ".join(log)


def dask_rows(instances: int, rank: int, updates: int, written) -> list[str]:
    """The Dask table; `written(lines)` is called after each row (the page keeps what ran before a failure)."""
    from sim_vs_emulation import make_config, parse, run_dask

    lines = ["| M | tokens/s | step s | rollout bubble | staleness max | audit (C1-C3) | wall s | machine busy |",
             "|---|---|---|---|---|---|---|---|"]
    for m in MS:
        args = parse(["--instances", str(instances), "--updates", str(updates)])
        with tempfile.TemporaryDirectory() as work:
            cfg = make_config(args, work, [f"emulation.lora_rank={rank}", f"rollout.versions_per_instance={m}"])
            figures, info = run_dask(cfg)
        lines.append(f"| {m} | {figures.tokens_per_s:,.0f} | {figures.step_s:.1f} | {figures.rollout_bubble:.1%} | "
                     f"{figures.staleness_max:.0f} | {'clean' if info['audit_ok'] else 'BROKEN'} | "
                     f"{info['wall_s']:.0f} | {info['machine_busy']:.0%} |")
        print(lines[-1], flush=True)
        written(lines)
    return lines


def write(text: list[str], t0: float) -> None:
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        f.write("\n".join(text + ["", f"(measured in {time.time() - t0:.0f} s of wall time)"]) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank of the policy (default 8)")
    parser.add_argument("--steps", type=int, default=5, help="simulated steps, the first 2 left out (default 5)")
    parser.add_argument("--dask", type=int, default=0, metavar="N", help="also the Dask emulation with N instances")
    parser.add_argument("--updates", type=int, default=8, help="updates of each Dask run (default 8)")
    args = parser.parse_args(argv)
    t0 = time.time()
    sim, calibration = simulator_rows(args.rank, args.steps)
    text = ["# Versions per instance (LoRA): M = 1..4 side by side", "",
            f"Produced by `python benchmarks/versions_per_instance.py {' '.join(sys.argv[1:] if argv is None else argv)}`"
            f" on a 2-core machine shared with other jobs.",
            "", f"## Simulator: the paper's 64 GPUs, DORA K=3, LoRA rank {args.rank}", "",
            f"Calibration (benchmarks/paper_table.py): {calibration}. {args.steps} steps a run, the first 2 left out; "
            "virtual seconds.", ""] + sim
    write(text, t0)
    if args.dask:
        text += ["", f"## Dask emulation: {args.dask} instances, LoRA rank {args.rank}", "",
                 "benchmarks/sim_vs_emulation.py's configuration; emulated seconds.", ""]
        text += dask_rows(args.dask, args.rank, args.updates, lambda rows: write(text + rows, t0))
        write(text, t0)
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
