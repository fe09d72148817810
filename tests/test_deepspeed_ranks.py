"""DeepSpeed ZeRO-2 and ZeRO-3 at world size 2: two real ranks (spawned processes, gloo on 127.0.0.1, a free port)
take one step, and it matches the plain torch engine's step on the same global batch.

Both ranks are handed the same whole TrainBatch (`replicated_batch=True`: splitting a batch across ranks is not
implemented), so the averaged gradient is the torch engine's, while ZeRO shards for real: each rank keeps half of the
gradients and of AdamW's fp32 state (stage 2), and half of every weight (stage 3, with the persistence threshold at 0
so that the tiny model's parameters are partitioned as a big model's are); the test checks those shard sizes.

Tolerance (fp32; the sharded all-reduce and reduce-scatter sum in another order than one process does): metrics
rel 1e-4 / abs 1e-6, updated weights rtol 1e-4 / atol 5e-5 (measured: ZeRO-2 equal, ZeRO-3 8e-6 off; the step
moves weights by up to 1e-2, lr 1e-2).
Takes 25-75 s on 2 shared cores, most of it importing deepspeed in both ranks: marked slow.
"""
from __future__ import annotations

import importlib.util
import json
import os
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from dora_tasks.core.config import TrainConfig
from dora_tasks.engines.torch_trainer import TorchTrainEngine
from tests.test_trainers import build_tiny_model, make_batch

pytestmark = [pytest.mark.deepspeed,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")]
WORLD_SIZE = 2
STAGES = (2, 3)
RANKS_TIMEOUT_S = 300  # both ranks, both stages; a rank that hangs in a collective fails the test here
METRICS = ("loss", "clip_fraction", "approx_kl", "entropy", "grad_norm", "tokens")


def train_config(stage: int) -> TrainConfig:
    return TrainConfig(engine="deepspeed" if stage else "torch", zero_stage=stage, micro_batch=5, lr=1e-2)


def shard_sizes(engine, stage: int) -> dict[str, int]:
    """Elements this rank holds of AdamW's fp32 partitions (and, at stage 3, of the weights), and the model's total."""
    optimizer, module = engine.engine.optimizer, engine.engine.module
    params = list(module.parameters())
    if stage == 3:
        return {"total": sum(p.ds_numel for p in params), "weights": sum(p.ds_tensor.numel() for p in params),
                "optimizer": sum(t.numel() for t in optimizer.fp32_partitioned_groups_flat)}
    return {"total": sum(p.numel() for p in params), "weights": sum(p.numel() for p in params),
            "optimizer": sum(t.numel() for t in optimizer.single_partition_of_fp32_groups)}


def run_rank(rank: int, port: int, model_path: str, batch, out: str) -> None:
    """One rank (in a spawned process): for each stage, a DeepSpeed engine, one step, its weights (rank 0 writes)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE),
                      LOCAL_RANK=str(rank))
    from dora_tasks.engines import deepspeed_trainer

    original_config = deepspeed_trainer.deepspeed_config

    def sharded_config(cfg) -> dict:  # this process only: ZeRO-3 partitions even the tiny model's parameters
        config = original_config(cfg)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        return config

    deepspeed_trainer.deepspeed_config = sharded_config
    for stage in STAGES:
        engine = deepspeed_trainer.DeepSpeedTrainEngine(model_path, train_config(stage), replicated_batch=True)
        try:
            assert torch.distributed.get_world_size() == WORLD_SIZE
            shards = shard_sizes(engine, stage)
            metrics = engine.train_step(batch)
            engine.save_weights(os.path.join(out, f"zero{stage}"))  # every rank gathers, rank 0 writes
        finally:
            engine.close()
        with open(os.path.join(out, f"zero{stage}-rank{rank}.json"), "w") as f:
            json.dump({"metrics": metrics, "shards": shards}, f)
    torch.distributed.destroy_process_group()


def spawn_ranks(model_path: str, batch, out: str) -> None:
    from dora_tasks.engines.deepspeed_trainer import free_port

    context = mp.spawn(run_rank, args=(free_port(), model_path, batch, out), nprocs=WORLD_SIZE, join=False)
    deadline = time.monotonic() + RANKS_TIMEOUT_S
    while not context.join(timeout=1.0):  # raises with the rank's traceback if one failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {WORLD_SIZE} DeepSpeed ranks did not finish within {RANKS_TIMEOUT_S} s")


def state_dict(path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def test_more_than_one_rank_needs_the_replicated_batch_opt_in(monkeypatch):
    from dora_tasks.engines.deepspeed_trainer import ensure_distributed_env

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("RANK", "0"),
                       ("WORLD_SIZE", str(WORLD_SIZE)), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(key, value)
    with pytest.raises(NotImplementedError, match="splitting a TrainBatch"):
        ensure_distributed_env()
    ensure_distributed_env(replicated_batch=True)
    assert os.environ["WORLD_SIZE"] == str(WORLD_SIZE)  # left as set


@pytest.mark.slow
def test_zero2_and_zero3_on_two_gloo_ranks_match_the_torch_step(tmp_path):
    model_path = build_tiny_model(tmp_path / "model")
    batch = make_batch(model_path, seed=1)
    reference = TorchTrainEngine(model_path, train_config(0))
    expected = reference.train_step(batch)
    reference.save_weights(str(tmp_path / "torch"))
    start = state_dict(model_path)
    expected_weights = state_dict(tmp_path / "torch")
    assert any(not torch.allclose(start[k], v, atol=1e-3) for k, v in expected_weights.items())  # the step moved them

    spawn_ranks(model_path, batch, str(tmp_path))

    for stage in STAGES:
        ranks = [json.loads((tmp_path / f"zero{stage}-rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
        for rank in ranks:
            shards = rank["shards"]  # each rank holds about half (ZeRO pads partitions to an alignment)
            assert shards["total"] / 2 <= shards["optimizer"] < shards["total"] * 0.6, (stage, shards)
            if stage == 3:
                assert shards["total"] / 2 <= shards["weights"] < shards["total"] * 0.6, shards
            got = rank["metrics"]
            assert all(np.isfinite(got[k]) for k in METRICS), got
            for key in METRICS:
                assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), (stage, key)
        weights = state_dict(tmp_path / f"zero{stage}")
        assert weights.keys() == expected_weights.keys()
        for name, value in expected_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=5e-5, msg=f"ZeRO-{stage} {name}")
