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
from distributed import Client, Future, wait
from distributed.scheduler import KilledWorker

from dora_tasks import steps
from dora_tasks.plugins import RolloutPlugin, TrainerLost, TrainerPlugin
from dora_tasks.records import Group, Prompt, PublishedWeights, TrainerRestore, UpdateResult
from pipelines.cluster import ClusterError, PausedWorkers, Workers, labelled_workers
from pipelines.config import Config
from pipelines.gate import BatchDecision, VersionGate
from pipelines.metrics import Timeline, UpdateTiming
from pipelines.orchestrator import Orchestrator, Start
from storage.checkpoint import CheckpointStore
from storage.trajectory_store import TrajectoryStore
from storage.weight_store import WeightStore

log = logging.getLogger("dora")
ROLLOUT, CPU, TRAINER = {"ROLLOUT": 1}, {"CPU": 1}, {"TRAINER": 1}
TRAINER_LOSS = (TrainerLost, KilledWorker)  # what a trainer task raises when the trainer's process died under it
MAX_TRAINER_RESTARTS = 3  # restarts in a row without a publish between them before the run stops
RESTORE_TIMEOUT_S = 600.0  # a new engine on a restarted trainer (DeepSpeed's first start compiles for a minute)
MAX_EVAL_ATTEMPTS = 2  # an evaluation that fails is tried once more, then skipped with a warning


class RunFolderError(ValueError):
    """The run folder cannot be used as asked (already holds a run, or holds none to resume)."""


class RewardFailureError(RuntimeError):
    """Every reward of `task.reward_failure_stop_updates` updates in a row failed: the reward function is broken."""


class TrainerError(RuntimeError):
    """The trainer cannot be brought back; the run folder can be resumed with `dora resume`."""


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
    checked: Future  # gate(u)
    updated: Future  # update(u), which publishes version u + 1


@dataclass
class RateLimit:
    """True at most once every `every_s` seconds (a warning that would repeat at every update)."""

    every_s: float
    last: float = float("-inf")

    def ready(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.every_s:
            return False
        self.last = now
        return True


@dataclass
class Evaluation:
    version: int
    attempt: int


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
    checkpoints: CheckpointStore | None = None  # where a restarted trainer takes its optimizer state from
    timeline: Timeline = field(default_factory=lambda: Timeline(time.time()))
    in_flight: dict[int, InFlight] = field(default_factory=dict)  # group_id -> futures
    attempts: dict[int, int] = field(default_factory=dict)
    complete: dict[int, Group] = field(default_factory=dict)  # fetched, not yet consumed
    unscored: list[int] = field(default_factory=list)  # rolled out this turn, scoring not submitted yet
    scoring: dict[tuple, list[int]] = field(default_factory=dict)  # advantage key -> the groups it scores
    scoring_batches: int = 0
    evaluations: dict[Future, Evaluation] = field(default_factory=dict)  # queued or running held-out evaluations
    eval_failures: int = 0
    trainer: str = ""  # address of the trainer worker holding the engine
    trainer_restarts: int = 0
    restarts_in_a_row: int = 0  # since the last publish
    all_rewards_failed: int = 0  # updates in a row in which every reward failed
    updates: deque[QueuedUpdate] = field(default_factory=deque)  # handed to the trainer, not yet published
    accuracy: dict[int, float] = field(default_factory=dict)
    live_history: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)
    last_metrics: dict[str, float] = field(default_factory=dict)
    pinned_versions: set[int] = field(default_factory=set)  # kept in the weight store for resume
    _synced: float = 0.0
    _reward_warnings: RateLimit = field(default_factory=lambda: RateLimit(30.0))
    _paused: PausedWorkers = field(default_factory=PausedWorkers)
    _finished: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # watched futures, as they finish

    # ---- cluster membership --------------------------------------------------------------------------------------
    def sync_instances(self, every_s: float = 1.0) -> None:
        """Follow rollout instances joining and leaving (a killed worker comes back under a new address).
        Asks the scheduler at most every `every_s` seconds."""
        if time.time() - self._synced < every_s:
            return
        self._synced = time.time()
        workers = self.check_workers()
        if self.trainer and self.trainer not in workers.trainer:
            self.recover_trainer(f"worker {self.trainer} left the cluster")
        current = workers.rollout
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
                                          t.reward_isolation, t.reward_memory_bytes,
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
        suffix = (self.trainer_restarts,) if self.trainer_restarts else ()  # a key of a cancelled task is never reused
        groups = [self.complete[g] for g in decision.group_ids]
        checked = self.client.submit(steps.gate, u, c.dora.max_staleness, c.rollout.group_size,
                                     c.rollout.partial_rollout, *groups, key=("gate", u) + suffix, resources=CPU,
                                     pure=False)
        updated = self.client.submit(steps.update, checked, self.weights.root, key=("update", u) + suffix,
                                     resources=TRAINER, pure=False)
        self.updates.append(QueuedUpdate(decision, time.time(), checked, updated))
        self.watch(updated)

    def is_update(self, future: Future) -> bool:
        return any(q.updated is future for q in self.updates)

    def on_published(self, future: Future) -> dict[str, float]:
        """Update u ended and published version u + 1: the driver takes the batch in (store, gate, orchestrator).
        Raises the task's error (then nothing changed)."""
        result: UpdateResult = future.result()
        queued = self.updates.popleft()
        if queued.updated.key != future.key:
            raise RuntimeError(f"{future.key} finished before {queued.updated.key}")
        decision, ready = queued.decision, queued.ready
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
        self.restarts_in_a_row = 0
        self.check_rewards([t.reward_error for g in groups for t in g.trajectories if t.reward_error],
                           sum(len(g.trajectories) for g in groups))
        return metrics

    # ---- trainer loss --------------------------------------------------------------------------------------------
    def recover_trainer(self, why: str) -> TrainerRestore:
        """The trainer died (at any moment: training, publishing, checkpointing, idle). A restarted trainer worker
        gets a new engine on the newest version the driver took in, with the optimizer state of the last checkpoint
        (a fresh one without), and the batches handed to the lost trainer go to it again, in order. A version the
        lost trainer published but the driver never took in is deleted: it is published again, once."""
        log.warning("trainer lost (%s); restoring it at version %d", why, self.gate.newest)
        queued = list(self.updates)
        self.updates.clear()
        self.client.cancel([f for q in queued for f in (q.checked, q.updated)])
        self.retain_weights(drop_unseen=True)
        checkpoint = self.checkpoints.latest() if self.checkpoints is not None else None
        folder = checkpoint.file("trainer") if checkpoint is not None else None
        restored = None
        while restored is None:  # the new trainer may die too, before it is restored
            self.count_trainer_restart(why)
            self.wait_for_trainer()
            try:
                restored = self.client.submit(steps.restore_trainer, self.gate.newest, folder, resources=TRAINER,
                                              key=("restore-trainer", self.trainer_restarts), pure=False
                                              ).result(timeout=RESTORE_TIMEOUT_S)
            except TRAINER_LOSS as exc:
                why = f"lost again while restored: {type(exc).__name__}"
            except TimeoutError:
                raise TrainerError(f"the trainer was lost ({why}) and not restored within {RESTORE_TIMEOUT_S:.0f} s; "
                                   f"continue the run with `dora resume {self.cfg.storage.run_dir}`") from None
        self.trainer = restored.worker
        for q in queued:
            self.submit_update(q.decision)
        if restored.optimizer_from:
            log.warning("trainer restored at version %d with the optimizer state of %s", restored.version,
                        restored.optimizer_from)
        else:
            log.warning("trainer restored at version %d with a FRESH optimizer state (%s)", restored.version,
                        "no checkpoint yet" if folder is None else f"{self.cfg.train.engine} ZeRO-"
                        f"{self.cfg.train.zero_stage} cannot take the optimizer state of {folder} alone")
        return restored

    def count_trainer_restart(self, why: str) -> None:
        self.trainer_restarts += 1
        self.restarts_in_a_row += 1
        if self.restarts_in_a_row > MAX_TRAINER_RESTARTS:
            raise TrainerError(f"the trainer was lost {self.restarts_in_a_row} times without publishing a version "
                               f"in between (last: {why}); continue the run with `dora resume "
                               f"{self.cfg.storage.run_dir}` once the trainer worker is healthy")

    def wait_for_trainer(self) -> str:
        """The address of a connected trainer worker (its Nanny restarts it within seconds)."""
        timeout_s = max(30.0, self.cfg.cluster.connect_timeout_s)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            trainers = labelled_workers(self.client).trainer
            if trainers:
                return trainers[0]
            time.sleep(0.2)
        raise ClusterError(f"the trainer was lost and no worker labelled GPU=1,TRAINER=1 joined within "
                           f"{timeout_s:.0f} s; start one and continue with `dora resume {self.cfg.storage.run_dir}`")

    def update_metrics(self, decision: BatchDecision, groups: list[Group], result: UpdateResult,
                       published: PublishedWeights, now: float) -> dict[str, float]:
        rewards = np.concatenate([np.nan_to_num(g.rewards, nan=0.0) for g in groups])
        errors = [t.reward_error for g in groups for t in g.trajectories if t.reward_error]
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
            "reward_failures": float(len(errors)), "reward_failure_share": len(errors) / len(rewards),
            "trainer_restarts": float(self.trainer_restarts), "eval_failures": float(self.eval_failures),
            "wall_s": now - self.timeline.t0,
        })
        metrics["tokens_per_s"] = metrics["tokens"] / max(1e-9, metrics["step_time_s"])
        return metrics

    def check_rewards(self, errors: list[str], scored: int) -> None:
        """Warn when more than `task.reward_failure_warn_share` of a batch's rewards failed; stop the run once every
        reward of `task.reward_failure_stop_updates` updates in a row failed (a reward function that always raises
        or returns no number would otherwise train on zeros in silence)."""
        t = self.cfg.task
        self.all_rewards_failed = self.all_rewards_failed + 1 if len(errors) == scored else 0
        example = max(set(errors), key=errors.count) if errors else ""
        if t.reward_failure_stop_updates and self.all_rewards_failed >= t.reward_failure_stop_updates:
            raise RewardFailureError(
                f"every reward of the last {self.all_rewards_failed} updates failed (task.reward_fn="
                f"{t.reward_fn or '(the task default)'}; most frequent error: {example}); fix the reward function "
                f"and continue with `dora resume {self.cfg.storage.run_dir}`, or set "
                "task.reward_failure_stop_updates=0 to train on failed rewards as 0")
        if errors and len(errors) > t.reward_failure_warn_share * scored and self._reward_warnings.ready():
            log.warning("%d of %d rewards of this update failed (most frequent: %s)", len(errors), scored, example)

    def retain_weights(self, *, drop_unseen: bool = False) -> None:
        """Keep the versions unconsumed groups still need, the newest, those a queued evaluation will read, (for
        resume) the checkpoint's, and any newer version the trainer published ahead of the driver (update lookahead:
        the next publish can land before the driver has taken in this one). `drop_unseen`: delete those too (resume
        and a restored trainer: they will be published again)."""
        keep = set(self.gate.unconsumed.values()) | {self.gate.newest} | self.pinned_versions
        keep |= {e.version for e in self.evaluations.values()}
        if self.cfg.storage.keep_versions:
            keep |= set(range(max(0, self.gate.newest - self.cfg.storage.keep_versions), self.gate.newest + 1))
        self.weights.retain(keep, newer_than=None if drop_unseen else self.gate.newest)

    # ---- evaluation ----------------------------------------------------------------------------------------------
    def submit_evaluation(self, version: int, attempt: int = 0) -> None:
        t = self.cfg.task
        future = self.client.submit(steps.evaluate, self.weights.path_for(version), self.eval_prompts,
                                    self.model_path, t.reward_fn, self.cfg.rollout.max_new_tokens, self.cfg.dora.seed,
                                    t.reward_timeout_s, t.reward_isolation, t.reward_memory_bytes,
                                    key=("evaluate", version) + ((attempt,) if attempt else ()), resources=CPU,
                                    pure=False, priority=-10)
        self.evaluations[future] = Evaluation(version, attempt)
        self.watch(future)

    def on_evaluated(self, future: Future) -> float | None:
        """The held-out accuracy of the evaluated version; None when it failed (tried again once, then skipped:
        a failed evaluation never stops training)."""
        evaluation = self.evaluations.pop(future)
        if future.status != "error":
            self.accuracy[evaluation.version] = float(future.result())
            self.retain_weights()
            return self.accuracy[evaluation.version]
        exc = future.exception()
        self.eval_failures += 1
        again = evaluation.attempt + 1 < MAX_EVAL_ATTEMPTS and evaluation.version in self.weights.versions()
        log.warning("evaluation of version %d failed (%s: %s); %s", evaluation.version, type(exc).__name__, exc,
                    "trying once more" if again else "skipped, training goes on")
        if again:
            self.submit_evaluation(evaluation.version, evaluation.attempt + 1)
        else:
            self.retain_weights()
        return None

    # ---- start-up ------------------------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Start every engine and load the current version before the run's clock starts (engine start-up is
        minutes on a busy machine and is not part of a step); evaluate the current version if it is due and not
        evaluated yet (version 0, or the checkpoint's version after a resume)."""
        v, path = self.gate.newest, self.weights.path_for(self.gate.newest)
        prompt = list(self.train_prompts[0].token_ids)
        futures = [self.client.submit(steps.warm_up_rollout, v, path, prompt, key=("warm-up", v, address),
                                      workers=[address], resources=ROLLOUT, pure=False)
                   for address in self.orchestrator.instances]
        trainer = self.client.submit(steps.warm_up_trainer, v, key=("warm-up-trainer", v), resources=TRAINER,
                                     pure=False)
        if v not in self.accuracy and self.evaluation_due(v):
            self.submit_evaluation(v)
        for f in futures + [trainer]:
            while True:
                try:
                    f.result(timeout=1.0)
                    break
                except TimeoutError:
                    self.check_workers()  # a paused engine never starts
        self.trainer = self.client.who_has(trainer)[trainer.key][0]
        while self.evaluations:
            wait(list(self.evaluations))
            for f in [f for f in self.evaluations if f.done()]:
                self.on_evaluated(f)
        self.timeline = Timeline(time.time())

    def evaluation_due(self, version: int) -> bool:
        interval = self.cfg.task.eval_interval
        return version in (0, self.cfg.dora.num_updates) or bool(interval and version % interval == 0)

    # ---- waiting -------------------------------------------------------------------------------------------------
    def pending(self) -> list[Future]:
        rolling = [g.futures[0] for g in self.in_flight.values() if not g.rolled_out]
        scoring = {g.futures[-1].key: g.futures[-1] for g in self.in_flight.values() if len(g.futures) > 1}
        return rolling + list(scoring.values()) + [q.updated for q in self.updates] + list(self.evaluations)

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
