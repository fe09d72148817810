"""Per-worker state as Dask WorkerPlugins: the rollout server on rollout instances, the train engine on the trainer,
the reward model on reward workers.

Worker labels (Dask resources) decide who is who:
  rollout instance: ``GPU=1,ROLLOUT=<slots>``  (and ``--nthreads <slots>``)
  trainer:          ``GPU=1,TRAINER=1``
  CPU worker:       ``CPU=<threads>``          (reward and advantage tasks)
  reward model:     ``GPU=1,REWARD=1``         (and ``--nthreads`` for the scoring tasks merged into one forward)
A plugin registered on the whole cluster sets itself up only on the workers that carry its label, creates its engine
lazily on first use (engine start takes seconds), and is set up again by Dask when the Nanny restarts a killed worker.
"""
from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field

from distributed import WorkerPlugin, get_worker

from dora_tasks.allocator import relax_malloc_trimming
from dora_tasks.core.clock import Clock
from dora_tasks.core.config import RolloutConfig, TrainConfig
from dora_tasks.core.config_reward import RewardConfig
from dora_tasks.episodes import EpisodeSpec

ROLLOUT_PLUGIN = "dora-rollout"
TRAINER_PLUGIN = "dora-trainer"
REWARD_MODEL_PLUGIN = "dora-reward-model"
WORKER_ENV = {
    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def _set_worker_env() -> None:
    for key, value in WORKER_ENV.items():
        os.environ.setdefault(key, value)
    if "torch" in sys.modules:  # else torch takes OMP_NUM_THREADS when first imported: emulated workers never import it
        sys.modules["torch"].set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    relax_malloc_trimming()  # the nanny's MALLOC_TRIM_THRESHOLD_ doubles a train step's time (allocator.py)


@dataclass
class RolloutPlugin(WorkerPlugin):
    model_path: str
    rollout: RolloutConfig
    weight_store: str
    engine_options: dict = field(default_factory=dict)  # passed on to the engine (`make_rollout_engine`)
    clock: Clock = field(default_factory=Clock)  # the run's clock: timestamps of groups and busy spans
    episodes: EpisodeSpec | None = None  # multi-turn episodes with an environment (`dora_tasks.episodes`), if set
    reports_topic: str = ""  # where the server's chunk reports go (Dask events: `worker.log_event`); "": nowhere
    name: str = ROLLOUT_PLUGIN

    def setup(self, worker) -> None:
        self.server = None
        if "ROLLOUT" not in worker.state.total_resources:
            return
        _set_worker_env()
        from dora_tasks.engines.rollout_factory import make_rollout_engine, rollout_engine_class
        from dora_tasks.rollout_server import RolloutServer
        from dora_tasks.version_loads import VersionLoads
        from dora_tasks.version_policy import ConcurrentVersions, DispatchVersion, PartialRollout
        from storage.weight_store import WeightStore

        # the engine's module (torch, for a real engine) is imported here, before any task: the engine thread
        # importing it while a task's thread unpickles a handed-over KV cache (torch too) can deadlock the imports
        rollout_engine_class(self.rollout.engine)
        store = WeightStore(self.weight_store)

        def newest() -> tuple[int | None, str]:
            version = store.latest()  # listed once: the path is that of the version returned
            return version, "" if version is None else store.path_for(version)

        policy = PartialRollout(newest) if self.rollout.partial_rollout else DispatchVersion()
        if self.rollout.versions_per_instance > 1:
            policy = ConcurrentVersions(self.rollout.versions_per_instance)
        self.version_loads = VersionLoads()  # wakes handed-over responses waiting for their version (`steps.resume`)
        make_engine = self.version_loads.watching(lambda: make_rollout_engine(self.model_path, self.rollout, version=0,
                                                                              **self.engine_options))
        self.server = RolloutServer(make_engine, policy,
                                    self.rollout.chunk_tokens, keep_kv_cache=self.rollout.keep_kv_cache,
                                    row_streams=self.rollout.per_row_streams,
                                    on_report=self._reporter(worker))

    def _reporter(self, worker):
        """Chunk reports as Dask events to the driver (msgpack takes lists): the instance, each ended response as
        [group id, attempt, sample], and, where requests migrate, each request's KV tokens as [group id, attempt,
        tokens] (the orchestrator places moved requests within the receivers' KV budgets)."""
        topic = self.reports_topic
        if not topic:
            return None
        with_kv = self.rollout.switching == "migrate"

        def report(r) -> None:
            held = [[*request, tokens] for request, tokens in r.held] if with_kv else []
            if r.ended or held:
                worker.log_event(topic, {"instance": worker.address, "held": held,
                                         "ended": [[*request, sample] for request, sample in r.ended]})
        return report

    def teardown(self, worker) -> None:
        if getattr(self, "server", None) is not None:
            self.server.close()


class TrainerLost(RuntimeError):
    """This trainer worker holds no engine: it was restarted after its process died. The driver restores it
    (`restore_trainer`) and hands the updates over again; no task of a restarted trainer builds an engine on its own."""


@dataclass
class TrainerPlugin(WorkerPlugin):
    """The train engine, created once by `warm_up_trainer` or `restore_trainer`. A trainer worker that died and was
    restarted by its Nanny has none until the driver restores it."""

    weight_store: str
    train: TrainConfig
    temperature: float = 1.0  # rollout sampling temperature: behaviour log-probs are taken after it
    engine_options: dict = field(default_factory=dict)  # passed on to the engine (`make_train_engine`)
    clock: Clock = field(default_factory=Clock)  # the run's clock: timestamps of updates and publishes
    base_path: str = ""  # where workers read the initial model: the base of train.lora's adapters
    name: str = TRAINER_PLUGIN

    def setup(self, worker) -> None:
        self.engine = None
        if "TRAINER" in worker.state.total_resources:
            _set_worker_env()

    def engine_at(self, version: int):
        """The engine if it holds `version`; None if it has not reached it yet (an earlier update has still to run).
        `TrainerLost` without an engine; a trainer past `version` is an error."""
        engine = self.held_engine()
        if engine.version > version:
            raise RuntimeError(f"trainer holds version {engine.version}, update {version} needs version {version}")
        return engine if engine.version == version else None

    def held_engine(self):
        if self.engine is None:
            raise TrainerLost(f"trainer {get_worker().address} holds no engine (its worker was restarted)")
        return self.engine

    def start_engine(self, version: int):
        """A new engine on the published weights of `version` (any engine held before is closed)."""
        from dora_tasks.engines.factory import make_train_engine
        from storage.weight_store import WeightStore

        if self.engine is not None:
            self.engine.close()
            self.engine = None
        path = WeightStore(self.weight_store).path_for(version)
        self.engine = make_train_engine(path, self.train, version=version, temperature=self.temperature,
                                        base_path=self.base_path, **self.engine_options)
        return self.engine

    def get_engine(self, version: int):
        return self.engine if self.engine is not None else self.start_engine(version)

    def teardown(self, worker) -> None:  # replaced by the next run's plugin on a cluster that outlives this run
        if getattr(self, "engine", None) is not None:
            self.engine.close()
            self.engine = None


def reports_topic(run_tag: str) -> str:
    """The Dask event topic of one run's chunk reports (a run's own: runs follow one another on one cluster)."""
    return f"dora-server-reports-{run_tag}"


def rollout_server():
    plugin = get_worker().plugins[ROLLOUT_PLUGIN]
    if plugin.server is None:
        raise RuntimeError(f"worker {get_worker().address} is not a rollout instance (needs the ROLLOUT resource)")
    return plugin.server


def trainer_plugin() -> TrainerPlugin:
    return get_worker().plugins[TRAINER_PLUGIN]


def rollout_plugin() -> RolloutPlugin:
    return get_worker().plugins[ROLLOUT_PLUGIN]


def rollout_clock() -> Clock:
    return get_worker().plugins[ROLLOUT_PLUGIN].clock


def busy_spans(dask_worker):
    """(start, end) spans in which a rollout instance decoded, on the run's clock (`client.run` on every worker;
    None elsewhere). The server records wall times; the clock maps them exactly. It lives here, not beside the
    driver, so that unpickling it on a worker imports nothing more than the worker holds."""
    plugin = dask_worker.plugins.get(ROLLOUT_PLUGIN)
    server = getattr(plugin, "server", None)
    return None if server is None else [(plugin.clock.at(s), plugin.clock.at(e)) for s, e in server.busy.spans]


def engine_pace(dask_worker) -> tuple[float, float] | None:
    """An emulated rollout instance's (seconds its engine emulated, wall seconds its server had requests to serve);
    None on other workers and engines. Where this machine keeps up, the first is the second times
    `emulation.speedup`: what falls short is this machine's CPU (the server's work between chunks, late wake-ups)
    passing as emulated time in which the instance produced nothing."""
    server = getattr(dask_worker.plugins.get(ROLLOUT_PLUGIN), "server", None)
    engine = None if server is None else server.engine
    if engine is None or not hasattr(engine, "emulated_s"):
        return None
    return engine.emulated_s, server.serving.busy_seconds()


async def hand_over_requests(request_ids: list, dask_worker) -> list[tuple]:
    """Hand the running responses of `request_ids` over at this rollout instance's next chunk boundary (`client.run`
    on the source instance, not a task: every thread of the worker may be held by a rollout task blocked on the
    server). Their rollout (or resume) tasks answer with the continuations; this answers (request id, sample index)
    of each."""
    import asyncio

    server = getattr(dask_worker.plugins.get(ROLLOUT_PLUGIN), "server", None)
    if server is None:
        return []
    handed = await asyncio.to_thread(server.hand_over, requests=request_ids)
    return sorted((tuple(c.request_id), c.sample_index) for c in handed)


@dataclass
class RewardModelPlugin(WorkerPlugin):
    """The reward model (`reward.model`) on workers labelled ``REWARD``, loaded once on first use, behind a batcher
    that merges the scoring tasks running at once on the worker's threads into shared forward passes."""

    reward: RewardConfig
    name: str = REWARD_MODEL_PLUGIN

    def setup(self, worker) -> None:
        self.batcher, self.role = None, "REWARD" if "REWARD" in worker.state.total_resources else ""
        self._lock = threading.Lock()
        if self.role:
            _set_worker_env()

    def scorer(self):
        """The batcher in front of the model, created (and the model loaded) by the first call."""
        if not self.role:
            raise RuntimeError(f"worker {get_worker().address} carries no REWARD label: reward models run only on "
                               "workers started with --resources \"GPU=1,REWARD=1\"")
        with self._lock:
            if self.batcher is None:
                from dora_tasks.workloads.reward_batcher import ForwardBatcher
                from dora_tasks.workloads.reward_model import load_reward_model

                model = load_reward_model(self.reward)
                self.batcher = ForwardBatcher(model.score, self.reward.batch_size, self.reward.batch_window_s)
        return self.batcher

    def teardown(self, worker) -> None:
        if getattr(self, "batcher", None) is not None:
            self.batcher.close()


def reward_model_plugin() -> RewardModelPlugin:
    return get_worker().plugins[REWARD_MODEL_PLUGIN]
