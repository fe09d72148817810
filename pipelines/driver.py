"""The driver's machinery: what the streaming loop in `pipelines.streaming` calls to extend the graph and to take in
results. The driver is the single writer of the trajectory store and the only owner of the gate and orchestrator.

Submission placement (Dask resource restrictions):
  rollout   -> the instance the orchestrator chose (``workers=[addr]``), resource ROLLOUT=1 (one slot)
  reward, advantage, gate, evaluate -> CPU workers, resource CPU=1
  update (and its publish) -> the trainer, resource TRAINER=1

A rollout task is one group. Its scoring is submitted once the driver sees it end: the groups one instance finished
since the driver's last turn (groups of one decode step end together) are scored by one reward task and one
advantage task, so Dask's per-task cost (messages, transfers, bookkeeping in four processes) is paid once for them.

A complete group is fetched by the driver (the store's single writer) and from then on travels by value: the gate
task of its batch carries it, so a group no longer depends on the memory of the worker that scored it, and workers
hold each group only until the driver has it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from distributed import Client, Future

from dora_tasks import steps
from dora_tasks.plugins import RolloutPlugin, TrainerPlugin
from dora_tasks.records import Group, Prompt, PublishedWeights, UpdateResult
from pipelines.cluster import PausedWorkers, Workers, labelled_workers
from pipelines.config import Config
from pipelines.gate import BatchDecision, VersionGate
from pipelines.metrics import Timeline, UpdateTiming
from pipelines.orchestrator import Orchestrator, Start
from storage.trajectory_store import TrajectoryStore
from storage.weight_store import WeightStore

log = logging.getLogger("dora")
ROLLOUT, CPU, TRAINER = {"ROLLOUT": 1}, {"CPU": 1}, {"TRAINER": 1}


class RunFolderError(ValueError):
    """The run folder cannot be used as asked (already holds a run, or holds none to resume)."""


def cache_root() -> str:
    return os.environ.get("DORA_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dora"))


def initial_policy(cfg: Config) -> str:
    """The model path given, or a warm-started policy (cached by its settings)."""
    if cfg.model.path:
        return cfg.model.path
    from dora_tasks.warmstart import warm_start, warmstart_settings

    digest = hashlib.sha1(json.dumps(warmstart_settings(cfg), sort_keys=True).encode()).hexdigest()[:12]
    return warm_start(cfg, os.path.join(cache_root(), "warmstart", digest))


@dataclass
class InFlight:
    group_id: int
    version: int
    attempt: int
    futures: list[Future]  # rollout, then the reward and advantage of its scoring batch
    instance: str  # where it is generated
    rolled_out: bool = False  # the rollout finished: its instance slot is free again


@dataclass
class QueuedUpdate:
    decision: BatchDecision
    ready: float  # when the gate handed the batch over
    updated: Future  # update(u), which publishes version u + 1


@dataclass
class Driver:
    cfg: Config
    client: Client
    gate: VersionGate
    orchestrator: Orchestrator
    store: TrajectoryStore
    weights: WeightStore
    model_path: str
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt]
    timeline: Timeline = field(default_factory=lambda: Timeline(time.time()))
    in_flight: dict[int, InFlight] = field(default_factory=dict)  # group_id -> futures
    attempts: dict[int, int] = field(default_factory=dict)
    complete: dict[int, Group] = field(default_factory=dict)  # fetched, not yet consumed
    unscored: list[int] = field(default_factory=list)  # rolled out this turn, scoring not submitted yet
    scoring: dict[tuple, list[int]] = field(default_factory=dict)  # advantage key -> the groups it scores
    scoring_batches: int = 0
    update_futures: dict[Future, str] = field(default_factory=dict)  # update/eval future -> kind
    updates: deque[QueuedUpdate] = field(default_factory=deque)  # handed to the trainer, not yet published
    accuracy: dict[int, float] = field(default_factory=dict)
    live_history: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)
    last_metrics: dict[str, float] = field(default_factory=dict)
    pinned_versions: set[int] = field(default_factory=set)  # kept in the weight store for resume
    _synced: float = 0.0
    _paused: PausedWorkers = field(default_factory=PausedWorkers)
    _finished: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # watched futures, as they finish

    # ---- cluster membership --------------------------------------------------------------------------------------
    def sync_instances(self, every_s: float = 1.0) -> None:
        """Follow rollout instances joining and leaving (a killed worker comes back under a new address).
        Asks the scheduler at most every `every_s` seconds."""
        if time.time() - self._synced < every_s:
            return
        self._synced = time.time()
        current = self.check_workers().rollout
        for address in list(self.orchestrator.instances):
            if address not in current:
                self.restart_groups_of(address)
        for address, slots in current.items():
            self.orchestrator.add_instance(address, slots)

    def check_workers(self) -> Workers:
        """The cluster's labelled workers; raises `ClusterError` once one has stayed paused too long."""
        workers = labelled_workers(self.client)
        self._paused.check(workers, self.cfg.cluster.paused_timeout_s)
        return workers

    def restart_groups_of(self, address: str) -> None:
        """A rollout instance died: its groups restart on their own version, those it was generating and those it
        generated whose scoring had not finished (their rollout output may have died with it before it was moved)."""
        generating = self.orchestrator.remove_instance(address)
        scoring = [gid for gid, g in self.in_flight.items() if g.instance == address and g.rolled_out]
        for gid in scoring:
            self.orchestrator.requeue(gid, self.in_flight[gid].version)
        for gid in generating + scoring:
            lost = self.in_flight.pop(gid)
            log.warning("instance %s lost; group %d restarts on version %d", address, gid, lost.version)
            self.client.cancel(lost.futures)  # a scoring batch holds groups of one instance only
        given_up = set(scoring)
        self.scoring = {key: gids for key, gids in self.scoring.items() if given_up.isdisjoint(gids)}

    # ---- rollout side --------------------------------------------------------------------------------------------
    def prompt_for(self, group_id: int) -> Prompt:
        return self.train_prompts[group_id % len(self.train_prompts)]

    def submit_group(self, start: Start) -> None:
        gid, v = start.group_id, start.version
        if start.new:
            self.gate.on_dispatch(gid, v)
        attempt = self.attempts[gid] = self.attempts.get(gid, -1) + 1
        prompt = self.prompt_for(gid)
        self.store.append_dispatch(gid, prompt.prompt_id, v, attempt, time.time())
        suffix = (attempt,) if attempt else ()
        r = self.cfg.rollout
        seed = self.cfg.dora.seed * 1_000_003 + gid * 31 + attempt
        rolled = self.client.submit(steps.rollout, gid, prompt, v, self.weights.path_for(v), r.group_size, seed,
                                    attempt, key=("rollout", v, gid) + suffix, workers=[start.instance],
                                    resources=ROLLOUT, pure=False)
        self.in_flight[gid] = InFlight(gid, v, attempt, [rolled], start.instance)
        self.watch(rolled)

    def on_rolled_out(self, gid: int) -> None:
        """The instance finished generating the group: free its slot; the group waits for this turn's scoring."""
        group = self.in_flight.get(gid)
        if group is not None and not group.rolled_out:
            group.rolled_out = True
            self.orchestrator.on_group_done(gid)
            self.unscored.append(gid)

    def submit_scoring(self) -> None:
        """rollout* -> reward(groups) -> advantage(groups): one pair of tasks per instance for the groups it finished
        since the last turn (reward and advantage run on CPU workers)."""
        by_instance: dict[str, list[int]] = {}
        for gid in self.unscored:
            if gid in self.in_flight:  # not given up on since (its instance died)
                by_instance.setdefault(self.in_flight[gid].instance, []).append(gid)
        self.unscored.clear()
        t, a = self.cfg.task, self.cfg.train
        for gids in by_instance.values():
            self.scoring_batches += 1
            n = self.scoring_batches
            rolled = [self.in_flight[g].futures[0] for g in gids]
            rewarded = self.client.submit(steps.reward, rolled, self.model_path, t.reward_fn, t.reward_timeout_s,
                                          key=("reward", n), resources=CPU, pure=False)
            scored = self.client.submit(steps.advantage, rewarded, a.advantage, a.filter_degenerate,
                                        key=("advantage", n), resources=CPU, pure=False)
            for g in gids:
                self.in_flight[g].futures += [rewarded, scored]
            self.scoring[scored.key] = gids
            self.watch(scored)

    def on_scored(self, future: Future) -> None:
        """A scoring batch is done: its groups are complete (the gate may put them in a batch)."""
        groups: list[Group] = future.result()
        if [g.group_id for g in groups] != self.scoring.pop(future.key):
            raise RuntimeError(f"{future.key} returned other groups than it was given")
        for group in groups:
            del self.in_flight[group.group_id]  # its futures go: the workers may drop the group
            self.gate.on_complete(group.group_id)
            self.complete[group.group_id] = group

    # ---- update side ---------------------------------------------------------------------------------------------
    def checkpoint_due(self, version: int) -> bool:
        """A checkpoint is taken once `version` is published (every `storage.checkpoint_interval`, not at the end)."""
        interval = self.cfg.storage.checkpoint_interval
        return bool(interval) and version % interval == 0 and version < self.cfg.dora.num_updates

    def may_hand_over(self) -> bool:
        """The gate may be asked for another batch: nothing is training, or the lookahead allows one more and no
        checkpoint (which must find the trainer between two updates) follows the last update handed over."""
        if not self.updates:
            return True
        last = self.updates[-1].decision.update
        return len(self.updates) <= self.cfg.dora.update_lookahead and not self.checkpoint_due(last + 1)

    def submit_update(self, decision: BatchDecision) -> None:
        """gate(u) -> update(u), which publishes u+1. A batch handed over early (lookahead) reaches the trainer while
        the previous update trains and starts the moment that one's weights are written."""
        u, c = decision.update, self.cfg
        groups = [self.complete[g] for g in decision.group_ids]
        checked = self.client.submit(steps.gate, u, c.dora.max_staleness, c.rollout.group_size,
                                     c.rollout.partial_rollout, *groups, key=("gate", u), resources=CPU, pure=False)
        updated = self.client.submit(steps.update, checked, self.weights.root, key=("update", u), resources=TRAINER,
                                     pure=False)
        self.updates.append(QueuedUpdate(decision, time.time(), updated))
        self.update_futures[updated] = "update"
        self.watch(updated)

    def on_published(self, future: Future) -> dict[str, float]:
        """Update u ended and published version u + 1: the driver takes the batch in (store, gate, orchestrator)."""
        queued = self.updates.popleft()
        if queued.updated.key != future.key:
            raise RuntimeError(f"{future.key} finished before {queued.updated.key}")
        decision, ready = queued.decision, queued.ready
        result: UpdateResult = future.result()
        published: PublishedWeights = result.published
        now = time.time()
        groups = [self.complete.pop(g) for g in decision.group_ids]
        self.gate.on_update_done(decision.update)
        self.orchestrator.on_publish(published.version)
        self.store.append_consumed(groups, decision.update, now)
        tokens = sum(g.num_tokens for g in groups)
        self.timeline.updates.append(UpdateTiming(decision.update, ready, result.start_time, result.end_time, now,
                                                  tokens, published.seconds))
        metrics = self.update_metrics(decision, groups, result, published, now)
        self.store.append_update(decision.update, result.start_time, result.end_time, published.version,
                                 published.seconds, metrics)
        self.retain_weights()
        self.last_metrics = metrics
        return metrics

    def update_metrics(self, decision: BatchDecision, groups: list[Group], result: UpdateResult,
                       published: PublishedWeights, now: float) -> dict[str, float]:
        rewards = np.concatenate([np.nan_to_num(g.rewards, nan=0.0) for g in groups])
        staleness = np.array([decision.update - g.version for g in groups])
        prev = self.timeline.updates[-2].published if len(self.timeline.updates) > 1 else self.timeline.t0
        metrics = dict(result.metrics)
        metrics.update({
            "reward_mean": float(rewards.mean()),
            "train_accuracy": float(np.mean(rewards == 1.0)),
            "staleness_max": float(staleness.max()), "staleness_mean": float(staleness.mean()),
            "versions_in_batch": float(len({g.version for g in groups})),
            "live_versions": float(max((len(v) for _, v in self.live_history[-50:]), default=1)),
            "step_time_s": now - prev, "weight_sync_s": published.seconds,
            "tokens": float(sum(g.num_tokens for g in groups)),
            "reward_failures": float(sum(1 for g in groups for t in g.trajectories if t.reward_error)),
            "wall_s": now - self.timeline.t0,
        })
        metrics["tokens_per_s"] = metrics["tokens"] / max(1e-9, metrics["step_time_s"])
        return metrics

    def retain_weights(self, *, drop_unseen: bool = False) -> None:
        """Keep the versions unconsumed groups still need, the newest, (for resume) the checkpoint's, and any newer
        version the trainer published ahead of the driver (update lookahead: the next publish can land before the
        driver has taken in this one). `drop_unseen`: delete those too (resume: they will be published again)."""
        keep = set(self.gate.unconsumed.values()) | {self.gate.newest} | self.pinned_versions
        if self.cfg.storage.keep_versions:
            keep |= set(range(max(0, self.gate.newest - self.cfg.storage.keep_versions), self.gate.newest + 1))
        self.weights.retain(keep, newer_than=None if drop_unseen else self.gate.newest)

    # ---- evaluation ----------------------------------------------------------------------------------------------
    def submit_evaluation(self, version: int) -> None:
        future = self.client.submit(steps.evaluate, self.weights.path_for(version), self.eval_prompts,
                                    self.model_path, self.cfg.task.reward_fn, self.cfg.rollout.max_new_tokens,
                                    self.cfg.dora.seed, key=("evaluate", version), resources=CPU, pure=False, priority=-10)
        self.update_futures[future] = f"evaluate:{version}"
        self.watch(future)

    # ---- start-up ------------------------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Start every engine and load the current version before the run's clock starts (engine start-up is
        minutes on a busy machine and is not part of a step)."""
        v, path = self.gate.newest, self.weights.path_for(self.gate.newest)
        prompt = list(self.train_prompts[0].token_ids)
        futures = [self.client.submit(steps.warm_up_rollout, v, path, prompt, key=("warm-up", v, address),
                                      workers=[address], resources=ROLLOUT, pure=False)
                   for address in self.orchestrator.instances]
        futures.append(self.client.submit(steps.warm_up_trainer, v, key=("warm-up-trainer", v), resources=TRAINER,
                                          pure=False))
        if 0 not in self.accuracy and self.gate.newest == 0:
            self.submit_evaluation(0)
        for f in futures:
            while True:
                try:
                    f.result(timeout=1.0)
                    break
                except TimeoutError:
                    self.check_workers()  # a paused engine never starts
        for f in list(self.update_futures):
            kind = self.update_futures.pop(f)
            self.accuracy[int(kind.split(":")[1])] = float(f.result())
        self.timeline = Timeline(time.time())

    # ---- waiting -------------------------------------------------------------------------------------------------
    def pending(self) -> list[Future]:
        rolling = [g.futures[0] for g in self.in_flight.values() if not g.rolled_out]
        scoring = {g.futures[-1].key: g.futures[-1] for g in self.in_flight.values() if len(g.futures) > 1}
        return rolling + list(scoring.values()) + list(self.update_futures)

    def watch(self, *futures: Future) -> None:
        """Queue each future when it finishes (one callback per future, registered once, rather than waiting
        anew on every pending future at every turn of the loop)."""
        for future in futures:
            future.add_done_callback(self._finished.put)

    def wait_any(self, timeout_s: float) -> list[Future]:
        """The pending futures that finished since the last call, after waiting up to `timeout_s` for the first.
        Futures of groups given up on (their instance died) are dropped."""
        try:
            done = [self._finished.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while not self._finished.empty():
            done.append(self._finished.get())
        expected = {f.key for f in self.pending()}
        return [f for f in done if f.key in expected]

    def note_live_versions(self) -> None:
        self.live_history.append((time.time(), tuple(self.orchestrator.live_versions())))


def publish_initial(weights: WeightStore, model_path: str) -> None:
    """Version 0 is the initial policy, copied into the weight store like every later version."""
    if 0 not in weights.versions():
        weights.publish(0, lambda folder: shutil.copytree(model_path, folder, dirs_exist_ok=True))


def register_plugins(client: Client, cfg: Config, weight_root: str, model_path: str) -> None:
    client.register_plugin(RolloutPlugin(model_path, cfg.rollout, weight_root))
    client.register_plugin(TrainerPlugin(weight_root, cfg.train, cfg.rollout.temperature))
