"""One rollout instance: an engine that serves one policy version at a time, fed by concurrent rollout tasks.

Rollout tasks run in the worker's thread pool (one thread per slot). Each hands its group to the server and blocks;
a single engine thread (engines must not be called concurrently) gathers waiting groups and generates them together.
Which version a batch runs on and which waiting groups may join it is the server's `VersionPolicy`
(`dora_tasks.version_policy`):

* `DispatchVersion` (DORA, the default): a batch is the waiting groups of one version, the loaded one first; the
  version changes only when no group of the loaded version is running or waiting, so every token of a group comes
  from its dispatch version (C1).
* `PartialRollout` (``rollout.partial_rollout``, a baseline for comparison only): every waiting group joins and the
  newest published version is loaded between chunks; a response continues under the new weights (re-encoded from
  its prompt plus the tokens so far, as AReaL's interruptible generation does), so each token's log-prob and version
  are those of the version that produced it and C1 is broken on purpose.

Batching (``rollout.chunk_tokens``), one chunk loop: between chunks, requests whose responses all ended are handed
back and waiting requests the policy lets join are added. On an engine with ``open_session`` (transformers) running
rows keep their KV cache between chunks (``rollout.keep_kv_cache``; `dora_tasks.engines.fast_session` or
`dora_tasks.engines.hf_session`); otherwise a continuing response is re-encoded by the same weights (vLLM's prefix
cache keeps that cheap). A response ends at its first eos (kept) or when ``max_new_tokens`` is spent (unfinished).

* ``> 0``, continuous batching: chunks of ``chunk_tokens`` tokens. Groups queued behind a long response are decoded
  in the same steps, which keeps the batch full under long-tailed lengths.
* ``0``, static batches: the chunk is the whole response budget, so every response ends in the batch's first chunk
  and nobody joins it midway; requests that arrive meanwhile wait until its longest response ends.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dora_tasks.core.contracts import DecodeSession, RolloutEngine
from dora_tasks.core.records import Generation
from dora_tasks.version_policy import DispatchVersion, VersionPolicy

CHUNK_SEED_STRIDE = 7919  # a prime: the seeds of a batch's successive chunks do not collide


@dataclass
class _Request:
    version: int
    weights_path: str
    prompt_ids: list[int]
    n: int
    seed: int
    done: threading.Event = field(default_factory=threading.Event)
    result: list[Generation] | None = None
    error: BaseException | None = None


@dataclass
class BusyLog:
    """Wall-clock intervals during which the engine was generating (for the rollout bubble)."""

    spans: list[tuple[float, float]] = field(default_factory=list)

    def busy_seconds(self, since: float = 0.0) -> float:
        return sum(max(0.0, e - max(s, since)) for s, e in self.spans if e > since)


class RolloutServer:
    def __init__(self, make_engine: Callable[[], RolloutEngine], policy: VersionPolicy | None = None,
                 chunk_tokens: int = 0, *, keep_kv_cache: bool = True):
        """`policy`: which version a batch runs on and who joins it (default `DispatchVersion`, DORA's).
        `chunk_tokens` > 0: continuous batching in chunks of that many tokens (0: static batches, one chunk of
        the whole response budget).
        `keep_kv_cache`: on an engine with `open_session`, running rows keep their KV cache between chunks instead
        of being re-encoded."""
        self._make_engine = make_engine
        self._policy = policy if policy is not None else DispatchVersion()
        self._chunk = chunk_tokens
        self._keep_kv_cache = keep_kv_cache
        self._engine: RolloutEngine | None = None
        self._waiting: list[_Request] = []
        self._cond = threading.Condition()
        self._closed = False
        self.busy = BusyLog()
        self.loads: list[tuple[int, float, float]] = []  # (version, start, end)
        self._thread = threading.Thread(target=self._loop, name="dora-rollout-engine", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return -1 if self._engine is None else self._engine.version

    def generate(self, version: int, weights_path: str, prompt_ids: list[int], n: int, seed: int) -> list[Generation]:
        request = _Request(version, weights_path, list(prompt_ids), n, seed)
        with self._cond:
            self._waiting.append(request)
            self._cond.notify_all()
        request.done.wait()
        if request.error is not None:
            raise request.error
        return request.result

    def reload(self, weights_path: str) -> None:
        """Load the current version's weights again (warm-up of the load path). Only while the server is idle."""
        with self._cond:
            if self._waiting or self._engine is None:
                raise RuntimeError("reload() is for an idle, started server")
            start = time.time()
            self._engine.load_version(self._engine.version, weights_path)
            self.loads.append((self._engine.version, start, time.time()))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- engine thread -------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch = self._take_batch()
            try:
                self._serve(batch)
            except BaseException as exc:  # noqa: BLE001 - handed to every waiting task, which re-raises it
                for r in batch:
                    if not r.done.is_set():
                        r.error = exc
                        r.done.set()

    def _take_batch(self) -> list[_Request]:
        """The waiting requests that join a batch of the loaded version, or, if none of that version waits, of the
        oldest waiting request's version."""
        loaded = self.version
        version = loaded if any(r.version == loaded for r in self._waiting) else self._waiting[0].version
        return self._take_joiners(version)

    def _take_joiners(self, version: int) -> list[_Request]:
        """Waiting requests the policy lets join a batch serving `version` (call with the lock held)."""
        batch, self._waiting = self._policy.joiners(self._waiting, version)
        return batch

    def _started(self) -> RolloutEngine:
        """The engine, created on first use (start-up takes seconds)."""
        if self._engine is None:
            self._engine = self._make_engine()
        return self._engine

    def _ensure(self, version: int, weights_path: str) -> RolloutEngine:
        if self._started().version != version:
            start = time.time()
            self._engine.load_version(version, weights_path)
            self.loads.append((version, start, time.time()))
        return self._engine

    def _serve(self, batch: list[_Request]) -> None:
        """Generate chunk by chunk until every request of the batch, and of those that joined it, is answered.

        Each turn: load the version the policy names, decode one chunk of every live response in the engine's
        session, hand back the requests whose responses all ended, let waiting requests the policy allows join.
        A session is opened anew (every live row re-encoded) only when the loaded version changed under it
        (`PartialRollout`)."""
        session = None
        active: list[tuple[_Request, list[_Partial]]] = []
        pending = list(batch)
        chunk_index = 0
        try:
            while pending or active:
                fresh = [(r, [_Partial(r.prompt_ids) for _ in range(r.n)]) for r in pending]
                active += fresh
                pending = []
                engine = self._load_for([r for r, _ in active])
                budget = engine.max_new_tokens
                live = {id(s): s for _, states in active for s in states if not s.done(budget)}
                session = self._rows_in_session(session, engine, live, fresh)
                if live:
                    self._decode_chunk(session, live, budget, active[0][0].seed + CHUNK_SEED_STRIDE * chunk_index)
                    chunk_index += 1
                active, pending = self._end_turn(active, budget)
        except BaseException as exc:
            _fail([r for r, _ in active] + pending, exc)
            raise

    def _rows_in_session(self, session: DecodeSession | None, engine: RolloutEngine, live: dict,
                         fresh: list) -> DecodeSession:
        """The session to decode the live rows in: the same one with the fresh rows added, or, on another version,
        a new one with every live row re-encoded."""
        if session is None or session.version != engine.version:
            session = self._open_session(engine)
            for key, s in live.items():
                session.add(key, s.prompt_ids + s.tokens)
            return session
        for _, states in fresh:
            for s in states:
                session.add(id(s), s.prompt_ids)
        return session

    def _decode_chunk(self, session: DecodeSession, live: dict, budget: int, seed: int) -> None:
        """One chunk of every live response: `chunk_tokens`, or the rest of its budget (0: static batches)."""
        chunk = self._chunk or budget
        steps = {key: min(chunk, budget - len(s.tokens)) for key, s in live.items()}
        start = time.time()
        outs = session.decode(steps, seed)
        self.busy.spans.append((start, time.time()))
        for key, g in outs.items():
            live[key].extend(g, budget - len(live[key].tokens))
        session.drop([key for key, s in live.items() if s.done(budget)])

    def _open_session(self, engine: RolloutEngine) -> DecodeSession:
        kept = engine.open_session() if self._keep_kv_cache else None
        return kept if kept is not None else ReencodingSession(engine)

    def _end_turn(self, active: list, budget: int) -> tuple[list, list[_Request]]:
        """Answer the requests whose responses all ended; those that arrived during the chunk join the next one."""
        active = _hand_back_finished(active, budget)
        with self._cond:
            return active, self._take_joiners(self.version)

    def _load_for(self, requests: list[_Request]) -> RolloutEngine:
        """The engine holding the version the policy names for these requests.

        A failed load is tried again only while the policy now names another version: the one it named was retained
        away between the weight store's listing and the load (`PartialRollout`); otherwise the error is raised."""
        version, path = self._policy.weights_for(requests, self.version)
        while True:
            try:
                return self._ensure(version, path)
            except (OSError, ValueError):
                failed = version
                version, path = self._policy.weights_for(requests, self.version)
                if version == failed:
                    raise


class ReencodingSession:
    """The session of an engine that keeps no KV cache between calls (or with `rollout.keep_kv_cache` off): every
    chunk re-encodes a row's prompt and tokens so far through `generate`, by the same weights (vLLM's prefix cache
    keeps that cheap)."""

    def __init__(self, engine: RolloutEngine):
        self.engine, self.version = engine, engine.version
        self.rows: dict = {}

    def add(self, key, token_ids) -> None:
        self.rows[key] = list(token_ids)

    def decode(self, steps: dict, seed: int) -> dict:
        keys = list(steps)  # one call: the longest step; a row with less room keeps what fits (`_Partial.extend`)
        outs = self.engine.generate([self.rows[k] for k in keys], 1, seed, max_new_tokens=max(steps.values()))
        for key, (g,) in zip(keys, outs):
            self.rows[key] += g.token_ids.tolist()
        return {key: g for key, (g,) in zip(keys, outs)}

    def drop(self, keys) -> None:
        for key in keys:
            self.rows.pop(key, None)


def _hand_back_finished(active: list[tuple[_Request, list[_Partial]]], budget: int) -> list:
    """Answer the requests whose responses all ended; the others stay active."""
    still = []
    for request, states in active:
        if all(s.done(budget) for s in states):
            request.result = [s.to_generation() for s in states]
            request.done.set()
        else:
            still.append((request, states))
    return still


def _fail(requests: list[_Request], exc: BaseException) -> None:
    for request in requests:
        request.error = exc
        request.done.set()


@dataclass
class _Partial:
    """One response grown chunk by chunk (under one version, or several in the partial-rollout baseline)."""

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False  # ended with eos

    def done(self, budget: int) -> bool:
        return self.finished or len(self.tokens) >= budget

    def extend(self, g: Generation, room: int) -> None:
        """Append a chunk's tokens (cut at its eos by the engine), at most `room` of them."""
        keep = min(len(g.token_ids), max(0, room))
        self.tokens += g.token_ids[:keep].tolist()
        self.logprobs += g.logprobs[:keep].tolist()
        self.versions += g.versions[:keep].tolist()
        self.finished = bool(g.finished and keep == len(g.token_ids))

    def to_generation(self) -> Generation:
        return Generation(np.array(self.tokens, np.int32), np.array(self.logprobs, np.float32),
                          np.array(self.versions, np.int32), self.finished)
