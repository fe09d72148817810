"""Records of a response that leaves one rollout instance and continues on another of the same version.

The unit an instance serves and can give away is one response (one sample of a group), not the whole group. A
running response is handed over at a chunk boundary as a `Continuation`: its tokens and behaviour log-probs so far,
its remaining budget, what the receiving session needs to continue it exactly (`RowState`: its own random stream and,
on the transformers engine, its KV cache) and what the group needs to reassemble it (request id, sample index).
The receiving session records what taking it in cost (`MigrationCost`).

On Dask (`pipelines.migration`) a group's rollout task whose responses were handed over answers `HandedOver` (the
trajectories that ended there and the continuations), each moved response is continued by a resume task that answers
`ResumedResponse`, and the group is put back together for scoring by `assemble_group`.

Simplified, and why:
- The KV cache travels as one tensor per layer for keys and one for values, [kv heads, length, head dim], positions
  0 .. length - 1, no padding: both transformers sessions store keys after the rotary embedding at the position that
  is the token's index, so this layout fits either of them.
- A continuation is adopted only by a session of its own version (C1); another version raises `VersionMismatch`.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from dora_tasks.core.records import Generation, Group, Migration, Trajectory

if TYPE_CHECKING:
    import torch


class VersionMismatch(ValueError):
    """A continuation offered to a session or an instance that serves another version than the one that produced it."""


@dataclass
class RowCache:
    """One row's KV cache and the logits of its next token: enough to continue decoding it without a prefill."""

    keys: list[torch.Tensor]  # per layer [kv heads, length, head dim]
    values: list[torch.Tensor]  # per layer [kv heads, length, head dim]
    next_logits: torch.Tensor  # [vocab], from the row's last cached token

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[1]) if self.keys else 0

    @property
    def nbytes(self) -> int:
        return sum(t.nelement() * t.element_size() for t in [*self.keys, *self.values, self.next_logits])


@dataclass
class RowState:
    """What a decode session hands out for one of its rows (`export`)."""

    version: int  # the version of the weights that computed the cache
    cache: RowCache | None  # None: the session keeps no cache (the receiver re-encodes the row)
    sampler: bytes | None  # the state of the row's own random stream; None: it drew from each chunk's shared stream


@dataclass
class Continuation:
    """A response in progress, handed over by one instance to continue on another of the same version."""

    version: int
    request_id: Hashable  # the request (group) the response belongs to, as its rollout named it
    sample_index: int  # its index among the request's samples
    seed: int  # the request's seed (the receiving batch's chunk seeds derive from it when it leads the batch)
    prompt_ids: np.ndarray  # int32 [P]
    token_ids: np.ndarray  # int32 [T], the response so far
    logprobs: np.ndarray  # float32 [T], behaviour log-probs so far
    versions: np.ndarray  # int32 [T]
    max_new_tokens: int  # the response's whole budget
    row: RowState
    handed_over_at: float  # wall clock, when it left the batch

    @property
    def budget_left(self) -> int:
        return self.max_new_tokens - len(self.token_ids)

    @property
    def ids(self) -> list[int]:
        """Prompt and response so far: what a receiver without the cache re-encodes."""
        return self.prompt_ids.tolist() + self.token_ids.tolist()

    @property
    def nbytes(self) -> int:
        arrays = sum(a.nbytes for a in (self.prompt_ids, self.token_ids, self.logprobs, self.versions))
        return arrays + (self.row.cache.nbytes if self.row.cache else 0) + len(self.row.sampler or b"")


@dataclass
class MigrationCost:
    """What one hand-over cost the receiving instance (`docs`: migration cost)."""

    request_id: Hashable
    sample_index: int
    version: int
    bytes_moved: int  # the continuation: arrays, cache and sampler state
    reprefill_tokens: int  # tokens the receiver encoded again (0 when the cache travelled)
    seconds: float  # taking the row in: inserting its cache, or re-encoding it (nan: re-encoded within a later chunk)
    handed_over_at: float
    adopted_at: float

    @property
    def delay(self) -> float:
        """Wall seconds from leaving the sender's batch to joining the receiver's session."""
        return self.adopted_at - self.handed_over_at

    @classmethod
    def of(cls, continuation: Continuation, reprefill_tokens: int, seconds: float) -> MigrationCost:
        c = continuation
        return cls(c.request_id, c.sample_index, c.version, c.nbytes, reprefill_tokens, seconds, c.handed_over_at,
                   time.time())


@dataclass
class Resumed:
    """A continued response as the receiving instance answers it: the finished generation (or, handed over again, a
    new continuation) and what the hand-over cost."""

    outcome: Generation | Continuation
    cost: MigrationCost


def check_version(version: int, continuation: Continuation) -> None:
    """Raise `VersionMismatch` unless `continuation` was produced by `version` (C1)."""
    if continuation.version != version:
        raise VersionMismatch(
            f"continuation of request {continuation.request_id!r} sample {continuation.sample_index} was produced by "
            f"version {continuation.version}; this serves version {version}: a response continues only on an "
            f"instance of its own version (C1)")


def check_cache_fits(continuation: Continuation) -> RowCache:
    """The continuation's cache, checked to hold exactly its prompt and response so far."""
    cache = continuation.row.cache
    if cache is None:
        raise ValueError(f"continuation of request {continuation.request_id!r} carries no KV cache")
    expected = len(continuation.prompt_ids) + len(continuation.token_ids)
    if cache.length != expected:
        raise ValueError(f"continuation of request {continuation.request_id!r}: its cache holds {cache.length} "
                         f"tokens, its prompt and response {expected}")
    return cache


@dataclass
class HandedOver:
    """What a rollout task answers when some of its group's running responses were handed over: the trajectories that
    ended on this instance (`group`, fewer than G) and a continuation for each response handed over."""

    group: Group
    continuations: list[Continuation]

    @property
    def instance(self) -> str:
        return self.group.instance

    def continuation(self, sample: int) -> Continuation:
        return _one(self.continuations, sample, self.group.group_id)


@dataclass
class ResumedResponse:
    """What a resume task answers: the response it continued, ended (`trajectory`) or handed over again
    (`continuation`), every move of it so far and, on one response of the group only, the group's trajectories that
    ended on the instance it started on (so that the group can be put together without that instance's data, which
    holds the continuations' caches)."""

    group_id: int
    attempt: int
    sample_idx: int
    instance: str  # where it continued
    end_time: float  # run's clock
    migrations: list[Migration]
    trajectory: Trajectory | None = None
    continuations: list[Continuation] = field(default_factory=list)  # [the continuation] when handed over again
    group: Group | None = None

    def continuation(self, sample: int) -> Continuation:
        return _one(self.continuations, sample, self.group_id)


def _one(continuations: list[Continuation], sample: int, group_id: int) -> Continuation:
    found = [c for c in continuations if c.sample_index == sample]
    if len(found) != 1:
        raise LookupError(f"group {group_id}: {len(found)} continuations of sample {sample}")
    return found[0]


def assemble_group(pieces: list[ResumedResponse]) -> Group:
    """The whole group from the resumed responses of its moved samples: the trajectories that ended where it started
    (carried by one of them) and theirs, in sample order, with every move. Raises unless exactly one piece carries the
    group and every piece ended (C2: one trajectory per sample)."""
    shells = [p.group for p in pieces if p.group is not None]
    if len(shells) != 1:
        raise ValueError(f"{len(shells)} of {len(pieces)} resumed responses carry their group (1 expected)")
    shell = shells[0]
    unended = [p.sample_idx for p in pieces if p.trajectory is None]
    if unended:
        raise ValueError(f"group {shell.group_id}: responses {unended} were handed over again, not ended")
    trajectories = sorted(shell.trajectories + [p.trajectory for p in pieces], key=lambda t: t.sample_idx)
    samples = [t.sample_idx for t in trajectories]
    if len(set(samples)) != len(samples):
        raise ValueError(f"group {shell.group_id}: samples {samples} (a response ended twice)")
    end = max([shell.end_time] + [p.end_time for p in pieces])
    migrations = sorted((m for p in pieces for m in p.migrations), key=lambda m: (m.sample_idx, m.handed_over_time))
    return dataclasses.replace(shell, trajectories=trajectories, end_time=end, migrations=migrations)
