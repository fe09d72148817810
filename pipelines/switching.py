"""How an instance moves from an older version to the newest: the orchestrator's switching strategies.

* `Drain` (the default): an instance finishing an older version's requests takes no new work and switches once its
  last request has ended; its freed rows idle meanwhile (the rollout bubble of a version switch).
* `Queue` (queued switching): such an instance is retargeted to the newest version at once, so new groups queue on it
  and start the moment its older requests end; it then holds requests of at most two versions (its engine still
  swaps weights only once the older ones have ended, so C1 holds).
* `Migrate` (DORA's Algorithm 1, steps 2-4): each live version gets a share of the instances in proportion to its
  remaining requests; an instance leaving an older version hands its unfinished requests to instances that stay on
  that version (fewest remaining requests leave first; a request goes where its rows and KV cache fit, and never to
  another version), then loads the newest version from a peer that holds it. An instance leaves only while requests
  of the newest version wait for a batch row that no instance serving it, nor an empty one, has free (else it would
  idle, and its requests decode slower in a fuller batch: a step's time grows with the batch's KV cache); a leaver
  whose requests do not all fit drains instead. Then, within each version, groups queued on an instance beyond what
  its engine decodes at once move to instances of that version with room (an instance that just switched takes the
  newest version's backlog). While a moved group is on its way (`Orchestrator.arriving`: until the driver or the
  simulator says it arrived, at the latest until it ends) it is not moved on and its receiver does not leave: a
  receiver that left would meet the group's requests on a version it no longer serves.
* `Concurrent(M)` (`rollout.versions_per_instance` = M > 1; LoRA adapters, one per version): an instance holding
  requests of fewer than M distinct versions, the newest counted, takes the newest version at once (it loads that
  version's adapter beside the ones it holds) and starts its new groups in the rows its older requests leave free;
  rows are shared between its versions. A group queued to restart on an older version may start on any instance
  that still holds that version; free rows are filled on the least busy instances first. A group still never changes
  version or instance (C1 per request). With M = 1 it decides as `Drain`.

A strategy is asked once per `Orchestrator.decide`: `plan` before idle instances get their version, `rebalance`
after, both before free rows are filled. That is the orchestrator's periodic firing, and with it the firing after
every publish and on KV pressure (both end in the next `decide`).
"""
from __future__ import annotations

from typing import Protocol


class Switching(Protocol):
    name: str
    versions_per_instance: int  # versions whose requests one instance may hold at once

    def plan(self, orch, capacity: int) -> list:
        """Retargets (`Load`) and migrations (`Migrate`) for now, applied to the orchestrator `orch` as returned."""

    def rebalance(self, orch) -> list:
        """Migrations within each version, once idle instances have been given their version."""

    def restart_versions(self, orch, inst) -> list[int]:
        """Versions whose queued groups may (re)start on `inst`, in the order they are taken."""

    def fill_order(self, orch) -> list:
        """The order in which instances are given their version and their free rows filled."""


class Drain:
    name, versions_per_instance = "drain", 1

    def plan(self, orch, capacity):
        return []

    def rebalance(self, orch):
        return []

    def restart_versions(self, orch, inst):
        return [inst.version]

    def fill_order(self, orch):
        return orch.ordered_instances()


class Queue(Drain):
    name, versions_per_instance = "queue", 2

    def plan(self, orch, capacity):
        actions = []
        for inst in orch.ordered_instances():
            if self._may_queue_behind(orch, inst, capacity):
                actions.append(orch.assign(inst, orch.newest))
        return actions

    @staticmethod
    def _may_queue_behind(orch, inst, capacity) -> bool:
        """`inst` holds requests of one older version only (and no restart waits for that version), and would move
        to the newest next anyway."""
        if not inst.running or inst.version == orch.newest:
            return False
        if orch.queued.get(inst.version) or len(orch.versions_on(inst)) > 1:
            return False
        return orch.target_version(inst, capacity) == orch.newest


class Migrate(Drain):
    name, versions_per_instance = "migrate", 1

    def plan(self, orch, capacity):
        """Leavers, fewest remaining requests first, while requests of the newest version wait for a batch row:
        a leaver with none to take would idle while its requests decode slower in a stayer's fuller batch."""
        shares = proportional_shares(orch.remaining_rows(capacity), len(orch.instances))
        waiting = rows_waiting_for_newest(orch)
        receiving = set(orch.arriving.values())
        actions = []
        for version in sorted({i.version for i in orch.instances.values() if i.version is not None}):
            if version == orch.newest:
                continue
            serving = [i for i in orch.ordered_instances() if i.version == version]
            surplus = len(serving) - shares.get(version, 0)
            free_to_leave = [i for i in serving if i.address not in receiving]  # else a move may reach it too late
            leavers = sorted(free_to_leave, key=lambda i: (orch.used_rows(i), i.address))[:max(0, surplus)]
            stayers = [i for i in serving if i not in leavers]
            for leaver in leavers:
                if waiting <= 0:
                    return actions
                moves = place(orch, leaver, stayers)
                if moves is not None:
                    actions += [orch.migrate(group_id, leaver, target) for group_id, target in moves]
                    waiting -= orch.free_batch_rows(leaver)  # the batch it now offers the newest version
        return actions

    def rebalance(self, orch):
        actions = []
        for version in sorted({i.version for i in orch.instances.values() if i.version is not None}):
            actions += balance(orch, [i for i in orch.ordered_instances() if i.version == version])
        return actions


class Concurrent(Drain):
    name = "concurrent"

    def __init__(self, versions_per_instance: int):
        if versions_per_instance < 1:
            raise ValueError(f"versions_per_instance: must be >= 1, got {versions_per_instance}")
        self.versions_per_instance = versions_per_instance

    def plan(self, orch, capacity):
        actions = []
        for inst in orch.ordered_instances():
            if inst.running and inst.version != orch.newest and self._has_room_for_newest(orch, inst):
                actions.append(orch.assign(inst, orch.newest))
        return actions

    def _has_room_for_newest(self, orch, inst) -> bool:
        return len(orch.versions_on(inst) | {orch.newest}) <= self.versions_per_instance

    def restart_versions(self, orch, inst):
        """Every version it holds an adapter of, oldest first (its restarts are the closest to the staleness bound)."""
        return sorted(orch.versions_on(inst) | {inst.version})

    def fill_order(self, orch):
        """Least busy first when M > 1: an instance still running older requests would otherwise take the newest
        version's groups in address order and queue them behind its full batch while other instances idle."""
        if self.versions_per_instance == 1:
            return orch.ordered_instances()
        return sorted(orch.ordered_instances(), key=lambda i: (orch.used_rows(i), i.address))


def proportional_shares(remaining: dict[int, int], instances: int) -> dict[int, int]:
    """DP_v = round(N * R_v / sum R): largest remainders, and at least one instance for every version with remaining
    work while there are instances to give (older versions first: their requests can run nowhere else)."""
    live = {v: r for v, r in remaining.items() if r > 0}
    total = sum(live.values())
    if not live or instances <= 0:
        return {}
    exact = {v: instances * r / total for v, r in live.items()}
    shares = {v: int(x) for v, x in exact.items()}
    for v in sorted(live, key=lambda v: (shares[v] - exact[v], -v))[:instances - sum(shares.values())]:
        shares[v] += 1
    for v in sorted(live):  # a version with work and no instance takes one from the version with most
        if shares[v] == 0:
            donor = max(shares, key=lambda w: (shares[w], w))
            if shares[donor] > 1:
                shares[donor] -= 1
                shares[v] = 1
    return shares


def rows_waiting_for_newest(orch) -> int:
    """Requests of the newest version waiting for a batch row (queued in an engine beyond its batch, or to restart)
    beyond the free batch rows of the instances serving it and of the empty ones: what a leaver takes at once
    (`rebalance` moves it there). New groups not yet created do not count: they start where rows free up."""
    serving = [i for i in orch.instances.values() if i.version == orch.newest]
    waiting = sum(orch.queued_rows(i) for i in serving) + len(orch.queued.get(orch.newest, ())) * orch.group_size
    room = sum(max(0, orch.free_batch_rows(i)) for i in orch.instances.values()
               if i.version == orch.newest or not i.running)
    return waiting - room


def place(orch, leaver, stayers) -> list[tuple[int, object]] | None:
    """Where each of the leaver's groups goes (all of a group's unfinished requests together): the stayer with most
    free rows whose running batch and KV budget take it (it decodes them at once, never queues them). None when any
    group fits nowhere: the leaver drains instead."""
    free = {s.address: orch.free_batch_rows(s) for s in stayers}
    kv = {s.address: orch.free_kv(s) for s in stayers}
    moves = []
    for group_id in sorted(leaver.running, key=lambda g: -orch.rows_of(g)):
        rows, tokens = orch.rows_of(group_id), orch.tokens.get(group_id, 0)
        fits = [s for s in stayers if free[s.address] >= rows and kv[s.address] >= tokens]
        if not fits:
            return None
        target = max(fits, key=lambda s: (free[s.address], s.address))
        free[target.address] -= rows
        kv[target.address] -= tokens
        moves.append((group_id, target))
    return moves


def balance(orch, serving: list) -> list:
    """Within one version: groups queued on an instance beyond what its engine decodes at once move to instances of
    that version whose batch has room (an instance that just switched, or one whose requests ended), those holding
    the fewest KV tokens first (a group still queued holds none yet, so it moves for free)."""
    room = {i.address: orch.free_batch_rows(i) for i in serving}
    kv = {i.address: orch.free_kv(i) for i in serving if room[i.address] >= orch.group_size}
    if not kv:
        return []
    actions = []
    for donor in serving:
        queued = orch.queued_rows(donor)
        if not kv:
            break  # no instance has room left, and none will
        if (not queued and all(orch.unfinished[g] for g in donor.running)) or kv.keys() == {donor.address}:
            continue  # nothing queued beyond its batch, or no room but its own: no group of it moves
        unplaced = None  # fewest rows of a group that fit nowhere: no later group (as many tokens or more) fits either
        for group_id in sorted(donor.running, key=lambda g: (orch.tokens.get(g, 0), g)):
            rows, tokens = orch.rows_of(group_id), orch.tokens.get(group_id, 0)
            if queued < rows or not kv:
                break
            if group_id in orch.arriving:
                continue  # on its way here: moved on only once it has arrived
            if unplaced is not None and rows >= unplaced:  # rooms and KV budgets only shrink below
                continue
            fits = [a for a in kv if a != donor.address and room[a] >= rows and kv[a] >= tokens]
            if not fits:
                unplaced = rows
                continue
            target = max(fits, key=lambda a: (room[a], a))
            actions.append(orch.migrate(group_id, donor, orch.instances[target]))
            queued, room[target], kv[target] = queued - rows, room[target] - rows, kv[target] - tokens
            if room[target] < orch.group_size:
                del kv[target]
    return actions


STRATEGIES = {s.name: s for s in (Drain, Queue, Migrate)}


def switching_named(name: str, versions_per_instance: int = 1) -> Switching:
    """The strategy `rollout.switching` names; `Concurrent(M)` in place of drain when M = versions_per_instance > 1."""
    if name not in STRATEGIES:
        raise ValueError(f"switching: got {name!r}, allowed: {', '.join(STRATEGIES)}")
    if versions_per_instance > 1:
        if name != "drain":
            raise ValueError(f"switching: {name!r} cannot serve {versions_per_instance} versions per instance "
                             "(an instance leaving its version); use 'drain'")
        return Concurrent(versions_per_instance)
    return STRATEGIES[name]()
