"""Where a benchmark run's time went, from its store, the Dask task stream and the rollout servers' records: the
per-update timing and group spans (`read_store`), the profile of a steady-state step (`profile`, `idle_split`), the
answer-length tail (`length_stats`) and their text (`profile_text`); the cores each role used (`CpuSampler`). Used by `benchmarks/compare_modes.py`.
"""
from __future__ import annotations

import ast
import os
import threading
import time
from collections import defaultdict

import numpy as np


class CpuSampler(threading.Thread):
    """Samples, every `period` s, the CPU seconds of each cluster worker process, of this process (driver + scheduler)
    and of the whole machine, so a run's steady window can be split into cores used per role and by everyone else."""

    def __init__(self, roles: dict[int, str], period: float = 0.5) -> None:
        super().__init__(name="cpu-sampler", daemon=True)
        import psutil

        self.procs = {role: psutil.Process(pid) for pid, role in roles.items()}
        self.procs["driver + scheduler"] = psutil.Process()
        self.period, self.samples, self.halt = period, [], threading.Event()

    def sample(self) -> tuple[float, dict[str, float], float]:
        import psutil

        cpu = {}
        for role, proc in self.procs.items():
            try:
                t = proc.cpu_times()
                cpu[role] = t.user + t.system
            except psutil.Error:
                pass
        m = psutil.cpu_times()
        busy = m.user + m.nice + m.system + getattr(m, "irq", 0.0) + getattr(m, "softirq", 0.0) + getattr(m, "steal", 0.0)
        return time.time(), cpu, busy

    def run(self) -> None:
        while not self.halt.wait(self.period):
            self.samples.append(self.sample())

    def cores(self, start: float, end: float) -> dict[str, float]:
        """Mean cores used in [start, end] per role (rollout instances summed), ours in all, and the machine's."""
        inside = [x for x in self.samples if start <= x[0] <= end]
        if len(inside) < 2:
            return {}
        (t0, a, m0), (t1, b, m1) = inside[0], inside[-1]
        out: dict[str, float] = defaultdict(float)
        for role in b:
            out[role.split("#")[0]] += (b[role] - a.get(role, b[role])) / (t1 - t0)
        out["ours, all processes"] = sum(v for k, v in list(out.items()))
        out["machine (everyone)"] = (m1 - m0) / (t1 - t0)
        out["others"] = max(0.0, out["machine (everyone)"] - out["ours, all processes"])
        return dict(out)


def worker_roles(client) -> dict[int, str]:
    """pid -> role of every worker process ("rollout#addr", "trainer", "cpu#addr")."""
    pids = client.run(os.getpid)
    info = client.scheduler_info(n_workers=-1)["workers"]
    roles = {}
    for address, pid in pids.items():
        res = info.get(address, {}).get("resources", {})
        kind = "rollout instances" if "ROLLOUT" in res else "trainer" if "TRAINER" in res else "reward/advantage"
        roles[pid] = f"{kind}#{address}"
    return roles


def read_store(path: str) -> dict:
    """Per-update timing, group spans and the consumed trajectories' lengths, from the store alone (every time in
    it is a plain `time.time()` of this machine, so they compare without clock corrections)."""
    from storage.trajectory_store import TrajectoryStore

    store = TrajectoryStore.open(path)
    traj = store.read_table("trajectories", ["group_id", "version", "instance", "consumed_by", "consumed_time",
                                             "start_time", "end_time", "response_len"])
    upd = store.read_table("updates")
    seen = {}
    for u, t in zip(traj["consumed_by"].tolist(), traj["consumed_time"].tolist()):
        seen[u] = t
    groups = {}
    for g, v, i, u, s0, e in zip(traj["group_id"].tolist(), traj["version"].tolist(), traj["instance"].tolist(),
                                 traj["consumed_by"].tolist(), traj["start_time"].tolist(), traj["end_time"].tolist()):
        groups[g] = (v, str(i), u, s0, e)
    return {"response_lengths": traj["response_len"].astype(int).tolist(),
            "publish_wall_s": {int(u): float(w) for u, w in zip(upd["update"], upd["metrics/wall_s"])},
            "_updates": {k: np.asarray(v).tolist() for k, v in upd.items()}, "_seen": seen, "_groups": groups}


# ---- profile of a step -------------------------------------------------------------------------------------------
def _key(entry) -> tuple:
    key = entry["key"]
    if isinstance(key, str) and key.startswith("("):
        key = ast.literal_eval(key)
    return key if isinstance(key, tuple) else (str(key),)


def profile(row: dict, stream: list[dict], servers: dict) -> dict:
    """Where the time goes, per steady-state step (updates 2..N-1, as the metrics count them).

    Trainer side, per step (store times): wait for the batch's last rollout to end; reward + advantage + driver +
    gate until the update starts; the update; the weight publish; until the driver sees the new version. Rollout
    side: generating / loading / idle shares of the instances, and why they idle (`idle_split`). Task durations
    (same-worker differences, so clock offsets cancel) come from the Dask task stream."""
    from pipelines.metrics import WARMUP_UPDATES

    per_kind: dict[str, list[float]] = defaultdict(list)
    for entry in stream:
        compute = [x for x in entry.get("startstops", ()) if x.get("action") == "compute"]
        if compute:
            per_kind[_key(entry)[0]].append(sum(x["stop"] - x["start"] for x in compute))
    upd, seen, groups = row["_updates"], row["_seen"], row["_groups"]
    timing = {int(u): (s0, e, p) for u, s0, e, p in zip(upd["update"], upd["start"], upd["end"],
                                                          upd["publish_seconds"])}
    last_end: dict[int, float] = defaultdict(float)
    for v, inst, u, s0, e in groups.values():
        last_end[u] = max(last_end[u], e)
    steady = [u for u in sorted(timing) if u >= WARMUP_UPDATES and u - 1 in seen and u in seen]
    phases: dict[str, list[float]] = defaultdict(list)
    for u in steady:
        prev, (start, end, pub), ready = seen[u - 1], timing[u], last_end[u]
        phases["wait for the batch's last rollout"].append(max(0.0, ready - prev))
        phases["reward+advantage+driver+gate"].append(max(0.0, start - max(prev, ready)))
        phases["update (train step)"].append(end - start)
        phases["publish (write weights)"].append(pub)
        phases["until the driver sees it"].append(seen[u] - end - pub)
    out = {"steady_steps": len(steady),
           "step_s": float(np.mean([seen[u] - seen[u - 1] for u in steady])) if steady else float("nan"),
           "trainer_phases_s": {k: float(np.mean(v)) for k, v in phases.items()},
           "task_mean_s": {k: float(np.mean(v)) for k, v in per_kind.items()},
           "task_count": {k: len(v) for k, v in per_kind.items()}}
    if steady:
        start, end = seen[steady[0] - 1], seen[steady[-1]]
        inst = {a: x for a, x in servers.items() if x}
        if inst and end > start:
            window = end - start
            busy = [_covered(x["busy"], start, end) / window for x in inst.values()]
            load = [_covered([(s0, e) for _, s0, e in x["loads"]], start, end) / window for x in inst.values()]
            out["rollout_instance_share"] = {"generating": float(np.mean(busy)), "loading weights": float(np.mean(load)),
                                             "idle": float(1 - np.mean(busy) - np.mean(load))}
            out["weight_loads_per_instance"] = float(np.mean([len(x["loads"]) for x in inst.values()]))
            out["weight_load_mean_s"] = float(np.mean([e - s0 for x in inst.values() for _, s0, e in x["loads"]]
                                                      or [0.0]))
            out["rollout_idle_split"] = idle_split(groups, inst, start, end)
        # share of the window after the run's last rollout ended: the last updates only train (finite-run tail)
        out["rollout_drained_share"] = max(0.0, end - max(e for *_, e in groups.values())) / (end - start)
        spans = [e - s0 for _, _, _, s0, e in groups.values()]
        out["group_rollout_s"] = {"mean": float(np.mean(spans)), "max": float(np.max(spans))}
    return out


def _covered(spans, start: float, end: float) -> float:
    from pipelines.metrics import merge_spans

    return sum(max(0.0, min(e, end) - max(s0, start)) for s0, e in merge_spans(spans))


def idle_split(groups: dict, servers: dict, start: float, end: float) -> dict:
    """Why instances idle, as shares of the steady window (mean over instances): the engine is generating or
    loading weights; it is idle although a group's rollout task is running on it (hand-off into the engine thread,
    waiting for the running static batch to end); or no rollout task is on it at all (nothing dispatched: gate
    capacity, RBS, the drain-before-switch rule, and the rollout -> reward -> advantage -> driver -> dispatch round
    trip that frees a slot)."""
    window = end - start
    shares = defaultdict(list)
    for address, server in servers.items():
        tasks = [(s0, e) for _, inst, _, s0, e in groups.values() if inst == address]
        engine = list(server["busy"]) + [(s0, e) for _, s0, e in server["loads"]]
        engine_busy = _covered(engine, start, end)
        either = _covered(tasks + engine, start, end)
        shares["engine busy"].append(engine_busy / window)
        shares["idle with a rollout task on it"].append((either - engine_busy) / window)
        shares["idle with no rollout task"].append((window - either) / window)
    return {k: float(np.mean(v)) for k, v in shares.items()}


def length_stats(lengths: list[int]) -> dict:
    a = np.asarray(lengths)
    med, p99 = float(np.median(a)), float(np.percentile(a, 99))
    return {"median": med, "p99": p99, "max": int(a.max()), "p99_over_median": p99 / max(med, 1e-9), "n": len(a)}


def profile_text(rows: list[dict]) -> str:
    out = []
    for row in rows:
        p = row.get("profile")
        if not p:
            if "cpu_s_per_1k_tokens" in row:
                out.append(f"{row['mode']} (run {row['repeat']}): one process, {row['cpu_cores_used']:.2f} cores used, "
                           f"CPU s per 1000 consumed tokens {row['cpu_s_per_1k_tokens']:.2f}, generation "
                           f"{row['non_overlapped_rollout_share']:.0%} of wall time")
            continue
        out.append(f"{row['mode']} (run {row['repeat']}): {p['steady_steps']} steady steps, mean step "
                   f"{p['step_s']:.2f} s, load average {row['load_average'][0]:.1f} -> {row['load_average'][1]:.1f}")
        for k, v in p["trainer_phases_s"].items():
            out.append(f"    trainer: {k:<36} {v:6.2f} s")
        share = p.get("rollout_instance_share", {})
        if p.get("rollout_idle_split"):
            out.append("    rollout idle split: " + ", ".join(f"{k} {v:.0%}" for k, v in p["rollout_idle_split"].items())
                       + f"; all rollouts done for the last {p.get('rollout_drained_share', 0):.0%} of the window")
        if share:
            out.append("    rollout instances: " + ", ".join(f"{k} {v:.0%}" for k, v in share.items())
                       + f"; {p['weight_loads_per_instance']:.1f} loads/instance, {p['weight_load_mean_s']:.3f} s each")
        if p.get("cores_used"):
            out.append("    cores used (of 2): " + ", ".join(f"{k} {v:.2f}" for k, v in p["cores_used"].items()))
        if p.get("cores_used") and row["throughput_tokens_per_s"] > 0:
            per = {k: 1000 * v / row["throughput_tokens_per_s"] for k, v in p["cores_used"].items()
                   if k not in ("machine (everyone)", "others")}
            out.append("    CPU s per 1000 consumed tokens: " + ", ".join(f"{k} {v:.2f}" for k, v in per.items()))
        if "trainer_cpu_while_updating" in p:
            out.append(f"    trainer CPU while an update runs: {p['trainer_cpu_while_updating']:.2f} core")
        tm = p["task_mean_s"]
        out.append("    task mean s: " + ", ".join(f"{k} {tm[k]:.3f} (x{p['task_count'][k]})" for k in
                                                  ("rollout", "reward", "advantage", "gate", "update", "publish",
                                                   "evaluate") if k in tm))
    return "\n".join(out)
