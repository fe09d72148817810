"""Several policy versions on one rollout instance: `rollout.versions_per_instance` M = 1 against 2-4, LoRA on.

    python benchmarks/lora_versions.py                                # M = 1, 2, 3 on the long-tail config
    python benchmarks/lora_versions.py --versions 1,2,4 --updates 12 --repeats 2 dora.max_staleness=2

Every run is a real pipeline run (`pipelines.streaming.run_pipeline`) of `configs/longtail_bench.yaml` with LoRA
adapters (`LORA`), the same warm-started model folder, the same staleness bound K and the same embedded cluster
(started once, attached to by every run), launched and measured by `benchmarks/compare_modes.py`'s `run_mode`:
only M changes. With M = 1 an instance drains its older versions before it takes the newest (the rollout bubble of
a version switch); with M > 1 it loads the newest version's adapter beside the ones it runs and starts its groups
in the rows the older ones free (`pipelines.switching.Concurrent`, `dora_tasks.version_policy.ConcurrentVersions`).

Columns: throughput (consumed tokens/s after the warm-up updates), step time, rollout bubble, trainer bubble (both
`pipelines/metrics.py`), staleness (mean and max over consumed trajectories), most versions generating on one
instance at once and the audit's verdict (`storage.audit`), the largest gap between a trajectory's behaviour
log-probs and a recompute under its own version's adapter (C1 per request, beyond the version tags the audit
reads), the share of the steady-state window the instance was generating and its version loads
(`benchmarks/run_profile.py`, from the rollout servers' logs), and the run's wall time.

`--decode-only`: what a mixed batch costs the transformers engine, apart from the pipeline: the same 32 prompts x 4
samples decoded by one rollout server as one version (M = 1) or split over 2 or 3 versions (time-sliced sessions),
median tokens/s over `--decode-reps` interleaved repetitions; on a random Qwen2 of the config's width (vocab 64,
so responses run long) with random rank-8 adapters.

Output (`--out`, default benchmarks/results): lora_versions_runs.md and lora_versions.json (the runs),
lora_versions_decode.md (`--decode-only`); benchmarks/results/lora_versions.md reads them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.compare_modes import QUICK, Clusters, run_mode, say, shape_text
from benchmarks.tables import markdown_table

LORA = ["train.lora.rank=8", "train.lora.alpha=16"]
BASE = ["tracking.live_view=false", "tracking.plots=false", "storage.checkpoint_interval=0", "task.eval_interval=0"]
COLUMNS = [  # (header, key, format)
    ("M", "versions_per_instance", "{}"), ("repeat", "repeat", "{}"), ("tokens/s", "throughput_tokens_per_s", "{:.0f}"),
    ("step s", "step_time_s", "{:.2f}"), ("rollout bubble", "rollout_bubble", "{:.0%}"),
    ("trainer bubble", "trainer_bubble", "{:.0%}"), ("staleness mean", "mean_staleness", "{:.2f}"),
    ("staleness max", "max_staleness", "{}"), ("versions on one instance", "max_versions_per_instance", "{}"),
    ("instance generating", "generating", "{:.0%}"), ("loads per instance", "loads", "{:.1f}"),
    ("log-prob gap to own adapter", "logprob_error", "{:.1e}"), ("audit", "audit_text", "{}"),
    ("wall s", "wall_s", "{:.1f}"),
    ("load avg (before, after)", "load_text", "{}"),
]


def behaviour_logprob_error(run_dir: str, store: str, rows_per_version: int = 16) -> float:
    """Largest |behaviour log-prob - recompute under the trajectory's own version| (base + that version's adapter,
    fp32) over up to `rows_per_version` trajectories of each kept version: a row decoded under another version's
    weights shows up here, where the audit (which reads version tags) cannot see it."""
    import numpy as np
    import torch

    from dora_tasks.algorithms.objective import sequence_logprobs
    from dora_tasks.core.config import RolloutConfig
    from dora_tasks.engines.hf_rollout import HFRolloutEngine
    from storage.trajectory_store import TrajectoryStore
    from storage.weight_store import WeightStore

    trajectories = TrajectoryStore.open(store)
    table = trajectories.read_table("trajectories", ["version", "prompt_len", "response_len"])
    weights, worst = WeightStore(os.path.join(run_dir, "weights")), 0.0
    for version in sorted(set(table["version"].tolist()) & set(weights.versions())):
        policy = HFRolloutEngine(weights.path_for(version), RolloutConfig(), version=version).model
        rows = np.flatnonzero((table["version"] == version) & (table["response_len"] > 0))[:rows_per_version]
        for tokens, behaviour, start in zip(trajectories.read_ragged("tokens", rows),
                                            trajectories.read_ragged("behaviour_logprobs", rows),
                                            table["prompt_len"][rows]):
            ids = torch.tensor([tokens.tolist()])
            with torch.no_grad():
                recomputed, _ = sequence_logprobs(policy, ids, torch.ones_like(ids), with_entropy=False)
            worst = max(worst, float(np.abs(recomputed[0, start:].numpy() - behaviour).max()))
    return worst


def decode_cost(hidden: int, heads: int, reps: int, work: str) -> dict[int, dict[str, float]]:
    """{M: {median, min, max tokens/s}}: one batch decoded by a rollout server, its requests spread over M versions."""
    import statistics

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dora_tasks.core.config import TrainConfig
    from dora_tasks.core.config_lora import LoraConfig
    from dora_tasks.engines.torch_trainer import TorchTrainEngine

    torch.set_num_threads(1)
    base = os.path.join(work, "base")
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                                 num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=256,
                                 eos_token_id=2, bos_token_id=1, pad_token_id=0)).save_pretrained(base)
    trainer = TorchTrainEngine(base, TrainConfig(lora=LoraConfig(rank=8, alpha=16)), base_path=base)
    folders = {}
    for version in (1, 2, 3):
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0, 0.02)
        folders[version] = os.path.join(work, f"v{version}")
        trainer.save_weights(folders[version])
    rates: dict[int, list[float]] = {1: [], 2: [], 3: []}
    for _ in range(reps):
        for m, rate in rates.items():
            rate.append(_decode_once(base, folders, m))
    return {m: {"median": statistics.median(r), "min": min(r), "max": max(r)} for m, r in rates.items()}


def _decode_once(base: str, folders: dict[int, str], m: int) -> float:
    """Tokens/s of 32 requests (4 samples each) on one server, request i on version 1 + i % m, all queued first."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from dora_tasks.core.config import RolloutConfig
    from dora_tasks.engines.hf_rollout import HFRolloutEngine
    from dora_tasks.rollout_server import RolloutServer
    from dora_tasks.version_policy import ConcurrentVersions, DispatchVersion

    engine = HFRolloutEngine(base, RolloutConfig(max_new_tokens=96, versions_per_instance=max(m, 2)))
    for version in range(1, m + 1):
        engine.load_version(version, folders[version])  # resident before the clock starts
    queued = threading.Event()
    server = RolloutServer(lambda: (queued.wait(), engine)[1], ConcurrentVersions(m) if m > 1 else DispatchVersion(),
                           chunk_tokens=16)
    prompts = [[1] + [5 + (i * 7 + j) % 50 for j in range(8)] for i in range(32)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(server.generate, 1 + i % m, folders[1 + i % m], p, 4, i) for i, p in enumerate(prompts)]
        time.sleep(0.5)
        start = time.perf_counter()
        queued.set()
        tokens = sum(len(g.token_ids) for f in futures for g in f.result())
    seconds = time.perf_counter() - start
    server.close()
    return tokens / seconds


def versions_row(row: dict, m: int) -> dict:
    """`run_mode`'s record with what this benchmark adds: M, mean staleness, versions per instance, loads."""
    from storage.audit import audit_store

    report = audit_store(row["store"], row["max_staleness_allowed"])
    histogram = {int(k): v for k, v in row["staleness_histogram"].items()}
    total = sum(histogram.values())
    row.update(versions_per_instance=m, max_versions_per_instance=report.max_versions_per_instance,
               mean_staleness=sum(k * v for k, v in histogram.items()) / total if total else float("nan"),
               loads=row["profile"].get("weight_loads_per_instance"),
               generating=row["profile"].get("rollout_instance_share", {}).get("generating"),
               audit_text="clean" if row["audit_ok"] else f"{len(report.violations)} violation kinds",
               load_text=" , ".join(f"{x:.1f}" for x in row["load_average"]),
               logprob_error=behaviour_logprob_error(row["run_dir"], row["store"]))
    return row


def table(rows: list[dict]) -> str:
    def fmt(value, spec):
        return "n/a" if value is None else spec.format(value)

    return markdown_table([h for h, _, _ in COLUMNS], [[fmt(r.get(k), f) for _, k, f in COLUMNS] for r in rows])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/longtail_bench.yaml")
    parser.add_argument("--versions", default="1,2,3", help="values of rollout.versions_per_instance, e.g. 1,2,4")
    parser.add_argument("--updates", type=int, default=None, help="updates per run (default: the config's)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per M (order reversed every other round)")
    parser.add_argument("--quick", action="store_true", help="compare_modes' smoke settings: TBS 4, RBS 8, G 4")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--decode-only", action="store_true", help="only the mixed-batch decode cost (no runs)")
    parser.add_argument("--decode-reps", type=int, default=7)
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides for every run")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from dora_tasks.core.config import load_config
    from pipelines.run import initial_policy

    started = time.time()
    if args.decode_only:
        return write_decode_cost(args, started)
    base = (QUICK if args.quick else []) + LORA + list(args.overrides) + BASE
    base += [f"dora.num_updates={args.updates}"] if args.updates else []
    cfg = load_config(args.config, base)
    base.append(f"storage.keep_versions={cfg.dora.num_updates + 1}")  # every adapter, for the log-prob check
    model_path = initial_policy(cfg)
    base.append(f"model.path={model_path}")
    cfg = load_config(args.config, base)
    versions = [int(m) for m in args.versions.split(",")]
    say(f"model {model_path}; M in {versions}; K={cfg.dora.max_staleness}; {cfg.dora.num_updates} updates x TBS "
        f"{cfg.dora.train_batch_size} x G {cfg.rollout.group_size}; load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs")
    os.makedirs(args.out, exist_ok=True)
    rows, clusters = [], Clusters(args.config, base)
    try:
        for repeat in range(args.repeats):
            for m in (versions if repeat % 2 == 0 else versions[::-1]):
                address, client, sampler = clusters.get([])
                record = run_mode(f"M={m}", [f"rollout.versions_per_instance={m}"], base, args, address, client,
                                  sampler, repeat)
                rows.append(versions_row(record, m))
    finally:
        clusters.close()
    rows.sort(key=lambda r: (r["versions_per_instance"], r["repeat"]))
    write(args, cfg, rows, model_path, started)
    return 0


def write_decode_cost(args, started: float) -> int:
    import tempfile

    from dora_tasks.core.config import load_config

    cfg = load_config(args.config, list(args.overrides))
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as work:
        cost = decode_cost(cfg.model.hidden_size, cfg.model.num_heads, args.decode_reps, work)
    lines = [f"### Mixed-batch decode cost, transformers engine ({time.strftime('%Y-%m-%d %H:%M')})", "",
             (f"32 prompts x 4 samples, 96-token budget, chunk 16, hidden {cfg.model.hidden_size}, median of "
              f"{args.decode_reps} interleaved repetitions; load average {load_before:.1f} -> "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs."), "",
             "| versions in the batch | tokens/s median (min - max) | vs one version |", "|---|---|---|"]
    lines += [f"| {m} | {c['median']:.0f} ({c['min']:.0f} - {c['max']:.0f}) | {c['median'] / cost[1]['median']:.2f} |"
              for m, c in cost.items()]
    text = "\n".join(lines)
    print("\n" + text + "\n")
    with open(os.path.join(args.out, "lora_versions_decode.md"), "w") as f:
        f.write(text + "\n")
    say(f"wrote {args.out}/lora_versions_decode.md in {time.time() - started:.0f} s")
    return 0


def write(args, cfg, rows: list[dict], model_path: str, started: float) -> None:
    text = "\n".join([
        f"## Several versions per rollout instance, LoRA ({time.strftime('%Y-%m-%d %H:%M')})", "",
        (f"Config `{args.config}` + {' '.join(LORA + args.overrides)}{' (--quick)' if args.quick else ''}; K = "
         f"{cfg.dora.max_staleness}; {cfg.dora.num_updates} updates x TBS {cfg.dora.train_batch_size} x G "
         f"{cfg.rollout.group_size}; RBS {cfg.dora.rollout_batch_size}; {shape_text(cfg)}; engine "
         f"{cfg.rollout.engine}; model `{model_path}`; {os.cpu_count()} CPUs shared with other jobs (load average "
         "per run in the last column): wall-clock figures are upper bounds."), "", table(rows)])
    print("\n" + text + "\n")
    with open(os.path.join(args.out, "lora_versions_runs.md"), "w") as f:
        f.write(text + "\n")
    public = [{k: v for k, v in r.items() if not k.startswith("_") and k != "response_lengths"} for r in rows]
    with open(os.path.join(args.out, "lora_versions.json"), "w") as f:
        json.dump({"config": args.config, "overrides": args.overrides, "rows": public,
                   "total_seconds": time.time() - started}, f, indent=1, default=str)
    say(f"wrote {args.out}/lora_versions_runs.md and lora_versions.json in {time.time() - started:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
