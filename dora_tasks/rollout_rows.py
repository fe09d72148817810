"""One response as the rollout server grows it chunk by chunk, and how a model turn of an episode ends early.

A `PartialResponse` is one row of the server's batch: its tokens, behaviour log-probs and per-token versions so far.
It ends at its first eos (kept), when its budget is spent (the engine's `max_new_tokens`, or the smaller `limit` of
a turn of a multi-turn episode), when its `stop` says the turn ended (`TurnEnd`), or when it is handed over to
another instance.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from dora_tasks.core.handover import Continuation, MigrationCost
from dora_tasks.core.records import Generation


class TurnEnd(Protocol):
    """Where a model turn ends before eos (an episode's stop strings, `dora_tasks.episodes.StopStrings`)."""

    def cut(self, tokens: Sequence[int], checked: int) -> int | None:
        """The length to cut `tokens` (the turn so far) at when the turn ended inside it, else None; the first
        `checked` tokens were looked at before (and did not end it)."""


@dataclass
class PartialResponse:
    """One response grown chunk by chunk (under one version, or several in the partial-rollout baseline)."""

    prompt_ids: list[int]
    sample_index: int = 0
    stream: int | bytes | None = None  # its own random stream to start from: a seed or a saved state (`row_streams`)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finished: bool = False  # ended with eos
    arrival: Continuation | None = None  # handed over by another instance, until it is placed in the session
    migration: MigrationCost | None = None  # what taking it over from another instance cost
    handed_over: Continuation | None = None  # given away to another instance: done here
    limit: int | None = None  # a turn's own budget, below the engine's (None: the engine's)
    stop: TurnEnd | None = None  # ends the turn early (a stop string of an episode)
    stopped: bool = False  # the turn ended at `stop`
    reported: bool = False  # its end was reported (`server_requests.chunk_report`)

    @classmethod
    def continuing(cls, c: Continuation) -> PartialResponse:
        return cls(c.prompt_ids.tolist(), c.sample_index, c.row.sampler, c.token_ids.tolist(), c.logprobs.tolist(),
                   c.versions.tolist(), arrival=c)

    def cap(self, budget: int) -> int:
        """Its budget of tokens: the engine's, or its turn's when smaller."""
        return budget if self.limit is None else min(budget, self.limit)

    def room(self, budget: int) -> int:
        return self.cap(budget) - len(self.tokens)

    def done(self, budget: int) -> bool:
        return self.finished or self.stopped or self.handed_over is not None or len(self.tokens) >= self.cap(budget)

    def outcome(self) -> Generation | Continuation:
        return self.handed_over if self.handed_over is not None else self.to_generation()

    def extend(self, g: Generation, room: int) -> None:
        """Append a chunk's tokens (cut at its eos by the engine), at most `room` of them, then cut them where the
        turn's `stop` ends it (the tokens sampled after that point are dropped, as if sampling had stopped there)."""
        keep = min(len(g.token_ids), max(0, room))
        checked = len(self.tokens)
        self.tokens += g.token_ids[:keep].tolist()
        self.logprobs += g.logprobs[:keep].tolist()
        self.versions += g.versions[:keep].tolist()
        self.finished = bool(g.finished and keep == len(g.token_ids))
        if self.stop is not None:
            self._cut_at_stop(checked)

    def _cut_at_stop(self, checked: int) -> None:
        end = self.stop.cut(self.tokens, checked)
        if end is None:
            return
        if end < len(self.tokens):
            self.finished = False  # an eos after the stop is dropped with the rest
        del self.tokens[end:], self.logprobs[end:], self.versions[end:]
        self.stopped = True

    def to_generation(self) -> Generation:
        return Generation(np.array(self.tokens, np.int32), np.array(self.logprobs, np.float32),
                          np.array(self.versions, np.int32), self.finished)
