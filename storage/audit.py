"""Audit a run from its trajectory store alone: the correctness claims C1-C3 and the multi-version timeline.

- C1, one version per trajectory: every response token the model produced carries the version its group was
  dispatched on (a trajectory whose tokens hold two versions was generated across a weight swap). The tokens an
  environment added to a multi-turn episode (loss mask 0, schema version 3) carry no policy version: they must
  carry -1 (`environment_token_version` otherwise), and are left out of the version check. A response that
  migrated between rollout instances is checked like any other, and each migration too: the instance that handed
  it over and the one that continued it both served the dispatch version (`migrations` table, schema version 2).
- C2, each dispatched group consumed exactly once and whole: the latest attempt of every dispatched group is consumed
  by one update, with exactly G trajectories, sample_idx 0..G-1, no duplicates; nothing consumed that was never
  dispatched. A group that is not consumed is *lost* only if an update `u > v + K` ran (the version gate would have
  waited for it); otherwise it was still in flight when the run stopped, which is reported, not a violation.
- C3, bounded staleness: `consumed_by - version <= K` for every trajectory (and never negative); histogram and max.
  At K = 0 every batch must hold a single version (synchronous RL).
- Timeline: `versions_live_concurrently`, the most distinct versions among group generation spans [start, end] that
  overlap in time (> 1 proves multi-version rollout); also the most per instance.

Simplified, and why: everything is read into memory except the per-token versions, which are scanned in blocks of
trajectories (the tables of a 100k-trajectory run are a few MB; its tokens are not). Group spans come from consumed
groups only: the dispatch table records no end time.

CLI: `python -m storage.audit <store> [--max-staleness K] [--json]`; exit 0 clean, 1 violations, 2 unusable store.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from dora_tasks.core.records import ENVIRONMENT_VERSION
from storage.schema import StoreError
from storage.trajectory_store import TrajectoryStore

BLOCK_ROWS = 65536  # trajectories whose token versions are scanned at once
MAX_EXAMPLES = 20


class AuditInputError(ValueError):
    """The store lacks what the audit needs (e.g. meta["group_size"])."""


@dataclass
class Violation:
    clause: str  # "C1", "C2" or "C3"
    name: str
    count: int
    what: str
    examples: list = field(default_factory=list)  # up to MAX_EXAMPLES, sorted
    examples_are: str = "group_id"  # or "(group_id, sample_idx)"


@dataclass
class AuditReport:
    store: str
    group_size: int
    max_staleness: int | None
    counts: dict[str, int] = field(default_factory=dict)
    staleness_histogram: dict[int, int] = field(default_factory=dict)  # staleness -> trajectories
    max_staleness_seen: int | None = None
    update_versions: dict[int, dict[int, int]] = field(default_factory=dict)  # update -> version -> groups
    filtered: dict[str, int] = field(default_factory=dict)  # filter name -> consumed groups
    reward_errors: dict[str, int] = field(default_factory=dict)
    env_errors: dict[str, int] = field(default_factory=dict)  # environment failures that ended an episode
    episodes: dict[str, float] = field(default_factory=dict)  # turns per trajectory, tool calls, environment tokens
    in_flight_groups: list[int] = field(default_factory=list)
    versions_live_concurrently: int = 0
    max_versions_per_instance: int = 0
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def count(self, name: str) -> int:
        """How many of violation `name` were found (0 when none)."""
        return sum(v.count for v in self.violations if v.name == name)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["ok"] = self.ok
        out["in_flight_groups"] = self.in_flight_groups[:MAX_EXAMPLES]
        return out

    def to_text(self) -> str:
        return "\n".join(_text_lines(self))


# -------------------------------------------------------------------- entry points
def audit_store(path: Any, max_staleness: int | None = None) -> AuditReport:
    """Audit the store at `path` (read-only). K comes from `max_staleness` or, if None, meta["max_staleness"]."""
    store = TrajectoryStore.open(path, mode="r")
    meta = store.meta
    if "group_size" not in meta:
        raise AuditInputError(f"{path}: meta has no group_size (meta keys: {sorted(meta)})")
    k = max_staleness if max_staleness is not None else meta.get("max_staleness")
    report = AuditReport(store=str(path), group_size=int(meta["group_size"]),
                         max_staleness=None if k is None else int(k))
    # Read order matters on a live store: an update's row is committed after its consumed rows, and a group's
    # dispatch row before its consumed rows, so updates -> trajectories -> dispatch sees no consumption without its
    # dispatch and no "lost" group that a newer update consumed.
    updates = store.read_table("updates", ["update"])
    traj = store.read_table("trajectories")
    dispatch = store.read_table("dispatch")
    migrations = store.read_table("migrations")  # after dispatch: every migration's dispatch row is visible
    _count(report, dispatch, traj, updates)
    _check_c1(report, store, dispatch, traj)
    _check_migrations(report, dispatch, traj, migrations)
    _check_c2(report, dispatch, traj, last_update(traj, updates))
    _check_c3(report, traj)
    _timeline(report, traj)
    return report


def main(argv: Sequence[str] | None = None, prog: str = "python -m storage.audit", speaker: str = "storage.audit"
         ) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("store", help="trajectory store path or fsspec URL")
    parser.add_argument("--max-staleness", type=int, default=None, help="K (default: the store's meta)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        report = audit_store(args.store, args.max_staleness)
    except (StoreError, AuditInputError) as exc:
        print(f"{speaker}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=1, default=str) if args.json else report.to_text())
    return 0 if report.ok else 1


# -------------------------------------------------------------------- checks
def last_update(traj: dict, updates: dict) -> int:
    """The newest update the run recorded (-1 for none)."""
    values = [int(a.max()) for a in (traj["consumed_by"], updates["update"]) if len(a)]
    return max(values, default=-1)


def _count(report: AuditReport, dispatch: dict, traj: dict, updates: dict) -> None:
    report.counts = {
        "dispatch_rows": len(dispatch["group_id"]),
        "redispatches": int((dispatch["attempt"] > 0).sum()),
        "dispatched_groups": len(np.unique(dispatch["group_id"])),
        "consumed_groups": len(np.unique(traj["group_id"])),
        "trajectories": len(traj["group_id"]),
        "consumed_tokens": int(traj["prompt_len"].astype(np.int64).sum() + traj["response_len"].astype(np.int64).sum()),
        "updates": len(updates["update"]),
    }
    errors = Counter(str(e) for e in traj["reward_error"] if e)
    report.reward_errors = dict(errors.most_common())
    report.env_errors = dict(Counter(str(e) for e in traj["env_error"] if e).most_common())
    turns = traj["turns"].astype(np.int64)
    report.episodes = {"multi_turn_trajectories": int((turns > 1).sum()),
                       "turns_mean": float(turns.mean()) if len(turns) else 0.0,
                       "tool_calls": int(traj["tool_calls"].astype(np.int64).sum()), "environment_tokens": 0}


def _check_c1(report: AuditReport, store: TrajectoryStore, dispatch: dict, traj: dict) -> None:
    dispatched = {(g, a): v for g, a, v in zip(dispatch["group_id"].tolist(), dispatch["attempt"].tolist(),
                                               dispatch["version"].tolist())}
    # the version each trajectory must carry: its dispatch row's (the row's own field when never dispatched: C2)
    expected = np.array([dispatched.get((g, a), v) for g, a, v in zip(
        traj["group_id"].tolist(), traj["attempt"].tolist(), traj["version"].tolist())], dtype=np.int64)
    n = len(expected)
    mixed, mismatch, unmarked = [], [], []
    for lo in range(0, n, BLOCK_ROWS):
        rows = np.arange(lo, min(n, lo + BLOCK_ROWS))
        versions, masks = store.read_ragged("token_versions", rows), store.read_ragged("loss_mask", rows)
        vmin, vmax, has = _version_range([v[m == 1] for v, m in zip(versions, masks)])
        mixed.extend(rows[has & (vmin != vmax)])
        mismatch.extend(rows[has & ((vmin != expected[rows]) | (vmax != expected[rows]))])
        unmarked.extend(r for r, v, m in zip(rows, versions, masks) if (v[m == 0] != ENVIRONMENT_VERSION).any())
        report.episodes["environment_tokens"] += int(sum(int((m == 0).sum()) for m in masks))
    field_mismatch = np.flatnonzero(traj["version"] != expected)
    _add(report, "C1", "mixed_version_trajectories", _pairs(traj, mixed),
         "trajectories whose response tokens carry more than one version")
    _add(report, "C1", "token_version_mismatch", _pairs(traj, mismatch),
         "trajectories with a token version other than their group's dispatch version")
    _add(report, "C1", "group_version_mismatch", _pairs(traj, field_mismatch),
         "trajectory rows whose version field differs from their dispatch row's version")
    _add(report, "C1", "environment_token_version", _pairs(traj, unmarked),
         f"trajectories with environment tokens (loss mask 0) carrying a policy version, not {ENVIRONMENT_VERSION}")


def _check_migrations(report: AuditReport, dispatch: dict, traj: dict, migrations: dict) -> None:
    """C1 across instances: each migrated response left and joined instances serving its dispatch version (its
    tokens are checked with every trajectory's by `_check_c1`)."""
    dispatched = {(g, a): v for g, a, v in zip(dispatch["group_id"].tolist(), dispatch["attempt"].tolist(),
                                               dispatch["version"].tolist())}
    moved = list(zip(migrations["group_id"].tolist(), migrations["attempt"].tolist(),
                     migrations["sample_idx"].tolist(), migrations["version"].tolist(),
                     migrations["target_version"].tolist()))
    consumed = set(zip(traj["group_id"].tolist(), traj["attempt"].tolist(), traj["sample_idx"].tolist()))
    report.counts["migrations"] = len(moved)
    report.counts["migration_bytes"] = int(migrations["bytes"].astype(np.int64).sum())
    report.counts["migrated_trajectories"] = len({m[:3] for m in moved} & consumed)
    wrong = [(g, s) for g, a, s, v, tv in moved if not v == tv == dispatched.get((g, a), v)]
    _add(report, "C1", "migration_version_mismatch", wrong,
         "migrations whose source or target instance served another version than the group's dispatch version")


def _version_range(per_row: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lengths = np.array([len(v) for v in per_row], dtype=np.int64)
    has = lengths > 0
    vmin = np.zeros(len(per_row), dtype=np.int64)
    vmax = np.zeros(len(per_row), dtype=np.int64)
    if has.any():
        flat = np.concatenate(per_row)
        starts = (np.cumsum(lengths) - lengths)[has]
        vmin[has] = np.minimum.reduceat(flat, starts)
        vmax[has] = np.maximum.reduceat(flat, starts)
    return vmin, vmax, has


def _check_c2(report: AuditReport, dispatch: dict, traj: dict, last: int) -> None:
    latest: dict[int, tuple[int, int]] = {}  # group_id -> (attempt, version) of its latest dispatch
    for gid, attempt, version in zip(dispatch["group_id"].tolist(), dispatch["attempt"].tolist(),
                                     dispatch["version"].tolist()):
        if gid not in latest or attempt >= latest[gid][0]:
            latest[gid] = (attempt, version)
    samples: dict[tuple[int, int, int], list[int]] = defaultdict(list)  # (gid, update, attempt) -> sample_idx
    for key in zip(traj["group_id"].tolist(), traj["consumed_by"].tolist(), traj["attempt"].tolist(),
                   traj["sample_idx"].tolist()):
        samples[key[:3]].append(key[3])
    consumptions: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for gid, update, attempt in samples:
        consumptions[gid].append((update, attempt))
    _c2_membership(report, samples)
    _c2_dispatch_match(report, latest, consumptions, last)
    filtered = {}
    for gid, name in zip(traj["group_id"].tolist(), traj["filtered"].tolist()):
        if name:
            filtered.setdefault(name, set()).add(gid)
    report.filtered = {name: len(ids) for name, ids in sorted(filtered.items())}


def _c2_membership(report: AuditReport, samples: dict[tuple[int, int, int], list[int]]) -> None:
    g = report.group_size
    per_group: dict[int, Counter] = defaultdict(Counter)  # over all consumptions: a pair must appear once in the run
    missing, invalid = [], []
    for (gid, _, _), idx in samples.items():
        per_group[gid].update(idx)
        present = set(idx)
        missing += [(gid, s) for s in range(g) if s not in present]
        invalid += [(gid, s) for s in present if not 0 <= s < g]
    duplicates = [(gid, s) for gid, counts in per_group.items() for s, c in counts.items() for _ in range(c - 1)]
    _add(report, "C2", "duplicate_trajectories", duplicates,
         "extra rows for an already consumed (group_id, sample_idx)")
    _add(report, "C2", "missing_trajectories", missing, f"members absent from a consumed group (G={g})")
    _add(report, "C2", "invalid_sample_idx", invalid, f"sample_idx outside 0..{g - 1}")


def _c2_dispatch_match(report: AuditReport, latest: dict, consumptions: dict, last: int) -> None:
    k = report.max_staleness
    twice = [gid for gid, c in consumptions.items() if len(c) > 1]
    never_dispatched = [gid for gid in consumptions if gid not in latest]
    wrong_attempt = [gid for gid, c in consumptions.items()
                     if gid in latest and any(a != latest[gid][0] for _, a in c)]
    unconsumed = sorted(gid for gid in latest if gid not in consumptions)
    if k is None:  # without K no deadline is known: report every unconsumed group as in flight
        lost, report.in_flight_groups = [], unconsumed
    else:
        lost = [gid for gid in unconsumed if last > latest[gid][1] + k]
        report.in_flight_groups = [gid for gid in unconsumed if last <= latest[gid][1] + k]
    report.counts["in_flight_groups"] = len(report.in_flight_groups)
    _add(report, "C2", "duplicated_groups", twice, "groups consumed more than once (by several updates or attempts)")
    _add(report, "C2", "undispatched_groups", never_dispatched, "consumed groups with no dispatch row")
    _add(report, "C2", "wrong_attempt_groups", wrong_attempt,
         "consumed groups whose attempt is not the latest dispatched")
    _add(report, "C2", "lost_groups", lost,
         f"dispatched groups never consumed although an update u > v+K ran (last u={last})")


def _check_c3(report: AuditReport, traj: dict) -> None:
    k = report.max_staleness
    staleness = traj["consumed_by"].astype(np.int64) - traj["version"].astype(np.int64)
    values, counts = np.unique(staleness, return_counts=True)
    report.staleness_histogram = {int(v): int(c) for v, c in zip(values, counts)}
    report.max_staleness_seen = int(staleness.max()) if len(staleness) else None
    gids = traj["group_id"]
    _add(report, "C3", "negative_staleness", gids[staleness < 0].tolist(),
         "trajectories consumed by an update older than their version")
    if k is not None:
        _add(report, "C3", "staleness_violations", gids[staleness > k].tolist(), f"trajectories with staleness > K={k}")
    composition: dict[int, Counter] = defaultdict(Counter)
    seen = set()
    for gid, update, version in zip(gids.tolist(), traj["consumed_by"].tolist(), traj["version"].tolist()):
        if (gid, update) not in seen:
            seen.add((gid, update))
            composition[update][version] += 1
    report.update_versions = {u: dict(sorted(c.items())) for u, c in sorted(composition.items())}
    if k == 0:
        mixed = [u for u, c in report.update_versions.items() if len(c) > 1]
        _add(report, "C3", "mixed_version_batches", mixed, "updates whose batch holds several versions at K=0")


def _timeline(report: AuditReport, traj: dict) -> None:
    spans: dict[tuple[int, int], tuple[float, float, int, str]] = {}
    for gid, attempt, start, end, version, instance in zip(
            traj["group_id"].tolist(), traj["attempt"].tolist(), traj["start_time"].tolist(),
            traj["end_time"].tolist(), traj["version"].tolist(), traj["instance"].tolist()):
        spans[(gid, attempt)] = (start, end, version, instance)
    report.versions_live_concurrently = max_concurrent_versions([s[:3] for s in spans.values()])
    per_instance: dict[str, list] = defaultdict(list)
    for start, end, version, instance in spans.values():
        per_instance[instance].append((start, end, version))
    report.max_versions_per_instance = max((max_concurrent_versions(s) for s in per_instance.values()), default=0)


def max_concurrent_versions(spans: Sequence[tuple[float, float, int]]) -> int:
    """Most distinct versions among spans [start, end] alive at one instant (a span ending at t and one starting at t
    do not overlap)."""
    events = sorted([(s, 1, v) for s, _, v in spans] + [(e, -1, v) for _, e, v in spans])
    alive: Counter = Counter()
    best = 0
    for _, delta, version in events:
        alive[version] += delta
        if alive[version] == 0:
            del alive[version]
        best = max(best, len(alive))
    return best


# -------------------------------------------------------------------- reporting
def _pairs(traj: dict, rows: list) -> list[tuple[int, int]]:
    return [(int(traj["group_id"][r]), int(traj["sample_idx"][r])) for r in rows]


def _add(report: AuditReport, clause: str, name: str, items: list, what: str) -> None:
    """Record violation `name` when `items` (group ids, or (group_id, sample_idx) pairs) is not empty."""
    if items:
        examples = sorted(set(items))[:MAX_EXAMPLES]
        kind = "(group_id, sample_idx)" if isinstance(examples[0], tuple) else "group_id"
        report.violations.append(Violation(clause, name, len(items), what, [_plain(e) for e in examples], kind))


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _clause_status(report: AuditReport, clause: str) -> str:
    bad = [v for v in report.violations if v.clause == clause]
    return "OK" if not bad else "VIOLATED (" + ", ".join(f"{v.name}={v.count}" for v in bad) + ")"


def _text_lines(r: AuditReport) -> list[str]:
    c = r.counts
    k = "unknown (no --max-staleness, none in meta)" if r.max_staleness is None else str(r.max_staleness)
    unchecked = " (K unknown: lost groups and staleness > K not checked)" if r.max_staleness is None else ""
    lines = [
        f"Trajectory store audit: {r.store}",
        f"  G={r.group_size}  K={k}",
        f"  dispatch rows {c['dispatch_rows']} ({c['redispatches']} re-dispatches), groups dispatched "
        f"{c['dispatched_groups']}, consumed {c['consumed_groups']}, in flight at the end {c['in_flight_groups']}",
        f"  trajectories {c['trajectories']} ({c['consumed_tokens']} tokens), updates {c['updates']}",
        f"  migrations {c.get('migrations', 0)} ({c.get('migration_bytes', 0)} bytes moved; "
        f"{c.get('migrated_trajectories', 0)} consumed trajectories migrated)",
        f"C1 one version per trajectory: {_clause_status(r, 'C1')}",
        f"C2 every group consumed once and whole: {_clause_status(r, 'C2')}{unchecked}",
        f"   filtered groups: {r.filtered or 'none'}",
        _reward_failure_line(r),
        _episode_line(r),
        f"C3 staleness <= K: {_clause_status(r, 'C3')}{unchecked}; max staleness {r.max_staleness_seen}",
        "   staleness histogram (trajectories):",
    ]
    lines += _histogram_lines(r.staleness_histogram)
    lines.append("versions per update (update: {version: groups}):")
    lines += [f"   {u}: {v}" for u, v in r.update_versions.items()]
    lines.append(f"versions live concurrently: {r.versions_live_concurrently} "
                 f"(most on one instance: {r.max_versions_per_instance})")
    lines.append("RESULT: OK" if r.ok else f"RESULT: {len(r.violations)} kinds of violation")
    lines += [f"  - {v.clause} {v.name}: {v.count} — {v.what}; e.g. {v.examples_are} {v.examples[:5]}"
              for v in r.violations]
    return lines


def _reward_failure_line(r: AuditReport) -> str:
    """Failed rewards count as 0 in training: a store full of them passes C1-C3 yet taught nothing."""
    failed, total = sum(r.reward_errors.values()), r.counts.get("trajectories", 0)
    if not failed:
        return "reward failures: none"
    share = f" ({failed / total:.0%} of trajectories{', EVERY reward failed' if failed == total else ''})" \
        if total else ""
    return f"reward failures: {failed}{share}; by error: {r.reward_errors}"


def _episode_line(r: AuditReport) -> str:
    """Multi-turn episodes: how many, their turns and tool calls, the environment's tokens and failures."""
    e = r.episodes
    failures = f"{sum(r.env_errors.values())}, by error: {r.env_errors}" if r.env_errors else "none"
    return (f"episodes: {e.get('multi_turn_trajectories', 0)} multi-turn trajectories, turns per trajectory "
            f"{e.get('turns_mean', 0.0):.2f} on the mean, tool calls {e.get('tool_calls', 0)}, environment tokens "
            f"{e.get('environment_tokens', 0)}; environment failures: {failures}")


def _histogram_lines(hist: dict[int, int], width: int = 40) -> list[str]:
    top = max(hist.values(), default=0)
    return [f"   {s:>4} | {'#' * max(1, round(width * n / top)):<{width}} {n}" for s, n in hist.items()]


if __name__ == "__main__":
    sys.exit(main())
