"""A pipeline defined in Python: dataset rows built here and a reward function that reads each row's own fields.

    python examples/custom_dataset_reward.py                       # a short run on the embedded cluster
    python examples/custom_dataset_reward.py dora.num_updates=40   # any config override

The task: add two numbers (`"17+25="` -> `"42"`). Each row also carries its operands and a tolerance, which the
reward reads from `row`: the exact sum scores 1, a sum off by no more than the row's tolerance 0.5, anything else 0.
The small policy is warm-started on the rows' answers (as for any dataset), then trained with DORA; the summary
says where the run folder, its log file, MLflow and the audit are.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

from pipelines import Pipeline

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "cpu_demo.yaml"
SETTINGS = [  # a few minutes on a laptop's CPU; override any of them on the command line
    "storage.run_dir=runs/example_custom_reward", "dora.num_updates=20", "task.eval_prompts=32",
    "task.eval_interval=10", "rollout.max_new_tokens=6", "storage.checkpoint_interval=10",
]


def addition_rows(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "operands": [a, b], "tolerance": rng.choice([0, 2])})
    return rows


def close_enough(response: str, *, prompt: str, answer: str, row: dict) -> float:
    """1 for the exact sum, 0.5 within the row's tolerance, else 0 (also for a response that is no number)."""
    try:
        value = int(response.strip())
    except ValueError:
        return 0.0
    total = sum(row["operands"])
    if value == total:
        return 1.0
    return 0.5 if abs(value - total) <= row["tolerance"] else 0.0


def main(overrides: list[str]) -> int:
    pipeline = Pipeline(CONFIG, overrides=SETTINGS + overrides, dataset=addition_rows(1024), reward=close_enough)
    summary = pipeline.run()
    print(summary.to_text())
    return 0 if summary.audit_ok else 1


if __name__ == "__main__":  # worker processes start by importing this file: the run starts only from here
    sys.exit(main(sys.argv[1:]))
