"""The rollout orchestrator (DORA's Algorithm 1): a pure, deterministic state machine over rollout instances.

Each rollout instance serves one policy version at a time (with `rollout.versions_per_instance` = M > 1, up to M
versions, one LoRA adapter each, its rows shared between them: `pipelines.switching.Concurrent`) and runs up to
`slots` groups at once (its engine batches them). The orchestrator decides, from events (instances joining and
leaving, versions published, groups finishing):

* **new prompts start on the newest version**: a new group is created only for a free slot of an instance that holds
  the newest version, so it never waits in a queue long enough to start on an older one;
* **in-flight groups finish on their own version**: an instance holding an older version takes no new work and
  switches to a newer one only when its last group has finished (no weight swap under a running group, C1); with
  M > 1 it takes the newest version beside its older groups while that makes at most M versions, and a group still
  runs on one version on one instance from start to end;
* **instances follow remaining work**: a free instance goes to the live version with the largest shortfall between
  its proportional share ``N * work_v / sum(work)`` and the instances it already has, where ``work_v`` counts the
  running and queued groups of version v (queued work of an older version appears when its instance died: the group
  restarts from scratch on its own version); ties go to the newest version;
* **RBS groups in flight**: new groups are created only while fewer than RBS are in flight, within the capacity the
  version gate grants, and within the run's budget of groups.

`decide` returns its decisions: `Start` (a group on an instance), `Load` (an instance assigned a version, from a peer
that holds it when there is one; the rollout server loads it when the first group of that version reaches it) and
`Migrate` (a group's unfinished requests handed to another instance of their version). The driver acts on `Start`
and `Migrate` (`pipelines.migration`) and reports all to its observers.

Free rows are filled instance by instance (in address order), so one publish's new groups pack one engine's batch:
where engines share cores, spreading them over the least busy instances makes two engines contend for the cores
with half-full batches. With an engine per device, spreading is the better choice (pick the least busy instance in
`decide`). `Concurrent` (M > 1) fills the least busy instance first: an instance still running older requests would
otherwise queue the newest version's groups behind its full batch while another idles.

Units: a group is dispatched whole (its G requests start together on one instance), but an instance's capacity is
counted in requests (rows: `slots * group_size`), and engines that report requests ending (`on_request_done`) and
their KV use (`on_progress`) free rows and budget request by request. How instances leave an older version is a
switching strategy (`pipelines.switching`: drain, queue or migrate); a migration moves all of a group's unfinished
requests from one instance to another of the same version.

An instance runs at most `slots` groups at once however many of their rows have ended (on Dask each group started
there holds one of its worker's ROLLOUT slots until it ends or is handed over; a group moved there counts too).

Simplified from the paper: the Dask driver learns request ends and KV use as the rollout servers report them at
their chunk boundaries (KV use only where requests migrate, and a KV budget only for the emulated engine, whose cost
model gives it: elsewhere KV is never the limit); the simulator (`pipelines.simulator`) reports both at once.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from pipelines.switching import Drain, Switching


class OrchestratorInvariantError(AssertionError):
    """The orchestrator's state broke an invariant."""


@dataclass
class Instance:
    address: str
    slots: int  # groups it runs at once (its rows: slots * group_size)
    version: int | None = None  # version its new groups start on (the newest it holds); None before the first load
    running: set[int] = field(default_factory=set)  # groups with unfinished requests here
    kv_budget: int = 0  # KV-cache tokens it holds (0: not reported, never a limit)
    batch_rows: int = 0  # requests its engine decodes at once, the rest queue in it (0: all its rows)


@dataclass(frozen=True)
class Load:
    """Load `version` on `instance` (it is idle), from the peer instance `source` that holds it ("": the store)."""

    instance: str
    version: int
    source: str = ""


@dataclass(frozen=True)
class Start:
    """Start group `group_id` on `instance` with `version`; `new` says whether it is a newly dispatched prompt."""

    instance: str
    group_id: int
    version: int
    new: bool


@dataclass(frozen=True)
class Migrate:
    """Hand the unfinished requests `samples` of group `group_id` (of `version`) from `source` to `target`, an
    instance serving the same version."""

    group_id: int
    samples: tuple[int, ...]
    version: int
    source: str
    target: str


@dataclass
class Orchestrator:
    rollout_batch_size: int
    group_budget: int  # total groups the run will dispatch (num_updates * TBS)
    switching: Switching = field(default_factory=Drain)
    group_size: int = 1  # requests of a group
    newest: int = 0
    next_group_id: int = 0
    instances: dict[str, Instance] = field(default_factory=dict)
    running: dict[int, tuple[int, str]] = field(default_factory=dict)  # group_id -> (version, instance)
    unfinished: dict[int, set[int]] = field(default_factory=dict)  # group_id -> its requests still running
    tokens: dict[int, int] = field(default_factory=dict)  # group_id -> KV tokens its unfinished requests hold
    queued: dict[int, deque] = field(default_factory=dict)  # version -> group ids waiting to (re)start on it
    # group_id -> the instance it was moved to, until it is there (`on_arrived`; at the latest when it ends): that
    # instance does not leave the group's version, nor is the group moved on, while its requests are on their way
    arriving: dict[int, str] = field(default_factory=dict)
    # running totals per instance address, kept with every change so that a decision need not sum over its groups
    rows_used: dict[str, int] = field(default_factory=dict)  # unfinished requests of its running groups
    kv_held: dict[str, int] = field(default_factory=dict)  # KV tokens (`tokens`) of its running groups
    # and per version: running groups and their unfinished requests (`relabel` rebuilds them)
    groups_of_version: Counter = field(default_factory=Counter)
    rows_of_version: Counter = field(default_factory=Counter)
    _versions_held: Counter | None = field(default=None, init=False, repr=False, compare=False)  # within `decide`

    # ---- events --------------------------------------------------------------------------------------------------
    def add_instance(self, address: str, slots: int, kv_budget: int = 0, batch_rows: int = 0) -> None:
        self.instances.setdefault(address, Instance(address, slots, kv_budget=kv_budget, batch_rows=batch_rows))
        self.rows_used.setdefault(address, 0)
        self.kv_held.setdefault(address, 0)

    def remove_instance(self, address: str) -> list[int]:
        """Forget an instance that died; its groups are queued to restart on their own version."""
        inst = self.instances.pop(address, None)
        if inst is None:
            return []
        lost = sorted(inst.running)
        for g in lost:
            version, _ = self._forget(g)
            self.queued.setdefault(version, deque()).append(g)
        del self.rows_used[address], self.kv_held[address]
        return lost

    def on_publish(self, version: int) -> None:
        self.newest = max(self.newest, version)

    def on_group_done(self, group_id: int) -> None:
        _, address = self._forget(group_id)
        inst = self.instances.get(address)
        if inst is not None:
            inst.running.discard(group_id)

    def on_request_done(self, group_id: int, sample: int) -> None:
        """One request of a running group ended: its row is free (the group stays until `on_group_done`)."""
        left = self.unfinished[group_id]
        if sample in left:
            left.discard(sample)
            version, address = self.running[group_id]
            self._count(address, rows=-1)
            self.rows_of_version[version] -= 1

    def on_progress(self, group_id: int, tokens: int) -> None:
        """The KV tokens a running group's unfinished requests hold now."""
        before = self.tokens.get(group_id, 0)
        self.tokens[group_id] = tokens
        if group_id in self.running:
            self._count(self.running[group_id][1], kv=tokens - before)

    def requeue(self, group_id: int, version: int) -> None:
        """Queue a known group to (re)start on `version` (used after a resume for groups whose rollout was lost)."""
        self.queued.setdefault(version, deque()).append(group_id)

    def on_arrived(self, group_id: int) -> None:
        """A moved group's requests are on the instance it was moved to."""
        self.arriving.pop(group_id, None)

    def _forget(self, group_id: int) -> tuple[int, str]:
        self.arriving.pop(group_id, None)
        rows = len(self.unfinished.pop(group_id, ()))
        tokens = self.tokens.pop(group_id, 0)
        version, address = self.running.pop(group_id)
        self._count(address, -rows, -tokens)
        self.groups_of_version[version] -= 1
        self.rows_of_version[version] -= rows
        return version, address

    def relabel(self, version: int) -> None:
        """Every instance and every running group is on `version` from now on (a baseline that re-prefills its
        running requests under each new version, as partial rollout does)."""
        for inst in self.instances.values():
            inst.version = version
        for group_id, (_, address) in list(self.running.items()):
            self.running[group_id] = (version, address)
        self._recount()

    def _recount(self) -> None:
        """Rebuild the per-version totals from `running`."""
        self.groups_of_version, self.rows_of_version = Counter(), Counter()
        for g, (v, _) in self.running.items():
            self.groups_of_version[v] += 1
            self.rows_of_version[v] += len(self.unfinished[g])

    def _count(self, address: str, rows: int = 0, kv: int = 0) -> None:
        """Add to an instance's running totals (`rows_used`, `kv_held`); an instance already removed has none."""
        if address in self.rows_used:
            self.rows_used[address] += rows
            self.kv_held[address] += kv

    # ---- what instances hold ---------------------------------------------------------------------------------------
    def ordered_instances(self) -> list[Instance]:
        return sorted(self.instances.values(), key=lambda i: i.address)

    def rows_of(self, group_id: int) -> int:
        return len(self.unfinished[group_id])

    def used_rows(self, inst: Instance) -> int:
        return self.rows_used[inst.address]

    def free_rows(self, inst: Instance) -> int:
        return inst.slots * self.group_size - self.used_rows(inst)

    def free_batch_rows(self, inst: Instance) -> int:
        """Rows a migrated request could decode in at once (not queue behind others)."""
        return min(self.free_rows(inst), (inst.batch_rows or inst.slots * self.group_size) - self.used_rows(inst))

    def queued_rows(self, inst: Instance) -> int:
        """Rows beyond what its engine decodes at once: requests waiting in the instance's queue."""
        return max(0, self.used_rows(inst) - (inst.batch_rows or inst.slots * self.group_size))

    def free_kv(self, inst: Instance) -> float:
        if not inst.kv_budget:
            return float("inf")
        return inst.kv_budget - self.kv_held[inst.address]

    def versions_on(self, inst: Instance) -> set[int]:
        return {self.running[g][0] for g in inst.running}

    @property
    def in_flight(self) -> int:
        return len(self.running) + sum(len(q) for q in self.queued.values())

    def live_versions(self) -> list[int]:
        return sorted({v for v, _ in self.running.values()} | {i.version for i in self.instances.values()
                                                                 if i.version is not None and i.running})

    def remaining_rows(self, capacity: int) -> dict[int, int]:
        """R_v: requests of each version still to run (running, queued to restart and, for the newest version, the
        new groups it could start now)."""
        work: dict[int, int] = {self.newest: 0}
        for v, groups in self.groups_of_version.items():
            if groups:
                work[v] = work.get(v, 0) + self.rows_of_version[v]
        for v, q in self.queued.items():
            if q:
                work[v] = work.get(v, 0) + len(q) * self.group_size
        work[self.newest] += self._creatable(capacity) * self.group_size
        return work

    # ---- decisions -----------------------------------------------------------------------------------------------
    def decide(self, capacity: int) -> list[Load | Start | Migrate]:
        """Actions for now. `capacity` is how many new groups the version gate allows to be dispatched."""
        self._versions_held = Counter(i.version for i in self.instances.values())  # kept by `assign` meanwhile
        try:
            return self._decide(capacity)
        finally:
            self._versions_held = None

    def _decide(self, capacity: int) -> list[Load | Start | Migrate]:
        actions: list[Load | Start | Migrate] = list(self.switching.plan(self, capacity))
        for inst in self.switching.fill_order(self):
            if not inst.running:
                target = self.target_version(inst, capacity)
                if target != inst.version:
                    actions.append(self.assign(inst, target))
            capacity = self._fill(inst, capacity, actions)
        rebalanced = self.switching.rebalance(self)
        if rebalanced:  # rows freed by migrations take new work at once
            actions += rebalanced
            for inst in self.ordered_instances():
                capacity = self._fill(inst, capacity, actions)
        return actions

    def _fill(self, inst: Instance, capacity: int, actions: list) -> int:
        """Start groups in `inst`'s free rows; returns the capacity left."""
        while self.free_rows(inst) >= self.group_size and len(inst.running) < inst.slots:
            start = self._next_start(inst, capacity)
            if start is None:
                break
            capacity -= start.new
            actions.append(start)
        return capacity

    def assign(self, inst: Instance, version: int) -> Load:
        """`inst` serves `version` from now on, loaded from a peer that holds it when there is one."""
        peers = [i.address for i in self.ordered_instances() if i is not inst and i.version == version]
        if self._versions_held is not None:
            self._versions_held[inst.version] -= 1
            self._versions_held[version] += 1
        inst.version = version
        return Load(inst.address, version, peers[0] if peers else "")

    def migrate(self, group_id: int, source: Instance, target: Instance) -> Migrate:
        version, _ = self.running[group_id]
        if target.version != version:
            raise OrchestratorInvariantError(f"group {group_id} of version {version} sent to {target.address} "
                                             f"serving version {target.version}")
        source.running.discard(group_id)
        target.running.add(group_id)
        self.running[group_id] = (version, target.address)
        self.arriving[group_id] = target.address
        rows, tokens = len(self.unfinished[group_id]), self.tokens.get(group_id, 0)
        self._count(source.address, -rows, -tokens)
        self._count(target.address, rows, tokens)
        return Migrate(group_id, tuple(sorted(self.unfinished[group_id])), version, source.address, target.address)

    def _next_start(self, inst: Instance, capacity: int) -> Start | None:
        version = next((v for v in self.switching.restart_versions(self, inst) if self.queued.get(v)), None)
        if version is not None:  # a group lost with its instance restarts on its own version
            group_id, new = self.queued[version].popleft(), False
        elif inst.version == self.newest and self._may_create(capacity):
            group_id, version, new = self.next_group_id, inst.version, True
            self.next_group_id += 1
        else:
            return None
        inst.running.add(group_id)
        self.running[group_id] = (version, inst.address)
        self.unfinished[group_id] = set(range(self.group_size))
        self._count(inst.address, self.group_size, self.tokens.get(group_id, 0))
        self.groups_of_version[version] += 1
        self.rows_of_version[version] += self.group_size
        return Start(inst.address, group_id, version, new)

    def _creatable(self, capacity: int) -> int:
        return max(0, min(capacity, self.rollout_batch_size - self.in_flight, self.group_budget - self.next_group_id))

    def _may_create(self, capacity: int) -> bool:
        return self._creatable(capacity) > 0

    def target_version(self, inst: Instance, capacity: int) -> int:
        """Proportional share: the live version whose remaining requests most exceed the instances serving it."""
        work = self.remaining_rows(capacity)
        total = sum(work.values()) or 1
        held = self._versions_held
        if held is None:
            held = Counter(i.version for i in self.instances.values())
        serving = {v: held[v] - (inst.version == v) for v in work}  # other instances serving v
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
            check(0 <= self.free_rows(inst), f"{inst.address} runs more requests than it has rows")
            check(self.rows_used[inst.address] == sum(len(self.unfinished[g]) for g in inst.running)
                  and self.kv_held[inst.address] == sum(self.tokens.get(g, 0) for g in inst.running),
                  f"{inst.address}'s running totals of rows and KV tokens drifted from its groups")
            for g in inst.running:
                version, address = self.running.get(g, (None, None))
                check(address == inst.address and version is not None and version <= inst.version,
                      f"group {g} on {inst.address} does not run on the instance's version {inst.version} or older")
            versions = self.versions_on(inst)
            check(len(versions - {inst.version}) < self.switching.versions_per_instance,
                  f"{inst.address} holds groups of versions {sorted(versions)} (version {inst.version})")
        groups, rows = Counter(v for v, _ in self.running.values()), Counter()
        for g, (v, _) in self.running.items():
            rows[v] += len(self.unfinished[g])
        check(+self.groups_of_version == groups and +self.rows_of_version == rows,
              "the per-version totals of running groups and requests drifted")
        owned = [g for i in self.instances.values() for g in i.running]
        check(len(owned) == len(set(owned)), "a group runs on two instances")
        check(set(owned) == set(self.running) == set(self.unfinished), "running groups and instance rows disagree")
        check(all(s <= set(range(self.group_size)) for s in self.unfinished.values()), "a request outside its group")
        queued = [g for q in self.queued.values() for g in q]
        check(len(queued) == len(set(queued)) and not (set(queued) & set(owned)), "a group is queued twice or also running")
        check(all(self.running.get(g, (None, None))[1] == a for g, a in self.arriving.items()),
              "a group on its way to an instance does not run there")
        check(self.next_group_id <= self.group_budget, "more groups created than the budget")
        check(all(v <= self.newest for v, _ in self.running.values()), "a group runs on an unpublished version")

    def to_state(self) -> dict:
        return {"rollout_batch_size": self.rollout_batch_size, "group_budget": self.group_budget,
                "newest": self.newest, "next_group_id": self.next_group_id}
