"""The rollout orchestrator (DORA's Algorithm 1): a pure, deterministic state machine over rollout instances.

Each rollout instance serves one policy version at a time and runs up to `slots` groups at once (its engine batches
them). The orchestrator decides, from events (instances joining and leaving, versions published, groups finishing):

* **new prompts start on the newest version**: a new group is created only for a free slot of an instance that holds
  the newest version, so it never waits in a queue long enough to start on an older one;
* **in-flight groups finish on their own version**: an instance holding an older version takes no new work and
  switches to a newer one only when its last group has finished (no weight swap under a running group, C1);
* **instances follow remaining work**: a free instance goes to the live version with the largest shortfall between
  its proportional share ``N * work_v / sum(work)`` and the instances it already has, where ``work_v`` counts the
  running and queued groups of version v (queued work of an older version appears when its instance died: the group
  restarts from scratch on its own version); ties go to the newest version;
* **RBS groups in flight**: new groups are created only while fewer than RBS are in flight, within the capacity the
  version gate grants, and within the run's budget of groups.

`decide` returns its decisions: `Start` (a group on an instance) and `Load` (an instance assigned a version; the
rollout server loads it when the first group of that version reaches it). The driver acts on the first and reports
both to its observers.

Free slots are filled instance by instance (in address order), so one publish's new groups pack one engine's batch:
where engines share cores, spreading them over the least busy instances makes two engines contend for the cores
with half-full batches. With an engine per device, spreading is the better choice (pick the least busy instance in
`decide`).

Queued switching (``rollout.queue_while_draining``, off by default): an instance draining an older version, with no
restarted work of that version waiting, is retargeted to the newest version at once, so new groups queue on it and
start the moment its older groups end, without a round trip to the driver (the rollout server still swaps weights
only once the older groups have ended: C1 holds). An instance then holds groups of at most two versions. It removes
the idle gap of each version switch, but groups end more spread out, so more scoring tasks run: off by default
because that orchestration competes with generation where they share cores, the better setting where engines have
their own devices (figures: docs/benchmark.md).

Simplified from the paper: requests are not migrated between instances of the same version (a group is one Dask
task; moving it would restart it). Without queued switching an instance draining an old version therefore idles its
free slots until its last group finishes, which shows up in the rollout bubble.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class OrchestratorInvariantError(AssertionError):
    """The orchestrator's state broke an invariant."""


@dataclass
class Instance:
    address: str
    slots: int
    version: int | None = None  # version currently loaded; None before the first load
    running: set[int] = field(default_factory=set)

    @property
    def free(self) -> int:
        return self.slots - len(self.running)


@dataclass(frozen=True)
class Load:
    """Load `version` on `instance` (it is idle)."""

    instance: str
    version: int


@dataclass(frozen=True)
class Start:
    """Start group `group_id` on `instance` with `version`; `new` says whether it is a newly dispatched prompt."""

    instance: str
    group_id: int
    version: int
    new: bool


@dataclass
class Orchestrator:
    rollout_batch_size: int
    group_budget: int  # total groups the run will dispatch (num_updates * TBS)
    queue_while_draining: bool = False  # retarget a draining instance to the newest version at once (see above)
    newest: int = 0
    next_group_id: int = 0
    instances: dict[str, Instance] = field(default_factory=dict)
    running: dict[int, tuple[int, str]] = field(default_factory=dict)  # group_id -> (version, instance)
    queued: dict[int, deque] = field(default_factory=dict)  # version -> group ids waiting to (re)start on it

    # ---- events --------------------------------------------------------------------------------------------------
    def add_instance(self, address: str, slots: int) -> None:
        self.instances.setdefault(address, Instance(address, slots))

    def remove_instance(self, address: str) -> list[int]:
        """Forget an instance that died; its groups are queued to restart on their own version."""
        inst = self.instances.pop(address, None)
        if inst is None:
            return []
        lost = sorted(inst.running)
        for g in lost:
            version, _ = self.running.pop(g)
            self.queued.setdefault(version, deque()).append(g)
        return lost

    def on_publish(self, version: int) -> None:
        self.newest = max(self.newest, version)

    def on_group_done(self, group_id: int) -> None:
        version, address = self.running.pop(group_id)
        inst = self.instances.get(address)
        if inst is not None:
            inst.running.discard(group_id)

    def requeue(self, group_id: int, version: int) -> None:
        """Queue a known group to (re)start on `version` (used after a resume for groups whose rollout was lost)."""
        self.queued.setdefault(version, deque()).append(group_id)

    # ---- decisions -----------------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self.running) + sum(len(q) for q in self.queued.values())

    def live_versions(self) -> list[int]:
        return sorted({v for v, _ in self.running.values()} | {i.version for i in self.instances.values()
                                                                 if i.version is not None and i.running})

    def decide(self, capacity: int) -> list[Load | Start]:
        """Actions for now. `capacity` is how many new groups the version gate allows to be dispatched."""
        actions: list[Load | Start] = []
        for inst in sorted(self.instances.values(), key=lambda i: i.address):
            if self._may_queue_behind(inst, capacity):
                inst.version = self.newest
                actions.append(Load(inst.address, self.newest))
            if not inst.running:
                target = self._target_version(inst, capacity)
                if target != inst.version:
                    inst.version = target
                    actions.append(Load(inst.address, target))
            while inst.free > 0:
                start = self._next_start(inst, capacity)
                if start is None:
                    break
                capacity -= start.new
                actions.append(start)
        return actions

    def _may_queue_behind(self, inst: Instance, capacity: int) -> bool:
        """Queued switching: `inst` holds groups of one older version only (and no restart waits for its version),
        and would move to the newest next anyway."""
        if not (self.queue_while_draining and inst.running and inst.version != self.newest):
            return False
        if self.queued.get(inst.version) or len({self.running[g][0] for g in inst.running}) > 1:
            return False  # restarts of its version wait for it, or it already holds two versions
        return self._target_version(inst, capacity) == self.newest

    def _next_start(self, inst: Instance, capacity: int) -> Start | None:
        queue = self.queued.get(inst.version)
        if queue:
            group_id = queue.popleft()
            new = False
        elif inst.version == self.newest and self._may_create(capacity):
            group_id, new = self.next_group_id, True
            self.next_group_id += 1
        else:
            return None
        inst.running.add(group_id)
        self.running[group_id] = (inst.version, inst.address)
        return Start(inst.address, group_id, inst.version, new)

    def _creatable(self, capacity: int) -> int:
        return max(0, min(capacity, self.rollout_batch_size - self.in_flight, self.group_budget - self.next_group_id))

    def _may_create(self, capacity: int) -> bool:
        return self._creatable(capacity) > 0

    def _target_version(self, inst: Instance, capacity: int) -> int:
        """Proportional share: the live version whose work most exceeds the instances serving it."""
        work: dict[int, int] = {self.newest: 0}
        for v, _ in self.running.values():
            work[v] = work.get(v, 0) + 1
        for v, q in self.queued.items():
            if q:
                work[v] = work.get(v, 0) + len(q)
        work[self.newest] += self._creatable(capacity)  # new prompts it could start now
        total = sum(work.values()) or 1
        serving = {v: 0 for v in work}
        for other in self.instances.values():
            if other is not inst and other.version in serving:
                serving[other.version] += 1
        n = len(self.instances)
        candidates = [v for v in work if work[v] > 0 and (v == self.newest or self.queued.get(v))]
        if not candidates:
            return self.newest
        return max(candidates, key=lambda v: (n * work[v] / total - serving[v], v))

    # ---- checks and persistence ----------------------------------------------------------------------------------
    def validate(self) -> None:
        def check(cond: bool, msg: str) -> None:
            if not cond:
                raise OrchestratorInvariantError(msg)

        for inst in self.instances.values():
            check(0 <= inst.free <= inst.slots, f"{inst.address} runs more groups than it has slots")
            versions = set()
            for g in inst.running:
                version, address = self.running.get(g, (None, None))
                check(address == inst.address and version is not None and version <= inst.version,
                      f"group {g} on {inst.address} does not run on the instance's version {inst.version} or older")
                versions.add(version)
            older = versions - {inst.version}
            check(not older or (self.queue_while_draining and len(older) == 1),
                  f"{inst.address} holds groups of versions {sorted(versions)} (version {inst.version})")
        owned = {g for i in self.instances.values() for g in i.running}
        check(owned == set(self.running), "running groups and instance slots disagree")
        queued = [g for q in self.queued.values() for g in q]
        check(len(queued) == len(set(queued)) and not (set(queued) & owned), "a group is queued twice or also running")
        check(self.next_group_id <= self.group_budget, "more groups created than the budget")
        check(all(v <= self.newest for v, _ in self.running.values()), "a group runs on an unpublished version")

    def to_state(self) -> dict:
        return {"rollout_batch_size": self.rollout_batch_size, "group_budget": self.group_budget,
                "newest": self.newest, "next_group_id": self.next_group_id}
