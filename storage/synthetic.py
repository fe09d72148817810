"""Synthetic groups and a synthetic run written to a trajectory store, for tests, the audit demo and the benchmark.

`simulate_run` follows the rules a real run obeys (so that its store audits clean): every group is dispatched on the
newest version, keeps it to the end, and is consumed whole by exactly one update `u` with `0 <= u - v <= K`; one group
is re-dispatched (attempt 1) after a "lost instance"; groups whose rewards are all equal are filtered ("zero_std"); the
last K versions' slow groups are still in flight when the run stops.

Simplified, and why: time is one unit per update (no real engine), token ids and log-probs are random numbers (the
store does not care what they mean), and batches hold whatever finished in time rather than exactly TBS groups (the
audit checks invariants, not batch sizes).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dora_tasks.core.records import Group, Prompt, Trajectory
from storage.trajectory_store import TrajectoryStore


def make_group(group_id: int, version: int, rng: np.random.Generator, *, group_size: int = 8, prompt_len: int = 16,
               response_lens: list[int] | None = None, instance: str = "", attempt: int = 0,
               start_time: float = 0.0, end_time: float = 0.0, filtered: str = "",
               rewards: list[float] | None = None, vocab_size: int = 32000) -> Group:
    """A complete group of `group_size` trajectories whose tokens all carry `version`."""
    prompt_ids = rng.integers(0, vocab_size, prompt_len, dtype=np.int32)
    lens = response_lens if response_lens is not None else [int(x) for x in rng.integers(1, 64, group_size)]
    rewards = rewards if rewards is not None else [float(x) for x in rng.integers(0, 2, group_size)]
    prompt = Prompt(prompt_id=group_id, text=f"prompt {group_id}", answer="",
                    token_ids=tuple(int(t) for t in prompt_ids))
    group = Group(group_id=group_id, prompt=prompt, version=version, instance=instance, attempt=attempt,
                  start_time=start_time, end_time=end_time, filtered=filtered)
    mean = float(np.mean(rewards))
    for idx, (n, reward) in enumerate(zip(lens, rewards)):
        group.trajectories.append(Trajectory(
            group_id=group_id, sample_idx=idx, prompt_ids=prompt_ids,
            response_ids=rng.integers(0, vocab_size, n, dtype=np.int32),
            versions=np.full(n, version, dtype=np.int32),
            behaviour_logprobs=-rng.exponential(1.0, n).astype(np.float32),
            finished=bool(idx % 3), reward=reward, advantage=reward - mean))
    return group


@dataclass
class SyntheticRun:
    """What `simulate_run` wrote, so that tests can compare the audit's figures with the truth."""

    group_size: int
    max_staleness: int
    dispatch_rows: int = 0
    consumed: dict[int, int] = field(default_factory=dict)  # group_id -> update
    versions: dict[int, int] = field(default_factory=dict)  # group_id -> dispatch version
    in_flight: list[int] = field(default_factory=list)
    filtered: dict[str, int] = field(default_factory=dict)
    redispatched: list[int] = field(default_factory=list)

    @property
    def staleness_histogram(self) -> dict[int, int]:
        hist: dict[int, int] = {}
        for gid, u in self.consumed.items():
            s = u - self.versions[gid]
            hist[s] = hist.get(s, 0) + self.group_size
        return dict(sorted(hist.items()))


def simulate_run(store: TrajectoryStore, *, updates: int = 6, groups_per_version: int = 4, group_size: int = 4,
                 max_staleness: int = 2, instances: int = 4, seed: int = 0) -> SyntheticRun:
    """Write a consistent run of `updates` updates to `store` (see the module docstring) and flush it."""
    rng = np.random.default_rng(seed)
    run = SyntheticRun(group_size=group_size, max_staleness=max_staleness)
    finishing: dict[int, list[Group]] = {}
    next_id = 0
    for u in range(updates):
        for k in range(groups_per_version):  # new prompts go to the newest version, u
            delay = _delay(rng, max_staleness)
            group = _group(next_id, u, delay, k, rng, group_size, instances)
            _dispatch(store, run, group)
            finishing.setdefault(u + delay, []).append(group)
            next_id += 1
        batch = finishing.pop(u, [])
        store.append_consumed(batch, update=u, time=u + 0.8)
        for g in batch:
            run.consumed[g.group_id] = u
            if g.filtered:
                run.filtered[g.filtered] = run.filtered.get(g.filtered, 0) + 1
        metrics = {"loss": float(rng.normal()), "reward_mean": float(np.mean([g.rewards.mean() for g in batch] or [0]))}
        if u >= 2:
            metrics["kl"] = float(rng.exponential())  # a metric that appears mid-run
        store.append_update(u, u + 0.8, u + 1.0, u + 1, 0.01, metrics)
    run.in_flight = sorted(g.group_id for gs in finishing.values() for g in gs)
    store.flush()
    return run


def _delay(rng: np.random.Generator, max_staleness: int) -> int:
    """Long-tailed completion delay in updates: mostly 0, sometimes up to K."""
    return 0 if max_staleness == 0 or rng.random() < 0.5 else int(rng.integers(1, max_staleness + 1))


def _group(group_id: int, version: int, delay: int, k: int, rng: np.random.Generator, group_size: int,
           instances: int) -> Group:
    rewards = [1.0] * group_size if group_id % 5 == 4 else [float(i % 2) for i in range(group_size)]
    group = make_group(group_id, version, rng, group_size=group_size, rewards=rewards,
                       instance=f"tcp://10.0.0.{version % instances}:4000{k % 2}",
                       attempt=1 if group_id == 1 else 0, start_time=version + 0.01 + 0.01 * k,
                       end_time=version + delay + 0.5 + 0.01 * k, filtered="zero_std" if group_id % 5 == 4 else "")
    if group_id == 3:  # a reward function that timed out
        group.trajectories[0].reward = float("nan")
        group.trajectories[0].reward_error = "timeout"
    return group


def _dispatch(store: TrajectoryStore, run: SyntheticRun, group: Group) -> None:
    if group.attempt == 1:  # first attempt lost with its instance, then re-dispatched
        store.append_dispatch(group.group_id, group.prompt.prompt_id, group.version, 0, group.start_time - 0.005)
        run.redispatched.append(group.group_id)
        run.dispatch_rows += 1
    store.append_dispatch(group.group_id, group.prompt.prompt_id, group.version, group.attempt, group.start_time)
    run.versions[group.group_id] = group.version
    run.dispatch_rows += 1
