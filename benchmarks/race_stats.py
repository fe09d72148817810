"""The race protocol (`benchmarks/race_protocol.yaml`) and the statistics of its passes, without running anything.

`load_protocol` reads and checks the protocol; `interleaved_order` fixes which side runs when (round r starts at side
r mod n, so no side always runs first or after the same neighbour); `bootstrap_median_ci` and `rank_test` give the
medians' 95% intervals and a Mann-Whitney U p-value, where a run that never reached the target counts as infinitely
slow (it ranks last, and an interval that reaches it is open); `version_concurrency` reads from a run's generation
spans how many policy versions were generating at once.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

KINDS = ("dora", "trl")


class ProtocolError(ValueError):
    """A race protocol file that cannot be run as written."""


@dataclass(frozen=True)
class Side:
    name: str
    kind: str  # "dora": a pipeline run on the race's cluster; "trl": benchmarks/trl_peer.py in its own process(es)
    overrides: tuple[str, ...] = ()  # dora: section.key=value for the run
    trl: dict[str, Any] = field(default_factory=dict)  # trl: processes, threads, continuous_batching, warm, use_vllm


@dataclass(frozen=True)
class Protocol:
    config: str
    overrides: tuple[str, ...]
    shape: tuple[str, ...]
    updates: int
    eval_every: int
    target: float
    runs: int
    seeds: tuple[int, ...]
    sides: tuple[Side, ...]
    bootstrap_resamples: int = 10000
    bootstrap_seed: int = 0


def _need(data: dict, key: str, where: str = "") -> Any:
    if key not in data:
        raise ProtocolError(f"race protocol: missing key {where}{key}")
    return data[key]


def _side(item: dict, index: int) -> Side:
    where = f"sides[{index}]."
    kind = _need(item, "kind", where)
    if kind not in KINDS:
        raise ProtocolError(f"race protocol: {where}kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return Side(name=str(_need(item, "name", where)), kind=kind, overrides=tuple(item.get("overrides", ())),
                trl=dict(item.get("trl", {})))


def parse_protocol(data: dict) -> Protocol:
    """The protocol from its YAML mapping; a ProtocolError names the key that is missing or wrong."""
    workload = _need(data, "workload")
    sides = tuple(_side(item, i) for i, item in enumerate(_need(data, "sides")))
    boot = data.get("bootstrap", {})
    protocol = Protocol(
        config=str(_need(workload, "config", "workload.")), overrides=tuple(workload.get("overrides", ())),
        shape=tuple(_need(data, "shape")), updates=int(_need(workload, "updates", "workload.")),
        eval_every=int(_need(workload, "eval_every", "workload.")), target=float(_need(data, "target")),
        runs=int(_need(data, "runs")), seeds=tuple(int(s) for s in _need(data, "seeds")), sides=sides,
        bootstrap_resamples=int(boot.get("resamples", 10000)), bootstrap_seed=int(boot.get("seed", 0)))
    _check(protocol)
    return protocol


def _check(p: Protocol) -> None:
    if p.runs < 1:
        raise ProtocolError(f"race protocol: runs must be >= 1, got {p.runs}")
    if len(p.seeds) != p.runs:
        raise ProtocolError(f"race protocol: seeds must give one seed per run ({p.runs}), got {len(p.seeds)}")
    if len(set(p.seeds)) != len(p.seeds):
        raise ProtocolError("race protocol: seeds must differ from run to run")
    names = [s.name for s in p.sides]
    if len(set(names)) != len(names) or not names:
        raise ProtocolError(f"race protocol: sides need distinct names, got {names}")
    if p.eval_every < 1 or p.updates < p.eval_every:
        raise ProtocolError(f"race protocol: workload.eval_every must be in 1..updates, got {p.eval_every}")


def load_protocol(path: str) -> Protocol:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ProtocolError(f"race protocol {path}: expected a mapping at the top level")
    return parse_protocol(data)


def interleaved_order(n_sides: int, runs: int) -> list[tuple[int, int]]:
    """(round, side index) in running order: every round runs each side once, round r starting at side r mod n."""
    return [(r, (r + i) % n_sides) for r in range(runs) for i in range(n_sides)]


def _quantile(values: np.ndarray, q: float) -> float:
    # inverted_cdf picks an observed value, so an infinite value never turns into nan by interpolation
    return float(np.quantile(values, q, method="inverted_cdf"))


def median(values: Sequence[float]) -> float:
    """The usual median (mean of the two middle values of an even count: infinite if either is)."""
    data = sorted(float(v) for v in values)
    if not data:
        return math.nan
    mid = len(data) // 2
    return data[mid] if len(data) % 2 else (data[mid - 1] + data[mid]) / 2


def bootstrap_median_ci(values: Sequence[float], resamples: int = 10000, seed: int = 0,
                        level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the median (the lower median of each resample)."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    draws = data[rng.integers(0, data.size, size=(resamples, data.size))]
    medians = np.quantile(draws, 0.5, axis=1, method="inverted_cdf")
    tail = (1 - level) / 2
    return _quantile(medians, tail), _quantile(medians, 1 - tail)


def rank_test(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided Mann-Whitney U p-value of a against b (infinite values rank last, ties share ranks)."""
    from scipy.stats import mannwhitneyu

    if not len(a) or not len(b):
        return math.nan
    big = max([abs(x) for x in list(a) + list(b) if math.isfinite(x)], default=1.0) * 10 + 1
    ranked_a = [x if math.isfinite(x) else big for x in a]
    ranked_b = [x if math.isfinite(x) else big for x in b]
    return float(mannwhitneyu(ranked_a, ranked_b, alternative="two-sided").pvalue)


def version_concurrency(spans: Sequence[tuple[float, float, int]]) -> tuple[int, float]:
    """(most distinct versions generating at one instant, share of the generating time with two or more) over
    spans (start, end, version); a span ending at t and one starting at t do not overlap."""
    events = sorted([(s, 1, v) for s, _, v in spans] + [(e, -1, v) for _, e, v in spans], key=lambda x: (x[0], x[1]))
    alive: Counter = Counter()
    best, busy, several, last = 0, 0.0, 0.0, None
    for t, delta, version in events:
        if last is not None and alive:
            busy += t - last
            several += (t - last) if len(alive) >= 2 else 0.0
        alive[version] += delta
        if alive[version] == 0:
            del alive[version]
        best, last = max(best, len(alive)), t
    return best, (several / busy if busy > 0 else 0.0)


def _times(passes: list[dict]) -> list[float]:
    return [math.inf if p.get("time_to_target_s") is None else float(p["time_to_target_s"]) for p in passes]


def side_summary(name: str, passes: list[dict], protocol: Protocol) -> dict:
    """One table row: medians with bootstrap intervals over every measured pass of the side; a pass that crashed
    has no measurement and is counted apart (`failed`), never left out silently."""
    failed = [p for p in passes if "failed" in p]
    passes = [p for p in passes if "failed" not in p]
    times, tput = _times(passes), [float(p["throughput_tokens_per_s"]) for p in passes]
    boot = {"resamples": protocol.bootstrap_resamples, "seed": protocol.bootstrap_seed}
    concurrency = [p["versions_generating_max"] for p in passes if p.get("versions_generating_max") is not None]
    shares = [p["two_or_more_versions_share"] for p in passes if p.get("two_or_more_versions_share") is not None]
    return {
        "side": name, "runs": len(passes), "failed": len(failed), "reached": sum(math.isfinite(t) for t in times),
        "time_to_target_median": median(times), "time_to_target_ci": bootstrap_median_ci(times, **boot),
        "tokens_per_s_median": median(tput), "tokens_per_s_ci": bootstrap_median_ci(tput, **boot),
        "times": times, "tokens_per_s": tput,
        "max_staleness": max((p.get("max_staleness", 0) for p in passes), default=0),
        "c1_violations": sum(p.get("c1_violations", 0) for p in passes),
        "trajectories": sorted({p.get("trained_trajectories") for p in passes}, key=str),
        "versions_generating_max": max(concurrency, default=None),
        "two_or_more_versions_share": median(shares) if shares else None,
        "load_median": median([p["load_average"][0] for p in passes]) if passes else math.nan,
    }


def best_peer(passes: list[dict], protocol: Protocol) -> str:
    """The TRL side with the lowest median time to target over its measured passes (the peer at its best is the one
    compared against); the first TRL side while none has a pass, the first side where there is no TRL side."""
    peers = [s.name for s in protocol.sides if s.kind == "trl"]
    if not peers:
        return protocol.sides[0].name
    measured = {name: _times([p for p in passes if p["side"] == name and "failed" not in p]) for name in peers}
    return min(peers, key=lambda name: median(measured[name]) if measured[name] else math.inf)


def summarise(passes: list[dict], protocol: Protocol, reference: str) -> list[dict]:
    """Rows in protocol order, each with its rank-test p-value against the `reference` side's times and tokens/s."""
    by_side = {s.name: [p for p in passes if p["side"] == s.name and "failed" not in p] for s in protocol.sides}
    crashed = {s.name: [p for p in passes if p["side"] == s.name and "failed" in p] for s in protocol.sides}
    ref = by_side.get(reference, [])
    rows = []
    for side in protocol.sides:
        row = side_summary(side.name, by_side[side.name] + crashed[side.name], protocol)
        if side.name != reference:
            row["p_time_vs_reference"] = rank_test(_times(by_side[side.name]), _times(ref))
            row["p_tokens_vs_reference"] = rank_test(row["tokens_per_s"], [p["throughput_tokens_per_s"] for p in ref])
        rows.append(row)
    return rows


def _num(x: float | None, spec: str = "{:.1f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return "never" if math.isinf(x) else spec.format(x)


def race_table(rows: list[dict], reference: str) -> str:
    head = ("| side | runs measured (crashed) | reached target | time to target s: median [95% CI] | p vs "
            f"{reference} | tokens/s: median [95% CI] | p vs {reference} | max staleness | C1 violations | "
            "trajectories per run | most versions generating at once | share of generating time with >= 2 |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lo, hi = r["time_to_target_ci"]
        tlo, thi = r["tokens_per_s_ci"]
        share = r["two_or_more_versions_share"]
        lines.append(
            f"| {r['side']} | {r['runs']} ({r['failed']}) | {r['reached']} of {r['runs']} | {_num(r['time_to_target_median'])} "
            f"[{_num(lo)}, {_num(hi)}] | {_num(r.get('p_time_vs_reference'), '{:.3f}')} | "
            f"{_num(r['tokens_per_s_median'], '{:.0f}')} [{_num(tlo, '{:.0f}')}, {_num(thi, '{:.0f}')}] | "
            f"{_num(r.get('p_tokens_vs_reference'), '{:.3f}')} | {r['max_staleness']} | {r['c1_violations']} | "
            f"{', '.join(str(t) for t in r['trajectories'])} | {r['versions_generating_max'] or 'n/a'} | "
            f"{'n/a' if share is None else f'{share:.0%}'} |")
    return "\n".join(lines)


def passes_table(passes: list[dict]) -> str:
    lines = ["| # | round | side | seed | time to target s | tokens/s | load average (1 min) before / after |",
             "|---|---|---|---|---|---|---|"]
    for i, p in enumerate(passes):
        if "failed" in p:
            lines.append(f"| {i} | {p['round']} | {p['side']} | {p['seed']} | crashed: {p['failed'][:120]} | - | "
                         f"{p['load_average'][0]:.1f} / {p['load_average'][-1]:.1f} |")
            continue
        t = p.get("time_to_target_s")
        before, after = p["load_average"][0], p["load_average"][-1]
        lines.append(f"| {i} | {p['round']} | {p['side']} | {p['seed']} | {'never' if t is None else f'{t:.1f}'} | "
                     f"{p['throughput_tokens_per_s']:.0f} | {before:.1f} / {after:.1f} |")
    return "\n".join(lines)
