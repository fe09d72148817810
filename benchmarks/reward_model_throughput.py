"""What a reward model scores per second when scoring tasks of several groups share forward passes, against one
forward per task.

`--tasks` threads (the scoring tasks a reward worker runs at once) each score `--rounds` groups of `--group` countdown
responses through one `ForwardBatcher`, as `steps.model_reward` does: merged (batch size `--batch`, a window of
`--window` s) and unmerged (batch size = one group, no window). Reported per mode: responses per second of wall time
and of forward time, the mean forward batch, the tasks one forward merged at most, and seconds per forward. The model
is the project's small countdown classifier (`reward_model_training`), trained first unless `--model` names one.

    python benchmarks/reward_model_throughput.py [--model FOLDER] [--tasks 4] [--rounds 8] [--group 8] [--batch 32]

Not a timed test: it measures this machine.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dora_tasks.core.config_reward import RewardConfig  # noqa: E402
from dora_tasks.workloads.reward_batcher import ForwardBatcher  # noqa: E402
from dora_tasks.workloads.reward_model import load_reward_model  # noqa: E402
from dora_tasks.workloads.reward_model_training import examples, train_reward_model  # noqa: E402


def measure(model, texts: list[str], tasks: int, rounds: int, group: int, batch: int, window_s: float) -> dict:
    """`tasks` threads, each scoring `rounds` groups of `group` texts through one batcher."""
    batcher = ForwardBatcher(model.score, batch, window_s)

    def task(i: int) -> None:
        for r in range(rounds):
            start = ((i * rounds + r) * group) % max(1, len(texts) - group)
            batcher.score(texts[start:start + group])

    threads = [threading.Thread(target=task, args=(i,)) for i in range(tasks)]
    begun = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - begun
    batcher.close()
    history = list(batcher.history)
    forward = sum(b.seconds for b in history)
    responses = sum(b.size for b in history)
    return {"responses": responses, "per_s_wall": responses / wall, "per_s_forward": responses / forward,
            "batch_mean": float(np.mean([b.size for b in history])), "tasks_max": max(b.calls for b in history),
            "s_per_forward": forward / len(history)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--window", type=float, default=0.02)
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = args.model or tempfile.mkdtemp(prefix="dora-reward-model-")
    if not args.model:
        train_reward_model(folder, "classifier", steps=120, batch=16, hidden=32, layers=1)
    model = load_reward_model(RewardConfig(model=folder))
    texts = [e.text for e in examples(256, seed=3, max_count=200, template=RewardConfig().scoring_template)]
    model.score(texts[:args.group])  # the first forward of a process is slow
    print("| mode | responses | responses/s (wall) | responses/s (forward) | mean batch | tasks/forward max | "
          "s/forward |\n|---|---|---|---|---|---|---|")
    for mode, batch, window in (("merged", args.batch, args.window), ("one group a forward", args.group, 0.0)):
        m = measure(model, texts, args.tasks, args.rounds, args.group, batch, window)
        print(f"| {mode} | {m['responses']} | {m['per_s_wall']:.0f} | {m['per_s_forward']:.0f} | "
              f"{m['batch_mean']:.1f} | {m['tasks_max']} | {m['s_per_forward']:.4f} |")


if __name__ == "__main__":
    main()
