"""Start the embedded cluster, or attach to one by scheduler address, and check its workers carry the right labels.

Embedded default: a SpecCluster of Nanny worker processes on this machine, GPU-labelled like a real cluster:
  rollout-i   ``GPU=1, ROLLOUT=<rollout.slots>``, ``nthreads=<rollout.slots>`` (one per instance)
  trainer     ``GPU=1, TRAINER=1``, ``nthreads=TRAINER_THREADS`` (updates take the label one at a time; the gate of the
              next batch, which asks for no label, checks it on the other thread meanwhile)
  cpu-i       ``CPU=<cluster.cpu_threads>`` (reward, advantage, evaluation)
  reward      ``GPU=1, REWARD=1``, ``nthreads=REWARD_THREADS`` (only with `reward.model`: the reward model's scoring;
              its threads let scoring tasks of several instances wait at once, merged into one forward pass)
Every socket of the embedded cluster listens on `cluster.host` (loopback by default): a Dask scheduler runs any
pickled function sent to it. With `cluster.tls_*` set, the driver's client and the embedded cluster speak TLS only.
A real cluster is launched the same way by hand (see the README, also for its binding and TLS flags):
  dask scheduler
  dask worker tcp://HOST:8786 --nthreads 4 --resources "GPU=1,ROLLOUT=4"     # one per rollout GPU
  dask worker tcp://HOST:8786 --nthreads 2 --resources "GPU=1,TRAINER=1"     # the trainer GPU
  dask worker tcp://HOST:8786 --nthreads 4 --resources "CPU=4"               # reward workers
  dask worker tcp://HOST:8786 --nthreads 8 --resources "GPU=1,REWARD=1"      # a reward-model GPU (reward.model)
The driver's client fetches results straight from the workers (``cluster.direct_to_workers``), so the scheduler does
not relay every group to the driver.
"""
from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from dataclasses import dataclass, field

import dask
from distributed import Client, Nanny, Scheduler, Security, SpecCluster
from distributed.comm.core import CommClosedError, FatalCommClosedError

from dora_tasks.core.config import ClusterConfig, Config
from dora_tasks.plugins import WORKER_ENV

log = logging.getLogger("dora")
# What a task asks for, by where it must run (`client.submit(..., resources=CPU)`): one slot of that label.
ROLLOUT, TRAINER, CPU = {"ROLLOUT": 1}, {"TRAINER": 1}, {"CPU": 1}
# A migrated response continues as one row of its new instance's batch, not in a slot of its own: its resume task
# asks for the rollout label without taking a slot, and leaves the worker's thread pool while it waits (`secede`).
ROLLOUT_ROW = {"ROLLOUT": 0}
# A reward-model scoring task likewise asks for the REWARD label without taking it: the tasks running at once on a
# reward worker (its threads) are what its batcher merges into one forward pass, so none may hold the label alone.
REWARD_MODEL = {"REWARD": 0}
TRAINER_THREADS = 2  # the update's, and the gate's of the batch that follows it
REWARD_THREADS = 8  # embedded reward worker: scoring tasks in flight at once (they mostly wait on the batcher)
MIN_WORKER_WAIT_S = 30.0  # a Nanny restarts a worker within seconds; a cluster's workers may take longer to join
WORKER_POLL_S = 0.2  # how often the scheduler is asked again while a worker is missing
WORKER_PRELOAD = "dora_tasks.worker_preload"  # run in each embedded worker as it starts: Ctrl-C is the driver's
ROLE_LABELS = {"rollout": "rollout (GPU=1,ROLLOUT=n)", "trainer": "trainer (GPU=1,TRAINER=1)", "cpu": "CPU (CPU=n)",
               "reward": "reward model (GPU=1,REWARD=1)"}

# The embedded cluster shares the driver's cores, and its Nannies and scheduler live in the driver process: the
# workers' statistical profiler (a stack sample of every task thread every 10 ms), the 100 ms memory polls of every
# Nanny and worker, the 0.5 s system monitors and every server's 20 ms event-loop tick (it only measures the loop's
# delay, yet many idle workers' ticks fill a core) take CPU the engines need, so they run rarely or not at all.
# Memory limits still hold (checked every 0.5 s); the dashboard's profile page stays empty.
# On a real cluster, set the same keys in the workers' Dask config if their cores are scarce.
EMBEDDED_DASK_CONFIG = {
    "distributed.worker.profile.enabled": False,
    "distributed.worker.memory.monitor-interval": "500ms",
    "distributed.admin.system-monitor.interval": "2s",
    "distributed.admin.tick.interval": "1s",
}
# Embedded workers are forked from a server process that imported Dask once, instead of each starting a fresh
# interpreter (spawn), so a run starts and closes sooner (docs/benchmark.md). A forked worker inherits that server's
# environment, so each Nanny passes this process's whole environment on (`os.environ` when the cluster starts).
WORKER_START_METHOD = {"distributed.worker.multiprocessing-method": "forkserver"}


class ClusterError(RuntimeError):
    """The cluster cannot be reached or lacks workers with the needed labels."""


@dataclass
class Workers:
    rollout: dict[str, int]  # address -> slots (value of the ROLLOUT resource)
    trainer: list[str]
    cpu: list[str]
    paused: dict[str, str] = field(default_factory=dict)  # address -> "role, memory of limit" (no task runs there)
    reward: list[str] = field(default_factory=list)  # reward-model workers (label REWARD)


def _describe_paused(info: dict, role: str) -> str:
    memory, limit = info.get("metrics", {}).get("memory"), info.get("memory_limit")
    if not memory or not limit:
        return role
    return f"{role}, process memory {memory / 2**30:.2f} GiB of its {limit / 2**30:.2f} GiB limit"


def security(cfg: ClusterConfig) -> Security | None:
    """TLS from `cluster.tls_*`, one certificate for every role, plain TCP refused; None when unset (Dask's own
    `distributed.comm.tls` config then applies)."""
    if not cfg.tls_cert:
        return None
    return Security(tls_ca_file=cfg.tls_ca_file, require_encryption=True,
                    tls_client_cert=cfg.tls_cert, tls_client_key=cfg.tls_key,
                    tls_scheduler_cert=cfg.tls_cert, tls_scheduler_key=cfg.tls_key,
                    tls_worker_cert=cfg.tls_cert, tls_worker_key=cfg.tls_key)


def embedded_cluster(cfg: Config) -> SpecCluster:
    dask.config.set(WORKER_START_METHOD)  # for good: a Nanny restarting its worker later starts it the same way
    env = {**os.environ, **WORKER_ENV}
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, cfg.rollout.kv_cache_bytes // 2**30))
    sec = security(cfg.cluster)
    # A Nanny passes host and protocol on to its worker, whose HTTP server then listens on that host too.
    listen = {"host": cfg.cluster.host, "protocol": "tls" if sec else "tcp", "security": sec}

    def nanny(nthreads: int, resources: dict[str, float]) -> dict:
        return {"cls": Nanny, "options": {"nthreads": nthreads, "resources": resources, "env": env,
                                          "memory_limit": cfg.cluster.worker_memory, "silence_logs": logging.ERROR,
                                          "preload": [WORKER_PRELOAD], **listen}}

    slots = cfg.rollout.slots
    workers = {f"rollout-{i}": nanny(slots, {"GPU": 1, "ROLLOUT": slots}) for i in range(cfg.rollout.instances)}
    workers["trainer"] = nanny(TRAINER_THREADS, {"GPU": 1, "TRAINER": 1})
    for i in range(cfg.cluster.cpu_workers):
        workers[f"cpu-{i}"] = nanny(cfg.cluster.cpu_threads, {"CPU": cfg.cluster.cpu_threads})
    if cfg.reward.model:
        workers["reward"] = nanny(REWARD_THREADS, {"GPU": 1, "REWARD": 1})
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": cfg.cluster.dashboard_address, **listen}}
    with dask.config.set(EMBEDDED_DASK_CONFIG):  # read by the scheduler and Nannies now, passed on to the workers
        return SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.ERROR, security=sec)


def connect(cfg: Config) -> tuple[SpecCluster | None, Client]:
    """Client on the embedded cluster, or on `cluster.scheduler_address` (clear error if it cannot be reached)."""
    sec = security(cfg.cluster)
    if not cfg.cluster.scheduler_address:
        cluster = embedded_cluster(cfg)
        return cluster, Client(cluster, security=sec, direct_to_workers=cfg.cluster.direct_to_workers)
    address = cfg.cluster.scheduler_address
    try:
        client = Client(address, timeout=cfg.cluster.connect_timeout_s, security=sec,
                        direct_to_workers=cfg.cluster.direct_to_workers)
    except (TypeError, OSError, asyncio.TimeoutError, TimeoutError) as exc:
        if isinstance(exc, TypeError) and "TLS" not in str(exc):
            raise
        raise _connect_error(cfg.cluster, exc) from None
    return None, client


TLS_KEYS = "cluster.tls_ca_file, cluster.tls_cert and cluster.tls_key"


def _connect_error(cfg: ClusterConfig, exc: BaseException) -> ClusterError:
    """One line naming the key to change, by how distributed failed: TypeError = a tls:// address without TLS
    settings, FatalCommClosedError or an ssl.SSLError cause = a refused certificate, CommClosedError = a plain TCP
    client hung up on (e.g. by a TLS scheduler), else nothing answered in time."""
    address = cfg.scheduler_address
    if isinstance(exc, TypeError):
        return ClusterError(f"cluster.tls_cert: {address} is a TLS address but no certificate is set; set {TLS_KEYS}")
    if isinstance(exc, (FatalCommClosedError, ssl.SSLError)) or isinstance(exc.__cause__, ssl.SSLError):
        reason = str(exc.__cause__ or exc).splitlines()[0]
        return ClusterError(f"cluster.tls_cert: the TLS handshake with the Dask scheduler at {address} failed "
                            f"({reason}); set {TLS_KEYS} to a certificate signed by the CA the scheduler trusts")
    if isinstance(exc, CommClosedError):
        return ClusterError(f"cluster.scheduler_address: the Dask scheduler at {address} closed the connection at "
                            f"once; if it runs with TLS, use its tls:// address and set {TLS_KEYS}")
    return ClusterError(f"cluster.scheduler_address: cannot reach the Dask scheduler at {address} within "
                        f"{cfg.connect_timeout_s:.0f} s ({type(exc).__name__}); start it with `dask scheduler` or "
                        "leave the address empty for the embedded cluster")


def labelled_workers(client: Client) -> Workers:
    """The connected workers by label, asked of the scheduler itself (`client.scheduler_info()` is a cache that the
    client refreshes in the background and can read empty for a moment: every instance would look lost)."""
    rollout, trainer, cpu, reward, paused = {}, [], [], [], {}
    for address, info in client.sync(client.scheduler.identity, n_workers=-1)["workers"].items():
        res = info.get("resources", {})
        roles = []
        if "ROLLOUT" in res and "GPU" in res:
            rollout[address] = int(res["ROLLOUT"])
            roles.append("rollout instance")
        if "TRAINER" in res and "GPU" in res:
            trainer.append(address)
            roles.append("trainer")
        if "CPU" in res:
            cpu.append(address)
            roles.append("CPU worker")
        if "REWARD" in res:
            reward.append(address)
            roles.append("reward-model worker")
        if info.get("status") == "paused":
            paused[address] = _describe_paused(info, " and ".join(roles) or "unlabelled worker")
    return Workers(rollout, sorted(trainer), sorted(cpu), paused, sorted(reward))


class PausedWorkers:
    """Follows workers that Dask's memory monitor paused (above `distributed.worker.memory.pause` of their memory
    limit no task starts there): a warning at once, a `ClusterError` once one stayed paused `timeout_s`, instead of
    a run that waits forever for tasks that cannot start."""

    def __init__(self) -> None:
        self.since: dict[str, float] = {}

    def check(self, workers: Workers, timeout_s: float, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.since = {a: self.since.get(a, now) for a in workers.paused}
        for address, what in workers.paused.items():
            paused_s = now - self.since[address]
            if paused_s == 0:
                log.warning("worker %s (%s) is paused by Dask's memory monitor", address, what)
            elif paused_s >= timeout_s:
                raise ClusterError(
                    f"worker {address} ({what}) has been paused by Dask's memory monitor for {paused_s:.0f} s, so "
                    "no task starts on it and the run cannot go on; give it more memory: cluster.worker_memory "
                    "(embedded cluster) or `dask worker --memory-limit`, or lower its use (rollout.kv_cache_bytes, "
                    "rollout.slots)")


def worker_wait_s(cfg: ClusterConfig) -> float:
    """How long the driver waits for a worker to (re)join before it gives up."""
    return max(MIN_WORKER_WAIT_S, cfg.connect_timeout_s)


def required_roles(cfg: Config) -> tuple[str, ...]:
    """The worker roles a run needs: rollout, trainer and CPU workers, and reward-model workers with `reward.model`."""
    return ("rollout", "trainer", "cpu") + (("reward",) if cfg.reward.model else ())


def wait_for_workers(client: Client, timeout_s: float, roles: tuple[str, ...] = ("rollout", "trainer", "cpu"),
                     then: str = "start workers with `dask worker ADDRESS --resources ...` (see README)") -> Workers:
    """Wait until at least one worker of each of `roles` (keys of `ROLE_LABELS`) is connected; `then` ends the
    error's message: what the user does next."""
    deadline = time.time() + timeout_s
    while True:
        workers = labelled_workers(client)
        missing = [ROLE_LABELS[role] for role in roles if not getattr(workers, role)]
        if not missing:
            return workers
        if time.time() > deadline:
            raise ClusterError(f"the cluster has no worker labelled {', '.join(missing)} after {timeout_s:.0f} s; "
                               + then)
        time.sleep(WORKER_POLL_S)
