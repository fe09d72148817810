"""What the driver does when the trainer dies, at any moment: training, publishing, checkpointing or idle.

The driver notices it two ways: the trainer worker leaves the cluster (`Driver.sync_instances`), or a trainer task
fails with `TrainerLost` (a restarted trainer worker holds no engine and builds none on its own) or Dask's
`KilledWorker`. Either way `recover_trainer` brings a restarted worker back to the newest version the driver took in.
"""
from __future__ import annotations

import logging

from distributed.client import FutureCancelledError
from distributed.scheduler import KilledWorker

from dora_tasks import steps
from dora_tasks.core.records import TrainerRestore
from dora_tasks.plugins import TrainerLost
from pipelines.cluster import TRAINER, wait_for_workers, worker_wait_s
from pipelines.events import TrainerRestored

log = logging.getLogger("dora")
# What a trainer task raises when the trainer's process died under it; cancelled: the batch scattered to the trainer
# died with it, and the scheduler forgot the update that needed it.
TRAINER_LOSS = (TrainerLost, KilledWorker, FutureCancelledError)
MAX_TRAINER_RESTARTS = 3  # restarts in a row without a publish between them before the run stops
RESTORE_TIMEOUT_S = 600.0  # a new engine on a restarted trainer (DeepSpeed's first start compiles for a minute)


def loss_reason(exc: BaseException) -> str:
    """The exception's type, with the scheduler's reason for a cancellation (e.g. "already forgotten": an input the
    update needed, such as its scattered batch, was dropped)."""
    reason = getattr(exc, "reason", None)
    return f"{type(exc).__name__} ({reason})" if reason else type(exc).__name__


def removals(client, address: str | None) -> str:
    """The scheduler's own record of why it removed the trainer's worker (its stimulus, e.g. a missed heartbeat or
    a closed stream), or "" where it has none: tells a trainer that died from one the scheduler gave up on."""
    if not address:
        return ""
    try:
        events = client.get_events(address)
    except (OSError, TimeoutError, KeyError):
        return ""
    removed = [e for _, e in events if isinstance(e, dict) and e.get("action") == "remove-worker"]
    return "; ".join(f"scheduler removed it ({e.get('stimulus_id', '?')}, expected={e.get('expected')})"
                     for e in removed[-2:])


class TrainerError(RuntimeError):
    """The trainer cannot be brought back; the run folder can be resumed with `dora resume`."""


class TrainerRecovery:
    """The `Driver`'s trainer recovery (a mixin: it works on the driver's queued updates, weights and counters)."""

    def recover_trainer(self, why: str) -> TrainerRestore:
        """The trainer died (at any moment: training, publishing, checkpointing, idle). A restarted trainer worker
        gets a new engine on the newest version the driver took in, with the optimizer state of the last checkpoint
        (a fresh one without), and the batches handed to the lost trainer go to it again, in order. A version the
        lost trainer published but the driver never took in is deleted: it is published again, once."""
        removed = removals(self.client, self.trainer)
        log.warning("trainer lost (%s%s); restoring it at version %d", why, f"; {removed}" if removed else "",
                    self.gate.newest)
        queued = list(self.updates)
        self.updates.clear()
        lost = [f for q in queued for f in q.futures()]
        self.untrack(lost)
        self.client.cancel(lost)
        self.retain_weights(drop_unseen=True)
        checkpoint = self.checkpoints.latest() if self.checkpoints is not None else None
        folder = checkpoint.file("trainer") if checkpoint is not None else None
        restored = None
        while restored is None:  # the new trainer may die too, before it is restored
            self.count_trainer_restart(why)
            self.wait_for_trainer()
            try:
                restored = self.client.submit(steps.restore_trainer, self.gate.newest, folder, resources=TRAINER,
                                              key=self.task_key("restore-trainer", self.counters["trainer_restarts"]),
                                              pure=False).result(timeout=RESTORE_TIMEOUT_S)
            except TRAINER_LOSS as exc:
                why = f"lost again while restored: {type(exc).__name__}"
            except TimeoutError:
                raise TrainerError(f"the trainer was lost ({why}) and not restored within {RESTORE_TIMEOUT_S:.0f} s; "
                                   f"continue the run with `dora resume {self.cfg.storage.run_dir}`") from None
        self.trainer = restored.worker
        for q in queued:
            self.submit_update(q.decision)
        self.emit(TrainerRestored(why, restored.version, restored.optimizer_from, folder or ""))
        return restored

    def count_trainer_restart(self, why: str) -> None:
        c = self.counters
        c["trainer_restarts"] += 1
        c["restarts_in_a_row"] += 1
        if c["restarts_in_a_row"] > MAX_TRAINER_RESTARTS:
            raise TrainerError(f"the trainer was lost {c['restarts_in_a_row']} times without publishing a version "
                               f"in between (last: {why}); continue the run with `dora resume "
                               f"{self.cfg.storage.run_dir}` once the trainer worker is healthy")

    def wait_for_trainer(self) -> None:
        """Wait for a connected trainer worker (its Nanny restarts it within seconds)."""
        wait_for_workers(self.client, worker_wait_s(self.cfg.cluster), ("trainer",),
                         f"the trainer was lost: start one and continue with `dora resume {self.cfg.storage.run_dir}`")
