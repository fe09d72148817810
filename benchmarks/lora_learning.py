"""Does a LoRA policy learn like a full-weights one? Same warm-started model, same updates, same K, same seed.

    python benchmarks/lora_learning.py                        # the learning benchmark's setting, K=1, 60 updates
    python benchmarks/lora_learning.py --updates 20 --lora-lr 1e-3 train.lora.rank=8   # overrides go after

The runs are those of `benchmarks/learning.py` (its LEARNING overrides, one warm-started model, real pipeline runs):
full weights at `train.lr`, LoRA (`train.lora`) at `--lora-lr` (adapters usually take a larger step than full
fine-tuning: B starts at zero and the update is scaled by alpha / rank), and full weights again with another seed
for the run-to-run noise. The comparison is `learning.compare`'s: a run is within noise when its change of held-out
accuracy differs from the full run's by no more than the two full runs differ.

Output: benchmarks/results/lora_learning.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from learning import LEARNING, RESULTS, ROOT, compare, markdown, run_mode, warm_started_model

LORA = ["train.lora.rank=16", "train.lora.alpha=32"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "longtail_bench.yaml"))
    parser.add_argument("--updates", type=int, default=60)
    parser.add_argument("--K", type=int, default=1)
    parser.add_argument("--lora-lr", type=float, default=3e-3)
    parser.add_argument("--work", default=os.path.join(ROOT, "runs", "lora_learning_bench"))
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("overrides", nargs="*", help="extra section.key=value overrides (after LEARNING)")
    args = parser.parse_args()

    overrides = LEARNING + [f"dora.num_updates={args.updates}"] + args.overrides
    start = time.time()
    model, warm_start_s = warm_started_model(args.config, overrides, args.work)
    common = overrides + [f"model.path={model}"]
    modes = [("full", common, 0), (f"LoRA lr {args.lora_lr:g}", common + LORA + [f"train.lr={args.lora_lr}"], 0),
             ("full seed 1", common, 1)]
    runs = []
    for label, mode_overrides, seed in modes:
        print(f"lora learning bench: {label} ...", flush=True)
        runs.append(run_mode(args.config, mode_overrides, args.K, seed, args.work, label))
        acc = runs[-1]["accuracy"]
        print(f"  {label}: accuracy {acc[0]:.3f} -> {acc[max(acc)]:.3f}, {runs[-1]['wall_s']:.0f} s", flush=True)
    table = compare(runs)
    setup = {"config": os.path.relpath(args.config, ROOT), "overrides": overrides + LORA, "updates": args.updates,
             "model": os.path.relpath(model, ROOT), "warm_start_s": warm_start_s, "K": args.K,
             "total_s": time.time() - start}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lora_learning.json"), "w") as f:
        json.dump({"setup": setup, "runs": runs, "table": table}, f, indent=1)
    text = (markdown(runs, table, setup).replace("K=0 vs K=1 vs K=3", f"full weights vs LoRA at K={args.K}")
            .replace("(K=0, seed 0 vs seed 1)", "(full weights, seed 0 vs seed 1)").replace("- K0", "- full"))
    with open(os.path.join(args.out, "lora_learning.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
