"""One rollout instance: an engine that serves one policy version at a time, fed by concurrent rollout tasks.

Rollout tasks run in the worker's thread pool (one thread per slot). Each hands its group to the server and blocks;
a single engine thread (engines must not be called concurrently) gathers waiting groups and generates them together.
Which version a batch runs on and which waiting groups may join it is the server's `VersionPolicy`
(`dora_tasks.version_policy`):

* `DispatchVersion` (DORA, the default): a batch is the waiting groups of one version, the loaded one first; the
  version changes only when no group of the loaded version is running or waiting, so every token of a group comes
  from its dispatch version (C1).
* `ConcurrentVersions` (``rollout.versions_per_instance`` = M > 1, LoRA): a batch holds requests of up to M versions,
  all resident on the engine, each row decoded under its own request's version (C1 per request,
  `dora_tasks.server_sessions`); a further version waits until one of the batch has no request left.
* `PartialRollout` (``rollout.partial_rollout``, a baseline for comparison only): every waiting group joins and the
  newest published version is loaded between chunks; a response continues under the new weights (re-encoded from
  its prompt plus the tokens so far, as AReaL's interruptible generation does), so each token's log-prob and version
  are those of the version that produced it and C1 is broken on purpose.

Batching (``rollout.chunk_tokens``): between chunks, requests whose responses all ended are handed back and
waiting requests the policy lets join are added. On an engine with ``open_session`` (transformers) running
rows keep their KV cache between chunks (``rollout.keep_kv_cache``; `dora_tasks.engines.fast_session` or
`dora_tasks.engines.hf_session`); otherwise a continuing response is re-encoded by the same weights (vLLM's prefix
cache keeps that cheap). A response ends at its first eos (kept) or when ``max_new_tokens`` is spent (unfinished).

* ``> 0``, continuous batching: chunks of ``chunk_tokens`` tokens. Groups queued behind a long response are decoded
  in the same steps, which keeps the batch full under long-tailed lengths.
* ``0``, static batches: the chunk is the whole response budget, so every response ends in the batch's first chunk
  and nobody joins it midway; requests that arrive meanwhile wait until its longest response ends.

Multi-turn episodes (`dora_tasks.episodes`): each model turn is a request of its own (`generate_turns`: one
response to an episode's history, at most its turn's `limit` of tokens, ended early where its `stop` says), so turns
batch with everything else; `hold(version)` keeps the server on one version between an episode's turns (requests
of other versions wait until no block holds it), so every model token of an episode comes from one version (C1).

Hand-over (DORA's request migration): one response, not a whole group, is what an instance can give away. At the next
chunk boundary `hand_over` takes running responses out of the batch as `Continuation`s (`dora_tasks.core.handover`);
the request that owned one is answered with it in place of that sample's `Generation`. `resume` makes a continuation
join another server's batch of the same version: on the transformers engine its KV cache is inserted (no re-prefill),
otherwise (`ReencodingSession`) prompt and response so far are re-encoded and that cost is measured. With
``row_streams`` every response samples from its own random stream, so a handed-over response continues with exactly
the tokens it would have drawn at home.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from dora_tasks.core.contracts import DecodeSession, RolloutEngine
from dora_tasks.core.handover import Continuation, Resumed, check_version
from dora_tasks.core.records import Generation
from dora_tasks.rollout_rows import PartialResponse, TurnEnd
from dora_tasks.server_requests import (ChunkReport, HandOver, Request, chunk_report, fail, hand_back_finished,
                                       hand_over_row, place)
from dora_tasks.server_sessions import ReencodingSession, open_versions_session
from dora_tasks.version_policy import DispatchVersion, VersionPolicy

__all__ = ["BusyLog", "ReencodingSession", "RolloutServer"]

CHUNK_SEED_STRIDE = 7919  # a prime: the seeds of a batch's successive chunks do not collide


@dataclass
class BusyLog:
    """Wall-clock intervals during which the engine was generating (for the rollout bubble)."""

    spans: list[tuple[float, float]] = field(default_factory=list)

    def busy_seconds(self, since: float = 0.0) -> float:
        return sum(max(0.0, e - max(s, since)) for s, e in self.spans if e > since)


class RolloutServer:
    def __init__(self, make_engine: Callable[[], RolloutEngine], policy: VersionPolicy | None = None,
                 chunk_tokens: int = 0, *, keep_kv_cache: bool = True, row_streams: bool = False,
                 on_report: Callable[[ChunkReport], None] | None = None):
        """`policy`: which version a batch runs on and who joins it (default `DispatchVersion`, DORA's).
        `chunk_tokens` > 0: continuous batching in chunks of that many tokens (0: static batches, one chunk of
        the whole response budget).
        `keep_kv_cache`: on an engine with `open_session`, running rows keep their KV cache between chunks instead
        of being re-encoded.
        `row_streams`: on a session engine, each response samples from its own random stream, seeded by its
        request's seed and sample index, so that a handed-over response continues exactly as it would have at
        home; off, the rows of a chunk draw from one stream seeded per chunk (a handed-over response then continues
        from the receiver's stream: the same distribution, other tokens).
        `on_report`: called from the engine thread at each chunk boundary with what its named requests did
        (`ChunkReport`: the responses that ended, the KV tokens each request holds): the orchestrator frees rows
        request by request and places moved requests within the receivers' KV budgets."""
        self._make_engine = make_engine
        self._on_report = on_report
        self._policy = policy if policy is not None else DispatchVersion()
        self._chunk = chunk_tokens
        self._keep_kv_cache = keep_kv_cache
        self._row_streams = row_streams
        self._engine: RolloutEngine | None = None
        self._waiting: list[Request] = []
        self._orders: list[HandOver] = []
        self._serving = False  # a batch is being generated (hand-over orders are answered at its chunk boundaries)
        self._holds: Counter[int] = Counter()  # versions open episodes hold: no other version loads meanwhile
        self._cond = threading.Condition()
        self._closed = False
        self.busy = BusyLog()
        self.serving = BusyLog()  # spans with requests to serve: decoding, loading, its work between chunks
        self.loads: list[tuple[int, float, float]] = []  # (version, start, end)
        self._thread = threading.Thread(target=self._loop, name="dora-rollout-engine", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return -1 if self._engine is None else self._engine.version

    @property
    def engine(self) -> RolloutEngine | None:
        """The engine, once the first request started it."""
        return self._engine

    def generate(self, version: int, weights_path: str, prompt_ids: list[int], n: int, seed: int, *,
                 request_id: Hashable = None) -> list[Generation | Continuation]:
        """`n` responses to one prompt with `version`. A response handed over meanwhile (`hand_over`) is answered
        by its `Continuation` in place of its `Generation`; `request_id` names the request in it."""
        request = Request(version, weights_path, list(prompt_ids), n, seed, request_id)
        return self._answer(request)

    def resume(self, continuation: Continuation, weights_path: str) -> Resumed:
        """Continue a response another instance handed over: it joins this server's batch of its version, adopted
        with its KV cache where the engine keeps one (re-encoded otherwise), and is answered when it ends (or with a
        new continuation if handed over again). Raises `VersionMismatch` when this server holds a newer version
        (C1); on an older one it waits, as a request of its version would, until the older rows have ended and the
        server loads its version from `weights_path` (an instance a migration retargets may be sent only moved
        responses, no new group that would make it load)."""
        if self._policy.max_versions > 1:
            raise ValueError("a handed-over response joins an instance of one version: hand-over (rollout.switching="
                             "migrate) needs rollout.versions_per_instance=1")
        self._check_resumable(continuation)
        request = Request(continuation.version, weights_path, continuation.prompt_ids.tolist(), 1, continuation.seed,
                           continuation.request_id, arrival=continuation)
        (outcome,) = self._answer(request)
        return Resumed(outcome, request.rows[0].migration)

    def hand_over(self, count: int | None = None, *, requests: Iterable[Hashable] | None = None
                  ) -> list[Continuation]:
        """At the next chunk boundary, take running responses out of the batch and return them as continuations:
        `count` of them (fewest tokens so far first), or every running response of `requests` (request ids).
        Their requests are answered with the same continuations. Nothing runs: []."""
        if (count is None) == (requests is None):
            raise ValueError("hand_over: give either a count or request ids")
        order = HandOver(count, None if requests is None else frozenset(requests))
        with self._cond:
            if not self._serving:
                return []
            self._orders.append(order)
        order.done.wait()
        return order.result

    def generate_turns(self, version: int, weights_path: str, histories: Sequence[Sequence[int]],
                       seeds: Sequence[int], limits: Sequence[int], stop: TurnEnd | None = None) -> list[Generation]:
        """One model turn of each of several episodes (`dora_tasks.episodes`), decoded together: one response to
        each history (prompt and response so far), at most its limit of tokens, ended early by `stop`. Call it
        inside `hold(version)`, so that no other version loads between an episode's turns."""
        requests = [Request(version, weights_path, list(h), 1, seed, limit=limit, stop=stop)
                    for h, seed, limit in zip(histories, seeds, limits, strict=True)]
        return [outcome for answers in self._answer_all(requests) for outcome in answers]

    @contextlib.contextmanager
    def hold(self, version: int) -> Iterator[None]:
        """Serve no other version than `version` while the block runs: a multi-turn episode asks for each model turn
        separately, and every one of its tokens must come from one version (C1). Waits while open blocks hold
        another version."""
        with self._cond:
            while self._holds and version not in self._holds and not self._closed:
                self._cond.wait()
            self._holds[version] += 1
        try:
            yield
        finally:
            with self._cond:
                self._holds[version] -= 1
                self._holds += Counter()  # drops the versions no block holds any more
                self._cond.notify_all()

    def _answer(self, request: Request) -> list[Generation | Continuation]:
        return self._answer_all([request])[0]

    def _answer_all(self, requests: list[Request]) -> list[list[Generation | Continuation]]:
        with self._cond:
            self._waiting += requests
            self._cond.notify_all()
        for request in requests:
            request.done.wait()
        for request in requests:
            if request.error is not None:
                raise request.error
        return [request.result for request in requests]

    def _check_resumable(self, continuation: Continuation) -> None:
        engine = self._engine
        if engine is None:
            return  # not started: it will load the continuation's version
        if engine.version > continuation.version:  # an older one moves up to it once its rows end, as for a generate
            check_version(engine.version, continuation)
        if engine.max_new_tokens != continuation.max_new_tokens:
            raise ValueError(f"continuation of request {continuation.request_id!r} has a budget of "
                             f"{continuation.max_new_tokens} tokens, this server's responses "
                             f"{engine.max_new_tokens}")

    def reload(self, weights_path: str) -> None:
        """Load the current version's weights again (warm-up of the load path). Only while the server is idle."""
        with self._cond:
            if self._waiting or self._engine is None:
                raise RuntimeError("reload() is for an idle, started server")
            start = time.time()
            self._engine.load_version(self._engine.version, weights_path)
            self.loads.append((self._engine.version, start, time.time()))
            self.serving.spans.append(self.loads[-1][1:])

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- engine thread -------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._servable() and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch = self._take_batch()
                self._serving = True
            start = time.time()
            try:
                self._serve(batch)
            except BaseException as exc:  # noqa: BLE001 - handed to every waiting task, which re-raises it
                for r in batch:
                    if not r.done.is_set():
                        r.error = exc
                        r.done.set()
            finally:
                self.serving.spans.append((start, time.time()))
                self._stop_serving()

    def _stop_serving(self) -> None:
        """The batch ended: hand-over orders still open find nothing running."""
        with self._cond:
            self._serving = False
            orders, self._orders = self._orders, []
        for order in orders:
            order.done.set()

    def _take_batch(self) -> list[Request]:
        """The waiting requests that join a batch of the loaded version, or, if none of that version waits, of the
        oldest waiting request's version."""
        loaded, servable = self.version, self._servable()
        version = loaded if any(r.version == loaded for r in servable) else servable[0].version
        return self._take_joiners(version)

    def _servable(self) -> list[Request]:
        """The waiting requests that may be served now: while episodes hold a version (`hold`), only its own."""
        return [r for r in self._waiting if not self._holds or r.version in self._holds]

    def _take_joiners(self, version: int) -> list[Request]:
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

    def _serve(self, batch: list[Request]) -> None:
        """Generate chunk by chunk until every request of the batch, and of those that joined it, is answered.

        Each turn: load the version the policy names, decode one chunk of every live response in the engine's
        session, hand back the requests whose responses all ended, let waiting requests the policy allows join.
        A session is opened anew (every live row re-encoded) only when the loaded version changed under it
        (`PartialRollout`)."""
        if self._policy.max_versions > 1:
            return self._serve_versions(batch)
        session = None
        active: list[tuple[Request, list[PartialResponse]]] = []
        pending = list(batch)
        chunk_index = 0
        try:
            while pending or active:
                fresh = [(r, self._rows_of(r)) for r in pending]
                active += fresh
                pending = []
                engine = self._load_for([r for r, _ in active])
                budget = engine.max_new_tokens
                live = {id(s): s for _, states in active for s in states if not s.done(budget)}
                session = self._rows_in_session(session, engine, live, fresh)
                if live:
                    self._decode_chunk(session, live, budget, active[0][0].seed + CHUNK_SEED_STRIDE * chunk_index)
                    chunk_index += 1
                self._give_away(session, active, budget)
                self._report(active, budget)
                active, pending = self._end_turn(active, budget)
        except BaseException as exc:
            fail([r for r, _ in active] + pending, exc)
            raise

    def _serve_versions(self, batch: list[Request]) -> None:
        """`_serve` under a policy that mixes versions (`ConcurrentVersions`): every version of the batch resident on
        the engine, each row in the session of its request's version, one chunk of every live row per turn."""
        session = None
        active: list[tuple[Request, list[PartialResponse]]] = []
        pending, chunk_index = list(batch), 0
        try:
            while pending or active:
                fresh = [(r, self._rows_of(r)) for r in pending]
                active += fresh
                engine = self._hold_versions([r for r, _ in active])
                session = session or open_versions_session(engine, self._keep_kv_cache)
                budget = engine.max_new_tokens
                for request, states in fresh:
                    for s in states:
                        session.add_on(request.version, id(s), s.prompt_ids + s.tokens, stream=s.stream)
                live = {id(s): s for _, states in active for s in states if not s.done(budget)}
                if live:
                    self._decode_chunk(session, live, budget, active[0][0].seed + CHUNK_SEED_STRIDE * chunk_index)
                    chunk_index += 1
                self._give_away(session, [], budget)  # no running row is offered: orders get nothing
                self._report(active, budget)
                active = hand_back_finished(active, budget)
                pending = self._admit(list(dict.fromkeys(r.version for r, _ in active)))
        except BaseException as exc:
            fail([r for r, _ in active] + pending, exc)
            raise

    def _admit(self, versions: list[int]) -> list[Request]:
        """Waiting requests that join a batch of `versions` (none once all ended: `_take_batch` chooses anew)."""
        self._engine.resident.running = frozenset(versions)  # a version whose requests all ended may be evicted
        with self._cond:
            if not versions:
                return []
            joined, self._waiting = self._policy.admit(self._waiting, versions)
            return joined

    def _hold_versions(self, requests: list[Request]) -> RolloutEngine:
        """The engine with every version of `requests` resident: one not resident is loaded in place of the least
        recently used version that has no request in the batch."""
        engine = self._started()
        resident = getattr(engine, "resident", None)
        if resident is None or resident.capacity < self._policy.max_versions:
            raise ValueError(f"{type(engine).__name__} does not hold {self._policy.max_versions} versions at once "
                             "(rollout.versions_per_instance): use train.lora with rollout.engine hf or vllm")
        paths = {r.version: r.weights_path for r in reversed(requests)}  # the first request's path of each version
        resident.running = frozenset(paths)
        for version in dict.fromkeys(r.version for r in requests):
            if version not in resident:
                start = time.time()
                engine.load_version(version, paths[version])
                self.loads.append((version, start, time.time()))
        return engine

    def _rows_of(self, request: Request) -> list[PartialResponse]:
        """The responses of a request joining the batch: its `n` samples, or the one response it continues."""
        if request.arrival is not None:
            request.rows = [PartialResponse.continuing(request.arrival)]
        else:
            request.rows = [PartialResponse(request.prompt_ids, i, self._row_stream(request.seed, i),
                                            limit=request.limit, stop=request.stop) for i in range(request.n)]
        return request.rows

    def _row_stream(self, seed: int, sample_index: int) -> int | None:
        """The seed of a response's own random stream (`row_streams`), None without."""
        if not self._row_streams:
            return None
        return int(np.random.SeedSequence([seed % 2**64, sample_index]).generate_state(1)[0])

    def _rows_in_session(self, session: DecodeSession | None, engine: RolloutEngine, live: dict,
                         fresh: list) -> DecodeSession:
        """The session to decode the live rows in: the same one with the fresh rows added, or, on another version,
        a new one with every live row re-encoded (keeping its own random stream)."""
        if session is None or session.version != engine.version:
            old, session = session, self._open_session(engine)
            for key, s in live.items():
                kept = old.sampler_state(key) if old is not None else None
                s.stream = kept if kept is not None else s.stream
                place(session, key, s)
            return session
        for _, states in fresh:
            for s in states:
                place(session, id(s), s)
        return session

    def _give_away(self, session: DecodeSession, active: list, budget: int) -> None:
        """Answer the hand-over orders that arrived during the chunk: the running responses they choose leave the
        session as continuations (their requests are answered with them by `_end_turn`)."""
        with self._cond:
            orders, self._orders = self._orders, []
        for order in orders:
            running = [(r, s) for r, states in active for s in states if not s.done(budget)]
            order.result = [hand_over_row(session, r, s, budget) for r, s in order.choose(running)]
            order.done.set()

    def _report(self, active: list, budget: int) -> None:
        if self._on_report is None:
            return
        report = chunk_report(active, budget)
        if report.ended or report.held:
            self._on_report(report)

    def _decode_chunk(self, session: DecodeSession, live: dict, budget: int, seed: int) -> None:
        """One chunk of every live response: `chunk_tokens`, or the rest of its budget (0: static batches)."""
        chunk = self._chunk or budget
        steps = {key: min(chunk, s.room(budget)) for key, s in live.items()}
        start = time.time()
        outs = session.decode(steps, seed)
        self.busy.spans.append((start, time.time()))
        for key, g in outs.items():
            live[key].extend(g, live[key].room(budget))
        session.drop([key for key, s in live.items() if s.done(budget)])

    def _open_session(self, engine: RolloutEngine) -> DecodeSession:
        kept = engine.open_session() if self._keep_kv_cache else None
        return kept if kept is not None else ReencodingSession(engine)

    def _end_turn(self, active: list, budget: int) -> tuple[list, list[Request]]:
        """Answer the requests whose responses all ended; those that arrived during the chunk join the next one."""
        active = hand_back_finished(active, budget)
        with self._cond:
            return active, self._take_joiners(self.version)

    def _load_for(self, requests: list[Request]) -> RolloutEngine:
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
