"""The driver: one typed event loop that extends the Dask graph and owns the run's state.

Every future the driver waits on is tracked with a typed task (`pipelines.events`: rollout, scoring, update,
evaluation); `on_done` dispatches a finished one on its type. What happened goes to observers as typed events
(MLflow tracking, the live view, benchmarks' probes subscribe with `subscribe`). The driver is the single writer of
the trajectory store and the only owner of the gate and orchestrator; `pipelines.streaming.stream` is its loop.

Submission placement (Dask resource restrictions):
  rollout, resume -> the instance the orchestrator chose (``workers=[addr]``), ROLLOUT=1 (a slot), =0 (a row)
  reward, advantage, evaluate -> CPU workers, resource CPU=1
  reward-model (with `reward.model`) -> a reward worker, resource REWARD=0 (the label, no slot: tasks share forwards)
  update (and its publish), checkpoint, restore -> the trainer, resource TRAINER=1
  gate -> the trainer's worker (``workers=[trainer]``, no label: it checks the next batch while an update trains)

A rollout task is one group; the groups one instance finished since the driver's last turn are scored by one reward
and one advantage task. A complete group is fetched by the driver (the store's writer); its batch goes straight to
the trainer's worker (`send_to_trainer`), where the gate task checks it: a batch never leaves the trainer. With
`rollout.switching=migrate` a group's running responses can move to another instance of its version
(`pipelines.migration`).

Faults: a rollout instance that leaves restarts its groups on their own version (and those whose responses moved
to or from it); a trainer that leaves, or whose update fails with `TrainerLost`, is restored (`recover_trainer`); an
evaluation that fails is tried once more, then skipped. Any other failed task ends the run with a `RunError` naming it.
"""
from __future__ import annotations

import logging
import queue
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import singledispatchmethod
from typing import Any, Callable

from distributed import Client, Future

from dora_tasks import steps
from dora_tasks.core.clock import Clock
from dora_tasks.core.config import Config
from dora_tasks.core.records import Group, Prompt, UpdateResult
from dora_tasks.plugins import reports_topic
from pipelines.cluster import CPU, REWARD_MODEL, ROLLOUT, TRAINER, PausedWorkers, Workers, labelled_workers
from pipelines.evaluation import Evaluations
from pipelines.events import (EvaluationTask, Event, GroupOrder, GroupRolledOut, GroupsScored, HandOverTask, Published,
                              ResumeTask, RolloutTask, ScoringSubmitted, ScoringTask, Task, Turn, UpdateSubmitted,
                              UpdatePartTask, UpdateTask)
from pipelines.gate import BatchDecision, VersionGate
from pipelines.in_flight import InFlight, Publication, QueuedUpdate
from pipelines.metrics import Timeline, UpdateTiming, update_metrics
from pipelines.migration import RequestMigration
from pipelines.orchestrator import Orchestrator, Start
from pipelines.reward_checks import REWARD_WARNING_EVERY_S, RateLimit, RewardChecks
from pipelines.streamed_updates import StreamedUpdates
from pipelines.trainer_recovery import TRAINER_LOSS, TrainerRecovery, loss_reason
from pipelines.weight_sharing import SharedWeights
from storage.checkpoint import CheckpointStore
from storage.trajectory_store import TrajectoryStore
from storage.weight_store import WeightStore

log = logging.getLogger("dora")
LIVE_WINDOW_TURNS = 50  # the `live_versions` metric: most versions live at once over this many recent turns
SEED_STRIDE = 1_000_003  # a prime: the seeds of two runs' groups do not collide
ATTEMPT_SEEDS = 31  # seeds per group: its attempts take consecutive ones
POLL_S = 1.0  # a blocking wait looks at the cluster again this often (a paused worker, a lost trainer)
DONE_POLL_S = 0.02  # how often a start-up wait looks at its futures
HAND_OVER_THREADS = 64  # sources whose orders wait for their chunk boundaries at once (threads start as needed)


class RunError(RuntimeError):
    """A task of the run failed; the message names it. The store keeps everything consumed so far."""


def engine_batch_rows(cfg: Config) -> int:
    """Rows one instance's engine decodes at once, where it bounds them below its slots' rows (the emulated engine's
    `emulation.max_rows`, like vLLM's max_num_seqs): the orchestrator then knows which rows queue inside an engine
    (what `switching=migrate` moves). 0: every row of its groups decodes at once (the transformers engine)."""
    return cfg.emulation.max_rows if cfg.emulated else 0


def engine_kv_budget(cfg: Config) -> int:
    """KV-cache tokens one instance's engine holds, where the driver knows it (the emulated engine's cost model): the
    orchestrator moves a request only to an instance with room for its cache. 0: not known, never a limit."""
    if not cfg.emulated:
        return 0
    from dora_tasks.emulation.cost_model import cost_model_from
    return cost_model_from(cfg.emulation).kv_capacity_tokens()


@dataclass
class Driver(TrainerRecovery, RequestMigration, StreamedUpdates, Evaluations, RewardChecks):
    cfg: Config
    client: Client
    gate: VersionGate
    orchestrator: Orchestrator
    store: TrajectoryStore
    weights: WeightStore
    model_path: str
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt]
    checkpoints: CheckpointStore | None = None
    clock: Clock = field(default_factory=Clock)  # every recorded time: wall seconds, or emulated ones (`Clock`)
    reward_fn: Any = None  # the reward function given in Python (`pipelines.api`); None: task.reward_fn's path
    timeline: Timeline = field(default_factory=lambda: Timeline(time.time()))  # restarted on the clock by warm_up
    tracked: dict[Future, Task] = field(default_factory=dict)  # every future the driver waits on
    in_flight: dict[int, InFlight] = field(default_factory=dict)  # group_id -> its futures, until complete
    attempts: dict[int, int] = field(default_factory=dict)
    complete: dict[int, Group] = field(default_factory=dict)  # fetched, not yet consumed
    unscored: list[int] = field(default_factory=list)  # rolled out this turn, scoring not submitted yet
    scoring_batches: int = 0
    updates: deque[QueuedUpdate] = field(default_factory=deque)  # handed to the trainer, not yet published
    unrecorded: deque[Publication] = field(default_factory=deque)  # published, not yet in the store (`on_published`)
    accuracy: dict[int, float] = field(default_factory=dict)
    pinned_versions: set[int] = field(default_factory=set)  # kept in the weight store for resume
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("trainer_restarts", "restarts_in_a_row", "eval_failures", "all_rewards_failed"), 0))
    trainer: str = ""  # address of the trainer worker holding the engine
    live_recent: deque[int] = field(default_factory=lambda: deque(maxlen=LIVE_WINDOW_TURNS))
    live_versions_max: int = 0
    last_metrics: dict[str, float] = field(default_factory=dict)
    observers: list[Callable[[Event], None]] = field(default_factory=list)
    shared: SharedWeights = field(init=False)  # each version's weights as Dask data, copied peer to peer
    run_tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])  # ends every key this run submits
    _synced: float = 0.0
    _reward_warnings: RateLimit = field(default_factory=lambda: RateLimit(REWARD_WARNING_EVERY_S))
    _paused: PausedWorkers = field(default_factory=PausedWorkers)
    _finished: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # (clock time, future), as they finish
    _taken: list[tuple[float, str]] = field(default_factory=list)  # (finished, kind) since the last decisions
    _server_reports: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # servers' chunk reports
    _listening: bool = False  # subscribed to the servers' chunk reports
    outbox: dict[str, list[GroupOrder]] = field(default_factory=dict)  # source -> hand-over orders not sent yet
    hand_over_pool: ThreadPoolExecutor = field(  # sends hand-over orders (`client.run` waits for a chunk boundary)
        default_factory=lambda: ThreadPoolExecutor(HAND_OVER_THREADS, thread_name_prefix="dora-hand-over"))

    def __post_init__(self) -> None:
        self.shared = SharedWeights(self.client, self.weights, run_tag=self.run_tag)
        if self.reward_fn is None:
            self.reward_fn = self.cfg.task.reward_fn

    def close(self) -> None:
        self.hand_over_pool.shutdown(wait=False, cancel_futures=True)
        if self._listening:
            self.client.unsubscribe_topic(reports_topic(self.run_tag))
        self.release_futures()

    def release_futures(self) -> None:
        """Drop every Dask future of the run, so that a cluster that outlives it (a client given to the run) forgets
        its tasks and data at once; a task still running there ends on its own, its result unused."""
        self.tracked.clear()
        self.in_flight.clear()
        self.updates.clear()
        self.shared.futures.clear()
        while not self._finished.empty():
            self._finished.get()

    def task_key(self, name: str, *parts) -> tuple:
        """The key of a task of this run: `(name, *parts, run_tag)`. Runs one after another on one cluster never
        share a key, so no task gets the result of an earlier run's task of the same name (Dask hands back the future
        already known under a key)."""
        return (name, *parts, self.run_tag)

    # ---- events --------------------------------------------------------------------------------------------------
    def subscribe(self, observer: Callable[[Event], None]) -> None:
        self.observers.append(observer)

    def emit(self, event: Event) -> None:
        for observer in self.observers:
            observer(event)

    def end_turn(self) -> None:
        live = tuple(self.orchestrator.live_versions())
        self.live_recent.append(len(live))
        self.live_versions_max = max(self.live_versions_max, len(live))
        self.emit(Turn(self.gate.next_update, self.gate.newest, live, self.orchestrator.in_flight, self.last_metrics))

    # ---- finished futures ----------------------------------------------------------------------------------------
    def on_done(self, future: Future) -> None:
        """Take in one finished future, by what it is (a future given up on since is ignored)."""
        task = self.tracked.pop(future, None)
        if task is not None:
            self._done(task, future)

    @singledispatchmethod
    def _done(self, task, future: Future) -> None:
        raise TypeError(f"untracked task type {type(task).__name__}")

    @_done.register
    def _(self, task: RolloutTask, future: Future) -> None:
        self._raise_if_failed(future)
        self.on_rollout_done(task)

    @_done.register
    def _(self, task: HandOverTask, future) -> None:
        self.on_handed_over(task, future)

    @_done.register
    def _(self, task: ResumeTask, future: Future) -> None:
        self.on_resumed(task, future)

    @_done.register
    def _(self, task: UpdatePartTask, future: Future) -> None:
        self._trainer_result(future, f"update {task.update} failed in part {task.part}")  # next: `stream_in_scored`

    @_done.register
    def _(self, task: ScoringTask, future: Future) -> None:
        self._raise_if_failed(future)
        self.on_scored(task, future.result())

    @_done.register
    def _(self, task: UpdateTask, future: Future) -> None:
        result: UpdateResult | None = self._trainer_result(future, f"update {task.update} failed")
        if result is not None:
            self.on_published(task, result)

    @_done.register
    def _(self, task: EvaluationTask, future: Future) -> None:
        self.on_evaluated(task, future)

    def _trainer_result(self, future: Future, failed: str):
        """A trainer task's result; None when the trainer was lost (it is recovered, its updates sent again)."""
        try:
            return future.result()
        except TRAINER_LOSS as exc:
            self.recover_trainer(f"{failed}: {loss_reason(exc)}")
            return None
        except Exception:  # noqa: BLE001 - named in the RunError below
            self._raise_if_failed(future)
            raise

    def _raise_if_failed(self, future: Future) -> None:
        if future.status == "error":
            exc = future.exception()
            raise RunError(f"task {future.key} failed: {type(exc).__name__}: {exc}") from exc

    def track(self, future: Future, task: Task) -> Future:
        """Wait on `future` as `task`: it is queued for `on_done` when it finishes."""
        self.tracked[future] = task
        future.add_done_callback(lambda f: self._finished.put((self.clock.now(), f)))
        return future

    def wait_done(self, futures: list[Future]) -> None:
        """Wait until every future ended (raising the first failure), checking the workers every `POLL_S` (a paused
        engine never starts). Polled, not `result(timeout=...)`: distributed's sync can lose a result that arrives as
        its timeout fires."""
        checked = time.monotonic()
        while not all(f.done() for f in futures):
            time.sleep(DONE_POLL_S)
            if time.monotonic() - checked >= POLL_S:
                self.check_workers()
                checked = time.monotonic()
        for f in futures:
            f.result()

    def wait_any(self, timeout_s: float) -> list[Future]:
        """The tracked futures that finished since the last call, after waiting up to `timeout_s` for the first."""
        try:
            done = [self._finished.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while not self._finished.empty():
            done.append(self._finished.get())
        self._taken.extend((t, type(self.tracked[f]).__name__) for t, f in done if f in self.tracked)
        return [f for _, f in done if f in self.tracked]

    def acted(self, kinds: tuple[str, ...] | None = None) -> None:
        """The decisions on the futures taken in so far are made (only those of these task kinds, when given): record
        their reaction lag."""
        now, waiting = self.clock.now(), []
        for finished, kind in self._taken:
            if kinds is None or kind in kinds:
                self.timeline.react(kind, now - finished)
            else:
                waiting.append((finished, kind))
        self._taken = waiting

    def untrack(self, futures: list[Future]) -> None:
        for future in futures:
            self.tracked.pop(future, None)

    # ---- cluster membership --------------------------------------------------------------------------------------
    def sync_instances(self, every_s: float = 1.0) -> None:
        """Follow workers joining and leaving (a killed worker comes back under a new address): rollout instances
        and the trainer. Asks the scheduler at most every `every_s` seconds."""
        if time.time() - self._synced < every_s:
            return
        self._synced = time.time()
        workers = self.check_workers()
        if self.trainer and self.trainer not in workers.trainer:
            self.recover_trainer(f"worker {self.trainer} left the cluster")
        for address in list(self.orchestrator.instances):
            if address not in workers.rollout:
                self.restart_groups_of(address)
        kv_budget, batch_rows = engine_kv_budget(self.cfg), engine_batch_rows(self.cfg)
        for address, slots in workers.rollout.items():
            self.orchestrator.add_instance(address, slots, kv_budget=kv_budget, batch_rows=batch_rows)

    def check_workers(self) -> Workers:
        """The cluster's labelled workers; raises `ClusterError` once one has stayed paused too long."""
        workers = labelled_workers(self.client)
        self._paused.check(workers, self.cfg.cluster.paused_timeout_s)
        return workers

    def restart_groups_of(self, address: str) -> None:
        """A rollout instance died: its groups restart on their own version, those it was generating, those it
        generated whose scoring had not finished (their rollout output may have died with it before it was moved)
        and those whose responses moved to or from it."""
        generating = self.orchestrator.remove_instance(address)  # queued to restart by the orchestrator
        for gid in generating:
            lost = self.in_flight.pop(gid)
            log.warning("instance %s lost; group %d restarts on version %d", address, gid, lost.version)
            self.untrack(lost.futures)  # a scoring batch holds groups of one instance only
            self.client.cancel(lost.futures)
        touched = [gid for gid, g in self.in_flight.items()
                   if (g.instance == address and g.rolled_out) or (g.moves is not None and address in g.moves.touched)]
        for gid in touched:
            self.restart_group(gid, f"instance {address} lost")

    # ---- rollout side --------------------------------------------------------------------------------------------
    def take_server_reports(self) -> None:
        """The rollout servers' chunk reports since the last turn: responses that ended free their rows in the
        orchestrator, and a running group's KV tokens, as told by the instance the orchestrator has it on, are
        counted on it (a report of an attempt given up on, or of a group whose rollout ended since, changes
        nothing; nor does one from the instance a group is being moved away from)."""
        while not self._server_reports.empty():
            report = self._server_reports.get()
            for gid, attempt, sample in report["ended"]:
                if self._current(gid, attempt) and gid in self.orchestrator.unfinished:
                    self.orchestrator.on_request_done(gid, sample)
            for gid, attempt, tokens in report["held"]:
                where = self.orchestrator.running.get(gid)
                if self._current(gid, attempt) and where is not None and where[1] == report["instance"]:
                    self.orchestrator.on_progress(gid, tokens)

    def _current(self, gid: int, attempt: int) -> bool:
        group = self.in_flight.get(gid)
        return group is not None and group.attempt == attempt

    def prompt_for(self, group_id: int) -> Prompt:
        return self.train_prompts[group_id % len(self.train_prompts)]

    def submit_group(self, start: Start) -> None:
        gid, v = start.group_id, start.version
        if start.new:
            self.gate.on_dispatch(gid, v)
            self.timeline.gate_state(self.clock.now(), closed=self.gate.capacity() <= 0)
        attempt = self.attempts[gid] = self.attempts.get(gid, -1) + 1
        prompt = self.prompt_for(gid)
        self.store.append_dispatch(gid, prompt.prompt_id, v, attempt, self.clock.now())
        suffix = (attempt,) if attempt else ()
        seed = self.cfg.dora.seed * SEED_STRIDE + gid * ATTEMPT_SEEDS + attempt
        rolled = self.client.submit(steps.rollout, gid, prompt, v, self.weights.path_for(v),
                                    self.cfg.rollout.group_size, seed, attempt,
                                    self.shared.for_group(start.instance, v),
                                    key=self.task_key("rollout", v, gid, *suffix),
                                    workers=[start.instance], resources=ROLLOUT, pure=False)
        self.in_flight[gid] = InFlight(gid, v, attempt, [rolled], start.instance)
        self.track(rolled, RolloutTask(gid, v, start.instance))

    def on_rolled_out(self, gid: int) -> None:
        """The instance finished generating the group: free its slot; the group waits for this turn's scoring."""
        group = self.in_flight.get(gid)
        if group is not None and not group.rolled_out:
            group.rolled_out = True
            self.shared.on_loaded(group.instance, group.version)
            if gid in self.orchestrator.running:
                self.orchestrator.on_group_done(gid)
            self.unscored.append(gid)
            self.emit(GroupRolledOut(gid, self.clock.now()))

    def submit_scoring(self) -> None:
        """rollout* -> reward(groups) [-> reward model(groups)] -> advantage(groups): one chain of tasks per instance
        for the groups it finished since the last turn (reward and advantage run on CPU workers; with `reward.model`,
        the model scores them on a REWARD worker in between)."""
        by_instance: dict[str, list[int]] = {}
        for gid in self.unscored:
            if gid in self.in_flight:  # not given up on since (its instance died)
                group = self.in_flight[gid]  # a group whose responses moved is scored alone (it may restart alone)
                by_instance.setdefault(f"moved {gid}" if group.moved else group.instance, []).append(gid)
        self.unscored.clear()
        t, a = self.cfg.task, self.cfg.train
        for gids in by_instance.values():
            self.scoring_batches += 1
            n = self.scoring_batches
            rolled = [self.in_flight[g].scoring_input() for g in gids]
            rewarded = self.client.submit(steps.reward, rolled, self.model_path, self.reward_fn, t.reward_timeout_s,
                                          t.reward_isolation, t.reward_memory_bytes,
                                          key=self.task_key("reward", n), resources=CPU, pure=False)
            if self.cfg.reward.model:  # the reward model, on its own worker, combined with the rule reward
                rewarded = self.client.submit(steps.model_reward, rewarded, self.model_path,
                                              key=self.task_key("reward-model", n),
                                              resources=REWARD_MODEL, pure=False)
            scored = self.client.submit(steps.advantage, rewarded, a.advantage, a.filter_degenerate,
                                        key=self.task_key("advantage", n), resources=CPU, pure=False)
            for g in gids:
                self.in_flight[g].futures += [rewarded, scored]
            self.track(scored, ScoringTask(n, tuple(gids)))
            self.emit(ScoringSubmitted(tuple(gids), self.clock.now()))

    def on_scored(self, task: ScoringTask, groups: list[Group]) -> None:
        """A scoring batch is done: its groups are complete (the gate may put them in a batch)."""
        if tuple(g.group_id for g in groups) != task.group_ids:
            raise RunError(f"scoring batch {task.number} returned other groups than it was given")
        for group in groups:
            del self.in_flight[group.group_id]  # its futures go: the workers may drop the group
            self.gate.on_complete(group.group_id)
            self.complete[group.group_id] = group
            self.store.append_migrations(group.migrations)
        self.emit(GroupsScored(task.group_ids, self.clock.now()))

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
        if self.streaming():  # a later batch's first part would only wait for this update's version
            return False
        last = self.updates[-1].decision.update
        return len(self.updates) <= self.cfg.dora.update_lookahead and not self.checkpoint_due(last + 1)

    def submit_update(self, decision: BatchDecision) -> None:
        """gate(u) -> update(u), which publishes u+1. A batch handed over early (lookahead) reaches the trainer while
        the previous update trains and starts the moment that one's weights are written."""
        if any(g not in self.complete for g in decision.group_ids):
            return self.submit_streamed_update(decision)
        u, c = decision.update, self.cfg
        suffix = self.restart_suffix()
        batch = self.send_to_trainer([self.complete[g] for g in decision.group_ids])
        checked = self.client.submit(steps.gate, u, c.dora.max_staleness, c.rollout.group_size,
                                     c.rollout.partial_rollout, batch, key=self.task_key("gate", u, *suffix),
                                     workers=[self.trainer], pure=False)
        updated = self.client.submit(steps.update, checked, self.weights.root, key=self.task_key("update", u, *suffix),
                                     resources=TRAINER, pure=False)
        self.updates.append(QueuedUpdate(decision, self.clock.now(), batch, checked, updated))
        self.track(updated, UpdateTask(u))
        self.emit(UpdateSubmitted(u, tuple(decision.group_ids), self.clock.now()))

    def restart_suffix(self) -> tuple:
        """Ends the keys of trainer tasks: the key of a task cancelled with a lost trainer is never reused."""
        restarts = self.counters["trainer_restarts"]
        return (restarts,) if restarts else ()

    def send_to_trainer(self, groups: list[Group]) -> Future:
        """The batch goes from the driver straight to the trainer's worker, not through the scheduler inside a task
        (a paper-scale batch is hundreds of MB); the gate runs there too, so it is never copied to another worker
        (whose death would lose the only copy the scheduler kept). Lost with the trainer, it is sent again by
        `recover_trainer`."""
        try:
            [batch] = self.client.scatter([groups], workers=[self.trainer], hash=False)  # direct: as configured
        except (OSError, ValueError) as exc:  # the trainer left (ValueError: no such worker any more)
            self.recover_trainer(f"a batch could not reach it: {type(exc).__name__}")
            return self.send_to_trainer(groups)
        return batch

    def on_published(self, task: UpdateTask, result: UpdateResult) -> None:
        """Update u ended and published version u + 1. The gate and the orchestrator take it in at once (the next
        batch and the new version's prompts wait on them); the store, metrics, evaluation and checkpoint follow the
        driver's next decisions (`record_published`), or come at once when a checkpoint is due (it must find the
        trainer between two updates, before the next batch is handed over)."""
        queued = self.updates.popleft()
        if queued.decision.update != task.update:
            raise RunError(f"update {task.update} finished before update {queued.decision.update}")
        now = self.clock.now()
        groups = [self.complete.pop(g) for g in queued.decision.group_ids]
        self.gate.on_update_done(task.update)
        self.timeline.gate_state(now, closed=self.gate.capacity() <= 0)
        self.orchestrator.on_publish(result.published.version)
        self.unrecorded.append(Publication(queued.decision, queued.ready, result, groups, now))
        if self.checkpoint_due(result.published.version):
            self.record_published()

    def record_published(self) -> None:
        """The store rows, metrics and events of the updates published since the driver's last decisions, then
        their evaluations and checkpoints: after the next batch is handed over, not on the trainer's path."""
        while self.unrecorded:
            self._record(self.unrecorded.popleft())

    def _record(self, publication: Publication) -> None:
        decision, ready, result, groups, now = publication
        update, published = decision.update, result.published
        self.store.append_consumed(groups, update, now)
        self.timeline.add(UpdateTiming(update, ready, result.start_time, result.end_time, now,
                                       sum(g.num_tokens for g in groups), published.seconds, result.busy_s,
                                       result.parts))
        metrics = update_metrics(update, groups, result, self.timeline, max(self.live_recent, default=1),
                                 self.counters)
        self.store.append_update(update, result.start_time, result.end_time, published.version,
                                 published.seconds, metrics)
        self.retain_weights()
        self.last_metrics = metrics
        self.counters["restarts_in_a_row"] = 0
        self.emit(Published(update, metrics))
        self.check_rewards(metrics, groups)
        if self.evaluation_due(published.version):
            self.submit_evaluation(published.version)
        if self.checkpoint_due(published.version):
            self.checkpoint(update)

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def checkpoint(self, update: int) -> None:
        """Gate, orchestrator, store rows and the trainer's state after `update`. The trainer is between two updates
        (`may_hand_over`); if it is lost meanwhile, it is restored and the checkpoint taken again."""
        self.store.flush()
        self.pinned_versions = set(self.gate.unconsumed.values()) | {self.gate.newest}
        state = {"gate": self.gate.to_state(), "orchestrator": self.orchestrator.to_state(), "attempts": self.attempts,
                 "store_rows": self.store.row_counts(), "accuracy": self.accuracy, "version": self.gate.newest}

        def save_trainer(folder: str) -> None:
            self.client.submit(steps.save_trainer_checkpoint, folder, resources=TRAINER, pure=False,
                               key=self.task_key("checkpoint", update, self.counters["trainer_restarts"])).result()

        while True:
            try:
                self.checkpoints.save(update, state, {"trainer": save_trainer})
                break
            except TRAINER_LOSS as exc:
                self.recover_trainer(f"checkpoint {update} failed: {type(exc).__name__}")
        self.retain_weights()

    def retain_weights(self, *, drop_unseen: bool = False) -> None:
        """Keep the versions unconsumed groups still need, the newest, those a queued evaluation will read, (for
        resume) the checkpoint's, and any newer version the trainer published ahead of the driver (update lookahead:
        the next publish can land before the driver has taken in this one). `drop_unseen`: delete those too (resume
        and a restored trainer: they will be published again)."""
        keep = set(self.gate.unconsumed.values()) | {self.gate.newest} | self.pinned_versions
        keep |= {t.version for t in self.tracked.values() if isinstance(t, EvaluationTask)}
        if self.cfg.storage.keep_versions:
            keep |= set(range(max(0, self.gate.newest - self.cfg.storage.keep_versions), self.gate.newest + 1))
        self.weights.retain(keep, newer_than=None if drop_unseen else self.gate.newest)
        self.shared.retain(keep)

    # ---- start-up ------------------------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Listen to the rollout servers' chunk reports; start every engine and load the current version before the
        run's clock starts (engine start-up is minutes on a busy machine and is not part of a step); evaluate the
        current version if it is due and not evaluated yet (version 0, or the checkpoint's version after a resume)."""
        self.client.subscribe_topic(reports_topic(self.run_tag), lambda event: self._server_reports.put(event[1]))
        self._listening = True
        v, path = self.gate.newest, self.weights.path_for(self.gate.newest)
        prompt = list(self.train_prompts[0].token_ids)
        futures = [self.client.submit(steps.warm_up_rollout, v, path, prompt, key=self.task_key("warm-up", v, address),
                                      workers=[address], resources=ROLLOUT, pure=False)
                   for address in self.orchestrator.instances]
        trainer = self.client.submit(steps.warm_up_trainer, v, key=self.task_key("warm-up-trainer", v),
                                     resources=TRAINER, pure=False)
        if v not in self.accuracy and self.evaluation_due(v):
            self.submit_evaluation(v)
        self.wait_done(futures + [trainer])
        self.trainer = self.client.who_has(trainer)[trainer.key][0]
        for address in self.orchestrator.instances:
            self.shared.on_loaded(address, v)  # loaded from the store by the warm-up
        while self.evaluations():  # not `distributed.wait`: that waits on the process's default client
            for future in self.wait_any(POLL_S):
                self.on_done(future)
        self.timeline = Timeline(self.clock.now())
        self._taken.clear()
