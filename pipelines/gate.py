"""The version gate: a pure, deterministic state machine that enforces bounded staleness (C3) for any K.

Events in, decisions out, no I/O (in the manner of dask/distributed's worker state machine); the Dask `gate` task is a
thin shell that re-checks the decision it is handed.

Rules, with `u` the next update (it starts from policy version `u` and publishes `u + 1`) and `TBS` counted in groups:

* Dispatch capacity (AReaL's rule): ``dispatched <= (newest + K + 1) * TBS``. It bounds the groups of version
  ``<= u - K`` that are still unconsumed at update `u` by ``(u + 1) * TBS - u * TBS = TBS``, so update `u` can always
  take all of them: nothing is ever left behind the window (C2 and C3 together).
* Update `u` may start only when every unconsumed group of version ``<= u - K`` is complete; it takes all of those
  stragglers first, then fills up to TBS by ``order``:
  - ``"completion"`` (default, streaming): the oldest *complete* groups, so an update starts as soon as TBS groups
    are complete and short groups stream in ahead of long ones dispatched before them (batches lean towards short
    answers until the window forces the long ones in);
  - ``"dispatch"``: the oldest unconsumed groups (by version, then group id, i.e. dispatch order), waiting until
    they are complete. Every batch holds the groups a synchronous run would have trained in that position, so its
    mix of response lengths is the workload's, not the fast ones'; the price is throughput, since an update waits
    for the slowest of its oldest groups (figures: docs/benchmark.md).
* A group of version `v` must be consumed by update ``v + K`` at the latest (its deadline). Filling a batch with newer
  complete groups while older ones are still running can leave more old groups than later updates can take, so an
  update also waits while its batch would break the schedule's feasibility:
  ``unconsumed(version <= x) <= (x + K - u) * TBS`` after the batch, for every version `x`. Oldest-first is the
  earliest-deadline-first choice, so when it is infeasible every choice is; once the old groups complete it is
  feasible again, because the capacity rule keeps ``unconsumed(version <= x) <= (x + K + 1 - u) * TBS``.
* Every update consumes exactly TBS groups, so a run of N updates trains on exactly ``N * TBS`` dispatched groups.

With K = 0 this is synchronous on-policy RL: TBS groups are dispatched on version `u`, all must finish, all are
consumed by update `u`, and nothing newer can be dispatched before version `u + 1` exists.

* Lookahead (``lookahead``, default 0): up to ``lookahead`` further batches may be decided while earlier ones are
  still training, so the trainer starts update ``u + 1`` the moment update ``u`` ends instead of after a round trip
  through the driver. The batch of update ``u + 1`` is chosen by the same rules with ``u + 1`` in place of ``u``,
  from the groups not already handed to an earlier decision. It is valid before version ``u + 1`` exists because
  update ``u``'s batch took every group of version ``<= u - K``, and new groups are dispatched on version
  ``newest >= u + 1 - K`` when K >= 1. With K = 0 no batch can be decided early: its groups (version ``u + 1``)
  cannot exist before ``u + 1`` is published.

* Streamed updates (``stream``, default off): a batch may be handed over while some of its stragglers (the groups of
  version ``u - K``, which it must take) are still running; `BatchDecision.pending` names them. The update trains
  what is complete and takes each straggler as it completes (gradients accumulate over the batch; the optimizer
  steps once, after the last), so the trainer computes while it waits for the longest responses instead of idling.
  The batch is chosen by the same rules; only the stragglers' completion is no longer waited for before the hand-over,
  and `on_update_done` refuses an update whose groups did not all complete (C2).

Simplification: updates run one at a time, in order (update `u + 1` trains the weights that update `u` produced).
"""
from __future__ import annotations

from dataclasses import dataclass, field


class GateInvariantError(AssertionError):
    """The gate's state broke one of its invariants (a bug, or events fed out of order)."""


@dataclass(frozen=True)
class BatchDecision:
    update: int
    group_ids: tuple[int, ...]
    versions: tuple[int, ...]
    pending: tuple[int, ...] = ()  # stragglers still running when it was handed over (streamed updates only)

    @property
    def max_staleness(self) -> int:
        return max(self.update - v for v in self.versions)


@dataclass
class VersionGate:
    max_staleness: int
    train_batch_size: int
    newest: int = 0  # newest published policy version
    next_update: int = 0
    dispatched_total: int = 0
    decided: list[BatchDecision] = field(default_factory=list)  # handed over, not yet done (oldest first)
    unconsumed: dict[int, int] = field(default_factory=dict)  # group_id -> version, dispatched and not yet consumed
    complete: set[int] = field(default_factory=set)  # subset of unconsumed whose rollout, reward and advantage finished
    consumed: dict[int, int] = field(default_factory=dict)  # group_id -> update that trained on it
    lookahead: int = 0  # batches that may be decided beyond the one training now
    order: str = "completion"  # how a batch is filled beyond its stragglers: "completion" or "dispatch" (see above)
    stream: bool = False  # hand a batch over before its stragglers complete (streamed updates, see above)

    @property
    def running(self) -> BatchDecision | None:
        """The oldest decided batch that has not finished training."""
        return self.decided[0] if self.decided else None

    # ---- dispatch side -------------------------------------------------------------------------------------------
    def capacity(self) -> int:
        """How many more groups may be dispatched now."""
        limit = (self.newest + self.max_staleness + 1) * self.train_batch_size
        return max(0, limit - self.dispatched_total)

    def on_dispatch(self, group_id: int, version: int) -> None:
        if group_id in self.unconsumed or group_id in self.consumed:
            raise GateInvariantError(f"group {group_id} dispatched twice")
        if version != self.newest:
            raise GateInvariantError(f"group {group_id} dispatched on version {version}, newest is {self.newest}")
        if self.capacity() <= 0:
            raise GateInvariantError(f"group {group_id} dispatched beyond capacity")
        self.unconsumed[group_id] = version
        self.dispatched_total += 1

    def on_complete(self, group_id: int) -> None:
        if group_id not in self.unconsumed:
            raise GateInvariantError(f"group {group_id} completed but is not in flight")
        self.complete.add(group_id)

    # ---- update side ---------------------------------------------------------------------------------------------
    def decide(self) -> BatchDecision | None:
        """The batch of the next undecided update if it may be handed over now, else None."""
        if len(self.decided) > self.lookahead:
            return None
        u = self.next_update + len(self.decided)
        floor = u - self.max_staleness
        taken = {g for d in self.decided for g in d.group_ids}
        pool = {g: v for g, v in self.unconsumed.items() if g not in taken}
        if any(v < floor for v in pool.values()):
            raise GateInvariantError(f"update {u}: a group older than version {floor} was left behind")
        stragglers = sorted(g for g, v in pool.items() if v == floor)
        pending = tuple(g for g in stragglers if g not in self.complete)
        if pending and not self.stream:
            return None
        if self.order == "dispatch":
            ready = sorted(pool, key=lambda g: (pool[g], g))[: self.train_batch_size]  # stragglers come first
            if any(g not in self.complete and pool[g] > floor for g in ready):
                return None
        else:
            ready = [g for g in pool if g in self.complete or pool[g] == floor]
        if len(ready) < self.train_batch_size:
            return None
        others = sorted((g for g in ready if pool[g] > floor), key=lambda g: (pool[g], g))
        chosen = stragglers + others[: self.train_batch_size - len(stragglers)]
        if not self._feasible_after(taken | set(chosen), u + 1):
            return None
        decision = BatchDecision(u, tuple(chosen), tuple(pool[g] for g in chosen), pending)
        self.decided.append(decision)
        return decision

    def _feasible_after(self, chosen: set[int], after: int) -> bool:
        """Can updates `after`, `after + 1`, ... still consume every remaining group before its deadline?"""
        left = sorted(v for g, v in self.unconsumed.items() if g not in chosen)
        return all(count <= (v + self.max_staleness - after + 1) * self.train_batch_size
                   for count, v in enumerate(left, start=1))

    def on_update_done(self, update: int) -> None:
        if self.running is None or self.running.update != update:
            raise GateInvariantError(f"update {update} finished but the running update is {self.running}")
        missing = [g for g in self.running.group_ids if g not in self.complete]
        if missing:
            raise GateInvariantError(f"update {update} finished before its groups {missing[:5]} completed")
        done = self.decided.pop(0)
        for g in done.group_ids:
            del self.unconsumed[g]
            self.complete.discard(g)
            self.consumed[g] = update
        self.next_update = update + 1
        self.newest = update + 1

    # ---- checks and persistence ----------------------------------------------------------------------------------
    def validate(self) -> None:
        K, tbs = self.max_staleness, self.train_batch_size

        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise GateInvariantError(msg)

        check(self.newest == self.next_update, f"newest {self.newest} != next update {self.next_update}")
        check(self.complete <= set(self.unconsumed), "a complete group is not unconsumed")
        check(not (set(self.unconsumed) & set(self.consumed)), "a group is both consumed and unconsumed")
        check(self.dispatched_total == len(self.unconsumed) + len(self.consumed), "dispatch count drifted")
        check(self.dispatched_total <= (self.newest + K + 1) * tbs, "capacity rule broken")
        check(len(self.consumed) == self.next_update * tbs, "an update consumed other than TBS groups")
        check(all(v >= self.next_update - K for v in self.unconsumed.values()),
              "an unconsumed group fell out of the window")
        left = sorted(self.unconsumed.values())
        for count, v in enumerate(left, start=1):
            check(count <= (v + K - self.next_update + 1) * tbs,
                  f"{count} unconsumed groups of version <= {v} cannot all be trained within the window")
        check(all(v <= self.newest for v in self.unconsumed.values()), "a group has a version from the future")
        check(len(self.decided) <= self.lookahead + 1, "more batches decided than the lookahead allows")
        taken: set[int] = set()
        for i, batch in enumerate(self.decided):
            check(batch.update == self.next_update + i, f"decided batches out of order: {batch.update}")
            check(len(batch.group_ids) == tbs, "a batch is not TBS groups")
            check(batch.max_staleness <= K and min(batch.update - v for v in batch.versions) >= 0,
                  "a batch exceeds the staleness bound")
            running = [g for g in batch.group_ids if g not in self.complete]
            check(all(self.unconsumed[g] == batch.update - K for g in running) and (self.stream or not running),
                  "a batch holds an incomplete group that is not a straggler it may stream in")
            check(not (taken & set(batch.group_ids)), "a group is in two decided batches")
            taken |= set(batch.group_ids)

    def to_state(self) -> dict:
        return {
            "max_staleness": self.max_staleness, "train_batch_size": self.train_batch_size, "newest": self.newest,
            "next_update": self.next_update, "dispatched_total": self.dispatched_total,
            "unconsumed": {str(g): v for g, v in self.unconsumed.items()}, "complete": sorted(self.complete),
            "consumed": {str(g): u for g, u in self.consumed.items()},
        }

    @classmethod
    def from_state(cls, state: dict, lookahead: int = 0, order: str = "completion",
                   stream: bool = False) -> "VersionGate":
        """A gate at a checkpoint (decided batches that had not finished training are decided again)."""
        gate = cls(state["max_staleness"], state["train_batch_size"], state["newest"], state["next_update"],
                   state["dispatched_total"], lookahead=lookahead, order=order, stream=stream)
        gate.unconsumed = {int(g): v for g, v in state["unconsumed"].items()}
        gate.complete = set(state["complete"])
        gate.consumed = {int(g): u for g, u in state["consumed"].items()}
        return gate
