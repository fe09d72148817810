"""The decode sessions the rollout server builds itself (`dora_tasks.rollout_server`), beside the engines' own.

* `ReencodingSession`: the rows of one version on an engine that keeps no KV cache between calls (vLLM), or with
  ``rollout.keep_kv_cache`` off: every chunk re-encodes each row through `generate`.
* `open_versions_session`: the rows of several policy versions at once (``rollout.versions_per_instance`` = M > 1,
  `dora_tasks.version_policy.ConcurrentVersions`), every row decoded under its own version's weights (C1 per request);
  the engine holds those versions resident (`dora_tasks.engines.resident`). Two kinds:

  - `TimeSlicedSession` (an engine with `opens_version_sessions`, whose `open_session(version)` opens a session on
    any resident version: transformers, ``keep_kv_cache`` on): one
    session per version, over that version's merged weights and with its rows' KV caches; a chunk decodes each
    version's session in turn. Time-sliced: versions do not share a forward, so a step of a batch holding v versions
    costs v forwards of smaller batches.
  - `MixedReencodingSession` (otherwise: vLLM): every chunk is one `generate` call over all live rows, each naming its
    version (vLLM: one `LoRARequest` per request, the adapters applied per row in one batched forward); rows are
    re-encoded every chunk as in `ReencodingSession` (vLLM's prefix cache keeps that cheap).
"""
from __future__ import annotations

import time
from collections.abc import Hashable, Sequence

import numpy as np

from dora_tasks.core.contracts import DecodeSession, RolloutEngine
from dora_tasks.core.handover import Continuation, MigrationCost, RowState, check_version
from dora_tasks.core.records import Generation


class ReencodingSession:
    """The session of an engine that keeps no KV cache between calls (or with `rollout.keep_kv_cache` off): every
    chunk re-encodes a row's prompt and tokens so far through `generate`, by the same weights (vLLM's prefix cache
    keeps that cheap)."""

    def __init__(self, engine: RolloutEngine):
        self.engine, self.version = engine, engine.version
        self.rows: dict = {}

    def add(self, key, token_ids, stream=None) -> None:
        """`stream` is ignored: `generate` draws from one stream per call."""
        self.rows[key] = list(token_ids)

    def sampler_state(self, key) -> None:
        return None

    def export(self, key) -> RowState:
        """Take a row out; no cache travels (the receiver re-encodes it)."""
        self.rows.pop(key, None)
        return RowState(self.version, None, None)

    def adopt(self, key, continuation: Continuation) -> MigrationCost:
        """Take in a row another instance of this version handed over by re-encoding its prompt and response so far
        (the re-prefill), timed: one `generate` call of one token, which on vLLM also leaves the row's blocks in the
        prefix cache for the next chunk."""
        check_version(self.version, continuation)
        ids = continuation.ids
        start = time.perf_counter()
        self.engine.generate([ids], 1, continuation.seed, max_new_tokens=1)
        seconds = time.perf_counter() - start
        self.rows[key] = ids
        return MigrationCost.of(continuation, len(ids), seconds)

    def decode(self, steps: dict, seed: int) -> dict:
        keys = list(steps)  # one call: the longest step; a row with less room keeps what fits (`extend`)
        outs = self.engine.generate([self.rows[k] for k in keys], 1, seed, max_new_tokens=max(steps.values()))
        for key, (g,) in zip(keys, outs):
            self.rows[key] += g.token_ids.tolist()
        return {key: g for key, (g,) in zip(keys, outs)}

    def drop(self, keys) -> None:
        for key in keys:
            self.rows.pop(key, None)


class MixedReencodingSession:
    """Rows of several versions on an engine without sessions: one `generate` call per chunk over every row, each
    under its own version (`generate(..., versions=)`)."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self.rows: dict[Hashable, tuple[list[int], int]] = {}  # key -> (prompt and tokens so far, its version)

    def add_on(self, version: int, key: Hashable, token_ids: Sequence[int], stream=None) -> None:
        """`stream` is ignored: `generate` draws from one stream per call."""
        self.rows[key] = (list(token_ids), version)

    def decode(self, steps: dict, seed: int) -> dict[Hashable, Generation]:
        keys = list(steps)  # one call: the longest step; a row with less room keeps what fits (`extend`)
        outs = self.engine.generate([self.rows[k][0] for k in keys], 1, seed, max_new_tokens=max(steps.values()),
                                    versions=[self.rows[k][1] for k in keys])
        for key, (g,) in zip(keys, outs):
            self.rows[key][0].extend(g.token_ids.tolist())
        return {key: g for key, (g,) in zip(keys, outs)}

    def drop(self, keys) -> None:
        for key in keys:
            self.rows.pop(key, None)


class TimeSlicedSession:
    """Rows of several versions, one engine session per version (its own weights and KV caches); a chunk decodes
    the versions' sessions one after the other. A version's session closes when its last row leaves, so an engine
    may reuse that version's place (`dora_tasks.engines.resident`)."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self.sessions: dict[int, DecodeSession] = {}
        self.version_of: dict[Hashable, int] = {}

    def add_on(self, version: int, key: Hashable, token_ids: Sequence[int], stream: int | bytes | None = None) -> None:
        if version not in self.sessions:
            self.sessions[version] = self.engine.open_session(version)
        self.sessions[version].add(key, token_ids, stream=stream)
        self.version_of[key] = version

    def decode(self, steps: dict, seed: int) -> dict[Hashable, Generation]:
        out: dict[Hashable, Generation] = {}
        for version, session in self.sessions.items():
            mine = {k: n for k, n in steps.items() if self.version_of[k] == version}
            if mine:
                out.update(session.decode(mine, version_seed(seed, version)))
        return out

    def drop(self, keys) -> None:
        for version, session in list(self.sessions.items()):
            session.drop([k for k in keys if self.version_of.get(k) == version])
            if not len(session):
                del self.sessions[version]
        for key in keys:
            self.version_of.pop(key, None)


def version_seed(seed: int, version: int) -> int:
    """The seed of one version's share of a chunk (rows without their own stream: versions draw independently)."""
    return int(np.random.SeedSequence([seed % 2**64, version]).generate_state(1)[0])


def open_versions_session(engine: RolloutEngine, keep_kv_cache: bool) -> TimeSlicedSession | MixedReencodingSession:
    """The session of a batch mixing versions: per-version sessions with their KV caches where the engine opens
    sessions (and `keep_kv_cache`), else one re-encoding call per chunk over every version's rows."""
    if keep_kv_cache and getattr(engine, "opens_version_sessions", False):
        return TimeSlicedSession(engine)
    return MixedReencodingSession(engine)
