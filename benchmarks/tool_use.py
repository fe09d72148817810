"""Does the calculator tool raise the reward? The arithmetic task with and without `task.environment`, same policy.

    python benchmarks/tool_use.py                      # the setting below
    python benchmarks/tool_use.py --updates 10 rollout.group_size=4    # any config override goes after

Both runs are real pipeline runs (embedded LocalCluster, `pipelines.streaming.run_pipeline`) from ONE warm-started
policy (the arithmetic task's warm start: half of its demonstrations call the tool), with the same seed, prompts and
number of updates; they differ only in `task.environment`. Without it (the no-tool baseline) the policy still
writes `<calc>...</calc>`, and then has to write the result itself. Per update, from each run's trajectory store:
the mean training reward, model turns per trajectory and tool calls; and each run's audit.

Output: benchmarks/results/tool_use.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
CALCULATOR = "dora_tasks.workloads.calculator.CalculatorEnvironment"
TOOL_USE = [
    "task.name=arithmetic", "task.num_prompts=2048", "task.eval_prompts=32", "model.hidden_size=64",
    "model.num_heads=2", "model.warmstart_steps=800", "rollout.max_new_tokens=48", "rollout.group_size=8",
    "rollout.instances=2", "rollout.slots=2", "dora.train_batch_size=8", "dora.rollout_batch_size=16",
    "dora.max_staleness=1", "train.lr=3e-4", "cluster.cpu_threads=1", "storage.checkpoint_interval=0",
    "tracking.live_view=false", "tracking.plots=false",
]


def run(overrides: list[str], work: str, label: str) -> dict:
    from dora_tasks.core.config import load_config
    from pipelines.streaming import run_pipeline
    from storage.audit import audit_store
    from storage.trajectory_store import TrajectoryStore

    run_dir = os.path.join(work, label)
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_config(None, overrides + [f"storage.run_dir={run_dir}",
                                         f"tracking.mlflow_uri=sqlite:///{run_dir}.mlflow.db"])
    summary = run_pipeline(cfg)
    store = TrajectoryStore.open(summary.store)
    t = store.read_table("trajectories", ["consumed_by", "reward", "turns", "tool_calls"])
    updates = sorted(set(t["consumed_by"].tolist()))
    per_update = {key: [float(np.nanmean(t[col][t["consumed_by"] == u].astype(float))) for u in updates]
                  for key, col in (("reward", "reward"), ("turns", "turns"), ("tool_calls", "tool_calls"))}
    report = audit_store(summary.store)
    return {"label": label, **per_update, "audit_ok": report.ok, "episodes": report.episodes,
            "env_errors": report.env_errors, "accuracy": {str(k): v for k, v in summary.accuracy.items()}}


def window(values: list[float], first: bool, n: int = 5) -> float:
    return float(np.mean(values[:n] if first else values[-n:]))


def table(results: list[dict]) -> str:
    lines = ["| run | reward, first 5 updates | reward, last 5 updates | turns per trajectory (last 5) | "
             "tool calls per trajectory (last 5) | audit |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['label']} | {window(r['reward'], True):.3f} | {window(r['reward'], False):.3f} | "
                     f"{window(r['turns'], False):.2f} | {window(r['tool_calls'], False):.2f} | "
                     f"{'PASS' if r['audit_ok'] else 'FAIL'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=30)
    parser.add_argument("--work", default=os.path.join(ROOT, "runs", "tool_use"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    base = TOOL_USE + [f"dora.num_updates={args.updates}"] + args.overrides
    results = [run(base + [f"task.environment={CALCULATOR}"], args.work, "tool"), run(base, args.work, "no_tool")]
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "tool_use.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = f"# Tool use: arithmetic with and without the calculator\n\n{table(results)}\n"
    with open(os.path.join(RESULTS, "tool_use.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
