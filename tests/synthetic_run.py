"""Synthetic store tables shaped like `TrajectoryStore.read_table` output, for the plot and tracking tests.

A tiny time-stepped simulation of a DORA run (RBS groups kept in flight on the newest version, long-tailed
response times, an update whenever TBS groups within the staleness window are complete), so the pictures look
like a real multi-version run without training anything.
"""
from __future__ import annotations

import numpy as np

EPOCH = 1.75e9  # absolute timestamps, as the store records them


def synthetic_tables(num_updates: int = 12, K: int = 2, tbs: int = 4, rbs: int = 8, group_size: int = 4,
                     instances: int = 2, seed: int = 0, update_seconds: float = 1.2) -> dict[str, dict]:
    rng = np.random.default_rng(seed)
    names = [f"tcp://127.0.0.1:{41000 + i}" for i in range(instances)]
    traj = {k: [] for k in ("group_id", "sample_idx", "version", "consumed_by", "instance", "start_time",
                            "end_time", "reward", "response_len", "prompt_len")}
    dispatch = {k: [] for k in ("group_id", "prompt_id", "version", "attempt", "time")}
    updates = {k: [] for k in ("update", "start", "end", "published_version", "publish_seconds", "reward_mean",
                               "accuracy", "loss")}
    groups: list[dict] = []  # in flight or complete, not consumed
    newest, t, dt, next_gid = 0, 0.0, 0.05, 0
    training: dict | None = None
    while len(updates["end"]) < num_updates and t < 600:
        in_flight = [g for g in groups if g["end"] > t]
        while len(in_flight) < rbs:
            load = [sum(g["instance"] == n for g in in_flight) for n in names]
            durations = np.minimum(rng.lognormal(np.log(1.5), 0.8, group_size), 12.0)
            g = {"gid": next_gid, "version": newest, "instance": names[int(np.argmin(load))], "start": t,
                 "ends": t + durations, "end": t + durations.max()}
            dispatch["group_id"].append(next_gid), dispatch["prompt_id"].append(1000 + next_gid)
            dispatch["version"].append(newest), dispatch["attempt"].append(0), dispatch["time"].append(EPOCH + t)
            groups.append(g), in_flight.append(g)
            next_gid += 1
        if training and t >= training["end"]:
            updates["end"].append(EPOCH + t)
            newest = training["u"] + 1
            training = None
        if training is None:
            u = len(updates["update"])
            ready = sorted((g for g in groups if g["end"] <= t and g["version"] >= u - K), key=lambda g: g["gid"])
            if len(ready) >= tbs and u < num_updates:
                rewards = []
                for g in ready[:tbs]:
                    groups.remove(g)
                    p = min(0.15 + 0.05 * g["version"], 0.95)
                    for j, end in enumerate(g["ends"]):
                        r = float(rng.random() < p)
                        rewards.append(r)
                        for key, val in (("group_id", g["gid"]), ("sample_idx", j), ("version", g["version"]),
                                         ("consumed_by", u), ("instance", g["instance"]),
                                         ("start_time", EPOCH + g["start"]), ("end_time", EPOCH + end),
                                         ("reward", r), ("response_len", int(40 * (end - g["start"]))),
                                         ("prompt_len", 24)):
                            traj[key].append(val)
                updates["update"].append(u), updates["start"].append(EPOCH + t)
                updates["published_version"].append(u + 1), updates["publish_seconds"].append(0.05)
                updates["reward_mean"].append(float(np.mean(rewards)))
                updates["accuracy"].append(min(0.1 + 0.06 * u, 1.0) if u % 3 == 2 else np.nan)
                updates["loss"].append(float(rng.normal()))
                training = {"u": u, "end": t + update_seconds}
        t += dt
    for g in groups:  # still in flight or unconsumed at the end: recorded with consumed_by = -1
        for j, end in enumerate(g["ends"]):
            for key, val in (("group_id", g["gid"]), ("sample_idx", j), ("version", g["version"]),
                             ("consumed_by", -1), ("instance", g["instance"]), ("start_time", EPOCH + g["start"]),
                             ("end_time", EPOCH + end), ("reward", 0.0), ("response_len", 10), ("prompt_len", 24)):
                traj[key].append(val)
    n = min(len(updates["end"]), len(updates["update"]))
    updates = {k: np.asarray(v[:n]) for k, v in updates.items()}
    return {"trajectories": {k: np.asarray(v) for k, v in traj.items()}, "updates": updates,
            "dispatch": {k: np.asarray(v) for k, v in dispatch.items()}}
