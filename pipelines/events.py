"""What the driver waits on and what it tells observers: small typed records, no behaviour.

Tasks: each future the driver waits on is tracked with one of these, and `Driver.on_done` dispatches on its type.
Events: what happened, emitted to the driver's observers (MLflow tracking, the live view, benchmarks' probes), which
read them and never change the driver.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pipelines.orchestrator import Load, Migrate


# ---- tasks -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RolloutTask:
    group_id: int
    version: int
    instance: str


@dataclass(frozen=True)
class ScoringTask:
    """reward(groups) -> advantage(groups) of the groups one instance finished in one turn; tracked by advantage."""

    number: int
    group_ids: tuple[int, ...]


@dataclass(frozen=True)
class UpdateTask:
    update: int  # gate(u) -> update(u), which publishes version u + 1


@dataclass(frozen=True)
class UpdatePartTask:
    update: int  # one part of a streamed update (`dora.stream_updates`); its end lets the next part go
    part: int


@dataclass(frozen=True)
class EvaluationTask:
    version: int
    attempt: int


@dataclass(frozen=True)
class GroupOrder:
    """One group of a hand-over order: its running responses on the order's source go to `target`."""

    group_id: int
    version: int
    attempt: int
    target: str


@dataclass(frozen=True)
class HandOverTask:
    """An order to `source` to hand the running responses of some groups over (each to its target): not a Dask task
    but a `client.run` on the source worker, run from a driver thread; it answers (request id, sample index) of each
    response handed over."""

    source: str
    orders: tuple[GroupOrder, ...]


@dataclass(frozen=True)
class ResumeTask:
    """`("resume", v, group_id, sample)`: a handed-over response continued on `instance` (its `hop`-th move)."""

    group_id: int
    version: int
    attempt: int
    sample: int
    hop: int
    instance: str


Task = RolloutTask | ScoringTask | UpdateTask | UpdatePartTask | EvaluationTask | HandOverTask | ResumeTask


# ---- events ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupRolledOut:
    group_id: int
    at: float


@dataclass(frozen=True)
class ResponsesHandedOver:
    """`source` handed the group's running responses `samples` over; they continue on `target` (none: the hand-over
    found nothing running, the group stays where it is)."""

    group_id: int
    samples: tuple[int, ...]
    source: str
    target: str
    at: float


@dataclass(frozen=True)
class ScoringSubmitted:
    group_ids: tuple[int, ...]
    at: float


@dataclass(frozen=True)
class GroupsScored:
    group_ids: tuple[int, ...]
    at: float


@dataclass(frozen=True)
class UpdateSubmitted:
    update: int
    group_ids: tuple[int, ...]
    at: float


@dataclass(frozen=True)
class Published:
    """Update `update` ended and version `update + 1` is taken in; `metrics` are also in the store's update row."""

    update: int
    metrics: dict[str, float] = field(hash=False)


@dataclass(frozen=True)
class Evaluated:
    version: int
    accuracy: float | None  # None: the evaluation failed (see `error`)
    error: str = ""


@dataclass(frozen=True)
class TrainerRestored:
    why: str
    version: int
    optimizer_from: str  # checkpoint folder of its optimizer state; "" = a fresh optimizer
    checkpoint: str = ""  # the latest checkpoint's trainer folder when it was restored; "" = none yet


@dataclass(frozen=True)
class Turn:
    """The end of one turn of the streaming loop: the state the live view shows."""

    next_update: int
    newest: int
    live_versions: tuple[int, ...]
    in_flight: int
    metrics: dict[str, float] = field(hash=False)


Event = (GroupRolledOut | ResponsesHandedOver | ScoringSubmitted | GroupsScored | UpdateSubmitted | Load | Migrate
         | Published | Evaluated | TrainerRestored | Turn)  # Load, Migrate: the orchestrator's decisions, as they are
