"""Opening and closing a run; the driver (`pipelines.driver`) runs it in between.

`open_run(cfg)` validates everything that can be checked before work starts (`prepare_run`: config, run folder,
reward function, environment, dataset, engines), then starts the cluster, or attaches to the client given
(`RunInputs`, from `pipelines.api`), with engine and library output going to the run's log file (`RunLog`), checks
its labels, and only then writes into the run folder: the rows given in Python, the stores, MLflow, the driver with
its observers (MLflow tracking and the live view), the engines' warm-up.
`Run.finish()` waits for the final evaluation, audits the store, draws the plots and returns a `RunSummary`. On any
exit (Ctrl-C too) the trajectory store is flushed and closed and the cluster closed, so nothing already produced is
lost and the folder can be resumed.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import yaml
from distributed import Client

from dora_tasks import steps
from dora_tasks.core.clock import Clock
from dora_tasks.core.config import Config, apply_overrides, config_from_dict
from dora_tasks.engines.preflight import check_engines
from dora_tasks.model import CharTokenizer, load_tokenizer
from dora_tasks.episodes import EpisodeSpec
from dora_tasks.workloads.datasets import load_prompts, rows_to_prompts, split_eval
from dora_tasks.workloads.rewards import check_reward_fn
from dora_tasks.plugins import RolloutPlugin, TrainerPlugin, busy_spans, reports_topic
from pipelines.cache import cache_root
from pipelines.cluster import TRAINER, connect, required_roles, wait_for_workers, worker_wait_s
from pipelines.driver import POLL_S, Driver
from pipelines.events import Evaluated, Published, TrainerRestored, Turn
from pipelines.gate import VersionGate
from pipelines.inputs import RunInputs, UserCode, check_same_rows, write_rows
from pipelines.live import LiveView
from pipelines.metrics import summary as timing_summary
from pipelines.orchestrator import Orchestrator
from pipelines.reward_workers import reward_model_summary, start_reward_model
from pipelines.run_log import RunLog, log_path
from pipelines.switching import switching_named
from pipelines.tracking import Tracker
from storage import objectstore
from storage.checkpoint import CheckpointStore
from storage.trajectory_store import TrajectoryStore
from storage.weight_store import WeightStore

log = logging.getLogger("dora")
CONFIG_FILE = "config.yaml"
CLUSTER_CLOSE_S = 60.0  # a loaded machine takes a while to stop engine-holding workers
AUDIT_VERDICTS = ("C1 ", "C2 ", "C3 ", "reward failures", "episodes")  # the audit's lines a passing summary shows


class RunFolderError(ValueError):
    """The run folder cannot be used as asked (already holds a run, or holds none to resume)."""


@dataclass
class RunSummary:
    run_dir: str
    store: str
    tracking_uri: str
    mlflow_run_id: str | None
    metrics: dict[str, float]
    accuracy: dict[int, float]
    audit_ok: bool
    audit_text: str
    plots: list[str] = field(default_factory=list)
    ui_command: str = ""

    def to_text(self) -> str:
        acc = " ".join(f"v{v}={a:.3f}" for v, a in sorted(self.accuracy.items()))
        lines = [f"run folder:       {self.run_dir}", f"trajectory store: {self.store}",
                 f"MLflow:           {self.tracking_uri} (run {self.mlflow_run_id})",
                 f"MLflow UI:        {self.ui_command}",
                 f"held-out accuracy: {acc}"]
        lines += [f"{k}: {v:.4g}" for k, v in self.metrics.items()]
        lines += [f"plots: {', '.join(self.plots)}", f"run log: {log_path(self.run_dir)}",
                  "audit: " + ("PASS" if self.audit_ok else "FAIL")]
        if not self.audit_ok:  # every violation, as the audit reports it
            return "\n".join(lines + [self.audit_text])
        verdicts = [line for line in self.audit_text.splitlines() if line.startswith(AUDIT_VERDICTS)]
        return "\n".join(lines + verdicts + [f"full audit: dora audit {self.store}"])


@dataclass
class Run:
    """An open run: the driver and what observes it. `finish()` closes it with a summary."""

    cfg: Config
    driver: Driver
    tracker: Tracker
    live: LiveView
    checkpoints: CheckpointStore

    def log_kept_updates(self) -> None:
        """A resumed run's MLflow run is new: it gets every update the store kept, and the accuracy of every
        version evaluated before the checkpoint, as they were logged first."""
        table = self.driver.store.read_table("updates")
        names = [c for c in table if c.startswith("metrics/")]
        for row, update in enumerate(table["update"]):
            self.tracker.log_update(int(update), {c.split("/", 1)[1]: table[c][row] for c in names})
        for version, accuracy in sorted(self.driver.accuracy.items()):
            self.tracker.log_update(version, {"accuracy": accuracy})

    # ---- the end -------------------------------------------------------------------------------------------------
    def finish(self) -> RunSummary:
        d, cfg = self.driver, self.cfg
        while d.evaluations():  # the final evaluation
            for future in d.wait_any(POLL_S):
                d.on_done(future)
        busy = d.client.run(busy_spans)
        dispatched = d.store.read_table("dispatch", ["time"])["time"]
        metrics = timing_summary(d.timeline, {a: s for a, s in busy.items() if s is not None},
                                 float(dispatched.max()) if len(dispatched) else float("inf"))
        metrics["live_versions_max"] = float(d.live_versions_max)
        d.store.close()
        from storage.audit import audit_store

        report = audit_store(cfg.storage.resolved("trajectory_store"), cfg.dora.max_staleness)
        metrics.update(migration_summary(TrajectoryStore.open(cfg.storage.resolved("trajectory_store"))))
        metrics.update(reward_model_summary(TrajectoryStore.open(cfg.storage.resolved("trajectory_store"))
                                            .read_table("updates")))
        plots = self._plots()
        self.tracker.log_update(cfg.dora.num_updates, {f"summary/{k}": v for k, v in metrics.items()})
        self.tracker.log_text("audit.txt", report.to_text())
        self.tracker.log_artifact(os.path.join(cfg.storage.run_dir, CONFIG_FILE))
        for path in plots:
            self.tracker.log_artifact(path, "plots")
        return RunSummary(cfg.storage.run_dir, cfg.storage.resolved("trajectory_store"), self.tracker.tracking_uri,
                          self.tracker.run_id, metrics, dict(d.accuracy), report.ok, report.to_text(), plots,
                          self.tracker.ui_command())

    def _plots(self) -> list[str]:
        if not self.cfg.tracking.plots:
            return []
        from pipelines.plots import make_plots

        store = TrajectoryStore.open(self.cfg.storage.resolved("trajectory_store"))
        tables = {name: store.read_table(name) for name in ("dispatch", "trajectories", "updates")}
        return make_plots(tables, os.path.join(self.cfg.storage.run_dir, "plots"), self.cfg.dora.max_staleness,
                          self.driver.accuracy)


def migration_summary(store: TrajectoryStore) -> dict[str, float]:
    """Responses moved between rollout instances over the run (`rollout.switching=migrate`): how many, the bytes
    moved, and the mean seconds a receiver took to take one in (none: zeros)."""
    moved = store.read_table("migrations", ["bytes", "seconds"])
    seconds = moved["seconds"][~np.isnan(moved["seconds"])]
    return {"migrations": float(len(moved["bytes"])), "migration_bytes": float(moved["bytes"].sum()),
            "migration_s_mean": float(seconds.mean()) if len(seconds) else 0.0}


# ---- observers ---------------------------------------------------------------------------------------------------
def tracking_observer(tracker: Tracker):
    """Per-update metrics at step = update, held-out accuracy at step = policy version (0 is the initial policy)."""

    def observe(event) -> None:
        if isinstance(event, Published):
            tracker.log_update(event.update, event.metrics)
        elif isinstance(event, Evaluated) and event.accuracy is not None:
            tracker.log_update(event.version, {"accuracy": event.accuracy})

    return observe


def live_observer(live: LiveView):
    """The status line at every turn; what the operator must see (a restored trainer, a skipped evaluation) once: as
    a line of its own above the status line, or as a log warning when the live view is off."""

    def tell(message: str) -> None:
        if live.enabled:
            live.event(message)
        else:
            log.warning(message)

    def observe(event) -> None:
        if isinstance(event, Turn):
            m = event.metrics
            live.update(event.next_update, event.newest, event.live_versions, event.in_flight,
                        m.get("reward_mean", float("nan")), m.get("tokens_per_s", 0.0), int(m.get("staleness_max", 0)),
                        m.get("reward_failure_share", 0.0))
        elif isinstance(event, TrainerRestored):
            tell(restored_message(event))
        elif isinstance(event, Evaluated) and event.accuracy is None:
            tell(f"evaluation of version {event.version} failed ({event.error}); skipped, training goes on")

    return observe


def live_view(cfg: Config, clock: Clock, terminal=None) -> LiveView:
    """The status line on the run's clock (its elapsed time and rates in emulated seconds under emulated engines,
    said once above it), redrawn as often in wall time either way, on `terminal` (default stderr)."""
    live = LiveView(cfg.tracking.live_view, stream=terminal, clock=clock.now)
    live.min_interval_s = clock.span(live.min_interval_s)
    if clock.emulated:
        live.event(f"EMULATED engines: every time and rate shown is in {clock.unit}")
    return live


def restored_message(event: TrainerRestored) -> str:
    if event.optimizer_from:
        optimizer = f"the optimizer state of {event.optimizer_from}"
    elif event.checkpoint:
        optimizer = f"a FRESH optimizer state (the engine cannot take the optimizer state of {event.checkpoint} alone)"
    else:
        optimizer = "a FRESH optimizer state (no checkpoint yet)"
    return f"trainer restored at version {event.version} with {optimizer}"


# ---- the initial policy and the workers' plugins -----------------------------------------------------------------
def initial_policy(cfg: Config) -> str:
    """The model path given, or a warm-started policy (cached by its settings); for the emulated task, an emulated
    model folder (no weights, nothing to warm-start)."""
    if cfg.model.path:
        return cfg.model.path
    if cfg.emulated:
        from dora_tasks.emulation.task import write_model_folder

        folder = os.path.join(cfg.storage.run_dir, "emulated-model")
        write_model_folder(folder, cfg.emulation.model, 0)
        return folder
    from dora_tasks.warmstart import warm_start, warmstart_settings

    digest = hashlib.sha1(json.dumps(warmstart_settings(cfg), sort_keys=True).encode()).hexdigest()[:12]
    return warm_start(cfg, os.path.join(cache_root(), "warmstart", digest))


def publish_initial(weights: WeightStore, model_path: str) -> None:
    """Version 0 is the initial policy, copied into the weight store like every later version."""
    if 0 not in weights.versions():
        weights.publish(0, lambda folder: shutil.copytree(model_path, folder, dirs_exist_ok=True))


def engine_options(cfg: Config) -> dict:
    """What the configured engines need besides their own config section: the emulated ones, the cost model's
    settings and the seed of the workload's lengths; vLLM under train.lora, the adapters' rank (it sizes their slots
    at start; the transformers engine merges adapters and needs nothing)."""
    if cfg.emulated:
        return {"emulation": cfg.emulation, "seed": cfg.dora.seed}
    return {"max_lora_rank": cfg.train.lora.rank} if cfg.train.lora.enabled and cfg.rollout.engine == "vllm" else {}


def register_plugins(client: Client, cfg: Config, weight_root: str, model_path: str, clock: Clock,
                     code: UserCode | None = None, run_tag: str = "") -> None:
    """The engines' plugins on every worker; with an environment (given in Python, or task.environment), rollouts
    are multi-turn episodes. With `run_tag`, rollout servers report to that run's driver."""
    options = engine_options(cfg)
    episodes = EpisodeSpec.of(cfg.task)
    if episodes is not None and code is not None and code.environment:
        episodes = dataclasses.replace(episodes, environment=code.environment)
    rollout = dataclasses.replace(cfg.rollout, switching=cfg.switching)  # "auto" resolved for the servers
    client.register_plugin(RolloutPlugin(model_path, rollout, weight_root, options, clock, episodes=episodes,
                                         reports_topic=reports_topic(run_tag) if run_tag else ""))
    client.register_plugin(TrainerPlugin(weight_root, cfg.train, cfg.rollout.temperature, options, clock,
                                         base_path=model_path))


# ---- opening a run -----------------------------------------------------------------------------------------------
def saved_config(run_dir: str, overrides: list[str]) -> Config:
    """The configuration a run folder holds, with `overrides` on top (what `dora resume` continues with)."""
    path = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise RunFolderError(f"{run_dir!r} holds no run to resume (no {CONFIG_FILE}); start one with `dora run`")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        raise RunFolderError(f"{path} is not valid YAML, so {run_dir!r} cannot be resumed: {exc}") from None
    cfg = config_from_dict(apply_overrides(data if isinstance(data, dict) else {}, overrides))
    cfg.storage.run_dir = run_dir
    return cfg


def _store_meta(cfg: Config) -> dict:
    d = cfg.dora
    return {"group_size": cfg.rollout.group_size, "max_staleness": d.max_staleness, "train_batch_size":
            d.train_batch_size, "num_updates": d.num_updates, "partial_rollout": cfg.rollout.partial_rollout,
            "config": json.dumps(cfg.to_dict()), "clock": cfg.clock(0.0).unit,
            "synthetic": "tokens, behaviour log-probs and rewards (emulated engines)" if cfg.emulated else ""}


def _switching(cfg: Config):
    return switching_named(cfg.switching, cfg.rollout.versions_per_instance)


def _fresh_state(cfg: Config, overwrite: bool = False) -> tuple[VersionGate, Orchestrator, TrajectoryStore]:
    run_dir, store_path = cfg.storage.run_dir, cfg.storage.resolved("trajectory_store")
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, CONFIG_FILE), "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
    d = cfg.dora
    gate = VersionGate(d.max_staleness, d.train_batch_size, lookahead=d.update_lookahead, order=d.batch_order,
                       stream=d.stream_updates)
    orch = Orchestrator(d.rollout_batch_size, d.num_updates * d.train_batch_size,
                        switching=_switching(cfg), group_size=cfg.rollout.group_size)
    return gate, orch, TrajectoryStore.create(store_path, _store_meta(cfg), overwrite=overwrite)


def _resumed_state(cfg: Config, ckpt):
    state = ckpt.state
    gate = VersionGate.from_state(state["gate"], lookahead=cfg.dora.update_lookahead, order=cfg.dora.batch_order,
                                  stream=cfg.dora.stream_updates)
    gate.complete = set()  # rollouts not consumed at the checkpoint run again, on their own version
    d = cfg.dora
    orch = Orchestrator(d.rollout_batch_size, d.num_updates * d.train_batch_size, newest=gate.newest,
                        next_group_id=state["orchestrator"]["next_group_id"],
                        switching=_switching(cfg), group_size=cfg.rollout.group_size)
    for gid, version in sorted(gate.unconsumed.items()):
        orch.requeue(gid, version)
    store = TrajectoryStore.open(cfg.storage.resolved("trajectory_store"), mode="a")
    store.truncate_to(state["store_rows"])
    return gate, orch, store


def _checkpoint_to_resume(checkpoints: CheckpointStore):
    """The latest complete checkpoint; None (said loudly) when the run was stopped before its first one."""
    ckpt = checkpoints.latest()
    if ckpt is None:
        log.warning("%s holds no complete checkpoint: the run starts again from update 0", checkpoints.root)
    return ckpt


@dataclass
class Prepared:
    """What `prepare_run` checked and read before any cluster starts."""

    cfg: Config
    code: UserCode
    train_prompts: list
    eval_prompts: list
    checkpoints: CheckpointStore
    ckpt: object = None  # the checkpoint to resume from; None: from the start


def prepare_run(cfg: Config | None, resume_dir: str, overrides: list[str], inputs: RunInputs) -> Prepared:
    """Check everything cheap, before any cluster starts: config, run folder, reward, environment, dataset,
    engines."""
    if resume_dir:
        cfg = saved_config(resume_dir, overrides)
    code = inputs.code(cfg)
    check_reward_fn(code.reward)
    if code.environment:
        from dora_tasks.workloads.environments import check_environment

        check_environment(code.environment)
    checkpoints = CheckpointStore(cfg.storage.resolved("checkpoint_store"))
    tokenizer = load_tokenizer(cfg.model.path) if cfg.model.path else CharTokenizer()
    if inputs.rows is None:
        train_prompts, eval_prompts = load_prompts(cfg.task, tokenizer, cfg.dora.seed, cfg.emulation)
    else:
        if resume_dir:
            check_same_rows(inputs.rows, cfg.task.dataset)
        prompts = rows_to_prompts(inputs.rows, cfg.task, tokenizer, source="the dataset rows given")
        train_prompts, eval_prompts = split_eval(prompts, cfg.task.eval_prompts, cfg.dora.seed)
    check_engines(cfg, cfg.model.path or None, train_prompts)
    if not resume_dir and objectstore.exists(cfg.storage.resolved("trajectory_store")):
        raise RunFolderError(f"storage.run_dir {cfg.storage.run_dir!r} already holds a run; resume it with "
                             f"`dora resume {cfg.storage.run_dir}` or choose another storage.run_dir")
    ckpt = _checkpoint_to_resume(checkpoints) if resume_dir else None
    return Prepared(cfg, code, train_prompts, eval_prompts, checkpoints, ckpt)


def attach(stack: contextlib.ExitStack, cfg: Config, client: Client | None) -> Client:
    """The client given (left open), else one on the embedded cluster or `cluster.scheduler_address` (closed with
    `stack`)."""
    if client is not None:
        return client
    cluster, client = connect(cfg)
    if cluster is not None:
        stack.callback(close_cluster, cluster)
    stack.callback(client.close)
    return client


def close_cluster(cluster) -> None:
    """Close the embedded cluster; on a machine too busy to close it in time, one warning instead of a traceback
    that would hide the run's own outcome (the Nannies have killed their worker processes by then)."""
    try:
        cluster.close(timeout=CLUSTER_CLOSE_S)
    except (TimeoutError, asyncio.TimeoutError) as exc:
        log.warning("the embedded cluster did not close within %.0f s (%s); its worker processes were killed",
                    CLUSTER_CLOSE_S, type(exc).__name__)


@contextlib.contextmanager
def open_run(cfg: Config | None, resume_dir: str = "", overrides: list[str] | None = None,
             inputs: RunInputs | None = None):
    """`prepare_run`, then start the cluster (engine and library output to the run's log file) and check its
    labels, and only then write into the run folder."""
    inputs = inputs or RunInputs()
    p = prepare_run(cfg, resume_dir, overrides or [], inputs)
    cfg, ckpt = p.cfg, p.ckpt
    with contextlib.ExitStack() as stack:
        run_log = stack.enter_context(RunLog(cfg.storage.run_dir, cfg.tracking.log_file))
        try:
            client = attach(stack, cfg, inputs.client)
            wait_for_workers(client, worker_wait_s(cfg.cluster), required_roles(cfg))
        except BaseException:
            run_log.discard()  # nothing of the run is written before its cluster answers
            raise
        if inputs.rows is not None and not resume_dir:
            write_rows(inputs.rows, cfg.task.dataset)  # at task.dataset: the warm start and a resume read them there
        model_path = initial_policy(cfg)
        check_engines(cfg, model_path, p.train_prompts)  # again, with the real initial policy
        weights = WeightStore(cfg.storage.resolved("weight_store"))
        if ckpt is not None:
            gate, orch, store = _resumed_state(cfg, ckpt)
        else:
            gate, orch, store = _fresh_state(cfg, overwrite=bool(resume_dir))
        stack.callback(store.close)
        publish_initial(weights, model_path)
        model_path = weights.share_initial(model_path, overwrite=not resume_dir)  # on an object store: a copy there
        clock = cfg.clock(origin=time.time())
        run_tag = uuid.uuid4().hex[:8]
        register_plugins(client, cfg, weights.root, model_path, clock, p.code, run_tag)
        start_reward_model(client, cfg)  # with `reward.model`: loaded on its workers before the clock starts
        run_log.say(f"Dask dashboard {client.dashboard_link}")
        tracker = stack.enter_context(Tracker(cfg, resume=bool(resume_dir)))
        live = live_view(cfg, clock, run_log.terminal)
        stack.callback(live.close)
        driver = Driver(cfg, client, gate, orch, store, weights, model_path, p.train_prompts, p.eval_prompts,
                        p.checkpoints, clock=clock, reward_fn=p.code.reward, run_tag=run_tag)
        stack.callback(driver.close)
        yield _started(Run(cfg, driver, tracker, live, p.checkpoints), ckpt, bool(resume_dir))


def _started(run: Run, ckpt, resumed: bool) -> Run:
    """The run restored (from `ckpt`, or started again), observed, and its engines warm."""
    driver = run.driver
    if ckpt is not None:
        _restore(run, ckpt)
    elif resumed:
        driver.retain_weights(drop_unseen=True)  # started again: versions of the stopped attempt go
    run.log_kept_updates()
    driver.subscribe(tracking_observer(run.tracker))
    driver.subscribe(live_observer(run.live))
    driver.sync_instances()
    driver.warm_up()  # engines loaded and the current version evaluated before the clock starts
    return run


def _restore(run: Run, ckpt) -> None:
    d = run.driver
    d.attempts = {int(g): a for g, a in ckpt.state["attempts"].items()}
    d.accuracy = {int(v): a for v, a in ckpt.state["accuracy"].items()}
    d.pinned_versions = set(d.gate.unconsumed.values()) | {d.gate.newest}
    d.retain_weights(drop_unseen=True)  # versions published after the checkpoint will be published again
    d.client.submit(steps.load_trainer_checkpoint, ckpt.file("trainer"), d.gate.newest,
                    key=d.task_key("restore", ckpt.update), resources=TRAINER, pure=False).result()
    log.info("resumed from %s at version %d with %d groups to roll out again", ckpt.path, d.gate.newest,
             len(d.gate.unconsumed))
