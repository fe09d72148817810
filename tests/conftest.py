"""Shared fixtures: one thread per process (2-core machines), offline hub, small real pipeline configs, and embedded
clusters shared by the end-to-end runs of one cluster shape."""
from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from dora_tasks.core.config import Config, load_config  # noqa: E402

torch.set_num_threads(1)

SMALL_RUN = [
    "model.hidden_size=64", "model.num_layers=2", "model.num_heads=2", "model.warmstart_steps=150",
    "task.max_count=200", "task.num_prompts=512", "task.eval_prompts=16",
    "rollout.instances=2", "rollout.slots=1", "rollout.group_size=4", "rollout.max_new_tokens=96",
    "dora.train_batch_size=4", "dora.rollout_batch_size=8", "dora.num_updates=6",
    "cluster.cpu_workers=1", "cluster.cpu_threads=1", "cluster.worker_memory=3GiB",
    "storage.checkpoint_interval=0", "tracking.live_view=false", "tracking.plots=false",
]


@pytest.fixture
def small_config(tmp_path):
    """A real run small enough for CI: a tiny warm-started Qwen2, the long-tailed countdown task, 2 instances."""

    def make(*overrides: str) -> Config:
        base = SMALL_RUN + [f"storage.run_dir={tmp_path / 'run'}", f"tracking.mlflow_uri=sqlite:///{tmp_path}/ml.db"]
        return load_config(None, base + list(overrides))

    return make


# ---- embedded clusters shared between tests ----------------------------------------------------------------------
SHARED_CLUSTERS_KEPT = 3  # shapes alive at once (the default suite interleaves 5); ~390 MiB unique per worker


def cluster_shape(cfg: Config) -> tuple:
    """Everything `pipelines.cluster.embedded_cluster` builds its workers from: two configs of one shape get the same
    cluster."""
    r = cfg.rollout
    return (r.instances, r.slots, r.kv_cache_bytes, bool(cfg.reward.model), dataclasses.astuple(cfg.cluster))


class SharedClusters:
    """Embedded clusters that outlive a test, one per cluster shape, the most recently used few kept. A test whose run
    neither kills nor restarts workers, nor checks how its cluster starts or closes, passes `client_for(cfg)` to its
    run (`RunInputs(client=...)`) instead of starting a cluster of its own, whose workers import the engines again
    at its first run, and closing it (~45 s of a 2-core machine at load 5; a later run on a warm cluster: ~1-2 s)."""

    def __init__(self) -> None:
        self.open: OrderedDict[tuple, tuple] = OrderedDict()  # shape -> (cluster, client)

    def client_for(self, cfg: Config):
        from distributed import Client

        from pipelines.cluster import embedded_cluster, security

        shape = cluster_shape(cfg)
        if shape in self.open and self._whole(*self.open[shape]):
            self.open.move_to_end(shape)
            return self.open[shape][1]
        self._close(shape)
        while len(self.open) >= SHARED_CLUSTERS_KEPT:
            self._close(next(iter(self.open)))
        cluster = embedded_cluster(cfg)
        self.open[shape] = cluster, Client(cluster, security=security(cfg.cluster), set_as_default=False,
                                           direct_to_workers=cfg.cluster.direct_to_workers)  # as `connect` does
        return self.open[shape][1]

    @staticmethod
    def _whole(cluster, client) -> bool:
        """Still usable: connected, with every worker it started (an earlier test's failure may have broken it)."""
        try:
            workers = client.sync(client.scheduler.identity, n_workers=-1)["workers"]
        except (OSError, TimeoutError):
            return False
        return client.status == "running" and len(workers) == len(cluster.worker_spec)

    def _close(self, shape: tuple) -> None:
        from pipelines.run import close_cluster

        if shape in self.open:
            cluster, client = self.open.pop(shape)
            client.close()
            close_cluster(cluster)

    def close(self) -> None:
        for shape in list(self.open):
            self._close(shape)


@pytest.fixture(scope="session")
def shared_clusters():
    clusters = SharedClusters()
    yield clusters
    clusters.close()


@pytest.fixture
def shared_cluster(shared_clusters):
    """`shared_cluster(cfg)`: a client on the session's embedded cluster of `cfg`'s shape (`SharedClusters`)."""
    return shared_clusters.client_for
