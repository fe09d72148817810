"""Streamed updates on Dask (`dora.stream_updates`): the trainer computes an update's batch while its stragglers run.

The version gate (`VersionGate(stream=True)`) may hand a batch over while some of its stragglers (groups of version
u - K, which it must take) are still running. The driver then submits the update in parts, chained so that they run
in order on the trainer's one TRAINER slot:

    batch(complete groups) ─► gate ─► update_part ─► ... ─► update_part(stragglers) ─► finish_update (publish u+1)

Stragglers go to the trainer together once it has finished the part before (a part costs at least its longest
sequence, so one part per straggler would queue those costs); `finish_update` follows the part that holds the last.
Until then no later batch is handed over (its first part would only wait for this update's version).
A lost trainer sends the whole decision again (`recover_trainer` -> `submit_update`): its parts start over from the
groups complete by then. Every train engine computes parts (`TrainEngine.accumulate`, `finish_update`).
"""
from __future__ import annotations

from dora_tasks import steps
from pipelines.cluster import TRAINER
from pipelines.events import UpdatePartTask, UpdateSubmitted, UpdateTask
from pipelines.gate import BatchDecision
from pipelines.in_flight import QueuedUpdate


class StreamedUpdates:
    """The `Driver`'s streamed updates (a mixin: it works on the driver's complete groups, queued updates and
    client)."""

    def submit_streamed_update(self, decision: BatchDecision) -> None:
        ready = [g for g in decision.group_ids if g in self.complete]
        queued = QueuedUpdate(decision, self.clock.now(), None, None, None,
                              waiting={g for g in decision.group_ids if g not in self.complete})
        self.updates.append(queued)
        self.emit(UpdateSubmitted(decision.update, tuple(decision.group_ids), self.clock.now()))
        self._submit_part(queued, ready, stragglers=False)

    def stream_in_scored(self) -> None:
        """Send the stragglers scored so far to the updates that wait for them, once their trainer finished the part
        before (called once a turn, after every future it took in: stragglers scored in one turn go as one part)."""
        for queued in list(self.updates):
            arrived = sorted(g for g in queued.waiting if g in self.complete)
            computing = queued.parts and not queued.parts[-1].done()
            if arrived and not computing and self._queued(queued):
                queued.waiting.difference_update(arrived)
                self._submit_part(queued, arrived, stragglers=True)

    def _queued(self, queued: QueuedUpdate) -> bool:
        """Still the driver's: a trainer recovery replaces every queued update by a new one, sent again."""
        return any(q is queued for q in self.updates)

    def _submit_part(self, queued: QueuedUpdate, group_ids: list[int], stragglers: bool) -> None:
        u, c = queued.decision.update, self.cfg
        batch = self.send_to_trainer([self.complete[g] for g in group_ids])
        if not self._queued(queued):
            return  # the trainer was lost on the way and recovered: the update went again, these groups with it
        key = (u, len(queued.parts) // 3, *self.restart_suffix())
        checked = self.client.submit(steps.gate, u, c.dora.max_staleness, c.rollout.group_size,
                                     c.rollout.partial_rollout, batch, key=self.task_key("gate-part", *key),
                                     workers=[self.trainer], pure=False)
        before = queued.parts[-1] if queued.parts else None
        part = self.client.submit(steps.update_part, checked, before, stragglers, key=self.task_key("update-part", *key),
                                  resources=TRAINER, pure=False)
        queued.parts += [batch, checked, part]
        self.track(part, UpdatePartTask(u, key[1]))
        if not queued.waiting:
            queued.updated = self.client.submit(steps.finish_update, part, self.weights.root,
                                                key=self.task_key("update", u, *self.restart_suffix()),
                                                resources=TRAINER, pure=False)
            self.track(queued.updated, UpdateTask(u))

    def streaming(self) -> bool:
        """An update handed over still waits for stragglers."""
        return any(q.waiting for q in self.updates)
