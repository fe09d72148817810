"""DeepSpeedTrainEngine on CPU/gloo, one rank: ZeRO 0, 2 and 3 match the plain torch engine step for step.

The first DeepSpeed process group on a machine compiles a shared-memory comm op (~45 s, cached in
~/.cache/torch_extensions); later runs take a few seconds. The module tears down the process group, the
/dev/shm all-reduce buffers of its port, and the rendezvous variables it set.
"""
from __future__ import annotations

import importlib.util
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from dora_tasks.algorithms.objective import batch_tensors, sequence_logprobs
from dora_tasks.engines.factory import make_train_engine
from dora_tasks.engines.torch_trainer import TorchTrainEngine
from dora_tasks.core.config import ConfigError, TrainConfig
from test_trainers import build_tiny_model, make_batch, parts_of

pytestmark = [pytest.mark.deepspeed,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")]
torch.set_num_threads(1)
RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def ds_config(stage: int) -> TrainConfig:
    return TrainConfig(engine="deepspeed", zero_stage=stage, micro_batch=5, lr=1e-2)


@pytest.fixture(scope="module")
def distributed():
    """Leave the process as we found it: no process group, no shm buffers, no rendezvous variables we set."""
    saved = {k: os.environ.get(k) for k in RENDEZVOUS_VARS}
    yield
    from dora_tasks.engines.deepspeed_trainer import shm_buffer_paths

    for path in shm_buffer_paths():
        os.remove(path)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_ds"))


@pytest.fixture(scope="module")
def batches(tiny_model):
    return make_batch(tiny_model, seed=1), make_batch(tiny_model, seed=2, update=1)


@pytest.fixture(scope="module")
def torch_reference(tiny_model, batches):
    """The plain torch engine after one step: the metrics and log-probs every ZeRO stage must reproduce."""
    engine = TorchTrainEngine(tiny_model, ds_config(0))
    metrics = engine.train_step(batches[0])
    return metrics, logprobs(engine.model, batches[0])


@pytest.fixture(scope="module")
def restart_batches(tiny_model, batches):
    return (*batches, make_batch(tiny_model, seed=3, update=2), make_batch(tiny_model, seed=4, update=3))


def train_until_restart(engine, batches, tmp_path, at_checkpoint=lambda: None):
    """Two steps, a checkpoint (version 2), one more step published as version 3."""
    for batch in batches[:2]:
        engine.train_step(batch)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    checkpointed = at_checkpoint()
    engine.train_step(batches[2])
    engine.save_weights(str(tmp_path / "v3"))
    return checkpointed


@pytest.fixture(scope="module")
def restart_reference(tiny_model, restart_batches, tmp_path_factory):
    """The torch engine restarted on version 3 with the version-2 checkpoint's optimizer state, after one step: the
    metrics and log-probs a restarted DeepSpeed engine must reproduce."""
    tmp_path = tmp_path_factory.mktemp("torch_restart")
    train_until_restart(TorchTrainEngine(tiny_model, ds_config(0)), restart_batches, tmp_path)
    engine = TorchTrainEngine(str(tmp_path / "v3"), ds_config(0), version=3)
    assert engine.load_optimizer_state(str(tmp_path / "ckpt"))
    metrics = engine.train_step(restart_batches[3])
    return metrics, logprobs(engine.model, restart_batches[3])


def adam_state(engine) -> list[dict[str, torch.Tensor]]:
    """The torch AdamW's state per parameter it steps (ZeRO: the flat fp32 partitions; stage 0: the module's)."""
    optimizer = engine.engine.optimizer
    base = getattr(optimizer, "optimizer", optimizer)
    master = (getattr(optimizer, "fp32_partitioned_groups_flat", None)
              or getattr(optimizer, "single_partition_of_fp32_groups", None)
              or [p for group in base.param_groups for p in group["params"]])
    return [{k: v.clone() for k, v in base.state[p].items()} for p in master]


def shard_every_parameter(monkeypatch) -> None:
    """The tiny model's parameters are all under ZeRO-3's persistence threshold: shard them as a big one's."""
    from dora_tasks.engines import deepspeed_trainer

    original_config = deepspeed_trainer.deepspeed_config

    def sharded_config(cfg) -> dict:
        config = original_config(cfg)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        return config

    monkeypatch.setattr(deepspeed_trainer, "deepspeed_config", sharded_config)


def logprobs(model, batch) -> torch.Tensor:
    tensors = batch_tensors(batch)
    with torch.no_grad():
        return sequence_logprobs(model, tensors["input_ids"], tensors["attention_mask"], with_entropy=False)[0]


def load_folder(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_zero_stage_out_of_range_fails_before_deepspeed_is_touched(tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # any import of deepspeed would raise ImportError
    from dora_tasks.engines.deepspeed_trainer import DeepSpeedTrainEngine

    with pytest.raises(ConfigError, match="train.zero_stage: must be 0, 1, 2 or 3, got 5"):
        DeepSpeedTrainEngine(tiny_model, ds_config(5))
    with pytest.raises(ConfigError, match="train.zero_stage"):
        make_train_engine(tiny_model, ds_config(-1))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_zero_stage_step_matches_torch_and_saves_loadable_weights(stage, distributed, tiny_model, batches,
                                                                  torch_reference, tmp_path):
    expected_metrics, expected_logp = torch_reference
    engine = make_train_engine(tiny_model, ds_config(stage), version=0)
    try:
        metrics = engine.train_step(batches[0])
        assert engine.version == 1
        assert all(np.isfinite(v) for v in metrics.values()), metrics
        for key in ("loss", "clip_fraction", "approx_kl", "entropy", "grad_norm"):
            assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-4, abs=1e-6), key
        engine.save_weights(str(tmp_path / "v1"))
    finally:
        engine.close()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(tmp_path / "v1"))
    torch.testing.assert_close(logprobs(load_folder(tmp_path / "v1"), batches[0]), expected_logp,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stage, sharded", [(0, False), (2, False), (3, True)], ids=["zero0", "zero2", "zero3-sharded"])
def test_streamed_parts_step_as_torchs_one_step_on_their_union(stage, sharded, distributed, tiny_model, batches,
                                                               torch_reference, monkeypatch):
    if sharded:
        shard_every_parameter(monkeypatch)
    expected_metrics, expected_logp = torch_reference
    engine = make_train_engine(tiny_model, ds_config(stage), version=0)
    try:
        for part, stragglers in zip(parts_of(batches[0], 1), (False, True)):
            engine.accumulate(part, stragglers)
        assert engine.version == 0
        metrics = engine.finish_update()
        assert engine.version == 1
        for key in ("loss", "clip_fraction", "approx_kl", "entropy", "grad_norm", "tokens"):
            assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-4, abs=1e-6), key
        torch.testing.assert_close(logprobs(engine.engine.module, batches[0]), expected_logp, rtol=1e-4, atol=1e-5)
    finally:
        engine.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_round_trip_reproduces_the_next_step(stage, distributed, tiny_model, batches, tmp_path):
    first, second = batches
    original = make_train_engine(tiny_model, ds_config(stage))
    try:
        original.train_step(first)
        original.save_checkpoint(str(tmp_path / "ckpt"))
        expected = original.train_step(second)
        original.save_weights(str(tmp_path / "original"))
    finally:
        original.close()
    restored = make_train_engine(tiny_model, ds_config(stage))
    try:
        restored.load_checkpoint(str(tmp_path / "ckpt"))
        assert restored.version == 1
        got = restored.train_step(second)
        restored.save_weights(str(tmp_path / "restored"))
    finally:
        restored.close()
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6, abs=1e-9)
    for name, value in load_folder(tmp_path / "original").state_dict().items():
        torch.testing.assert_close(load_folder(tmp_path / "restored").state_dict()[name], value, rtol=0, atol=1e-7)


@pytest.mark.parametrize("stage, sharded", [(0, False), (1, False), (2, False), (3, False), (3, True)],
                         ids=["zero0", "zero1", "zero2", "zero3", "zero3-sharded"])
def test_load_optimizer_state_keeps_the_published_weights_and_matches_torch(stage, sharded, distributed, tiny_model,
                                                                           restart_batches, restart_reference,
                                                                           tmp_path, monkeypatch):
    if sharded:
        shard_every_parameter(monkeypatch)
    original = make_train_engine(tiny_model, ds_config(stage))
    try:
        saved = train_until_restart(original, restart_batches, tmp_path, at_checkpoint=lambda: adam_state(original))
    finally:
        original.close()
    restarted = make_train_engine(str(tmp_path / "v3"), ds_config(stage), version=3)
    try:
        assert restarted.load_optimizer_state(str(tmp_path / "ckpt")) is True
        assert restarted.version == 3
        restarted.save_weights(str(tmp_path / "loaded"))
        state = adam_state(restarted)
        metrics = restarted.train_step(restart_batches[3])
        restarted.save_weights(str(tmp_path / "v4"))
    finally:
        restarted.close()
    published, loaded = (load_folder(tmp_path / name).state_dict() for name in ("v3", "loaded"))
    assert published.keys() == loaded.keys() and all(torch.equal(v, loaded[k]) for k, v in published.items())
    assert len(state) == len(saved) > 0
    for got, expected in zip(state, saved):
        assert got.keys() == expected.keys() == {"step", "exp_avg", "exp_avg_sq"} and float(got["step"]) == 2.0
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    expected_metrics, expected_logp = restart_reference
    for key in ("loss", "clip_fraction", "approx_kl", "entropy", "grad_norm"):
        assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-4, abs=1e-6), key
    torch.testing.assert_close(logprobs(load_folder(tmp_path / "v4"), restart_batches[3]), expected_logp,
                               rtol=1e-4, atol=1e-5)
