"""One rollout instance: an engine that serves one policy version at a time, fed by concurrent rollout tasks.

Rollout tasks run in the worker's thread pool (one thread per slot). Each hands its group to the server and blocks;
a single engine thread (engines must not be called concurrently) gathers the waiting groups of the loaded version
and generates them together in one batched call.

Version switches happen only between batches and only when no request of the loaded version is waiting, so every
token of a group comes from one version (C1). The orchestrator sends an instance only work of the version it assigned,
so a switch is the instance moving to a newer version (or to an older one to restart a group whose instance died).

Partial-rollout baseline (``rollout.partial_rollout``, comparison only): generation proceeds in chunks of
``partial_chunk_tokens`` and the newest published version is loaded between chunks, as AReaL/slime-style partial
rollout does; the per-token versions then record the mix (C1 is broken on purpose and the audit reports it).
Simplified: batches are static (a batch ends when its longest response ends); vLLM's own continuous batching is used
only inside one batch.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dora_tasks.contracts import RolloutEngine
from dora_tasks.records import Generation


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
    def __init__(self, make_engine: Callable[[], RolloutEngine], newest_weights: Callable[[], tuple[int, str]] | None = None,
                 partial_chunk_tokens: int = 0):
        self._make_engine = make_engine
        self._newest_weights = newest_weights  # partial-rollout baseline only
        self._chunk = partial_chunk_tokens
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
            except BaseException as exc:  # hand the error to every waiting task
                for r in batch:
                    r.error = exc
                    r.done.set()

    def _take_batch(self) -> list[_Request]:
        """All waiting requests of the loaded version; if there are none, those of the oldest waiting request."""
        loaded = self.version
        version = loaded if any(r.version == loaded for r in self._waiting) else self._waiting[0].version
        batch = [r for r in self._waiting if r.version == version]
        self._waiting = [r for r in self._waiting if r.version != version]
        return batch

    def _ensure(self, version: int, weights_path: str) -> RolloutEngine:
        if self._engine is None:
            self._engine = self._make_engine()
        if self._engine.version != version:
            start = time.time()
            self._engine.load_version(version, weights_path)
            self.loads.append((version, start, time.time()))
        return self._engine

    def _serve(self, batch: list[_Request]) -> None:
        engine = self._ensure(batch[0].version, batch[0].weights_path)
        start = time.time()
        n = batch[0].n
        if self._chunk and self._newest_weights is not None:
            outputs = self._generate_partial(engine, batch, n)
        else:
            outputs = engine.generate([r.prompt_ids for r in batch], n, batch[0].seed)
        self.busy.spans.append((start, time.time()))
        for request, gens in zip(batch, outputs):
            request.result = gens
            request.done.set()

    def _generate_partial(self, engine: RolloutEngine, batch: list[_Request], n: int) -> list[list[Generation]]:
        """Baseline: continue unfinished responses across weight updates, chunk by chunk."""
        states = [[_Partial(r.prompt_ids) for _ in range(n)] for r in batch]
        budget = engine.max_new_tokens
        seed = batch[0].seed
        while budget > 0:
            version, path = self._newest_weights()
            if version > engine.version:
                self._ensure(version, path)
            live = [s for group in states for s in group if not s.finished]
            if not live:
                break
            step = min(self._chunk, budget)
            outs = engine.generate([s.prompt_ids + s.tokens for s in live], 1, seed, max_new_tokens=step)
            for s, (g,) in zip(live, outs):
                s.extend(g)
            budget -= step
            seed += 1
        return [[s.to_generation() for s in group] for group in states]


@dataclass
class _Partial:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False

    def extend(self, g: Generation) -> None:
        self.tokens += g.token_ids.tolist()
        self.logprobs += g.logprobs.tolist()
        self.versions += g.versions.tolist()
        self.finished = g.finished

    def to_generation(self) -> Generation:
        return Generation(np.array(self.tokens, np.int32), np.array(self.logprobs, np.float32),
                          np.array(self.versions, np.int32), self.finished)
