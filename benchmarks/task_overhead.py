"""What Dask costs per group, with no model: the pipeline's task shape run with empty tasks on the embedded cluster.

Each group is what `pipelines.driver` submits (rollout on the rollout instance -> reward -> advantage on the CPU
worker, the driver fetching the scored group), every TBS groups a gate task carrying them by value and an update on
the trainer; the tasks only build or pass on a `Group` of G trajectories of the benchmark's size (15 prompt + 5
response tokens), so all CPU measured is orchestration: Dask's messages, transfers and task bookkeeping in every
process. Two variants run side by side with it, to size what a change of shape would save:

* ``fused scoring``: reward and advantage as one task per group (one task and one hand-over fewer);
* ``gate by futures``: the gate task gets the groups' futures (their data stays on the CPU worker) instead of values;
* ``one graph per group``: a group's three tasks sent to the scheduler in one graph (`dask.delayed` with
  `dask.annotate` for the placement) instead of three `submit` calls.

    python benchmarks/task_overhead.py [--updates 100] [--repeats 2] [--config configs/longtail_bench.yaml]

Prints one table: CPU ms per group of each process and wall ms per group, each variant's total against the
pipeline's shape. Not a timed test: it measures this machine.
"""
from __future__ import annotations

import argparse
import os
import queue
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = ("pipeline", "fused scoring", "gate by futures", "one graph per group")
ROLES = ("driver + scheduler", "rollout instances", "reward/advantage", "trainer")  # as compare_modes.worker_roles
PROMPT_TOKENS, RESPONSE_TOKENS = 15, 5


def empty_rollout(group_id: int, group_size: int):
    from dora_tasks.records import Group, Prompt, Trajectory

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


def empty_gate(update: int, *groups):
    from dora_tasks.records import TrainBatch

    return TrainBatch(update, list(groups), 3)


def empty_update(batch) -> int:
    return len(batch.groups)


class Loop:
    """A driver loop of the pipeline's shape: RBS groups in flight, an update every TBS complete groups."""

    def __init__(self, client, variant: str, group_size: int, tbs: int, rbs: int) -> None:
        self.client, self.variant, self.g, self.tbs, self.rbs = client, variant, group_size, tbs, rbs
        self.finished: queue.SimpleQueue = queue.SimpleQueue()
        self.next_group = self.next_update = 0
        self.held: dict[int, list] = {}

    def submit_group(self):
        submit, gid = self.client.submit, self.next_group
        self.next_group += 1
        if self.variant == "one graph per group":
            return self.submit_group_as_one_graph(gid)
        rolled = submit(empty_rollout, gid, self.g, key=("rollout", gid), resources={"ROLLOUT": 1}, pure=False)
        if self.variant == "fused scoring":
            scored = submit(empty_scoring, rolled, key=("scoring", gid), resources={"CPU": 1}, pure=False)
        else:
            rewarded = submit(empty_reward, rolled, key=("reward", gid), resources={"CPU": 1}, pure=False)
            scored = submit(empty_advantage, rewarded, key=("advantage", gid), resources={"CPU": 1}, pure=False)
        scored.add_done_callback(self.finished.put)
        return scored

    def submit_group_as_one_graph(self, gid: int):
        import dask
        from dask import delayed

        with dask.annotate(resources={"ROLLOUT": 1}):
            rolled = delayed(empty_rollout, pure=False)(gid, self.g, dask_key_name=("rollout", gid))
        with dask.annotate(resources={"CPU": 1}):
            rewarded = delayed(empty_reward, pure=False)(rolled, dask_key_name=("reward", gid))
            scored = delayed(empty_advantage, pure=False)(rewarded, dask_key_name=("advantage", gid))
        futures = self.client.compute([rolled, rewarded, scored], optimize_graph=False)
        self.held[gid] = futures  # the rollout and reward futures live until the group is complete, as in the driver
        futures[-1].add_done_callback(self.finished.put)
        return futures[-1]

    def submit_update(self, batch: list):
        u = self.next_update
        self.next_update += 1
        groups = [future for future, _ in batch] if self.variant == "gate by futures" else [g for _, g in batch]
        checked = self.client.submit(empty_gate, u, *groups, key=("gate", u), resources={"CPU": 1}, pure=False)
        updated = self.client.submit(empty_update, checked, key=("update", u), resources={"TRAINER": 1}, pure=False)
        updated.add_done_callback(self.finished.put)
        return updated

    def run(self, updates: int) -> None:
        in_flight, complete, updating, done = {}, [], None, 0
        while done < updates:
            while len(in_flight) < self.rbs:
                future = self.submit_group()
                in_flight[future.key] = future
            if updating is None and len(complete) >= self.tbs:
                updating = self.submit_update(complete[:self.tbs])
                complete = complete[self.tbs:]
            future = self.finished.get()
            if updating is not None and future.key == updating.key:
                future.result()
                updating, done = None, done + 1
            elif future.key in in_flight:
                complete.append((in_flight.pop(future.key), future.result()))  # the driver fetches every group
                self.held.pop(future.key[1], None)
        for future in in_flight.values():
            future.result()
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
        start = time.perf_counter()
        loop.run(updates)
        wall = time.perf_counter() - start
        groups = updates * cfg.dora.train_batch_size
        row = {role: 1000 * (cpu - before[role]) / groups for role, cpu in role_cpu_seconds(processes).items()}
        row["wall"] = 1000 * wall / groups
        return row
    finally:
        client.close()
        cluster.close()


def table(rows: dict[str, list[dict[str, float]]]) -> str:
    roles = ROLES
    mean = {v: {k: float(np.mean([r[k] for r in runs])) for k in runs[0]} for v, runs in rows.items()}
    total = {v: sum(m[r] for r in roles) for v, m in mean.items()}
    base = total["pipeline"]
    lines = ["| shape | " + " | ".join(f"{r} CPU ms/group" for r in roles) + " | total CPU ms/group | wall ms/group | "
             "total vs pipeline |", "|---" * (len(roles) + 4) + "|"]
    for v, m in mean.items():
        runs = " / ".join(f"{sum(r[k] for k in roles):.1f}" for r in rows[v])
        lines.append(f"| {v} | " + " | ".join(f"{m[r]:.1f}" for r in roles)
                     + f" | {total[v]:.1f} ({runs}) | {m['wall']:.1f} | {total[v] / base:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/longtail_bench.yaml")
    parser.add_argument("--updates", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    args = parser.parse_args()
    from pipelines.config import load_config

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
