"""What the driver keeps of each group and each update in flight: their futures and where they are."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from distributed import Future

from dora_tasks.core.records import Group, UpdateResult
from pipelines.gate import BatchDecision
from pipelines.migration import Moves


@dataclass
class InFlight:
    group_id: int
    version: int
    attempt: int
    futures: list[Future]  # rollout, its resumes (if responses moved), then the reward and advantage of its scoring
    instance: str  # where it is generated (where it started, when responses of it moved)
    rolled_out: bool = False  # every response ended: its rows are free again
    moves: Moves | None = None  # where its responses are, once one was asked to move (`pipelines.migration`)
    resumes: dict[tuple[int, int], Future] = field(default_factory=dict)  # (sample, hop) -> its resume
    reported: set[int] = field(default_factory=set)  # samples whose end the orchestrator was told

    @property
    def moved(self) -> bool:
        return self.moves is not None and self.moves.moved

    def scoring_input(self) -> Future | list[Future]:
        """What its reward task takes: the rollout's group, or the resumed responses of a group whose responses
        moved (one of them carries the trajectories that ended where it started)."""
        if not self.moved:
            return self.futures[0]
        return [self.resumes[task] for task in self.moves.final_tasks()]


@dataclass
class QueuedUpdate:
    decision: BatchDecision
    ready: float  # when the gate handed the batch over
    batch: Future | None  # the batch's groups, on the trainer (kept until the update ends: the gate may run again)
    checked: Future | None  # gate(u) (a streamed update: None, its parts hold theirs)
    updated: Future | None  # update(u), which publishes version u + 1 (a streamed update: once its last part is in)
    # a streamed update (`dora.stream_updates`): its groups not sent to the trainer yet, and every future of its parts
    # (batch, gate, part), the last part's last
    waiting: set[int] = field(default_factory=set)
    parts: list[Future] = field(default_factory=list)

    def futures(self) -> list[Future]:
        return [f for f in (self.batch, self.checked, self.updated, *self.parts) if f is not None]


class Publication(NamedTuple):
    """An update the driver took in (`Driver.on_published`) and has yet to record."""
    decision: BatchDecision
    ready: float  # when the gate handed the batch over
    result: UpdateResult
    groups: list[Group]
    taken_in: float  # when the driver took it in
