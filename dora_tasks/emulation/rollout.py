"""The emulated rollout engine (`rollout.engine=emulated`): a vLLM-like instance as a timing model, for scale studies.

It keeps the `RolloutEngine` contract and returns real token arrays, so everything downstream (the rollout server's
chunk loop and version policy, the driver, gate, store and audit) runs as with a real engine; only the decoding is
replaced by sleeping what the cost model (`dora_tasks.emulation.cost_model`) says the accelerators would take,
divided by `emulation.speedup`.

* Lengths: a row's response length is `LengthModel.response_tokens(prompt_id, sample)`. The prompt id is read from the
  prompt's synthetic tokens (`dora_tasks.emulation.task`); the sample index is the order in which a session receives
  a prompt's rows (the rollout server adds the G rows of a group one after the other), modulo `rollout.group_size`.
  A row added again with tokens already generated (a re-encoded row) keeps the sample its first token names.
* Tokens are synthetic; behaviour log-probs are `SYNTHETIC_LOGPROB` (a constant, marked as such: no model sampled
  them); every token carries the loaded version, so the audit's C1 check tests the version policy for real.
* Continuous batching within the KV-cache budget (`CostModel.kv_capacity_tokens`): at every decode call the rows
  are admitted first come first served while their caches, grown by this call's tokens, fit (and at most
  `emulation.max_rows` of them), and as rows end within the call waiting rows take their places for the steps left;
  a row that does not fit waits (fewer tokens, unfinished) and its cache is dropped, so it is prefilled again
  (prompt + tokens so far) when it is admitted, as vLLM's recompute preemption does.
* Cost of a call: `prefill_s` of each newly admitted row, plus the sum over the call's steps of
  `decode_step_s(rows running, their total context)`, rows joining and leaving as above.
* `load_version` sleeps the weight-load time (`emulation.weight_source`: from a peer instance or from the store);
  with `emulation.lora_rank` > 0 a version after 0 is its adapter's bytes, and every decode step pays for the
  distinct adapters of its rows (`CostModel.adapter_step_s`).
* Several versions at once (``rollout.versions_per_instance`` = M > 1): up to M versions resident (`resident`, least
  recently used out; a resident one loads for free), and `open_session(version)` opens a view of the one batch all
  of them share (`VersionView`): the first view to decode in a chunk admits and pays for the whole batch (KV budget,
  `max_rows`; the other versions' rows for this call's chunk), the others then take their rows' tokens, already
  paid; so a step holding rows of several adapters costs one step over all of them, not one per version.
"""
from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dora_tasks.core.clock import Clock
from dora_tasks.core.contracts import DecodeSession, RolloutEngine
from dora_tasks.core.handover import Continuation, MigrationCost, RowState, check_version
from dora_tasks.core.records import Generation
from dora_tasks.emulation.cost_model import CostModel, cost_model_from
from dora_tasks.emulation.lengths import length_model_from
from dora_tasks.emulation.task import SAMPLE_BASE, is_emulated_model, prompt_id_of, response_token_ids
from dora_tasks.engines.resident import ResidentVersions

SYNTHETIC_LOGPROB = -1.0  # behaviour log-prob of every emulated token: SYNTHETIC, no model sampled it
_EMPTY_I, _EMPTY_F = np.zeros(0, np.int32), np.zeros(0, np.float32)


class EmulatedRolloutEngine(RolloutEngine):
    opens_version_sessions = True  # `open_session(version)`: a view of the batch every resident version shares

    def __init__(self, model_path: str, rollout_cfg, version: int = 0, *, emulation, seed: int = 0):
        self.version = version
        self.cost = cost_model_from(emulation)
        self.lengths = length_model_from(emulation, seed)
        self.clock = Clock(emulation.speedup)
        self.group_size = rollout_cfg.group_size
        self.max_rows = emulation.max_rows
        self.capacity = self.cost.kv_capacity_tokens()
        self._budget = rollout_cfg.max_new_tokens
        peer = emulation.weight_source == "peer"
        self._load_s = {adapter: self.cost.weights_from_peer_s(adapter) if peer else self.cost.weights_from_store_s(
            adapter) for adapter in (False, True)}  # a version after 0 moves as its adapter (with LoRA)
        self.emulated_s = 0.0  # emulated seconds this engine has spent (decoding, prefilling, loading)
        versions = getattr(rollout_cfg, "versions_per_instance", 1)
        self.resident: ResidentVersions[bool] | None = ResidentVersions(versions) if versions > 1 else None
        if self.resident is not None:
            self.resident.put(version, True)
        self._shared: EmulatedSession | None = None  # the batch the versions' views share

    @property
    def max_new_tokens(self) -> int:
        return self._budget

    def load_version(self, version: int, weights_path: str) -> None:
        """Make `version` the loaded one; with several versions held, a resident one costs nothing and a new one takes
        the place of the least recently used version not running."""
        from storage.objectstore import local_folder

        if self.resident is not None and version in self.resident:
            self.resident.get(version)
            self.version = version
            return
        if not is_emulated_model(local_folder(weights_path)):  # on an object store: via the worker's cache
            raise OSError(f"{weights_path!r} holds no emulated model "
                          "(rollout.engine=emulated needs task.name=emulated)")
        if self.resident is not None and (victim := self.resident.victim()) is not None:
            self.resident.pop(victim)
        self.spend(self._load_s[version > 0])
        self.version = version
        if self.resident is not None:
            self.resident.put(version, True)

    def open_session(self, version: int | None = None) -> "EmulatedSession | VersionView":
        """A session on the loaded version; with several versions (`resident`) and a `version`, a view of the batch
        every resident version shares."""
        if version is None or self.resident is None:
            return EmulatedSession(self)
        self.resident.get(version)  # KeyError naming it when it is not resident
        if self._shared is None:  # one for the engine's life: every view, open or to come, shares its batch
            self._shared = EmulatedSession(self)
        return VersionView(self._shared, version)

    def generate(self, prompts: Sequence[Sequence[int]], n: int, seed: int, *, max_new_tokens: int | None = None,
                 versions: Sequence[int] | None = None) -> list[list[Generation]]:
        """`versions`: each prompt's version (several versions in one batch), default the loaded one."""
        budget = max_new_tokens or self._budget
        session = EmulatedSession(self)
        keys = [(i, j) for i in range(len(prompts)) for j in range(n)]
        for i, j in keys:
            session.add((i, j), prompts[i], version=None if versions is None else versions[i])
        parts: dict = {k: [] for k in keys}
        live = dict.fromkeys(keys, 0)
        while live:
            for key, g in session.decode({k: budget - done for k, done in live.items()}, seed).items():
                parts[key].append(g)
                live[key] += len(g.token_ids)
                if g.finished or live[key] >= budget:
                    del live[key]
            session.drop([k for k in parts if k not in live])
        return [[_concat(parts[(i, j)]) for j in range(n)] for i in range(len(prompts))]

    def spend(self, seconds: float) -> None:
        """Let `seconds` of accelerator time pass (slept at `emulation.speedup`)."""
        self.emulated_s += seconds
        self.clock.sleep(seconds)


@dataclass
class _Row:
    sample: int
    context: int  # prompt + tokens generated so far
    target: int  # its response length
    generated: int
    version: int  # the version (adapter) it is decoded under
    cached: bool = False  # its KV cache is on the instance (admitted and not preempted since)


class EmulatedSession(DecodeSession):
    """Rows decoded together, on the loaded version (or each on its own, `add(version=)`); dict order is the admission
    order (first come first served)."""

    def __init__(self, engine: EmulatedRolloutEngine):
        self.engine, self.version = engine, engine.version
        self.rows: dict[Hashable, _Row] = {}
        self._added: Counter = Counter()  # rows of each prompt id added so far: the next sample index
        self._paid: dict[Hashable, int] = {}  # tokens of rows decoded and paid for with another row's call

    def add(self, key: Hashable, token_ids: Sequence[int], stream: int | bytes | None = None,
            version: int | None = None) -> None:
        """`stream` is ignored: emulated tokens are not sampled. `version`: the row's own (default the session's)."""
        prompt_id = prompt_id_of(token_ids)
        start = next((i for i in range(2, len(token_ids)) if token_ids[i] >= SAMPLE_BASE), len(token_ids))
        if start < len(token_ids):
            sample = int(token_ids[start]) - SAMPLE_BASE
        else:
            sample = self._added[prompt_id] % self.engine.group_size
            self._added[prompt_id] += 1
        target = self.engine.lengths.response_tokens(prompt_id, sample)
        self.rows[key] = _Row(sample, len(token_ids), target, len(token_ids) - start,
                              self.version if version is None else version)

    def drop(self, keys: Sequence[Hashable]) -> None:
        for key in keys:
            self.rows.pop(key, None)
            self._paid.pop(key, None)

    def sampler_state(self, key: Hashable) -> None:
        return None

    def export(self, key: Hashable) -> RowState:
        """Take a row out; no cache travels (as vLLM, the receiver prefills it again)."""
        self.rows.pop(key, None)
        return RowState(self.version, None, None)

    def adopt(self, key: Hashable, continuation: Continuation) -> MigrationCost:
        """Take in a handed-over row as a re-encoded one: its prefill is spent when it is next admitted; the cost
        reported is that prefill's emulated seconds."""
        check_version(self.version, continuation)
        ids = continuation.ids
        self.add(key, ids)
        return MigrationCost.of(continuation, len(ids), self.engine.cost.prefill_s(len(ids)))

    def decode(self, steps: Mapping[Hashable, int], seed: int) -> dict[Hashable, Generation]:
        return self.decode_part(steps, steps)

    def decode_part(self, steps: Mapping[Hashable, int], batch: Mapping[Hashable, int]) -> dict[Hashable, Generation]:
        """Decode the rows of `steps` as part of `batch` (every row this turn decodes, `steps` among them). When a row
        of `steps` was not in the last call, the batch is run and paid for together (its prefills and decode steps),
        and the tokens of its other rows are kept as paid until their own call takes them."""
        wanted = {k: max(0, min(n, self.rows[k].target - self.rows[k].generated)) for k, n in batch.items()}
        if any(k not in self._paid for k in steps):
            granted, prefill, spans, versions = self._run_call(wanted)
            self.engine.spend(prefill + span_cost(self.engine.cost, spans, versions))
            self._paid = {k: granted.get(k, 0) for k in wanted}
        return {k: self._emit(k, min(wanted[k], self._paid.pop(k, 0))) for k in steps}

    def _run_call(self, wanted: Mapping[Hashable, int]) -> tuple[dict, float, list, list]:
        """Continuous batching over one call of `chunk` steps: rows are admitted first fit in admission order while
        their caches, grown by this call's tokens, fit and rows < `max_rows`; as rows end, waiting rows take their
        place for the steps left (vLLM schedules at every step, not per call). Returns each admitted row's tokens,
        the prefill seconds of rows whose cache was not held, and the (context, first step, end step) spans and
        versions of the admitted rows."""
        e = self.engine
        chunk = max(wanted.values(), default=0)
        waiting = [k for k in self.rows if wanted.get(k, 0) > 0]
        granted, spans, versions, running = {}, [], [], []  # running: a heap of (end step, order, cache held)
        used, prefill, step = 0, 0.0, 0
        while waiting and step < chunk:
            still = []
            for i, key in enumerate(waiting):
                if running and len(running) >= e.max_rows:
                    still.extend(waiting[i:])
                    break
                row, n = self.rows[key], min(wanted[key], chunk - step)
                if running and used + row.context + n > e.capacity:
                    still.append(key)
                    continue
                if not row.cached:
                    prefill += e.cost.prefill_s(row.context)
                    row.cached = True
                granted[key], used = n, used + row.context + n
                spans.append((row.context, step, step + n))
                versions.append(row.version)
                heapq.heappush(running, (step + n, len(spans), row.context + n))
            waiting = still
            if not running:
                break
            step = running[0][0]
            while running and running[0][0] == step:  # rows ending here free their rows and caches
                used -= heapq.heappop(running)[2]
        for key in waiting:
            self.rows[key].cached = False  # preempted or still waiting: its cache is (re)built when admitted
        return granted, prefill, spans, versions

    def _emit(self, key: Hashable, count: int) -> Generation:
        row = self.rows[key]
        v = row.version
        tokens = response_token_ids(row.sample, row.generated, count) if count else _EMPTY_I
        row.generated += count
        row.context += count
        ended = row.generated >= row.target
        finished = ended and row.target < self.engine.lengths.cap  # a response cut at the cap ends unfinished
        return Generation(tokens, np.full(count, SYNTHETIC_LOGPROB, np.float32) if count else _EMPTY_F,
                          np.full(count, v, np.int32) if count else _EMPTY_I, finished)


def decode_cost(cost: CostModel, rows: Sequence[tuple[int, int]], versions: Sequence[int] | None = None) -> float:
    """Seconds to decode rows given as (context, tokens) together, each leaving after its tokens: the sum over steps
    s of `decode_step_s(rows still running, sum of their context + s, their distinct versions)`; `versions`: each
    row's (LoRA adapter; default one version for all)."""
    return span_cost(cost, [(context, 0, tokens) for context, tokens in rows], versions)


def span_cost(cost: CostModel, spans: Sequence[tuple[int, int, int]], versions: Sequence[int] | None = None) -> float:
    """Seconds to decode rows given as (context, first step, end step) in one batch: each row joins at its first
    step with its context and leaves at its end step; summed in closed form between the steps where rows change."""
    versions = list(versions) if versions is not None else [0] * len(spans)
    changes: dict[int, list] = {}
    for (context, first, end), version in zip(spans, versions):
        if end > first:
            changes.setdefault(first, []).append((1, context - first, version))
            changes.setdefault(end, []).append((-1, first - context, version))
    total, rows, context, running = 0.0, 0, 0, Counter()
    points = sorted(changes)
    for here, after in zip(points, points[1:] + [None]):
        for sign, offset, version in changes[here]:  # context at step x = sum over running rows of (context + x - first)
            rows, context = rows + sign, context + offset
            running[version] += sign
            if not running[version]:
                del running[version]
        if after is not None and rows:
            total += _sum_steps(cost, rows, context, here, after) + (after - here) * cost.adapter_step_s(len(running))
    return total


def _sum_steps(cost: CostModel, rows: int, context: int, a: int, b: int) -> float:
    """sum over s in [a, b) of decode_step_s(rows, context + rows * s). decode_step_s is convex and piecewise linear
    in the context (the larger of a memory and a compute line), so a span whose midpoint lies on its chord is linear
    and sums in closed form; otherwise it is halved."""
    def f(s: int) -> float:
        return cost.decode_step_s(rows, context + rows * s)

    n = b - a
    if n <= 2:
        return sum(f(s) for s in range(a, b))
    first, last, mid = f(a), f(b - 1), (a + b - 1) // 2
    chord = first + (last - first) * (mid - a) / (b - 1 - a)
    if abs(f(mid) - chord) <= 1e-9 * max(abs(chord), 1e-12):
        return n * (first + last) / 2
    return _sum_steps(cost, rows, context, a, mid + 1) + _sum_steps(cost, rows, context, mid + 1, b)


class VersionView:
    """One version's rows in the batch all resident versions share (`EmulatedRolloutEngine.open_session(version)`):
    its decode runs as part of that batch, the other versions' rows counted at this call's chunk."""

    def __init__(self, shared: EmulatedSession, version: int):
        self.shared, self.version = shared, version
        self.keys: set = set()

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: Hashable, token_ids: Sequence[int], stream: int | bytes | None = None) -> None:
        self.shared.add(key, token_ids, version=self.version)
        self.keys.add(key)

    def decode(self, steps: Mapping[Hashable, int], seed: int) -> dict[Hashable, Generation]:
        chunk = max(steps.values(), default=0)
        batch = {**{k: chunk for k in self.shared.rows}, **steps}
        return self.shared.decode_part(steps, batch)

    def drop(self, keys: Sequence[Hashable]) -> None:
        self.shared.drop(keys)
        self.keys.difference_update(keys)

    def sampler_state(self, key: Hashable) -> None:
        return None


def _concat(parts: list[Generation]) -> Generation:
    return Generation(np.concatenate([p.token_ids for p in parts] or [_EMPTY_I]),
                      np.concatenate([p.logprobs for p in parts] or [_EMPTY_F]),
                      np.concatenate([p.versions for p in parts] or [_EMPTY_I]), bool(parts and parts[-1].finished))
