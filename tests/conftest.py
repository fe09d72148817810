"""Shared fixtures: one thread per process (2-core machines), offline hub, small real pipeline configs."""
from __future__ import annotations

import os

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
