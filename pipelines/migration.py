"""Request migration on Dask (`rollout.switching=migrate`): a running response leaves one rollout instance and
continues on another instance of its version, with its tokens, behaviour log-probs, sampler state and KV cache.

How the driver carries out one `Migrate(group, samples, version, source, target)` of the orchestrator:

    hand-over order ──► source: `client.run(hand_over_requests)` from a driver thread, not a task (every thread of
                        the source may be held by a rollout task blocked on its server); one order per source and
                        turn names every group it gives away, and orders to several sources wait at once. At its
                        next chunk boundary the server takes the groups' running responses out of its batch; each
                        rollout task answers `HandedOver` (the trajectories that ended there and a continuation per
                        moved response), the order answers the moved (request, sample) pairs.
    ("resume", v, group, sample) ──► target, one task per moved response (`steps.resume`), pinned there with the
                        rollout label; its continuation (KV cache included) is a Dask dependency, copied worker to
                        worker, never through the driver. A response is one row of the target's batch, not a slot:
                        the task takes no ROLLOUT slot and secedes from the thread pool while it waits.
    scoring          ── once every sample's trajectory is in: reward (which puts the group together from the
                        resumed responses, one of which carries the trajectories that ended on the source) ->
                        advantage, as for any group (C2: one trajectory per sample index).

The orchestrator counts rows: a moved group's rows are on the target from its decision on; the responses that
ended on the source before the order arrived, and each resumed response as it ends, free their row
(`on_request_done`). A response can move again (another order, from the instance now holding it): its next resume
takes the previous one's answer as its dependency.

`Moves` is the pure bookkeeping of one group (where each response is, which task answers it); `RequestMigration`,
a mixin of the `Driver`, submits the orders and tasks and takes in their ends.

Faults (one line): an instance that dies restarts, on their version and from scratch, every group it held a
response of or handed responses over from (source or target), as for any group of a lost instance; a failed
hand-over order or resume restarts its group the same way. A moved group is scored in a batch of its own, so that
restarting it gives up no other group's scoring.

Simplified, and why:
- The order names the group, not single responses: all of its running responses on the source move together, as
  the orchestrator moves all of a group's unfinished requests together.
- An order that finds nothing running (the responses ended, or had not joined the source's batch yet) leaves the
  group where it is; the orchestrator takes it back when the source still serves its version, else counts its rows
  on the target until it ends (safe: C1 is the servers' to keep, they batch one version at a time).
- A second order for a group whose first is unanswered waits for that answer (one order out per group).
- A cancelled resume (its group restarted) still runs to its end on its instance: a Dask cancel does not stop a
  row in an engine's batch. Its result is dropped.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future as ThreadFuture
from dataclasses import dataclass, field

from distributed import Future

from dora_tasks import steps
from dora_tasks.plugins import hand_over_requests
from pipelines.cluster import ROLLOUT_ROW
from pipelines.events import GroupOrder, HandOverTask, ResponsesHandedOver, ResumeTask, RolloutTask
from pipelines.orchestrator import Migrate

log = logging.getLogger("dora")
ROLLOUT_TASK = (-1, 0)  # the task id of a group's rollout task; a resume's is (sample, hop)


class MigrationInvariantError(AssertionError):
    """An answer contradicts where the driver knows the group's responses to be."""


@dataclass(frozen=True)
class Holder:
    """The task answering for a response: the group's rollout task (hop 0) or its `hop`-th resume, on `instance`."""

    instance: str
    hop: int = 0


@dataclass
class Moves:
    """Where each response of one group is, as the driver knows it: events in (`ask`, `answer`, `task_done`), what
    to do out. Pure: no futures, no cluster."""

    at: dict[int, Holder]  # sample -> the task answering for it now
    done: set[tuple[int, int]] = field(default_factory=set)  # tasks that finished: ROLLOUT_TASK or (sample, hop)
    order: tuple[str, str] | None = None  # (source, target) of the hand-over asked and not answered yet
    then: tuple[str, str] | None = None  # the next order, sent once `order` is answered
    settled: set[tuple[int, int]] = field(default_factory=set)  # tasks that had finished when `order` was sent
    carrier: int | None = None  # the sample whose resumed response carries the group's trajectories from its source
    touched: set[str] = field(default_factory=set)  # every instance a task of the group ran on

    @classmethod
    def start(cls, group_size: int, instance: str) -> Moves:
        return cls({s: Holder(instance) for s in range(group_size)}, touched={instance})

    @staticmethod
    def task_of(sample: int, holder: Holder) -> tuple[int, int]:
        return ROLLOUT_TASK if holder.hop == 0 else (sample, holder.hop)

    def ask(self, source: str, target: str) -> tuple[str, str] | None:
        """A hand-over of the group's responses on `source` to `target`: the order to send now, or None when one is
        out (this one is sent once that is answered; a later one replaces it)."""
        if self.order is None:
            return self._send(source, target)
        self.then = (source, target)
        return None

    def _send(self, source: str, target: str) -> tuple[str, str]:
        self.order, self.settled = (source, target), set(self.done)
        return self.order

    def answer(self, samples: list[int]) -> tuple[list[tuple[int, Holder, Holder]], tuple[str, str] | None]:
        """The order's answer: the samples its source handed over. Returns the resumes to submit (sample, the task
        holding its continuation, the new holder) and the next order to send, if any. The samples that stayed on
        the source end there (with their task)."""
        if self.order is None:
            raise MigrationInvariantError("an answer without an order")
        (source, target), self.order = self.order, None
        moved = []
        for s in sorted(samples):
            old = self.at.get(s)
            if old is None or old.instance != source:
                raise MigrationInvariantError(f"sample {s} handed over by {source}, but it is held by {old}")
            self.at[s] = Holder(target, old.hop + 1)
            moved.append((s, old, self.at[s]))
        if moved:
            self.touched.add(target)
            if self.carrier is None:
                self.carrier = moved[0][0]
        following, self.then = self.then, None
        if following is not None:
            self._send(*following)
        return moved, following

    def task_done(self, task: tuple[int, int]) -> None:
        self.done.add(task)

    def ended(self) -> set[int]:
        """The samples whose trajectory is in: their task finished, and the order out (if any) cannot have moved
        them (their task had finished before it was sent, or runs elsewhere). A task end that the driver learns
        while an order to its instance is out may be a hand-over: it counts once the order is answered."""
        pending = self.order[0] if self.order is not None else None
        return {s for s, h in self.at.items()
                if (task := self.task_of(s, h)) in self.done and (h.instance != pending or task in self.settled)}

    @property
    def complete(self) -> bool:
        return len(self.ended()) == len(self.at)

    @property
    def moved(self) -> bool:
        return any(h.hop for h in self.at.values())

    def carries_group(self, sample: int, old: Holder) -> bool:
        """Whether the resume of `sample` from `old` carries the group's trajectories: the carrier's first move
        (later moves take them along from its previous answer)."""
        return sample == self.carrier and old.hop == 0

    def final_tasks(self) -> list[tuple[int, int]]:
        """The resume tasks whose answers make up the group (those of the responses that moved), in sample order."""
        return [(s, h.hop) for s, h in sorted(self.at.items()) if h.hop]

    def instances_of_unended(self) -> set[str]:
        ended = self.ended()
        return {h.instance for s, h in self.at.items() if s not in ended}

    def validate(self) -> None:
        if self.carrier is not None and self.at[self.carrier].hop == 0:
            raise MigrationInvariantError(f"carrier {self.carrier} never moved")
        if self.moved and self.carrier is None:
            raise MigrationInvariantError("responses moved but none carries the group")
        if {h.instance for h in self.at.values()} - self.touched:
            raise MigrationInvariantError("a response on an instance the group never touched")
        if self.order is None and self.then is not None:
            raise MigrationInvariantError("a next order without one out")


class RequestMigration:
    """The `Driver`'s request migration (a mixin: it works on the driver's groups in flight, orchestrator and
    client)."""

    def migrate(self, action: Migrate) -> None:
        """Take in the orchestrator's `Migrate`: its source will be asked (`send_orders`) to hand the group's running
        responses over."""
        self.emit(action)
        group = self.in_flight.get(action.group_id)
        if group is None or group.rolled_out or group.version != action.version:
            return  # it ended (or restarted) since
        if group.moves is None:
            group.moves = Moves.start(self.cfg.rollout.group_size, group.instance)
        order = group.moves.ask(action.source, action.target)
        if order is not None:
            self._queue_order(group, *order)

    def _queue_order(self, group, source: str, target: str) -> None:
        self.outbox.setdefault(source, []).append(GroupOrder(group.group_id, group.version, group.attempt, target))

    def send_orders(self) -> None:
        """One hand-over order per source for every group queued since the last call, all sent at once: an order
        waits for its source's next chunk boundary, so orders one after another would each wait a chunk."""
        for source, orders in self.outbox.items():
            rids = [steps.request_id(o.group_id, o.attempt) for o in orders]
            future: ThreadFuture = self.hand_over_pool.submit(self.client.run, hand_over_requests, rids,
                                                              workers=[source])
            self.track(future, HandOverTask(source, tuple(orders)))
        self.outbox.clear()

    def on_handed_over(self, task: HandOverTask, future: ThreadFuture) -> None:
        """The source answered which responses it handed over: each continues on its target in a resume task."""
        try:
            answered, failure = future.result().get(task.source, []), None
        except Exception as exc:  # noqa: BLE001 - whether anything moved is unknown: its groups start again
            answered, failure = [], f"hand-over by {task.source} failed: {type(exc).__name__}: {exc}"
        samples: dict[tuple, list[int]] = {}
        for request, sample in answered:
            samples.setdefault(tuple(request), []).append(sample)
        for order in task.orders:
            handed = samples.get(steps.request_id(order.group_id, order.attempt), [])
            self._handed_over(order, task.source, handed, failure)

    def _handed_over(self, order: GroupOrder, source: str, samples: list[int], failure: str | None) -> None:
        group = self.in_flight.get(order.group_id)
        if group is None or group.attempt != order.attempt:
            return
        if failure is not None and not group.rolled_out:  # (rolled out: every response had ended before the order)
            self.restart_group(order.group_id, failure)
            return
        moves = group.moves
        moved, following = moves.answer(samples)
        path = self.weights.path_for(group.version)
        for sample, old, new in moved:
            held = group.futures[0] if old.hop == 0 else group.resumes[(sample, old.hop)]
            again = (group.attempt, new.hop) if group.attempt or new.hop > 1 else ()
            resumed = self.client.submit(steps.resume, held, sample, path, moves.carries_group(sample, old),
                                         key=self.task_key("resume", group.version, group.group_id, sample, *again),
                                         workers=[new.instance], resources=ROLLOUT_ROW, pure=False)
            group.resumes[(sample, new.hop)] = resumed
            group.futures.append(resumed)
            self.track(resumed, ResumeTask(group.group_id, group.version, group.attempt, sample, new.hop,
                                           new.instance))
        if not moved:
            self._take_back(group)
        self.emit(ResponsesHandedOver(order.group_id, tuple(samples), source, order.target, self.clock.now()))
        if following is not None:
            self._queue_order(group, *following)
        self._settle(group)

    def on_resumed(self, task: ResumeTask, future: Future) -> None:
        group = self.in_flight.get(task.group_id)
        if group is None or group.attempt != task.attempt:
            return
        if future.status == "error":
            exc = future.exception()
            self.restart_group(task.group_id, f"resume of sample {task.sample} on {task.instance} failed: "
                                              f"{type(exc).__name__}: {exc}")
            return
        group.moves.task_done((task.sample, task.hop))
        self.shared.on_loaded(task.instance, task.version)  # its engine holds the version
        self._settle(group)

    def on_rollout_done(self, task: RolloutTask) -> None:
        """A group's rollout task ended: the group is rolled out, unless responses of it moved or may be moving."""
        group = self.in_flight.get(task.group_id)
        if group is None or group.moves is None:
            self.on_rolled_out(task.group_id)
            return
        group.moves.task_done(ROLLOUT_TASK)
        self._settle(group)

    def _settle(self, group) -> None:
        """Free the rows of the responses that ended since; the group is rolled out once all have."""
        ended = group.moves.ended()
        for sample in sorted(ended - group.reported):
            if group.group_id in self.orchestrator.unfinished:
                self.orchestrator.on_request_done(group.group_id, sample)
        group.reported |= ended
        if group.moves.complete:
            self.on_rolled_out(group.group_id)

    def _take_back(self, group) -> None:
        """A hand-over that moved nothing: the orchestrator takes the group back to the instance still holding its
        responses when that one still serves its version (else it counts its rows where it sent them)."""
        orch, gid = self.orchestrator, group.group_id
        holders = group.moves.instances_of_unended()
        if gid not in orch.running or len(holders) != 1:
            return
        (here,) = holders
        counted = orch.running[gid][1]
        inst = orch.instances.get(here)
        if (here != counted and inst is not None and inst.version == group.version and counted in orch.instances
                and orch.free_rows(inst) >= orch.rows_of(gid)):
            orch.migrate(gid, orch.instances[counted], inst)

    def restart_group(self, gid: int, why: str) -> None:
        """Give up a group's attempt (its futures are cancelled) and queue it to start again on its version."""
        lost = self.in_flight.pop(gid)
        log.warning("group %d restarts on version %d: %s", gid, lost.version, why)
        if gid in self.orchestrator.running:
            self.orchestrator.on_group_done(gid)
        self.orchestrator.requeue(gid, lost.version)
        self.untrack(lost.futures)
        self.client.cancel(lost.futures)
