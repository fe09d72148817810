"""The version gate: a pure, deterministic state machine that enforces bounded staleness (C3) for any K.

Events in, decisions out, no I/O (in the manner of dask/distributed's worker state machine); the Dask `gate` task is a
thin shell that re-checks the decision it is handed.

Rules, with `u` the next update (it starts from policy version `u` and publishes `u + 1`) and `TBS` counted in groups:

* Dispatch capacity (AReaL's rule): ``dispatched <= (newest + K + 1) * TBS``. It bounds the groups of version
  ``<= u - K`` that are still unconsumed at update `u` by ``(u + 1) * TBS - u * TBS = TBS``, so update `u` can always
  take all of them: nothing is ever left behind the window (C2 and C3 together).
* Update `u` may start only when every unconsumed group of version ``<= u - K`` is complete; it takes all of those
  stragglers first, then fills up to TBS with the oldest complete groups (ordered by version, then group id).
* A group of version `v` must be consumed by update ``v + K`` at the latest (its deadline). Filling a batch with newer
  complete groups while older ones are still running can leave more old groups than later updates can take, so an
  update also waits while its batch would break the schedule's feasibility:
  ``unconsumed(version <= x) <= (x + K - u) * TBS`` after the batch, for every version `x`. Oldest-first is the
  earliest-deadline-first choice, so when it is infeasible every choice is; once the old groups complete it is
  feasible again, because the capacity rule keeps ``unconsumed(version <= x) <= (x + K + 1 - u) * TBS``.
* Every update consumes exactly TBS groups, so a run of N updates trains on exactly ``N * TBS`` dispatched groups.

With K = 0 this is synchronous on-policy RL: TBS groups are dispatched on version `u`, all must finish, all are
consumed by update `u`, and nothing newer can be dispatched before version `u + 1` exists.

Simplification: the trainer runs one update at a time (update `u + 1` needs the weights of `u + 1`), so the gate
never has two decisions outstanding.
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
    running: BatchDecision | None = None
    unconsumed: dict[int, int] = field(default_factory=dict)  # group_id -> version, dispatched and not yet consumed
    complete: set[int] = field(default_factory=set)  # subset of unconsumed whose rollout, reward and advantage finished
    consumed: dict[int, int] = field(default_factory=dict)  # group_id -> update that trained on it

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
        """The next batch if update `next_update` may start now, else None."""
        if self.running is not None:
            return None
        u, floor = self.next_update, self.next_update - self.max_staleness
        stragglers = sorted(g for g, v in self.unconsumed.items() if v <= floor)
        if any(g not in self.complete for g in stragglers):
            return None
        if len(self.complete) < self.train_batch_size:
            return None
        others = sorted((g for g in self.complete if self.unconsumed[g] > floor), key=lambda g: (self.unconsumed[g], g))
        chosen = stragglers + others[: self.train_batch_size - len(stragglers)]
        if not self._feasible_after(set(chosen)):
            return None
        decision = BatchDecision(u, tuple(chosen), tuple(self.unconsumed[g] for g in chosen))
        self.running = decision
        return decision

    def _feasible_after(self, chosen: set[int]) -> bool:
        """Can updates u+1, u+2, ... still consume every remaining group before its deadline?"""
        left = sorted(v for g, v in self.unconsumed.items() if g not in chosen)
        after = self.next_update + 1
        return all(count <= (v + self.max_staleness - after + 1) * self.train_batch_size
                   for count, v in enumerate(left, start=1))

    def on_update_done(self, update: int) -> None:
        if self.running is None or self.running.update != update:
            raise GateInvariantError(f"update {update} finished but the running update is {self.running}")
        for g in self.running.group_ids:
            del self.unconsumed[g]
            self.complete.discard(g)
            self.consumed[g] = update
        self.running = None
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
        if self.running is not None:
            check(len(self.running.group_ids) == tbs, "a batch is not TBS groups")
            check(self.running.max_staleness <= K, "a batch exceeds the staleness bound")
            check(set(self.running.group_ids) <= self.complete, "a batch holds an incomplete group")

    def to_state(self) -> dict:
        return {
            "max_staleness": self.max_staleness, "train_batch_size": self.train_batch_size, "newest": self.newest,
            "next_update": self.next_update, "dispatched_total": self.dispatched_total,
            "unconsumed": {str(g): v for g, v in self.unconsumed.items()}, "complete": sorted(self.complete),
            "consumed": {str(g): u for g, u in self.consumed.items()},
        }

    @classmethod
    def from_state(cls, state: dict) -> "VersionGate":
        gate = cls(state["max_staleness"], state["train_batch_size"], state["newest"], state["next_update"],
                   state["dispatched_total"])
        gate.unconsumed = {int(g): v for g, v in state["unconsumed"].items()}
        gate.complete = set(state["complete"])
        gate.consumed = {int(g): u for g, u in state["consumed"].items()}
        return gate
