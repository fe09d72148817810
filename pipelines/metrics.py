"""The run's timing metrics, as defined in the design (pure functions over recorded timestamps).

* throughput: prompt + response tokens consumed by updates / wall seconds, steady state (updates 0 and 1 left out:
  the window from the publish of update 1 to the last publish);
* step time: wall time between consecutive publishes, steady state;
* rollout bubble: share of rollout-instance wall time with no sequence being decoded;
* open rollout bubble: the same until the run's last group is dispatched; a run that trains every group it dispatches
  (C2) ends by draining, its last K updates with no new work for the instances, and this window leaves that out;
  split into its *held* part, idle while the version gate admitted no new group (the staleness bound holds rollout
  back until the trainer publishes: no orchestrator could fill those rows without breaking C3), and its *free*
  part, idle while the gate admitted new groups (what switching and orchestration leave unused);
* trainer bubble: share of trainer wall time with no update running;
* non-overlapped rollout share: share of wall time the trainer spends waiting for rollout data (from the end of
  one publish to the moment the gate hands over the next batch);
* driver reaction lag: from a future the driver waits on finishing to the end of the driver's next decisions (new
  groups, moves, updates) after taking it in, over the steady window; its trainer share is the part of the window the
  driver spent reacting to the trainer's updates and streamed parts, which the trainer's next work waits on. Under
  emulated engines it is this machine's driver seen in emulated seconds: a trainer share of a few percent means the
  CPU, not the emulated hardware, set part of the pace.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

WARMUP_UPDATES = 2


@dataclass
class Reactions:
    """The driver's reaction lags over a span: how many, their sum and the longest (not each one: a long run takes
    in millions of futures)."""

    count: int = 0
    total: float = 0.0
    longest: float = 0.0

    def add(self, lag: float) -> None:
        self.count += 1
        self.total += lag
        self.longest = max(self.longest, lag)


@dataclass
class UpdateTiming:
    update: int
    ready: float  # the gate handed over the batch
    start: float  # the update began on the trainer
    end: float  # the update finished
    published: float  # the driver saw the new version published
    tokens: int  # prompt + response tokens of the consumed trajectories
    publish_seconds: float = 0.0
    busy: float | None = None  # a streamed update: seconds it computed between start and end (None: all of them)
    parts: tuple[tuple[float, float, int], ...] = ()  # a streamed update: (start, end, groups) of each part
    reactions: dict[str, Reactions] = field(default_factory=dict)  # the driver's by task kind, since the last publish

    def waiting_inside(self) -> float:
        """Seconds a streamed update waited for its stragglers between its parts."""
        return 0.0 if self.busy is None else max(0.0, self.end - self.start - self.busy)


@dataclass
class Timeline:
    t0: float
    updates: list[UpdateTiming] = field(default_factory=list)
    gate_closed: list[tuple[float, float]] = field(default_factory=list)  # the gate admitted no new group
    closed_since: float | None = None  # the gate is closed now, since then
    reacting: dict[str, Reactions] = field(default_factory=dict)  # by task kind, since the last publish

    def gate_state(self, now: float, closed: bool) -> None:
        """The version gate's dispatch capacity changed: `closed` when it admits no new group."""
        if closed and self.closed_since is None:
            self.closed_since = now
        elif not closed and self.closed_since is not None:
            self.gate_closed.append((self.closed_since, now))
            self.closed_since = None

    def add(self, timing: UpdateTiming) -> None:
        """An update published: it takes the driver's reactions since the publish before."""
        timing.reactions, self.reacting = self.reacting, {}
        self.updates.append(timing)

    def react(self, kind: str, lag: float) -> None:
        """The driver acted `lag` seconds after a future of `kind` finished."""
        self.reacting.setdefault(kind, Reactions()).add(lag)

    def closed_spans(self, end: float) -> list[tuple[float, float]]:
        """The spans the gate admitted no new group, one still open ending at `end`."""
        return self.gate_closed + ([(self.closed_since, end)] if self.closed_since is not None else [])

    def steady(self) -> list[UpdateTiming]:
        return self.updates[WARMUP_UPDATES:] if len(self.updates) > WARMUP_UPDATES else []

    def steady_window(self) -> tuple[float, float]:
        """(start, end) of the steady state: from the publish that closes the warm-up to the last publish."""
        if len(self.updates) <= WARMUP_UPDATES:
            start = self.t0
        else:
            start = self.updates[WARMUP_UPDATES - 1].published
        end = self.updates[-1].published if self.updates else self.t0
        return start, end


def update_metrics(update: int, groups, result, tl: Timeline, live_versions: int,
                   counters: dict[str, int]) -> dict[str, float]:
    """The metrics of update `update` (logged to MLflow and kept in the store's update row): the trainer's own, the
    batch's rewards and staleness, step and weight-sync time, throughput, reward failures, the run's fault counters.
    `tl` already holds this update's timing; failed rewards count as 0."""
    rewards = np.concatenate([np.nan_to_num(g.rewards, nan=0.0) for g in groups])
    failed = len(reward_errors(groups))
    staleness = np.array([update - g.version for g in groups])
    now = tl.updates[-1].published
    prev = tl.updates[-2].published if len(tl.updates) > 1 else tl.t0
    metrics = dict(result.metrics)
    metrics.update({
        "reward_mean": float(rewards.mean()),
        "train_accuracy": float(np.mean(rewards == 1.0)),
        "staleness_max": float(staleness.max()), "staleness_mean": float(staleness.mean()),
        "versions_in_batch": float(len({g.version for g in groups})),
        "live_versions": float(live_versions),
        "step_time_s": now - prev, "weight_sync_s": result.published.seconds,
        "tokens": float(sum(g.num_tokens for g in groups)),
        "reward_failures": float(failed), "reward_failure_share": failed / len(rewards),
        "trainer_restarts": float(counters["trainer_restarts"]), "eval_failures": float(counters["eval_failures"]),
        "wall_s": now - tl.t0,
    })
    metrics["tokens_per_s"] = metrics["tokens"] / max(1e-9, metrics["step_time_s"])
    metrics.update(peer_weight_metrics(groups))
    metrics.update(migration_metrics(groups))
    metrics.update(episode_metrics(groups))
    metrics.update(reward_model_metrics(groups))
    return metrics


def peer_weight_metrics(groups) -> dict[str, float]:
    """The version copies instances received from peers with this batch's groups (each group is consumed once)."""
    copies = [g.weights for g in groups if g.weights is not None and g.weights.source]
    return {"weights_peer_copies": float(len(copies)),
            "weights_peer_bytes": float(sum(c.nbytes for c in copies)),
            "weights_peer_s_max": max((c.seconds for c in copies), default=0.0)}


def migration_metrics(groups) -> dict[str, float]:
    """The responses of this batch's groups that moved between rollout instances: how many moves, the bytes they
    carried, the seconds the receivers spent taking them in (re-prefill or cache insertion) and the re-encoded
    tokens."""
    moves = [m for g in groups for m in g.migrations]
    return {"migrations": float(len(moves)), "migration_bytes": float(sum(m.nbytes for m in moves)),
            "migration_s": float(np.nansum([m.seconds for m in moves])) if moves else 0.0,
            "migration_reprefill_tokens": float(sum(m.reprefill_tokens for m in moves))}


def reward_model_metrics(groups) -> dict[str, float]:
    """How the reward model (`reward.model`) scored this batch's groups, and where: responses scored, their share
    of the forward time, responses per forward second, the mean forward batch (responses) and the most scoring
    tasks one forward merged, the mean model score, and the share scored on REWARD-labelled workers (none: {})."""
    scored = [g.reward_model for g in groups if g.reward_model is not None]
    if not scored:
        return {}
    responses = sum(len(s.scores) for s in scored)
    seconds = sum(s.seconds for s in scored)
    sizes = [size for s in scored for size in s.batch_sizes]
    return {"reward_model_responses": float(responses), "reward_model_s": seconds,
            "reward_model_responses_per_s": responses / seconds if seconds > 0 else float("nan"),
            "reward_model_batch_mean": float(np.mean(sizes)) if sizes else float("nan"),
            "reward_model_tasks_per_batch_max": float(max(s.tasks_per_batch for s in scored)),
            "reward_model_score_mean": float(np.mean([x for s in scored for x in s.scores])),
            "reward_model_on_reward_workers": sum(len(s.scores) for s in scored if s.role == "REWARD") / responses,
            "reward_model_workers": float(len({s.worker for s in scored}))}


def episode_metrics(groups) -> dict[str, float]:
    """Multi-turn episodes of this batch (`task.environment`): model turns per trajectory on the mean, tool calls
    (in all and per trajectory), environment tokens, and environment failures (count and share of trajectories)."""
    trajectories = [t for g in groups for t in g.trajectories]
    n = max(1, len(trajectories))
    tools = sum(t.tool_calls for t in trajectories)
    failed = sum(1 for t in trajectories if t.env_error)
    return {"turns_mean": sum(t.turns for t in trajectories) / n, "tool_calls": float(tools),
            "tool_calls_mean": tools / n, "env_failures": float(failed), "env_failure_share": failed / n,
            "environment_tokens": float(sum(int((t.loss_mask == 0).sum()) for t in trajectories))}


def reward_errors(groups) -> list[str]:
    """The error of each failed reward of `groups` (a failed reward counts as 0)."""
    return [t.reward_error for g in groups for t in g.trajectories if t.reward_error]


def throughput(tl: Timeline) -> float:
    steady = tl.steady()
    start, end = tl.steady_window()
    if not steady or end <= start:
        steady, start = tl.updates, tl.t0
    wall = max(1e-9, end - start)
    return sum(u.tokens for u in steady) / wall


def step_times(tl: Timeline) -> np.ndarray:
    pub = np.array([tl.t0] + [u.published for u in tl.updates])
    return np.diff(pub)


def mean_step_time(tl: Timeline) -> float:
    steps = step_times(tl)
    steady = steps[WARMUP_UPDATES:] if len(steps) > WARMUP_UPDATES else steps
    return float(np.mean(steady)) if len(steady) else float("nan")


def merge_spans(spans) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as sorted, disjoint intervals."""
    merged: list[list[float]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def _overlap(spans: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in spans)


def trainer_bubble(tl: Timeline) -> float:
    start, end = tl.steady_window()
    if end <= start:
        return float("nan")
    busy = _overlap([(u.start, u.end + u.publish_seconds) for u in tl.updates], start, end)
    busy -= sum(_share_within(u, start, end) * u.waiting_inside() for u in tl.updates)
    return 1.0 - min(1.0, busy / (end - start))


def non_overlapped_rollout_share(tl: Timeline) -> float:
    """Share of wall time during which the trainer waits for rollout data."""
    start, end = tl.steady_window()
    if end <= start:
        return float("nan")
    prev = [tl.t0] + [u.published for u in tl.updates[:-1]]
    waits = [(p, u.ready) for p, u in zip(prev, tl.updates) if u.ready > p]
    inside = sum(_share_within(u, start, end) * u.waiting_inside() for u in tl.updates)
    return min(1.0, (_overlap(waits, start, end) + inside) / (end - start))


def _share_within(u: UpdateTiming, start: float, end: float) -> float:
    """The share of an update's span inside [start, end] (a streamed update's waits are spread over its span)."""
    span = u.end - u.start
    return _overlap([(u.start, u.end)], start, end) / span if span > 0 else 0.0


def rollout_bubble(busy: dict[str, list[tuple[float, float]]], start: float, end: float) -> float:
    """`busy`: per instance, the intervals its engine was generating."""
    if not busy or end <= start:
        return float("nan")
    shares = [_overlap(spans, start, end) / (end - start) for spans in busy.values()]
    return 1.0 - min(1.0, float(np.mean(shares)))


def held_rollout_bubble(busy: dict[str, list[tuple[float, float]]], held: list[tuple[float, float]], start: float,
                        end: float) -> float:
    """Share of rollout-instance time in [start, end] idle while `held` (the gate admitted no new group)."""
    if not busy or end <= start:
        return float("nan")
    window = [(max(s, start), min(e, end)) for s, e in merge_spans(held) if min(e, end) > max(s, start)]
    idle = [_overlap(window, start, end) - _overlap(_intersect(merge_spans(spans), window), start, end)
            for spans in busy.values()]
    return float(np.mean(idle)) / (end - start)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intersection of two sorted lists of disjoint intervals."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


TRAINER_KINDS = ("UpdateTask", "UpdatePartTask")  # the trainer may wait on the driver's reaction to these


def reaction_lag(tl: Timeline) -> dict[str, float]:
    """The driver's reaction lag over the steady window: mean and max over every future, and the share of the window
    spent reacting to the trainer's (an update or a streamed part ended: the next one waits on the driver)."""
    steady = [r for u in tl.steady() for r in u.reactions.items()]
    count = sum(r.count for _, r in steady)
    start, end = tl.steady_window()
    if not count or end <= start:
        return dict.fromkeys(("driver_reaction_lag_mean_s", "driver_reaction_lag_max_s",
                              "driver_reaction_lag_step_share", "driver_trainer_lag_share"), float("nan"))
    mean = sum(r.total for _, r in steady) / count
    return {"driver_reaction_lag_mean_s": mean, "driver_reaction_lag_max_s": max(r.longest for _, r in steady),
            "driver_reaction_lag_step_share": mean / mean_step_time(tl),
            "driver_trainer_lag_share": sum(r.total for kind, r in steady if kind in TRAINER_KINDS) / (end - start)}


def trainer_parts(tl: Timeline) -> dict[str, float]:
    """Streamed updates over the steady window: the parts an update took on the trainer, and the share of its groups
    its first part held (the rest were stragglers)."""
    return parts_figures([[groups for *_, groups in u.parts] for u in tl.steady() if u.parts])


def parts_figures(updates: list[list[int]]) -> dict[str, float]:
    """Parts per update and the first part's share of the groups, from each update's groups per part (the Dask run's
    and the simulator's)."""
    if not updates:
        return {"trainer_parts_per_update": float("nan"), "first_part_group_share": float("nan")}
    return {"trainer_parts_per_update": float(np.mean([len(p) for p in updates])),
            "first_part_group_share": float(np.mean([p[0] / sum(p) for p in updates]))}


def summary(tl: Timeline, busy: dict[str, list[tuple[float, float]]],
            last_dispatch: float = float("inf")) -> dict[str, float]:
    start, end = tl.steady_window()
    open_end = min(end, last_dispatch)
    open_bubble = rollout_bubble(busy, start, open_end)
    held = held_rollout_bubble(busy, tl.closed_spans(end), start, open_end)
    return {
        "throughput_tokens_per_s": throughput(tl),
        "step_time_s": mean_step_time(tl),
        "trainer_bubble": trainer_bubble(tl),
        "rollout_bubble": rollout_bubble(busy, start, end),
        "open_rollout_bubble": open_bubble,
        "open_rollout_bubble_held": held,
        "open_rollout_bubble_free": open_bubble - held,
        "gate_closed_share": _overlap(merge_spans(tl.closed_spans(end)), start, open_end) / (open_end - start)
        if open_end > start else float("nan"),
        "open_window_s": max(0.0, open_end - start),
        "non_overlapped_rollout_share": non_overlapped_rollout_share(tl),
        "wall_s": (tl.updates[-1].published - tl.t0) if tl.updates else 0.0,
        **reaction_lag(tl),
        **trainer_parts(tl),
    }
