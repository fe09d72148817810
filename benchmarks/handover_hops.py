"""Where the hand-over of a batch goes: the hops of each batch's last group, from its rollout's end to its update.

    python benchmarks/handover_hops.py                      # K=3 on configs/longtail_bench.yaml, ~1 min
    python benchmarks/handover_hops.py --staleness 0        # synchronous: every batch waits for its last group

One real pipeline run (embedded cluster) through `pipelines.streaming.stream`, with the driver's steps wrapped to note
when it saw each group's rollout end, submitted its scoring, took in the scored group, and submitted each update;
the store gives each rollout's end (the instance's clock; one machine, one clock) and each update's start. For every
update, the hops of the group of its batch that was scored last (the one the update waited for):

  rollout end -> driver sees it        the rollout task's end reaching the driver (worker -> scheduler -> client)
  -> scoring submitted                 the driver's turn
  -> scored group at the driver        client -> scheduler -> CPU worker (fetching the rollout), reward, advantage,
                                       -> scheduler -> client, the driver fetching the scored groups
  -> gate and update submitted         the driver's turn and the gate's decision
  -> previous update ends              the update before it still training (update lookahead); 0 when it had ended
  -> update starts                     gate task, the batch's transfer to the trainer, the update task's start

Prints the median and mean of each hop over the steady updates (the first 2 left out). Not a timed test.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

HOPS = ("rollout end -> driver sees it", "-> scoring submitted", "-> scored group at the driver",
        "-> gate and update submitted", "-> previous update ends", "-> update starts")
WARMUP_UPDATES = 2


class DriverClock:
    """When the driver saw each group's rollout end, submitted its scoring and took it in, and submitted each update."""

    def __init__(self) -> None:
        self.rolled: dict[int, float] = {}
        self.scoring_submitted: dict[int, float] = {}
        self.scored: dict[int, float] = {}
        self.updates: dict[int, tuple[float, list[int]]] = {}  # update -> (submitted, its groups)

    def observe(self, event) -> None:
        """A driver observer (`Driver.subscribe`): the first time each group passes each hop."""
        from pipelines.events import GroupRolledOut, GroupsScored, ScoringSubmitted, UpdateSubmitted

        if isinstance(event, GroupRolledOut):
            self.rolled.setdefault(event.group_id, event.at)
        elif isinstance(event, ScoringSubmitted):
            for gid in event.group_ids:
                self.scoring_submitted.setdefault(gid, event.at)
        elif isinstance(event, GroupsScored):
            for gid in event.group_ids:
                self.scored.setdefault(gid, event.at)
        elif isinstance(event, UpdateSubmitted):
            self.updates[event.update] = (event.at, list(event.group_ids))


def batch_hops(clock: DriverClock, rollout_end: dict[int, float], update_start: dict[int, float],
               previous_end: dict[int, float]) -> list[list[float]]:
    """Seconds of each hop (HOPS) for every update's last-scored group. `previous_end[u]`: when update u-1's task
    ended (its train step and publish), if any."""
    rows = []
    for u, (submitted, groups) in sorted(clock.updates.items()):
        last = max(groups, key=lambda g: clock.scored[g])
        ready = max(submitted, previous_end.get(u, submitted))
        rows.append([clock.rolled[last] - rollout_end[last], clock.scoring_submitted[last] - clock.rolled[last],
                     clock.scored[last] - clock.scoring_submitted[last], submitted - clock.scored[last],
                     ready - submitted, update_start[u] - ready])
    return rows


def table(rows: list[list[float]]) -> str:
    ms = 1000 * np.asarray(rows[WARMUP_UPDATES:], dtype=float)
    lines = ["| hop of the batch's last group | median ms | mean ms |", "|---|---|---|"]
    lines += [f"| {name} | {np.median(col):.1f} | {np.mean(col):.1f} |" for name, col in zip(HOPS, ms.T)]
    total = ms.sum(axis=1)
    lines.append(f"| total, rollout end -> update starts | {np.median(total):.1f} | {np.mean(total):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks import one_run
    from pipelines.run import open_run
    from pipelines.streaming import stream
    from storage.trajectory_store import TrajectoryStore

    args = one_run.parser(__doc__.split("\n")[0], "runs/handover_hops").parse_args(argv)
    cfg = one_run.config(args)
    clock = DriverClock()
    with open_run(cfg) as run:
        run.driver.subscribe(clock.observe)
        stream(run.driver)
        summary = run.finish()
    store = TrajectoryStore.open(summary.store)
    t = store.read_table("trajectories", ["group_id", "end_time"])
    rollout_end: dict[int, float] = {}
    for gid, end in zip(t["group_id"].tolist(), t["end_time"].tolist()):
        rollout_end[gid] = max(rollout_end.get(gid, 0.0), end)
    u = store.read_table("updates", ["update", "start", "end", "publish_seconds"])
    update_start = dict(zip(u["update"].tolist(), u["start"].tolist()))
    previous_end = {int(n) + 1: e + p for n, e, p in zip(u["update"].tolist(), u["end"].tolist(),
                                                         u["publish_seconds"].tolist())}
    print(f"K={args.staleness} {' '.join(args.overrides)}: {summary.metrics['throughput_tokens_per_s']:.0f} tokens/s, "
          f"non-overlapped rollout share {summary.metrics['non_overlapped_rollout_share']:.0%}, "
          f"{len(clock.updates)} updates\n")
    print(table(batch_hops(clock, rollout_end, update_start, previous_end)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
