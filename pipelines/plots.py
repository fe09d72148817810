"""Pictures of a run, from plain arrays: learning curves, staleness, the multi-version rollout timeline, throughput.

Each `plot_*` function takes numpy arrays / dicts, writes one PNG and returns its path; `make_plots` maps the
trajectory store's tables ("trajectories", "updates", "dispatch") onto them. Times are plotted as given, in seconds;
`make_plots` first shifts every table onto "seconds since the run started" (the earliest time in any table).

Simplifications, and why:
- Matplotlib's object API (`Figure`, Agg canvas) instead of pyplot: no global backend switch, no figure registry,
  so plotting is safe from any thread and has no import-time side effects.
- A group's span on the timeline is [earliest trajectory start, latest trajectory end] of its rows; re-dispatched
  attempts are not drawn separately (the store keeps only the attempt that completed).
- Publish time of version `u+1` is taken as the `end` of update `u` (the update includes its publish).
- Missing optional columns are derived where the definition allows it (reward per update from the trajectories,
  tokens per update from prompt_len + response_len of the consumed trajectories, trainer bubble from update
  start/end, rollout bubble from group spans per instance); otherwise that curve is left out, never the whole plot.
"""
from __future__ import annotations

import math
import os
from typing import Iterable, Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.transforms import blended_transform_factory

Table = Mapping[str, np.ndarray]

DPI = 120
REWARD_COLOR = "tab:blue"
ACCURACY_COLOR = "tab:orange"


# ----------------------------------------------------------------------------------------------- small helpers
def _f64(values: Iterable) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).reshape(-1)


def _save(fig: Figure, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    return path


def _out_path(out: str | None, default_name: str) -> str:
    """`out` may be a .png path, a folder, or None (current folder)."""
    if out and out.lower().endswith(".png"):
        return out
    return os.path.join(out or ".", default_name)


def _finite_xy(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keep = np.isfinite(x) & np.isfinite(y)
    return x[keep], y[keep]


def version_colors(versions: Sequence[int]) -> dict[int, tuple]:
    """A distinct colour per policy version.

    Up to 20 versions: the ten saturated tab20 colours first, then their light partners, so neighbouring versions
    never share a hue; beyond 20 a continuous viridis scale (old = dark, new = light).
    """
    import matplotlib

    uniq = sorted(set(int(v) for v in versions))
    if len(uniq) <= 20:
        cmap = matplotlib.colormaps["tab20"]
        order = list(range(0, 20, 2)) + list(range(1, 20, 2))
        return {v: cmap(order[i]) for i, v in enumerate(uniq)}
    cmap = matplotlib.colormaps["viridis"]
    lo, hi = uniq[0], uniq[-1]
    return {v: cmap((v - lo) / (hi - lo)) for v in uniq}


# ----------------------------------------------------------------------------------------------- learning curves
def _plot_reward_accuracy(ax, x: np.ndarray, reward: np.ndarray, xa: np.ndarray, accuracy: np.ndarray,
                          xlabel: str) -> None:
    xr, yr = _finite_xy(x, reward)
    ax.plot(xr, yr, "o-", color=REWARD_COLOR, ms=3, label="reward (mean of consumed batch)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("reward", color=REWARD_COLOR)
    ax.tick_params(axis="y", labelcolor=REWARD_COLOR)
    ax.grid(alpha=0.3)
    xa, ya = _finite_xy(xa, accuracy)
    if len(xa):
        twin = ax.twinx()
        twin.plot(xa, ya, "s--", color=ACCURACY_COLOR, ms=4, label="accuracy (held-out, policy after x updates)")
        twin.set_ylabel("accuracy", color=ACCURACY_COLOR)
        twin.tick_params(axis="y", labelcolor=ACCURACY_COLOR)
        twin.set_ylim(-0.02, 1.02)
        lines = ax.get_lines() + twin.get_lines()
        ax.legend(lines, [ln.get_label() for ln in lines], loc="best", fontsize=8)
    else:
        ax.legend(loc="best", fontsize=8)


def accuracy_points(update: np.ndarray, end_time: np.ndarray, column: np.ndarray,
                    by_version: Mapping[int, float] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(version, wall time, accuracy) of each evaluated policy: version v is the policy after v updates, published
    at the end of update v - 1; version 0 is the initial policy, at time 0. `by_version` (a run's evaluations,
    version 0 included) wins over the table's column, which holds version u + 1 on the row of update u."""
    ends = {int(u) + 1: t for u, t in zip(update, end_time)}
    ends[0] = 0.0
    if by_version is None:
        by_version = {int(u) + 1: a for u, a in zip(update, column)}
    versions = sorted(v for v in by_version if v in ends)
    return (np.array(versions, dtype=np.float64), np.array([ends[v] for v in versions], dtype=np.float64),
            np.array([by_version[v] for v in versions], dtype=np.float64))


def plot_learning(updates: Table, out: str | None = None, accuracy: Mapping[int, float] | None = None) -> str:
    """Reward vs update and held-out accuracy vs policy version (left), both vs wall time (right).

    `updates`: arrays `update`, `end_time` (s), `reward_mean`, `accuracy` (NaN where not evaluated; may be absent).
    `accuracy`: version -> held-out accuracy, version 0 included (else the table's column, without version 0).
    """
    update = _f64(updates["update"])
    n = len(update)
    end_time = _f64(updates.get("end_time", np.full(n, np.nan)))
    reward = _f64(updates.get("reward_mean", np.full(n, np.nan)))
    versions, times, acc = accuracy_points(update, end_time, _f64(updates.get("accuracy", np.full(n, np.nan))),
                                           accuracy)
    fig = Figure(figsize=(13, 4.2))
    left, right = fig.subplots(1, 2, gridspec_kw={"wspace": 0.4})
    _plot_reward_accuracy(left, update, reward, versions, acc, "update")
    left.set_title("vs update")
    _plot_reward_accuracy(right, end_time, reward, times, acc, "wall time since start (s)")
    right.set_title("vs wall time")
    fig.suptitle(f"Learning: {n} updates")
    return _save(fig, _out_path(out, "learning.png"))


# ----------------------------------------------------------------------------------------------- staleness
def plot_staleness(staleness: np.ndarray, K: int | None, out: str | None = None) -> str:
    """Histogram of `u - v` over consumed trajectories, with the bound K marked (bars beyond K drawn red)."""
    s = np.asarray(staleness, dtype=np.int64).reshape(-1)
    top = max(int(s.max()) if len(s) else 0, K if K is not None else 0)
    low = min(int(s.min()) if len(s) else 0, 0)  # negative staleness (consumed before generated) is a bug: show it
    values = np.arange(low, top + 1)
    counts = np.array([(s == v).sum() for v in values])
    colors = ["tab:red" if v < 0 or (K is not None and v > K) else "tab:green" for v in values]
    fig = Figure(figsize=(6.5, 4))
    ax = fig.subplots()
    bars = ax.bar(values, counts, width=0.8, color=colors, edgecolor="black", linewidth=0.5)
    ax.bar_label(bars, labels=[str(c) if c else "" for c in counts], fontsize=8, padding=2)
    ax.set_xlim(low - 0.6, top + 1.4)
    if K is not None:
        ax.axvline(K + 0.5, color="tab:red", ls="--", lw=1.5, label=f"bound K = {K}")
        ax.axvspan(K + 0.5, top + 1.4, color="tab:red", alpha=0.08, label="not allowed (> K)")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xticks(values)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("staleness u - v (update that consumed it - version that generated it)")
    ax.set_ylabel("consumed trajectories")
    ax.margins(y=0.35)  # room for the legend above the bars
    smax = int(s.max()) if len(s) else 0
    if low < 0:
        verdict = "  (negative: VIOLATION)"
    else:
        verdict = "" if K is None else ("  (<= K: ok)" if smax <= K else "  (> K: VIOLATION)")
    ax.set_title(f"Staleness of {len(s)} trajectories: max {smax}{verdict}")
    return _save(fig, _out_path(out, "staleness.png"))


# ----------------------------------------------------------------------------------------------- timeline
def pack_lanes(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, int]:
    """Assign overlapping intervals to lanes (greedy, by start): returns each interval's lane and the lane count."""
    lane = np.zeros(len(start), dtype=np.int64)
    lane_ends: list[float] = []
    for i in np.argsort(start, kind="stable"):
        free = next((k for k, e in enumerate(lane_ends) if e <= start[i]), None)
        if free is None:
            free = len(lane_ends)
            lane_ends.append(end[i])
        lane_ends[free] = end[i]
        lane[i] = free
    return lane, max(len(lane_ends), 1)


def versions_in_flight(version: np.ndarray, start: np.ndarray, end: np.ndarray,
                       times: np.ndarray) -> np.ndarray:
    """Number of distinct versions with at least one group in flight at each of `times`."""
    count = np.zeros(len(times), dtype=np.int64)
    for v in np.unique(version):
        sel = version == v
        started = np.searchsorted(np.sort(start[sel]), times, side="right")
        ended = np.searchsorted(np.sort(end[sel]), times, side="right")
        count += (started - ended) > 0
    return count


def _short_instance(name) -> str:
    text = str(name)
    return text.split("://", 1)[-1]


def _draw_instance_rows(ax, inst: np.ndarray, version: np.ndarray, start: np.ndarray, end: np.ndarray,
                        consumed: np.ndarray, colors: dict[int, tuple]) -> None:
    names = sorted(set(inst.tolist()), key=lambda x: (str(type(x)), x))
    for row, name in enumerate(names):
        sel = np.flatnonzero(inst == name)
        lane, lanes = pack_lanes(start[sel], end[sel])
        height = 0.84 / lanes
        y = row - 0.42 + (lane + 0.5) * height
        for used in (True, False):
            part = consumed[sel] == used
            ax.barh(y[part], (end - start)[sel][part], left=start[sel][part], height=height * 0.88,
                    color=[colors[int(v)] for v in version[sel][part]], edgecolor="black", linewidth=0.3,
                    alpha=1.0 if used else 0.35, hatch=None if used else "///")
    ax.set_yticks(range(len(names)))
    two_lines = len(names) <= 16
    ax.set_yticklabels([f"instance {i}" + ("\n" + _short_instance(n) if two_lines and str(n) != str(i) else "")
                        for i, n in enumerate(names)], fontsize=8 if two_lines else 6)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.grid(axis="x", alpha=0.3)


def _draw_publish_lines(axes, publish_times: Sequence[tuple[int, float]], colors: dict[int, tuple]) -> None:
    """A dashed line per publish on every panel; version labels on top, thinned out to at most ~20."""
    top = axes[0]
    trans = blended_transform_factory(top.transData, top.transAxes)
    stride = max(1, math.ceil(len(publish_times) / 20))
    width = 1.2 if len(publish_times) <= 20 else 0.7
    for i, (version, t) in enumerate(publish_times):
        color = colors.get(int(version), "grey")
        for ax in axes:
            ax.axvline(t, color=color, ls="--", lw=width, alpha=0.9)
        if i % stride == 0:
            top.text(t, 1.01, f"v{int(version)}", transform=trans, ha="center", va="bottom", fontsize=7,
                     color=color)


def _version_legend(fig: Figure, axes, colors: dict[int, tuple], any_unconsumed: bool) -> None:
    ax = axes[0]
    unconsumed = [Patch(facecolor="white", edgecolor="black", hatch="///", linewidth=0.3, label="not consumed")]
    if len(colors) <= 20:
        handles = [Patch(facecolor=c, edgecolor="black", linewidth=0.3, label=f"v{v}") for v, c in colors.items()]
        ax.legend(handles=handles + (unconsumed if any_unconsumed else []), title="dispatch\nversion",
                  loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, ncol=1 if len(colors) <= 12 else 2)
        return
    import matplotlib
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    vs = sorted(colors)
    mappable = ScalarMappable(norm=Normalize(vs[0], max(vs[-1], vs[0] + 1)), cmap=matplotlib.colormaps["viridis"])
    fig.colorbar(mappable, ax=list(axes), label="dispatch version", fraction=0.03, pad=0.02)  # keeps x aligned


def plot_timeline(spans: Table, publish_times: Sequence[tuple[int, float]], out: str | None = None) -> str:
    """The picture of multi-version rollout.

    One row per rollout instance; each group is a bar from its start to its end, coloured by the version it was
    dispatched on (overlapping groups of one instance are stacked in thin lanes); dashed vertical lines mark when
    each version was published, in that version's colour. The lower panel counts the distinct versions in flight.
    `spans`: arrays `instance` (str or int), `version`, `group_id`, `start`, `end`, and optionally `consumed`
    (bool; groups no update trained on are drawn hatched); `publish_times`: (version, time) pairs.
    """
    inst = np.asarray(spans["instance"]).reshape(-1)
    version = np.asarray(spans["version"], dtype=np.int64).reshape(-1)
    start, end = _f64(spans["start"]), _f64(spans["end"])
    consumed = np.asarray(spans.get("consumed", np.ones(len(start), dtype=bool)), dtype=bool).reshape(-1)
    ok = np.isfinite(start) & np.isfinite(end)  # rows of a missing chunk read back as NaN times
    inst, version, start, end, consumed = inst[ok], version[ok], start[ok], end[ok], consumed[ok]
    publish_times = [(int(v), float(t)) for v, t in publish_times]
    colors = version_colors(list(version) + [v for v, _ in publish_times])
    n_inst = len(set(inst.tolist()))
    rows_height = min(1.1 * max(n_inst, 1), 14.0)  # 64 instances still fit a screen
    fig = Figure(figsize=(13, 3.0 + rows_height))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [rows_height, 1.2]})
    _draw_instance_rows(top, inst, version, start, end, consumed, colors)
    if len(start):
        times = np.linspace(np.nanmin(start), np.nanmax(end), 800)
        bottom.step(times, versions_in_flight(version, start, end, times), where="post", color="black", lw=1)
    bottom.set_ylabel("versions\nin flight")
    bottom.set_xlabel("wall time since start (s)")
    bottom.yaxis.get_major_locator().set_params(integer=True)
    bottom.grid(alpha=0.3)
    _draw_publish_lines([top, bottom], publish_times, colors)
    _version_legend(fig, (top, bottom), colors, not consumed.all())
    top.set_title(f"Rollout timeline: {len(start)} groups on {n_inst} instances, "
                  f"{len(set(version.tolist()))} dispatch versions (dashed: version published)", pad=14)
    return _save(fig, _out_path(out, "timeline.png"))


# ----------------------------------------------------------------------------------------------- throughput
def steady_throughput(end_time: np.ndarray, tokens: np.ndarray, skip: int = 2) -> float:
    """Tokens consumed by updates after the first `skip`, over the wall time they took (design.md's throughput)."""
    if len(end_time) <= skip + 1:
        return float("nan")
    span = end_time[-1] - end_time[skip - 1] if skip else end_time[-1] - end_time[0]
    return float(np.nansum(tokens[skip:]) / span) if span > 0 else float("nan")


def plot_throughput(updates: Table, out: str | None = None) -> str:
    """Tokens/s per update interval with the steady-state figure (top), rollout and trainer bubbles (bottom).

    `updates`: arrays `end_time` (s), `tokens` (consumed by each update), `rollout_bubble`, `trainer_bubble`
    (shares in [0, 1]; either may be absent or NaN).
    """
    end_time = _f64(updates["end_time"])
    n = len(end_time)
    tokens = _f64(updates.get("tokens", np.full(n, np.nan)))
    prev = np.concatenate([[0.0], end_time[:-1]])  # the first interval starts with the run
    interval = np.where(end_time - prev > 0, end_time - prev, np.nan)
    rate = tokens / interval
    fig = Figure(figsize=(11, 6.5))
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.bar(prev, rate, width=interval, align="edge", color="tab:blue", alpha=0.6, edgecolor="black",
            linewidth=0.4, label="per update interval")
    steady = steady_throughput(end_time, tokens)
    if np.isfinite(steady):
        top.axhline(steady, color="tab:red", ls="--", label=f"steady state (updates >= 2): {steady:,.0f} tok/s")
    top.set_ylabel("tokens / s (consumed)")
    top.legend(loc="lower right", fontsize=8)
    top.grid(alpha=0.3)
    top.set_title("Throughput: prompt + response tokens consumed by updates per wall second")
    for key, color, label in (("rollout_bubble", "tab:purple", "rollout bubble (instances idle)"),
                              ("trainer_bubble", "tab:brown", "trainer bubble (no update running)")):
        x, y = _finite_xy(end_time, _f64(updates.get(key, np.full(n, np.nan))) * 100)
        if len(x):
            bottom.plot(x, y, "o-", color=color, ms=3, label=f"{label}: mean {y.mean():.0f}%")
    bottom.set_ylim(-3, 103)
    bottom.set_ylabel("share of wall time (%)")
    bottom.set_xlabel("wall time since start (s)")
    bottom.grid(alpha=0.3)
    if bottom.get_lines():
        bottom.legend(loc="upper right", fontsize=8)
    return _save(fig, _out_path(out, "throughput.png"))


# ----------------------------------------------------------------------------------------------- store tables
def _col(table: Table | None, *names: str) -> np.ndarray | None:
    """The first of `names` present in `table` (also as the store's `metrics/<name>`), as an array; else None."""
    if not table:
        return None
    for name in names:
        for key in (name, f"metrics/{name}"):
            if key in table:
                return np.asarray(table[key]).reshape(-1)
    return None


def _time_origin(tables: Mapping[str, Table]) -> float:
    candidates = [_col(tables.get("trajectories"), "start_time"), _col(tables.get("updates"), "start"),
                  _col(tables.get("dispatch"), "time")]
    mins = [np.nanmin(_f64(c)) for c in candidates if c is not None and len(c) and np.isfinite(_f64(c)).any()]
    return float(min(mins)) if mins else 0.0


def group_spans(traj: Table, t0: float = 0.0) -> dict[str, np.ndarray]:
    """Per-trajectory rows -> one span per group: instance, version, group_id, start, end (times minus t0), consumed."""
    gid = np.asarray(traj["group_id"]).reshape(-1)
    uniq, first, inverse = np.unique(gid, return_index=True, return_inverse=True)
    start = np.full(len(uniq), np.inf)
    end = np.full(len(uniq), -np.inf)
    np.minimum.at(start, inverse, _f64(traj["start_time"]))
    np.maximum.at(end, inverse, _f64(traj["end_time"]))
    consumed = np.zeros(len(uniq), dtype=bool)
    if "consumed_by" in traj:
        np.logical_or.at(consumed, inverse, consumed_mask(traj))
    else:
        consumed[:] = True
    return {"instance": np.asarray(traj["instance"]).reshape(-1)[first],
            "version": np.asarray(traj["version"]).reshape(-1)[first].astype(np.int64),
            "group_id": uniq, "start": start - t0, "end": end - t0, "consumed": consumed}


def consumed_mask(traj: Table) -> np.ndarray:
    consumed = _f64(traj["consumed_by"])
    return np.isfinite(consumed) & (consumed >= 0)


def _per_update_sum(update: np.ndarray, consumed_by: np.ndarray, values: np.ndarray, mean: bool) -> np.ndarray:
    out = np.full(len(update), np.nan)
    for i, u in enumerate(update):
        sel = consumed_by == u
        if sel.any():
            vals = values[sel][np.isfinite(values[sel])]
            out[i] = (vals.mean() if mean else vals.sum()) if len(vals) else np.nan
    return out


def _covered_share(intervals: np.ndarray, lo: float, hi: float) -> float:
    """Share of [lo, hi] covered by the union of `intervals` (rows of start, end)."""
    if hi <= lo:
        return float("nan")
    clipped = np.clip(intervals, lo, hi)
    clipped = clipped[clipped[:, 1] > clipped[:, 0]]
    covered, cursor = 0.0, lo
    for s, e in clipped[np.argsort(clipped[:, 0])]:
        if e > cursor:
            covered += e - max(s, cursor)
            cursor = e
    return covered / (hi - lo)


def rollout_bubble_from_spans(spans: Table, bounds: np.ndarray) -> np.ndarray:
    """Per update interval [bounds[i], bounds[i+1]]: mean over instances of the share with no group in flight."""
    inst = np.asarray(spans["instance"])
    rows = np.stack([_f64(spans["start"]), _f64(spans["end"])], axis=1)
    names = sorted(set(inst.tolist()), key=str)
    out = np.full(len(bounds) - 1, np.nan)
    for i in range(len(bounds) - 1):
        shares = [_covered_share(rows[inst == name], bounds[i], bounds[i + 1]) for name in names]
        out[i] = 1.0 - float(np.mean(shares)) if shares else np.nan
    return out


def trainer_bubble(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Per update: share of [previous end (run start for the first), end] with no update running."""
    interval = end - np.concatenate([[0.0], end[:-1]])
    safe = np.where(interval > 0, interval, 1.0)
    return np.where(interval > 0, 1.0 - (end - start) / safe, np.nan)


def updates_view(tables: Mapping[str, Table], t0: float) -> dict[str, np.ndarray]:
    """The "updates" table in the shape plot_learning / plot_throughput take, deriving missing optional columns."""
    upd, traj = tables["updates"], tables.get("trajectories")
    update = _f64(upd["update"])
    n = len(update)
    start = _col(upd, "start")
    start = _f64(start) - t0 if start is not None else np.full(n, np.nan)
    end = _f64(upd["end"]) - t0
    view = {"update": update, "start_time": start, "end_time": end}
    for key in ("reward_mean", "accuracy", "tokens", "rollout_bubble", "trainer_bubble"):
        col = _col(upd, key, {"tokens": "num_tokens", "reward_mean": "reward"}.get(key, key))
        view[key] = _f64(col) if col is not None else np.full(n, np.nan)
    missing = {key for key, values in view.items() if np.isnan(values).all()}
    if traj and n:
        mask = consumed_mask(traj)
        consumed_by = _f64(traj["consumed_by"])[mask]
        if "reward_mean" in missing and "reward" in traj:
            view["reward_mean"] = _per_update_sum(update, consumed_by, _f64(traj["reward"])[mask], mean=True)
        if "tokens" in missing and {"prompt_len", "response_len"} <= set(traj):
            tokens = _f64(traj["prompt_len"])[mask] + _f64(traj["response_len"])[mask]
            view["tokens"] = _per_update_sum(update, consumed_by, tokens, mean=False)
        if "rollout_bubble" in missing:
            view["rollout_bubble"] = rollout_bubble_from_spans(group_spans(traj, t0), np.concatenate([[0.0], end]))
    if "trainer_bubble" in missing and np.isfinite(start).all():
        view["trainer_bubble"] = trainer_bubble(start, end)
    return view


def publish_times(upd: Table, t0: float) -> list[tuple[int, float]]:
    version = _col(upd, "published_version")
    version = _f64(upd["update"]) + 1 if version is None else _f64(version)
    return [(int(v), float(t)) for v, t in zip(version, _f64(upd["end"]) - t0) if np.isfinite(v) and np.isfinite(t)]


def make_plots(tables: Mapping[str, Table], out_dir: str, K: int | None,
               accuracy: Mapping[int, float] | None = None) -> list[str]:
    """Every plot the given store tables allow, as PNGs in `out_dir`; returns their paths. `accuracy`: held-out
    accuracy by policy version (version 0 included), for the learning curve.

    `tables`: name -> column -> array, as `TrajectoryStore.read_table(name)` returns them. Missing or empty tables
    skip their plots; missing optional metric columns are derived or left out (see the module docstring).
    """
    os.makedirs(out_dir, exist_ok=True)
    tables = {name: t for name, t in tables.items() if t and len(next(iter(t.values()))) > 0}
    t0 = _time_origin(tables)
    traj, upd = tables.get("trajectories"), tables.get("updates")
    paths = []
    if upd is not None:
        view = updates_view(tables, t0)
        paths.append(plot_learning(view, os.path.join(out_dir, "learning.png"), accuracy))
        paths.append(plot_throughput(view, os.path.join(out_dir, "throughput.png")))
    if traj is not None:
        mask = consumed_mask(traj)
        staleness = (_f64(traj["consumed_by"]) - _f64(traj["version"]))[mask].astype(np.int64)
        paths.append(plot_staleness(staleness, K, os.path.join(out_dir, "staleness.png")))
        spans = group_spans(traj, t0)
        pubs = publish_times(upd, t0) if upd is not None else []
        paths.append(plot_timeline(spans, pubs, os.path.join(out_dir, "timeline.png")))
    return paths
