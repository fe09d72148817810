"""Where the rollout bubble goes: every gap between a rollout engine's busy spans, with the driver's state around it.

    python benchmarks/rollout_gaps.py                                   # K=3, default switching, ~1 min
    python benchmarks/rollout_gaps.py rollout.switching=queue # queued switching, same run otherwise

One real pipeline run (`configs/longtail_bench.yaml`, embedded cluster, one rollout instance) through
`pipelines.streaming.stream`, whose `on_turn` hook records the driver's state at every turn of its loop: the gate's
free capacity, the groups on the instance, the version the instance serves and the newest version. After the run the
instance's busy spans (its rollout server's `BusyLog`, the same spans the rollout bubble is computed from) give the
idle gaps of the steady window. Each gap is classed by the driver's state at the last turn before it:

  cap0 / cap>0          the gate allowed no more / more groups to be dispatched
  running=0 / >0        no group / some group was assigned to the instance
  inst_old / inst_new   the instance served an older version than the newest / the newest

and the table prints the share of the window, the count and the mean length of each class, a histogram of gap
lengths, and the gaps of 10 ms or more with the driver's turns around them. A version switch with the default
switching shows up as a gap of tens of ms right after the instance's last older group ends.
"""
from __future__ import annotations

import bisect
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

BINS_MS = [0, 2, 5, 10, 20, 50, 100, 1000, 10_000]


def idle_gaps(spans: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The sub-intervals of [start, end] covered by no busy span."""
    from pipelines.metrics import merge_spans

    edges = [start] + [t for s, e in merge_spans(spans) for t in (s, e)] + [end]
    return [(max(a, start), min(b, end)) for a, b in zip(edges[::2], edges[1::2]) if min(b, end) > max(a, start)]


def state_class(turn: tuple) -> str:
    _, capacity, running, version, newest = turn
    return (f"{'cap0' if capacity == 0 else 'cap>0'} {'running=0' if running == 0 else 'running>0'} "
            f"{'inst_new' if version == newest else 'inst_old'}")


def report(gaps: list[tuple[float, float]], turns: list[tuple], window: float) -> str:
    times = [t[0] for t in turns]
    classes: dict[str, list[float]] = {}
    for a, b in gaps:
        turn = turns[max(0, bisect.bisect_left(times, a) - 1)]
        classes.setdefault(state_class(turn), []).append(b - a)
    idle = sum(b - a for a, b in gaps)
    lines = [f"steady window {window:.2f} s, idle {idle / window:.1%} in {len(gaps)} gaps", "",
             "| driver state before the gap | share of window | gaps | mean ms |", "|---|---|---|---|"]
    for name, lengths in sorted(classes.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {name} | {sum(lengths) / window:.1%} | {len(lengths)} | {1000 * np.mean(lengths):.1f} |")
    counts, _ = np.histogram([1000 * (b - a) for a, b in gaps], bins=BINS_MS)
    lines += ["", "gap length ms: " + ", ".join(f"{lo}-{hi}: {n}" for lo, hi, n in zip(BINS_MS, BINS_MS[1:], counts))]
    for a, b in gaps:
        if b - a < 0.010:
            continue
        lines.append(f"\ngap of {1000 * (b - a):.0f} ms at {a - turns[0][0]:.2f} s (driver turns: time from the gap's "
                     "start, free capacity, groups on the instance, its version, newest)")
        i, j = max(0, bisect.bisect_left(times, a) - 1), bisect.bisect_left(times, b)
        lines += [f"    {t[0] - a:+.3f} s  cap {t[1]}  running {t[2]}  version {t[3]}  newest {t[4]}"
                  for t in turns[i:min(j + 1, i + 6)]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks import one_run

    parser = one_run.parser(__doc__.split("\n")[0], "runs/rollout_gaps")
    args = parser.parse_args(argv)

    from pipelines.run import busy_spans, open_run
    from pipelines.streaming import stream

    cfg = one_run.config(args)
    if cfg.rollout.instances != 1:
        parser.error("the driver-state classes follow one rollout instance: use rollout.instances=1")
    turns: list[tuple] = []

    def record(driver) -> None:
        inst = next(iter(driver.orchestrator.instances.values()))
        turns.append((time.time(), driver.gate.capacity(), len(inst.running), inst.version, driver.orchestrator.newest))

    with open_run(cfg) as run:
        stream(run.driver, record)
        spans = next(s for s in run.driver.client.run(busy_spans).values() if s)
        start, end = run.driver.timeline.steady_window()
        summary = run.finish()
    print(f"K={args.staleness} {' '.join(args.overrides)}: rollout bubble {summary.metrics['rollout_bubble']:.1%}, "
          f"{summary.metrics['throughput_tokens_per_s']:.0f} tokens/s")
    print(report(idle_gaps(spans, start, end), turns, end - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
