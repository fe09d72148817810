"""DORA against synchronous, one-step off-policy and partial rollout (and optionally TRL), side by side, in one run.

One invocation runs the same long-tailed workload (countdown, `configs/longtail_bench.yaml`), the same warm-started
model folder, the same cluster shape (one embedded cluster of GPU-labelled worker processes per shape, started
before the first mode that needs it and attached to by every mode of that shape, so no mode pays or dodges worker
start-up) and the same number of trained trajectories (`num_updates * TBS * G`, C2 checked by the audit) for each
mode, through `pipelines.streaming.run_pipeline`:

    sync K=0 | one-step off-policy K=1 | partial rollout K=1 | DORA K=2 | DORA K=3 |
    sync K=0 and DORA K=3 on the colocated shape (COLOCATED; --no-colocated leaves them out, --colocated-only keeps
    only them) | [TRL GRPO, --with-trl]

and prints ONE table (written to `<out>/compare_modes.md` and `.json`): throughput, step time, rollout bubble,
trainer bubble, non-overlapped rollout share (definitions and code:
`pipelines/metrics.py`), max staleness and C1 violations (from the audit of each run's store), held-out accuracy
(initial -> final, the pipeline's own greedy evaluation), wall time to the target accuracy, and speed-up over K=0.
It also prints the answer-length tail of the consumed trajectories (p99/median) and a profile of where a step's time
goes (from the Dask task stream, the rollout servers' busy spans and weight loads, and the store's update rows).

Accuracy over time: every mode keeps its published versions (`storage.keep_versions`) and the versions at
`--eval-every` are evaluated after all runs, off the clock, with the same `dora_tasks.warmstart.evaluate` the
pipeline uses; each point is placed at the wall time its version was published. The target accuracy is `--target`,
or by default the lowest final accuracy of the synchronous runs (K=0): "the same accuracy" as the baseline.

Simplified, and why: few repeats per mode (`--repeats`, default 2, the second round in reverse order so that a drift
in machine load hits every mode); docs/benchmark.md gives the noise this leaves.

    python benchmarks/compare_modes.py [--updates 10] [--config configs/longtail_bench.yaml]
                                       [--out benchmarks/results] [--quick] [--with-trl] [key=value ...]
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _k, _v in {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(_k, _v)

import numpy as np

from benchmarks.run_profile import CpuSampler, length_stats, profile, profile_text, read_store, worker_roles
from benchmarks.tables import markdown_table

# The config's cluster shape gives rollout and training one core each (1 rollout instance, 1 trainer: disjoint
# hardware, the DORA paper's setting); COLOCATED runs two rollout instances, so synchronous rollout has both cores
# while the trainer waits (the colocated setting of verl and TRL), which is the faster shape for K=0 here.
COLOCATED = ["rollout.instances=2", "rollout.slots=8"]
MODES = [  # (name, overrides, cluster shape: overrides of the embedded cluster; [] = the config's)
    ("sync K=0", ["dora.max_staleness=0"], []),
    ("one-step off-policy K=1", ["dora.max_staleness=1"], []),
    ("partial rollout K=1", ["dora.max_staleness=1", "rollout.partial_rollout=true"], []),
    ("DORA K=2", ["dora.max_staleness=2"], []),
    ("DORA K=3", ["dora.max_staleness=3"], []),
    ("DORA K=3 queued switching", ["dora.max_staleness=3", "rollout.switching=queue"], []),
    ("sync K=0 colocated", ["dora.max_staleness=0"], COLOCATED),
    ("DORA K=3 colocated", ["dora.max_staleness=3"], COLOCATED),
    ("DORA K=3 colocated queued switching", ["dora.max_staleness=3", "rollout.switching=queue"], COLOCATED),
    ("DORA K=3 colocated drain switching", ["dora.max_staleness=3", "rollout.switching=drain"], COLOCATED),
]
QUICK = ["dora.train_batch_size=4", "dora.rollout_batch_size=8", "rollout.group_size=4", "task.eval_prompts=16"]
COLUMNS = [  # (header, key, format); "(a / b)": the value of each repeat
    ("mode", "mode", "{}"), ("tokens/s", "throughput_text", "{}"),
    ("tokens per trajectory", "tokens_per_trajectory", "{:.1f}"), ("step s", "step_time_s", "{:.2f}"),
    ("rollout bubble", "rollout_bubble", "{:.0%}"), ("trainer bubble", "trainer_bubble", "{:.0%}"),
    ("non-overlapped rollout", "non_overlapped_rollout_share", "{:.0%}"), ("max staleness", "max_staleness", "{}"),
    ("C1 violations", "c1_text", "{}"), ("held-out acc (v0 -> final)", "accuracy_text", "{}"),
    ("wall s (all updates)", "wall_s", "{:.1f}"), ("time to target s: median (runs)", "time_to_target_text", "{}"),
    ("speed-up vs K=0 (same shape)", "speedup_text", "{}"), ("vs fastest K=0", "speedup_best_text", "{}"),
    ("trajectories/s vs K=0 (same shape)", "speedup_steps_text", "{}"),
]
log = logging.getLogger("compare_modes")


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def shape_text(cfg) -> str:
    return f"{cfg.rollout.instances} rollout x {cfg.rollout.slots} slots + 1 trainer"


class Clusters:
    """One embedded cluster at a time, started for the shape the next mode needs (and kept while it stays the same),
    with a `CpuSampler` over its workers."""

    def __init__(self, config: str, base: list[str]) -> None:
        self.config, self.base = config, base
        self.shape: list[str] | None = None
        self.cluster = self.client = self.sampler = None

    def get(self, shape: list[str]):
        from distributed import Client

        from dora_tasks.core.config import load_config
        from pipelines.cluster import embedded_cluster

        if shape != self.shape:
            self.close()
            cfg = load_config(self.config, self.base + shape)
            say(f"cluster: {shape_text(cfg)}, {cfg.cluster.cpu_workers} CPU worker")
            self.cluster = embedded_cluster(cfg)
            self.client = Client(self.cluster)
            self.client.wait_for_workers(cfg.rollout.instances + 1 + cfg.cluster.cpu_workers, timeout=600)
            self.sampler = CpuSampler(worker_roles(self.client))
            self.sampler.start()
            self.shape = shape
        return self.cluster.scheduler_address, self.client, self.sampler

    def close(self) -> None:
        if self.cluster is None:
            return
        self.sampler.halt.set()
        self.client.close()
        self.cluster.close()
        self.shape = self.cluster = self.client = self.sampler = None


# ---- one mode ----------------------------------------------------------------------------------------------------
def run_mode(name: str, overrides: list[str], base: list[str], args, address: str, client, sampler: CpuSampler,
             repeat: int = 0) -> dict:
    from distributed import get_task_stream

    from dora_tasks.core.config import load_config
    from pipelines.streaming import run_pipeline
    from storage.audit import audit_store

    slug = "_".join("".join(c for c in word if c.isalnum()).lower() for word in name.split())
    run_dir = os.path.abspath(os.path.join(args.out, "runs", f"{slug}_r{repeat}"))
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_config(args.config, base + overrides + [f"cluster.scheduler_address={address}",
                                                       f"storage.run_dir={run_dir}"])
    load_before = os.getloadavg()[0]
    say(f"{name}: running ({' '.join(overrides)}) in {run_dir}")
    started = time.time()
    with get_task_stream(client=client) as stream:
        summary = run_pipeline(cfg)
    servers = client.run(_server_record)  # the run's rollout servers are still the workers' plugins
    audit = audit_store(summary.store, cfg.dora.max_staleness).to_dict()
    c1 = {v["name"]: v["count"] for v in audit["violations"] if v["clause"] == "C1"}
    m = summary.metrics
    row = {
        "mode": name, "repeat": repeat, "overrides": overrides, "run_dir": run_dir, "store": summary.store,
        "max_staleness_allowed": cfg.dora.max_staleness,
        "shape": shape_text(cfg),
        "throughput_tokens_per_s": m["throughput_tokens_per_s"], "step_time_s": m["step_time_s"],
        "rollout_bubble": m["rollout_bubble"], "trainer_bubble": m["trainer_bubble"],
        "non_overlapped_rollout_share": m["non_overlapped_rollout_share"], "wall_s": m["wall_s"],
        "live_versions_max": m.get("live_versions_max", float("nan")),
        "max_staleness": audit["max_staleness_seen"],
        # trajectories with a token of a version other than their group's dispatch version (a superset of the
        # mixed-version ones, so the two names are not added up)
        "c1_violations": c1.get("token_version_mismatch", 0) + c1.get("group_version_mismatch", 0),
        "c1_detail": c1, "audit_ok": audit["ok"], "audit_counts": audit["counts"],
        "other_violations": [v for v in audit["violations"] if v["clause"] != "C1"],
        "staleness_histogram": audit["staleness_histogram"],
        "versions_live_concurrently": audit["versions_live_concurrently"],
        "accuracy": {int(k): float(v) for k, v in summary.accuracy.items()},
        "trained_trajectories": audit["counts"]["trajectories"], "consumed_tokens": audit["counts"]["consumed_tokens"],
        "load_average": [load_before, os.getloadavg()[0]], "total_seconds": time.time() - started,
    }
    row.update(read_store(summary.store))
    row["profile"] = profile(row, stream.data, servers)
    seen = row["_seen"]
    from pipelines.metrics import WARMUP_UPDATES

    if WARMUP_UPDATES - 1 in seen and seen:
        window = (seen[WARMUP_UPDATES - 1], seen[max(seen)])
        row["profile"]["cores_used"] = sampler.cores(*window)
        upd = row["_updates"]
        updating = sum(max(0.0, min(e, window[1]) - max(s_, window[0])) for s_, e in zip(upd["start"], upd["end"]))
        cores = row["profile"]["cores_used"]
        if updating > 0 and "trainer" in cores:
            # trainer CPU while an update runs: 1.0 = the update had a core to itself
            row["profile"]["trainer_cpu_while_updating"] = cores["trainer"] * (window[1] - window[0]) / updating
    say(f"{name}: {row['throughput_tokens_per_s']:.0f} tokens/s, step {row['step_time_s']:.2f} s, "
        f"accuracy {row['accuracy']}, C1 {row['c1_violations']}, {row['total_seconds']:.0f} s in all")
    return row


def _server_record(dask_worker):
    plugin = dask_worker.plugins.get("dora-rollout")
    server = getattr(plugin, "server", None)
    if server is None:
        return None
    return {"busy": list(server.busy.spans), "loads": list(server.loads)}


# ---- accuracy over time ------------------------------------------------------------------------------------------
def accuracy_curves(rows: list[dict], cfg, client, eval_every: int) -> None:
    """Evaluate each mode's kept versions at `eval_every` (off the clock) on the cluster's CPU workers, as the pipeline
    evaluates (on the engine workers, several at once at 256 prompts, they outgrew the workers' memory limit). A
    version whose evaluation fails is left out of its curve with a warning; the runs' results are kept."""
    from dora_tasks import steps
    from dora_tasks.model import load_tokenizer
    from dora_tasks.workloads.datasets import load_prompts
    from pipelines.cluster import CPU

    _, eval_prompts = load_prompts(cfg.task, load_tokenizer(cfg.model.path), cfg.dora.seed)
    n = cfg.dora.num_updates
    wanted = [v for v in range(eval_every, n, eval_every)] if eval_every else []
    futures = {}
    for row in rows:
        for v in wanted:
            if v in row["accuracy"]:
                continue
            path = _weights_dir(row["run_dir"], v)
            if path is None:
                continue
            futures[(row["mode"], row["repeat"], v)] = client.submit(
                steps.evaluate, path, eval_prompts, cfg.model.path, cfg.task.reward_fn, cfg.rollout.max_new_tokens,
                cfg.dora.seed, cfg.task.reward_timeout_s, cfg.task.reward_isolation, cfg.task.reward_memory_bytes,
                key=("bench-evaluate", row["mode"], row["repeat"], v), resources=CPU, pure=False)
    results = {}
    for k, future in futures.items():
        try:
            results[k] = future.result()
        except Exception as exc:  # noqa: BLE001 (one failed evaluation must not lose the pass)
            log.warning("evaluation of %s repeat %s version %s failed, left out of its curve: %s", *k, exc)
    for row in rows:
        for v in wanted:
            if (row["mode"], row["repeat"], v) in results:
                row["accuracy"][v] = float(results[(row["mode"], row["repeat"], v)])
        row["accuracy_curve"] = [{"update": v, "wall_s": 0.0 if v == 0 else row["publish_wall_s"].get(v - 1),
                                  "accuracy": a} for v, a in sorted(row["accuracy"].items())]


def _weights_dir(run_dir: str, version: int) -> str | None:
    from storage.weight_store import WeightStore

    store = WeightStore(os.path.join(run_dir, "weights"))
    return store.path_for(version) if version in store.versions() else None


def time_to_target(curve: list[dict], target: float) -> float | None:
    """Wall seconds at which the first trained version (update >= 1) reached `target`; None if none did."""
    for point in curve:
        if point["update"] >= 1 and point["accuracy"] >= target - 1e-9 and point["wall_s"] is not None:
            return float(point["wall_s"])
    return None


# ---- table -------------------------------------------------------------------------------------------------------
def finish_runs(runs: list[dict], target: float, n: int) -> None:
    """Per run: initial/final accuracy, time to target, speed-up over the K=0 run of the same repeat on the same
    cluster shape (TRL: on the config's shape) and over the fastest K=0 run of that repeat (any shape), and the same
    in trajectories per second (K=0's step time over the run's: every run trains the same number of trajectories).

    Tokens/s favours a policy that drifts to longer responses (each update then consumes more tokens for the same
    work of the pipeline); tokens per trajectory and the trajectories/s speed-up show where that happens."""
    for run in runs:
        acc = run.get("accuracy") or {}
        if acc:
            run["initial_accuracy"], run["final_accuracy"] = acc.get(0, float("nan")), acc.get(n, float("nan"))
        run["time_to_target_s"] = time_to_target(run["accuracy_curve"], target)
        syncs = [r for r in runs if r["mode"].startswith("sync") and r.get("repeat") == run.get("repeat")]
        shape = run.get("shape", syncs[0]["shape"] if syncs else None)
        base = next((r for r in syncs if r["shape"] == shape), None)
        fastest = max(syncs, key=lambda r: r["throughput_tokens_per_s"], default=None)
        tput = run["throughput_tokens_per_s"]
        run["speedup"] = tput / base["throughput_tokens_per_s"] if base else float("nan")
        run["speedup_best"] = tput / fastest["throughput_tokens_per_s"] if fastest else float("nan")
        run["speedup_steps"] = base["step_time_s"] / run["step_time_s"] if base else float("nan")
        trajectories = run.get("trained_trajectories")
        run["tokens_per_trajectory"] = run.get("consumed_tokens", 0) / trajectories if trajectories else float("nan")


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per mode: means over repeats (max for staleness); throughput and C1 also per repeat."""
    rows = []
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]

        def mean(key, mine=mine):
            vals = [r[key] for r in mine if r.get(key) is not None and not _isnan(r[key])]
            return float(np.mean(vals)) if vals else float("nan")

        tput = [r["throughput_tokens_per_s"] for r in mine]
        ttt = sorted(math.inf if r["time_to_target_s"] is None else r["time_to_target_s"] for r in mine)
        median_ttt = float(np.median(ttt))
        row = {k: mean(k) for k in ("throughput_tokens_per_s", "step_time_s", "rollout_bubble", "trainer_bubble",
                                    "non_overlapped_rollout_share", "initial_accuracy", "final_accuracy", "wall_s",
                                    "speedup", "speedup_best", "speedup_steps", "tokens_per_trajectory")}
        row.update({
            "mode": mode, "repeats": len(mine),
            "throughput_text": f"{row['throughput_tokens_per_s']:.0f} ({' / '.join(f'{t:.0f}' for t in tput)})",
            "max_staleness": max(r["max_staleness"] for r in mine),
            "c1_text": " / ".join(str(r["c1_violations"]) for r in mine),
            "accuracy_text": f"{row['initial_accuracy']:.3f} -> {row['final_accuracy']:.3f}",
            "time_to_target_s": None if math.isinf(median_ttt) else median_ttt,
            "time_to_target_text": time_to_target_text(median_ttt, [r["time_to_target_s"] for r in mine]),
        })
        for key in ("speedup", "speedup_best", "speedup_steps"):
            row[f"{key}_text"] = f"{row[key]:.2f}x ({' / '.join(f'{r[key]:.2f}' for r in mine)})"
        rows.append(row)
    return rows


def time_to_target_text(median: float, per_run: list[float | None]) -> str:
    """"7.9 (14.3 / - / 4.5)": the median over runs (a run that never reached the target counts as infinite),
    then each run's time, "-" where it never reached the target."""
    runs = " / ".join("-" if t is None else f"{t:.1f}" for t in per_run)
    return f"{'not reached' if math.isinf(median) else f'{median:.1f}'} ({runs})"


def _isnan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)


def fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a" if value is not None else "not reached"
    return spec.format(value)


def table(rows: list[dict]) -> str:
    return markdown_table([h for h, _, _ in COLUMNS], [[fmt(row.get(k), f) for _, k, f in COLUMNS] for row in rows])


def trl_runs(args, cfg, model_path: str, target: float) -> list[dict]:
    """TRL's GRPOTrainer on the same model, prompts, G, lr and number of trained prompts, per repeat and thread count
    (its sampling seed + 1 each repeat)."""
    from benchmarks.trl_peer import run_trl

    n, runs = cfg.dora.num_updates, []
    trl_seed = cfg.dora.seed if args.trl_seed is None else args.trl_seed
    for repeat in range(args.repeats):
        seed = trl_seed + repeat
        for threads in args.trl_threads:
            say(f"TRL GRPOTrainer, {threads} torch thread(s) (repeat {repeat}, sampling seed {seed})")
            trl_dir = os.path.abspath(os.path.join(args.out, "runs", f"trl_t{threads}_r{repeat}"))
            shutil.rmtree(trl_dir, ignore_errors=True)
            load_before = os.getloadavg()[0]
            trl = run_trl(model_path, cfg, updates=n, out_dir=trl_dir, target=target, log=say, threads=threads,
                          eval_every=args.eval_every if args.eval_every is not None else 2, sampling_seed=seed)
            # trained_trajectories, max_staleness and c1_violations come from the peer's ledger of what it trained on
            trl.update(repeat=repeat, sampling_seed=seed, trained_prompts=n * cfg.dora.train_batch_size,
                       load_average=[load_before, os.getloadavg()[0]])
            runs.append(trl)
    return runs


def write_results(args, cfg, runs: list[dict], rows: list[dict], target: float, model_path: str,
                  t_start: float) -> None:
    """The table and per-run profile (`<out>/compare_modes.md`, printed) and every run's record (`.json`)."""
    n = cfg.dora.num_updates
    lengths = length_stats([x for r in runs for x in r.get("response_lengths", [])])
    per_mode_len = {f"{r['mode']} #{r['repeat']}": length_stats(r["response_lengths"])
                    for r in runs if r.get("response_lengths")}
    text = "\n".join([
        f"## DORA vs baselines on the long-tailed countdown workload ({time.strftime('%Y-%m-%d %H:%M')})", "",
        (f"Config `{args.config}` + {' '.join(args.overrides) or 'no overrides'}{' (--quick)' if args.quick else ''};"
         f" {n} updates x TBS {cfg.dora.train_batch_size} x G {cfg.rollout.group_size} = "
         f"{n * cfg.dora.train_batch_size * cfg.rollout.group_size} trained trajectories per run; {args.repeats} "
         f"run(s) per mode (forward then reverse order), table = mean, (a / b) = each run; "
         f"cluster shape {shape_text(cfg)} (modes marked colocated: {' '.join(COLOCATED)}), RBS "
         f"{cfg.dora.rollout_batch_size}, {cfg.cluster.cpu_workers} CPU worker; model `{model_path}`."),
        (f"Target accuracy {target:.3f} "
         f"({'--target' if args.target is not None else 'lowest final accuracy of the sync K=0 runs'}); "
         f"accuracy = greedy held-out accuracy on {cfg.task.eval_prompts} prompts."),
        (f"Response length of consumed trajectories (tokens, all modes): median {lengths['median']:.0f}, "
         f"p99 {lengths['p99']:.0f}, max {lengths['max']}, p99/median {lengths['p99_over_median']:.1f}."), "",
        table(rows), "", "Profile (steady-state steps, each run):", "```", profile_text(runs), "```"])
    print("\n" + text + "\n")
    with open(os.path.join(args.out, "compare_modes.md"), "w") as f:
        f.write(text + "\n")
    public = [{k: v for k, v in r.items() if not k.startswith("_") and k != "response_lengths"} for r in runs]
    with open(os.path.join(args.out, "compare_modes.json"), "w") as f:
        json.dump({"config": args.config, "overrides": args.overrides, "quick": args.quick, "updates": n,
                   "target_accuracy": target, "model": model_path, "response_length": lengths,
                   "response_length_per_run": per_mode_len, "rows": rows, "runs": public,
                   "total_seconds": time.time() - t_start, "cpus": os.cpu_count()}, f, indent=1, default=float)


# ---- main --------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=None, help="updates per mode (default: the config's)")
    parser.add_argument("--config", default="configs/longtail_bench.yaml")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 updates, TBS 4, RBS 8, G 4, 16 eval prompts")
    parser.add_argument("--with-trl", action="store_true", help="also train TRL's GRPOTrainer (benchmarks/trl_peer.py)")
    parser.add_argument("--trl-threads", type=lambda text: [int(x) for x in text.split(",")], default=[1],
                        help="torch threads of TRL's process, one TRL run per value, e.g. 1,2 (default 1)")
    parser.add_argument("--trl-seed", type=int, default=None,
                        help="TRL's sampling seed in the first repeat, +1 each repeat (default dora.seed); TRL is "
                             "deterministic given it, so repeats need their own seeds to show its spread")
    parser.add_argument("--target", type=float, default=None,
                        help="held-out accuracy to time (default: the lowest final accuracy of the sync K=0 runs)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="evaluate every N-th version after the runs, off the clock (default 2)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode (order reversed every other round)")
    parser.add_argument("--modes", default="", help="comma-separated subset of mode names' first words, e.g. sync,DORA")
    shapes = parser.add_mutually_exclusive_group()
    shapes.add_argument("--no-colocated", action="store_true",
                        help="leave out the modes on the colocated cluster shape (COLOCATED)")
    shapes.add_argument("--colocated-only", action="store_true",
                        help="only the modes on the colocated cluster shape (COLOCATED)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides for every mode")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from dora_tasks.core.config import load_config
    from pipelines.run import initial_policy

    t_start = time.time()
    updates = args.updates or (4 if args.quick else None)
    base = (QUICK if args.quick else []) + list(args.overrides) + [
        "tracking.live_view=false", "tracking.plots=false", "storage.checkpoint_interval=0", "task.eval_interval=0"]
    if updates:
        base.append(f"dora.num_updates={updates}")
    cfg = load_config(args.config, base)
    n = cfg.dora.num_updates
    base += [f"storage.keep_versions={n + 1}"]
    say(f"warm start (cached by settings): {cfg.model.hidden_size} wide, {cfg.model.warmstart_steps} steps")
    model_path = initial_policy(cfg)
    base.append(f"model.path={model_path}")
    cfg = load_config(args.config, base)
    os.makedirs(args.out, exist_ok=True)
    modes = [(name, o, shape) for name, o, shape in MODES
             if (not args.modes or name.split()[0].lower() in args.modes.lower().split(","))
             and (shape != COLOCATED or not args.no_colocated) and (shape == COLOCATED or not args.colocated_only)]
    say(f"model {model_path}; {len(modes)} modes x {n} updates x TBS {cfg.dora.train_batch_size} x G "
        f"{cfg.rollout.group_size}; RBS {cfg.dora.rollout_batch_size}; load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs")

    runs: list[dict] = []
    clusters = Clusters(args.config, base)
    try:
        for repeat in range(args.repeats):  # forward, then backward: drifting machine load hits every mode
            for name, overrides, shape in (modes if repeat % 2 == 0 else modes[::-1]):
                address, client, sampler = clusters.get(shape)
                runs.append(run_mode(name, shape + overrides, base, args, address, client, sampler, repeat))
        say("held-out accuracy of intermediate versions (off the clock)")
        accuracy_curves(runs, cfg, clusters.client, args.eval_every if args.eval_every is not None else 2)
    finally:
        clusters.close()
    order = [name for name, _, _ in modes]
    runs.sort(key=lambda r: (order.index(r["mode"]), r["repeat"]))
    # the accuracy every synchronous run reached (a mean of finals can fall between the levels 64-128 prompts allow)
    base_final = [r["accuracy"][n] for r in runs if r["mode"].startswith("sync") and n in r["accuracy"]]
    target = args.target if args.target is not None else (float(min(base_final)) if base_final else 0.0)
    if args.with_trl:
        runs += trl_runs(args, cfg, model_path, target)
    finish_runs(runs, target, n)
    rows = aggregate(runs)

    write_results(args, cfg, runs, rows, target, model_path, t_start)
    say(f"wrote {args.out}/compare_modes.md and .json in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
