"""The rollout server's bookkeeping of one request and one hand-over order, and the moves of a response into and out
of a decode session (`dora_tasks.rollout_server` drives them)."""
from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from dora_tasks.core.contracts import DecodeSession
from dora_tasks.core.handover import Continuation, MigrationCost
from dora_tasks.core.records import Generation
from dora_tasks.rollout_rows import PartialResponse, TurnEnd


@dataclass
class Request:
    version: int
    weights_path: str
    prompt_ids: list[int]
    n: int
    seed: int
    request_id: Hashable = None
    arrival: Continuation | None = None  # a response handed over by another instance (`resume`), n == 1
    limit: int | None = None  # a model turn of an episode: its own token budget (None: the engine's)
    stop: TurnEnd | None = None  # a model turn of an episode: where it ends before eos
    rows: list[PartialResponse] = field(default_factory=list)  # its responses, once it joined a batch
    done: threading.Event = field(default_factory=threading.Event)
    result: list[Generation | Continuation] | None = None
    error: BaseException | None = None


@dataclass
class ChunkReport:
    """What a server tells of its named requests at a chunk boundary: the responses that ended in the chunk
    (request id, sample index; not those handed over) and the KV tokens (prompt and tokens so far) the unfinished
    responses of each request still hold on it (a request with none left here is not named)."""

    ended: list[tuple[Hashable, int]]
    held: list[tuple[Hashable, int]]


def chunk_report(active: list[tuple[Request, list[PartialResponse]]], budget: int) -> ChunkReport:
    """Marks the ended responses it names as reported: each end is told once."""
    ended, held = [], []
    for request, states in active:
        if request.request_id is None:
            continue
        tokens = 0
        for s in states:
            if s.handed_over is not None:
                continue
            if not s.done(budget):
                tokens += len(s.prompt_ids) + len(s.tokens)
            elif not s.reported:
                s.reported = True
                ended.append((request.request_id, s.sample_index))
        if tokens:
            held.append((request.request_id, tokens))
    return ChunkReport(ended, held)


@dataclass
class HandOver:
    """An order to give away running responses at the next chunk boundary: `count` of them (fewest tokens first:
    the cheapest to move, the most budget left), or every one of the requests named."""

    count: int | None
    requests: frozenset | None
    done: threading.Event = field(default_factory=threading.Event)
    result: list[Continuation] = field(default_factory=list)

    def choose(self, running: list[tuple[Request, PartialResponse]]) -> list[tuple[Request, PartialResponse]]:
        if self.requests is not None:
            return [(r, s) for r, s in running if r.request_id in self.requests]
        return sorted(running, key=lambda rs: len(rs[1].tokens))[:self.count]


def hand_back_finished(active: list[tuple[Request, list[PartialResponse]]], budget: int) -> list:
    """Answer the requests whose responses all ended; the others stay active."""
    still = []
    for request, states in active:
        if all(s.done(budget) for s in states):
            request.result = [s.outcome() for s in states]
            request.done.set()
        else:
            still.append((request, states))
    return still


def place(session: DecodeSession, key, s: PartialResponse) -> None:
    """Put a response into the session: one handed over by another instance is adopted when the session serves its
    version; any other (or one arriving after a version change, `PartialRollout`) is encoded from its prompt and
    tokens so far."""
    arrival, s.arrival = s.arrival, None
    if arrival is not None and arrival.version == session.version:
        s.migration = session.adopt(key, arrival)
        return
    session.add(key, s.prompt_ids + s.tokens, stream=s.stream)
    if arrival is not None:
        s.migration = MigrationCost.of(arrival, len(s.prompt_ids) + len(s.tokens), float("nan"))


def hand_over_row(session: DecodeSession, request: Request, s: PartialResponse, budget: int) -> Continuation:
    """Take a running response out of the session as a continuation (it is done here from now on)."""
    row = session.export(id(s))
    s.handed_over = Continuation(
        version=session.version, request_id=request.request_id, sample_index=s.sample_index, seed=request.seed,
        prompt_ids=np.array(s.prompt_ids, np.int32), token_ids=np.array(s.tokens, np.int32),
        logprobs=np.array(s.logprobs, np.float32), versions=np.array(s.versions, np.int32), max_new_tokens=budget,
        row=row, handed_over_at=time.time())
    return s.handed_over


def fail(requests: list[Request], exc: BaseException) -> None:
    for request in requests:
        request.error = exc
        request.done.set()
