"""What Dask costs per group, with no model: the pipeline's task shape run with empty tasks on the embedded cluster.

Each group is what `pipelines.driver` submits: a rollout on the rollout instance, then, for the groups whose rollouts
the driver saw end in one turn, one reward and one advantage task on the CPU worker (the driver fetching the scored
groups); every TBS groups a gate task carrying them by value and an update on the trainer. The tasks only build or
pass on `Group`s of G trajectories of the benchmark's size (15 prompt + 5 response tokens), so all CPU measured is
orchestration: Dask's messages, transfers and task bookkeeping in every process. Two other shapes run side by side
with it, to size what the shape costs:

* ``scoring per group``: a reward and an advantage task per group, submitted with its rollout (the pipeline before
  scoring per turn);
* ``fused scoring per group``: reward and advantage as one task per group.

With empty rollouts, how many groups end in one driver turn depends on how fast the driver loop runs; the table
gives the groups per scoring task measured. (In the pipeline, groups that end in one decode chunk end together.)

    python benchmarks/task_overhead.py [--updates 100] [--repeats 2] [--config configs/longtail_bench.yaml]

Prints one table: CPU ms per group of each process and wall ms per group, each shape's total against the
pipeline's. Not a timed test: it measures this machine.
"""
from __future__ import annotations

import argparse
import os
import queue
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipelines.cluster import CPU, ROLLOUT, TRAINER  # noqa: E402

VARIANTS = ("pipeline", "scoring per group", "fused scoring per group")
ROLES = ("driver + scheduler", "rollout instances", "reward/advantage", "trainer")  # as compare_modes.worker_roles
PROMPT_TOKENS, RESPONSE_TOKENS = 15, 5


def empty_rollout(group_id: int, group_size: int):
    from dora_tasks.core.records import Group, Prompt, Trajectory

    prompt = np.arange(PROMPT_TOKENS, dtype=np.int32)
    trajectories = [Trajectory(group_id, i, prompt, np.arange(RESPONSE_TOKENS, dtype=np.int32),
                               np.zeros(RESPONSE_TOKENS, np.int32), np.zeros(RESPONSE_TOKENS, np.float32), True)
                    for i in range(group_size)]
    return Group(group_id, Prompt(group_id, "count 7 step 10:", "7", tuple(range(PROMPT_TOKENS))), 0, "", 0,
                 trajectories)


def empty_reward(group):
    for t in group.trajectories:
        t.reward = 1.0
    return group


def empty_advantage(group):
    for t in group.trajectories:
        t.advantage = 0.0
    return group


def empty_scoring(group):
    return empty_advantage(empty_reward(group))


def empty_rewards(groups: list) -> list:
    return [empty_reward(g) for g in groups]


def empty_advantages(groups: list) -> list:
    return [empty_advantage(g) for g in groups]


def empty_gate(update: int, *groups):
    from dora_tasks.core.records import TrainBatch

    return TrainBatch(update, list(groups), 3)


def empty_update(batch) -> int:
    return len(batch.groups)


class Loop:
    """A driver loop of the pipeline's shape: RBS groups in flight, an update every TBS complete groups."""

    def __init__(self, client, variant: str, group_size: int, tbs: int, rbs: int) -> None:
        self.client, self.variant, self.g, self.tbs, self.rbs = client, variant, group_size, tbs, rbs
        self.finished: queue.SimpleQueue = queue.SimpleQueue()
        self.next_group = self.next_update = self.scoring_tasks = self.scored_groups = 0
        self.rolling: dict = {}  # key -> rollout future whose scoring is not submitted yet (pipeline)
        self.scoring: dict = {}  # key -> (scoring future, groups it scores)

    def in_flight(self) -> int:
        return len(self.rolling) + sum(n for _, n in self.scoring.values())

    def submit_group(self) -> None:
        submit, gid = self.client.submit, self.next_group
        self.next_group += 1
        rolled = submit(empty_rollout, gid, self.g, key=("rollout", gid), resources=ROLLOUT, pure=False)
        if self.variant == "pipeline":
            self.rolling[rolled.key] = rolled
            rolled.add_done_callback(self.finished.put)
        elif self.variant == "fused scoring per group":
            self.watch(submit(empty_scoring, rolled, key=("scoring", gid), resources=CPU, pure=False), 1)
        else:
            rewarded = submit(empty_reward, rolled, key=("reward", gid), resources=CPU, pure=False)
            self.watch(submit(empty_advantage, rewarded, key=("advantage", gid), resources=CPU, pure=False), 1)

    def submit_scoring(self, rolled: list) -> None:
        """The pipeline's shape: one reward and one advantage task for the rollouts that ended in one turn."""
        n = self.scoring_tasks
        rewarded = self.client.submit(empty_rewards, rolled, key=("reward", n), resources=CPU, pure=False)
        self.watch(self.client.submit(empty_advantages, rewarded, key=("advantage", n), resources=CPU,
                                      pure=False), len(rolled))

    def watch(self, scored, groups: int) -> None:
        self.scoring_tasks += 1
        self.scored_groups += groups
        self.scoring[scored.key] = (scored, groups)
        scored.add_done_callback(self.finished.put)

    def submit_update(self, groups: list):
        u = self.next_update
        self.next_update += 1
        checked = self.client.submit(empty_gate, u, *groups, key=("gate", u), resources=CPU, pure=False)
        updated = self.client.submit(empty_update, checked, key=("update", u), resources=TRAINER, pure=False)
        updated.add_done_callback(self.finished.put)
        return updated

    def run(self, updates: int) -> None:
        complete, updating, done = [], None, 0
        while done < updates:
            while self.in_flight() < self.rbs:
                self.submit_group()
            if updating is None and len(complete) >= self.tbs:
                updating = self.submit_update(complete[:self.tbs])
                complete = complete[self.tbs:]
            finished = [self.finished.get()]
            while not self.finished.empty():
                finished.append(self.finished.get())
            rolled = []
            for future in finished:
                if updating is not None and future.key == updating.key:
                    future.result()
                    updating, done = None, done + 1
                elif future.key in self.rolling:
                    rolled.append(self.rolling.pop(future.key))
                elif future.key in self.scoring:
                    result = self.scoring.pop(future.key)[0].result()  # the driver fetches every group
                    complete.extend(result if isinstance(result, list) else [result])
            if rolled:
                self.submit_scoring(rolled)
        while self.rolling or self.scoring:  # let the groups still in flight finish before the next measurement
            future = self.finished.get()
            if future.key in self.rolling:
                self.submit_scoring([self.rolling.pop(future.key)])
            self.scoring.pop(future.key, None)
        while not self.finished.empty():
            self.finished.get()


def cpu_seconds(process) -> float:
    t = process.cpu_times()
    return t.user + t.system


def role_cpu_seconds(processes: list[tuple[str, object]]) -> dict[str, float]:
    """CPU seconds so far per role, summed over that role's processes."""
    out: dict[str, float] = {}
    for role, process in processes:
        out[role] = out.get(role, 0.0) + cpu_seconds(process)
    return out


def measure(variant: str, cfg, updates: int) -> dict[str, float]:
    """CPU ms per group of each role (ROLES: summed over its processes), and wall ms per group."""
    import psutil
    from distributed import Client

    from benchmarks.compare_modes import worker_roles
    from pipelines.cluster import embedded_cluster

    cluster = embedded_cluster(cfg)
    client = Client(cluster, direct_to_workers=True)
    try:
        client.wait_for_workers(cfg.rollout.instances + 1 + cfg.cluster.cpu_workers, timeout=300)
        processes = [(role.split("#")[0], psutil.Process(pid)) for pid, role in worker_roles(client).items()]
        processes.append(("driver + scheduler", psutil.Process()))
        loop = Loop(client, variant, cfg.rollout.group_size, cfg.dora.train_batch_size, cfg.dora.rollout_batch_size)
        loop.run(5)  # warm: imports, connections
        before = role_cpu_seconds(processes)
        tasks, scored = loop.scoring_tasks, loop.scored_groups
        start = time.perf_counter()
        loop.run(updates)
        wall = time.perf_counter() - start
        groups = updates * cfg.dora.train_batch_size
        row = {role: 1000 * (cpu - before[role]) / groups for role, cpu in role_cpu_seconds(processes).items()}
        row["wall"] = 1000 * wall / groups
        row["groups per scoring task"] = (loop.scored_groups - scored) / max(1, loop.scoring_tasks - tasks)
        return row
    finally:
        client.close()
        cluster.close()


def table(rows: dict[str, list[dict[str, float]]]) -> str:
    roles = ROLES
    mean = {v: {k: float(np.mean([r[k] for r in runs])) for k in runs[0]} for v, runs in rows.items()}
    total = {v: sum(m[r] for r in roles) for v, m in mean.items()}
    base = total["pipeline"]
    lines = ["| shape | groups per scoring task | " + " | ".join(f"{r} CPU ms/group" for r in roles)
             + " | total CPU ms/group | wall ms/group | total vs pipeline |", "|---" * (len(roles) + 5) + "|"]
    for v, m in mean.items():
        runs = " / ".join(f"{sum(r[k] for k in roles):.1f}" for r in rows[v])
        lines.append(f"| {v} | {m['groups per scoring task']:.1f} | " + " | ".join(f"{m[r]:.1f}" for r in roles)
                     + f" | {total[v]:.1f} ({runs}) | {m['wall']:.1f} | {total[v] / base:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/longtail_bench.yaml")
    parser.add_argument("--updates", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    args = parser.parse_args()
    from dora_tasks.core.config import load_config

    cfg = load_config(args.config, args.overrides)
    rows: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for repeat in range(args.repeats):  # alternate the order, so a drift in machine load hits every shape
        for variant in (VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]):
            rows[variant].append(measure(variant, cfg, args.updates))
            print(f"[{time.strftime('%H:%M:%S')}] {variant}: {rows[variant][-1]}", flush=True)
    print(f"\nDask cost per group of the pipeline's task shape, empty tasks, {args.updates} updates x TBS "
          f"{cfg.dora.train_batch_size} x G {cfg.rollout.group_size}, {args.repeats} run(s) each (total per run in "
          f"parentheses), cluster of `{args.config}`:\n")
    print(table(rows))


if __name__ == "__main__":
    main()
