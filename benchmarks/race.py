"""The race against TRL, run as `benchmarks/race_protocol.yaml` fixes it: time to a held-out accuracy target and
tokens/s, every side run `runs` times in interleaved rounds, every pass kept.

Each round runs every side once (round r starting at side r mod n, `race_stats.interleaved_order`) with the round's
seed: a DORA pass sets `dora.seed` (its train prompts' order and its sampling), a TRL pass gives TRL the same prompts
in the same order (`--data-seed`) and its sampling seed. Every pass is evaluated on the same 256 held-out prompts of
the workload's own seed, off the clock: DORA's kept versions every `eval_every` updates after the pass, until the first
one at the target (TRL evaluates in its process with its clock paused, likewise up to the target). A pass that never
reaches the target is kept as such and ranks last. Per pass the runner records the load average (the machine may be
shared; interleaving spreads any load over every side), the audit's staleness and C1 counts (TRL: its ledger of what
it generated and trained on) and, for DORA, how many policy versions were generating at once (from the store).

Passes are appended to `<out>/passes.jsonl` as they finish (a rerun resumes after them); `--deadline HH:MM` (UTC)
starts no pass that cannot end before it, and the page then says the protocol was cut short and how far it got.

    python benchmarks/race.py [--protocol benchmarks/race_protocol.yaml] [--out benchmarks/results/race]
                              [--deadline 08:10] [--rounds N] [--report-only]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the race's workers keep their weight caches in a scratch folder of their own: other Dask clusters on a shared
# machine purge what they take for stale folders in the common one
os.environ.setdefault("DASK_TEMPORARY_DIRECTORY", os.path.join("/tmp", f"dora-race-{os.getpid()}"))
from benchmarks import compare_modes
from benchmarks.race_stats import (
    Protocol,
    Side,
    best_peer,
    interleaved_order,
    load_protocol,
    passes_table,
    race_table,
    summarise,
    version_concurrency,
)

IN_RUN_EVAL_PROMPTS = 8  # the pipeline's own v0/final evaluation shares the run's cores: keep it small (the race
#                          evaluates every pass on the full held-out set, off the clock)
say = compare_modes.say


def base_overrides(protocol: Protocol) -> list[str]:
    return list(protocol.overrides) + [
        "tracking.live_view=false", "tracking.plots=false", "storage.checkpoint_interval=0", "task.eval_interval=0",
        f"dora.num_updates={protocol.updates}", f"storage.keep_versions={protocol.updates + 1}"]


def generation_spans(store_path: str) -> list[tuple[float, float, int]]:
    """(start, end, version) of every group attempt's generation, from the store."""
    from storage.trajectory_store import TrajectoryStore

    traj = TrajectoryStore.open(store_path).read_table(
        "trajectories", ["group_id", "attempt", "version", "start_time", "end_time"])
    spans = {}
    for gid, attempt, version, start, end in zip(*(traj[k].tolist() for k in (
            "group_id", "attempt", "version", "start_time", "end_time"))):
        spans[(gid, attempt)] = (start, end, version)
    return list(spans.values())


def evaluate_until_target(row: dict, cfg, client, eval_prompts, protocol: Protocol) -> list[dict]:
    """Held-out accuracy of the pass's versions every `eval_every` updates, in order, up to the first at the
    target; each point at the wall time its version was published."""
    from dora_tasks import steps
    from pipelines.cluster import CPU

    t = cfg.task
    curve = []
    for v in range(protocol.eval_every, protocol.updates + 1, protocol.eval_every):
        path = compare_modes._weights_dir(row["run_dir"], v)
        if path is None:
            continue
        future = client.submit(steps.evaluate, path, eval_prompts, cfg.model.path, t.reward_fn,
                               cfg.rollout.max_new_tokens, cfg.dora.seed, t.reward_timeout_s, t.reward_isolation,
                               t.reward_memory_bytes, key=("race-evaluate", row["run_dir"], v), resources=CPU,
                               pure=False)
        curve.append({"update": v, "wall_s": row["publish_wall_s"].get(v - 1), "accuracy": float(future.result())})
        if curve[-1]["accuracy"] >= protocol.target - 1e-9:
            break
    return curve


def dora_pass(side: Side, seed: int, rnd: int, ctx: SimpleNamespace) -> dict:
    address, client, sampler = ctx.clusters.get(list(ctx.protocol.shape))
    overrides = list(ctx.protocol.shape) + list(side.overrides) + [
        f"dora.seed={seed}", f"task.eval_prompts={IN_RUN_EVAL_PROMPTS}"]
    row = compare_modes.run_mode(side.name, overrides, ctx.base, ctx.args, address, client, sampler, rnd)
    curve = evaluate_until_target(row, ctx.cfg, client, ctx.eval_prompts, ctx.protocol)
    most, share = version_concurrency(generation_spans(row["store"]))
    shutil.rmtree(os.path.join(row["run_dir"], "weights"), ignore_errors=True)
    return {
        "throughput_tokens_per_s": row["throughput_tokens_per_s"], "step_time_s": row["step_time_s"],
        "time_to_target_s": compare_modes.time_to_target(curve, ctx.protocol.target), "accuracy_curve": curve,
        "max_staleness": row["max_staleness"], "c1_violations": row["c1_violations"],
        "trained_trajectories": row["trained_trajectories"], "audit_ok": row["audit_ok"],
        "versions_generating_max": most, "two_or_more_versions_share": share,
        "rollout_bubble": row["rollout_bubble"], "trainer_bubble": row["trainer_bubble"],
        "load_average": row["load_average"], "wall_s": row["wall_s"]}


def trl_command(side: Side, seed: int, ctx: SimpleNamespace, out_dir: str, json_out: str) -> list[str]:
    o = side.trl
    peer = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "trl_peer.py"), "--model", ctx.model_path,
            "--config", ctx.protocol.config, "--updates", str(ctx.protocol.updates),
            "--eval-every", str(ctx.protocol.eval_every), "--target", str(ctx.protocol.target),
            "--sampling-seed", str(seed), "--data-seed", str(seed), "--threads", str(o.get("threads", 1)),
            "--stop-eval-at-target", "--out", out_dir, "--json-out", json_out]
    peer += [flag for key, flag in (("continuous_batching", "--continuous-batching"), ("warm", "--warm"),
                                    ("use_vllm", "--use-vllm")) if o.get(key)]
    peer += list(ctx.protocol.overrides)
    processes = int(o.get("processes", 1))
    if processes > 1:
        launcher = os.path.join(os.path.dirname(sys.executable), "accelerate")
        # --cpu would take accelerate's single-process launcher; --multi_gpu starts N ranks (torchrun), and the
        # peer's use_cpu=True makes them train on the CPU over gloo
        return [launcher, "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no"] + peer
    return [sys.executable] + peer


def trl_pass(side: Side, seed: int, rnd: int, ctx: SimpleNamespace) -> dict:
    slug = "".join(c for c in side.name.lower() if c.isalnum())
    out_dir = os.path.abspath(os.path.join(ctx.args.out, "runs", f"{slug}_r{rnd}"))
    json_out = out_dir + ".json"
    shutil.rmtree(out_dir, ignore_errors=True)
    load_before = os.getloadavg()[0]
    command = trl_command(side, seed, ctx, out_dir, json_out)
    say(f"{side.name}: {' '.join(command[:3])} ... (seed {seed})")
    done = subprocess.run(command, capture_output=True, text=True, check=False,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode != 0 or not os.path.exists(json_out):
        raise RuntimeError(f"{side.name} failed (exit {done.returncode}): {done.stderr[-3000:]}")
    with open(json_out) as f:
        row = json.load(f)
    keep = ("throughput_tokens_per_s", "step_time_s", "time_to_target_s", "accuracy_curve", "max_staleness",
            "c1_violations", "trained_trajectories", "generated_completions", "staleness_histogram", "wall_s",
            "processes", "config")
    return {k: row[k] for k in keep} | {"load_average": [load_before, os.getloadavg()[0]],
                                        "versions_generating_max": 1, "two_or_more_versions_share": 0.0}


def run_pass(side: Side, seed: int, rnd: int, ctx: SimpleNamespace) -> dict:
    """One pass; one that crashes is recorded with its error (and the page counts it), never left out silently."""
    started, load = time.time(), os.getloadavg()
    try:
        record = (dora_pass if side.kind == "dora" else trl_pass)(side, seed, rnd, ctx)
    except Exception as exc:  # noqa: BLE001 (a crashed pass must not lose the race's other passes)
        say(f"{side.name} round {rnd} failed: {type(exc).__name__}: {str(exc)[:300]}")
        ctx.clusters.close()  # a failed run may leave the workers' state behind: the next DORA pass starts clean
        record = {"failed": f"{type(exc).__name__}: {str(exc)[:500]}", "time_to_target_s": None,
                  "throughput_tokens_per_s": float("nan"), "load_average": [load[0], os.getloadavg()[0]]}
    record.update(side=side.name, round=rnd, seed=seed, load_average_1_5_15_before=list(load),
                  started_utc=dt.datetime.fromtimestamp(started, dt.timezone.utc).strftime("%H:%M:%S"),
                  pass_seconds=time.time() - started)
    if "failed" in record:
        return record
    t = record["time_to_target_s"]
    say(f"{side.name} round {rnd}: time to target {'never' if t is None else f'{t:.1f} s'}, "
        f"{record['throughput_tokens_per_s']:.0f} tokens/s, load {load[0]:.1f}")
    return record


def read_passes(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def context(protocol: Protocol, args) -> SimpleNamespace:
    """The warm-started model, the base overrides, the fixed held-out prompts and the (lazily started) cluster."""
    from dora_tasks.core.config import load_config
    from dora_tasks.model import load_tokenizer
    from dora_tasks.workloads.datasets import load_prompts
    from pipelines.run import initial_policy

    base = base_overrides(protocol)
    model_path = initial_policy(load_config(protocol.config, base))
    base.append(f"model.path={model_path}")
    cfg = load_config(protocol.config, base)
    _, eval_prompts = load_prompts(cfg.task, load_tokenizer(model_path), cfg.dora.seed)
    run_args = SimpleNamespace(config=protocol.config, out=args.out)
    return SimpleNamespace(protocol=protocol, args=run_args, base=base, cfg=cfg, model_path=model_path,
                           eval_prompts=eval_prompts, clusters=compare_modes.Clusters(protocol.config, base))


def run_race(protocol: Protocol, args) -> None:
    """Runs the passes not yet in passes.jsonl, in the protocol's order; a pass that crashed is run again once, when
    the runner next passes its place (its crash stays in the record). With a deadline, starts no pass that its
    side's longest pass so far says cannot end before it (the order is never changed to fit more in)."""
    log_path = os.path.join(args.out, "passes.jsonl")
    previous = read_passes(log_path)
    done = {(p["round"], p["side"]) for p in previous if "failed" not in p}
    crashed = Counter((p["round"], p["side"]) for p in previous if "failed" in p)
    ctx = context(protocol, args)
    rounds = protocol.runs if args.rounds is None else min(args.rounds, protocol.runs)
    longest: dict[str, float] = {}
    try:
        for rnd, index in interleaved_order(len(protocol.sides), rounds):
            side = protocol.sides[index]
            if (rnd, side.name) in done or crashed[(rnd, side.name)] > 1:
                continue  # measured, or crashed twice: a crash (an error, not a slow run) is run again once
            if not _time_for(args.deadline, longest.get(side.name, max(longest.values(), default=0.0))):
                say(f"deadline {args.deadline} UTC: stopping before round {rnd}, {side.name}")
                return
            record = run_pass(side, protocol.seeds[rnd], rnd, ctx)
            longest[side.name] = max(longest.get(side.name, 0.0), record["pass_seconds"])
            with open(log_path, "a") as f:
                f.write(json.dumps(record, default=float) + "\n")
    finally:
        ctx.clusters.close()


def _time_for(deadline: str | None, seconds: float) -> bool:
    if not deadline:
        return True
    now = dt.datetime.now(dt.timezone.utc)
    hour, minute = (int(x) for x in deadline.split(":"))
    return now + dt.timedelta(seconds=seconds) <= now.replace(hour=hour, minute=minute, second=0, microsecond=0)


def write_report(protocol: Protocol, out: str, reference: str) -> str:
    passes = read_passes(os.path.join(out, "passes.jsonl"))
    rounds_complete = sum(all(any(p["round"] == r and p["side"] == s.name for p in passes) for s in protocol.sides)
                          for r in range(protocol.runs))
    full = rounds_complete == protocol.runs
    rows = summarise(passes, protocol, reference)
    loads = [p["load_average"][0] for p in passes]
    title = (f"## Race against TRL ({'full protocol' if full else 'REDUCED: cut short'}, "
             f"{rounds_complete} of {protocol.runs} rounds complete, {len(passes)} passes)")
    settings = (f"Protocol `benchmarks/race_protocol.yaml`: target {protocol.target}, {protocol.updates} updates, "
                f"evaluated every {protocol.eval_every}; seeds {', '.join(map(str, protocol.seeds))}; DORA shape "
                f"{' '.join(protocol.shape)}. Load average (1 min) at pass start: min {min(loads, default=0):.1f}, "
                f"max {max(loads, default=0):.1f}.")
    text = "\n".join([
        title, "", settings, "",
        race_table(rows, reference), "", "Every pass, in running order:", "", passes_table(passes)])
    with open(os.path.join(out, "race.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "race.json"), "w") as f:
        json.dump({"rows": rows, "rounds_complete": rounds_complete, "full_protocol": full}, f, indent=1,
                  default=float)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocol", default="benchmarks/race_protocol.yaml")
    parser.add_argument("--out", default="benchmarks/results/race")
    parser.add_argument("--deadline", default=None, help="UTC HH:MM: start no pass that would end after it")
    parser.add_argument("--rounds", type=int, default=None, help="run at most this many rounds (a smoke run)")
    parser.add_argument("--reference", default=None,
                        help="side the p-values compare against (default: the TRL side with the lowest median time)")
    parser.add_argument("--report-only", action="store_true", help="write the page from passes.jsonl only")
    args = parser.parse_args(argv)
    protocol = load_protocol(args.protocol)
    os.makedirs(args.out, exist_ok=True)
    if not args.report_only:
        run_race(protocol, args)
    reference = args.reference or best_peer(read_passes(os.path.join(args.out, "passes.jsonl")), protocol)
    print(write_report(protocol, args.out, reference))
    return 0


if __name__ == "__main__":
    sys.exit(main())
