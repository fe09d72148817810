"""Where a migrating run's time goes: one EMULATED run on a `dask` CLI cluster, its run folder kept, traced.

    python benchmarks/migration_trace.py --instances 16 --slots 24 --trainer-gpus 28 --out /tmp/trace16
    python benchmarks/migration_trace.py --instances 16 --slots 24 --trainer-gpus 28 --out /tmp/trace16 \
        rollout.switching=drain emulation.response_p50=1286.3        # config overrides at the end

The run is `switching_scale`'s (same config and cluster; `rollout.switching=migrate` unless overridden). The
driver's events (`Migrate`, `ResponsesHandedOver`, `GroupRolledOut`, `Published`, `Load`) go to
`<out>/events.jsonl`; from them and the trajectory store it prints, in emulated seconds:
* hand-over orders: how many, how many found nothing running, and the time from the orchestrator's decision to the
  source's answer (p50 / p90 / max);
* moved responses: in all, received per instance, and their time in transit (left the source -> joined the target);
* each update's start, and the groups that rolled out last with where their longest response ran and moved:
  under bounded staleness an update waits for the slowest group of the oldest version it must take;
* the open bubble split by cause: each idle gap of an instance (its engine's busy spans, kept in `<out>/busy.json`)
  by whether the instance handed responses over, loaded a version, received responses, or none of these.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.switching_scale import parse as scale_parse, settings  # noqa: E402 - after the path

TRACED = ("Migrate", "ResponsesHandedOver", "GroupRolledOut", "Published", "Load")


def traced_run(args) -> dict:
    """The run, with the driver's events written to `<out>/events.jsonl`; returns `run_and_measure`'s row."""
    import psutil

    import pipelines.run as run_module
    from benchmarks.emulated_scale import CliCluster, run_and_measure
    from benchmarks.sim_vs_emulation import make_config

    os.makedirs(args.out, exist_ok=True)
    cfg = make_config(settings(args, args.instances[0]), args.out,
                      [f"emulation.tp={args.tp}", "rollout.switching=migrate", *args.overrides])
    opened = run_module.open_run

    def open_traced(*a, **k):
        run = opened(*a, **k)
        inner = run.__enter__()
        log = open(os.path.join(args.out, "events.jsonl"), "w")
        inner.driver.subscribe(lambda e: write_event(log, inner.driver.clock.now(), e))

        class Traced:
            def __enter__(self):
                return inner

            def __exit__(self, *exc):
                log.close()
                return run.__exit__(*exc)
        return Traced()

    run_module.open_run = open_traced
    summarized = run_module.timing_summary

    def keep_busy_spans(timeline, busy, last_dispatch):
        with open(os.path.join(args.out, "busy.json"), "w") as f:
            json.dump({"busy": busy, "last_dispatch": last_dispatch}, f)
        return summarized(timeline, busy, last_dispatch)

    run_module.timing_summary = keep_busy_spans
    cluster, address, _ = CliCluster.start(cfg, args.instances[0])
    try:
        cfg.cluster.scheduler_address = address
        return run_and_measure(cfg, psutil.Process(cluster.scheduler_pid), cluster.worker_processes())
    finally:
        cluster.stop()
        run_module.open_run, run_module.timing_summary = opened, summarized


def write_event(log, now: float, event) -> None:
    name = type(event).__name__
    if name not in TRACED:
        return
    fields = {k: getattr(event, k) for k in ("group_id", "samples", "source", "target", "instance", "version")
              if hasattr(event, k)}
    log.write(json.dumps({"t": now, "type": name, **{k: list(v) if isinstance(v, tuple) else v
                                                       for k, v in fields.items()}}) + "\n")


def percentiles(x) -> str:
    return "p50 {:.1f} / p90 {:.1f} / max {:.1f}".format(*np.percentile(x, [50, 90, 100])) if len(x) else "-"


def report(out: str, slowest: int = 8) -> str:
    from storage.trajectory_store import TrajectoryStore

    events = [json.loads(line) for line in open(os.path.join(out, "events.jsonl"))]
    asked: dict[int, list[float]] = collections.defaultdict(list)
    latency, empty = [], 0
    for e in events:
        if e["type"] == "Migrate":
            asked[e["group_id"]].append(e["t"])
        elif e["type"] == "ResponsesHandedOver":
            latency.append(e["t"] - asked[e["group_id"]].pop(0))
            empty += not e["samples"]
    store = TrajectoryStore.open(os.path.join(out, "run", "trajectories.zarr"))
    moved, updates = store.read_table("migrations"), store.read_table("updates")
    t0 = float(updates["start"][0]) - 1e-9 if len(updates["start"]) else 0.0
    rolled = {e["group_id"]: e["t"] for e in events if e["type"] == "GroupRolledOut"}
    lines = [f"hand-over orders: {len(latency)} answered, {empty} found nothing running; decision -> answer "
             f"{percentiles(latency)} s",
             f"moved responses: {len(moved['group_id'])}; in transit "
             f"{percentiles(moved['adopted_time'] - moved['handed_over_time'])} s",
             "received per instance: " + ", ".join(f"{a[-5:]} {n}" for a, n in
                                                   collections.Counter(map(str, moved["target"])).most_common()),
             "update starts (s from update 0): " + ", ".join(f"{s - t0:.0f}" for s in updates["start"])]
    t = store.read_table("trajectories", ["group_id", "sample_idx", "response_len", "instance", "version",
                                          "consumed_by"])
    lines.append("groups that rolled out last (s from update 0):")
    for g in sorted(rolled, key=rolled.get)[-slowest:]:
        rows = np.flatnonzero(t["group_id"] == g)
        if not len(rows):
            continue
        i = rows[np.argmax(t["response_len"][rows])]
        hops = np.flatnonzero((moved["group_id"] == g) & (moved["sample_idx"] == t["sample_idx"][i]))
        path = " -> ".join([str(moved["source"][hops[0]])[-5:]] + [str(moved["target"][j])[-5:] for j in hops]) \
            if len(hops) else str(t["instance"][i])[-5:]
        lines.append(f"  group {g} v{t['version'][i]} (update {t['consumed_by'][i]}): rolled out at "
                     f"{rolled[g] - t0:.0f}, longest response {t['response_len'][i]} tokens on {path}")
    return "\n".join(lines)


def idle_report(out: str) -> str:
    """The open bubble split by what each idle gap's instance was doing: it had handed responses over (a leaver),
    loaded a version without handing any over (a drain switch), or neither (it had no work)."""
    from benchmarks.rollout_gaps import idle_gaps
    from pipelines.metrics import WARMUP_UPDATES

    path = os.path.join(out, "busy.json")
    if not os.path.exists(path):
        return "open bubble by cause: no busy.json (the run was traced before it was kept)"
    kept = json.load(open(path))
    events = [json.loads(line) for line in open(os.path.join(out, "events.jsonl"))]
    published = [e["t"] for e in events if e["type"] == "Published"]
    start, end = published[min(WARMUP_UPDATES, len(published)) - 1], kept["last_dispatch"]
    causes: collections.Counter = collections.Counter()
    before_load, after_load = [], []  # a drain switch's gap: idle -> the orchestrator's Load, Load -> busy again
    for address, spans in kept["busy"].items():
        for s, e in idle_gaps(spans, start, end):
            near = [x for x in events if s - 1.0 <= x["t"] <= e]
            loads = [x["t"] for x in near if x["type"] == "Load" and x.get("instance") == address]
            if any(x["type"] == "Migrate" and x.get("source") == address for x in near):
                causes["handed responses over (leaver)"] += e - s
            elif loads:
                causes["loaded a version, nothing handed over"] += e - s
                before_load.append(max(0.0, loads[0] - s))
                after_load.append(e - max(s, loads[0]))
            elif any(x["type"] == "Migrate" and x.get("target") == address for x in near):
                causes["received responses"] += e - s
            else:
                causes["no load, no move (no work)"] += e - s
    total = len(kept["busy"]) * max(1e-9, end - start)
    return (f"open bubble by cause (window {end - start:.0f} s x {len(kept['busy'])} instances): "
            + ", ".join(f"{cause} {t / total:.1%}" for cause, t in causes.most_common())
            + f"\ndrain switches: {len(before_load)} gaps; idle -> Load {sum(before_load) / total:.1%} of the window "
            f"({percentiles(before_load)} s), Load -> busy {sum(after_load) / total:.1%} ({percentiles(after_load)} s)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the run's folder (kept): run, store, events.jsonl")
    p.add_argument("--report-only", action="store_true", help="print the report of the run already in --out")
    args, rest = p.parse_known_args(argv)
    scale = scale_parse(rest)
    scale.out = args.out
    if not args.report_only:
        row = traced_run(scale)
        print(f"tokens/s {row['throughput']:,.0f}, open bubble {row['open_bubble']:.1%} "
              f"({row['open_bubble_held']:.1%} while the gate held dispatch, closed {row['gate_closed_share']:.0%}), "
              f"audit {'PASS' if row['audit_ok'] else 'FAIL'}, machine {row['machine_share']:.0%} busy")
    print(report(scale.out))
    print(idle_report(scale.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
