"""The transformers rollout engine: log-probs equal a teacher-forced recompute; load_version swaps weights in place."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dora_tasks.core.config import ModelConfig, RolloutConfig
from dora_tasks.engines.hf_rollout import HFRolloutEngine, WeightsError
from dora_tasks.model import EOS_ID, CharTokenizer, build_model, save_policy

TOK = CharTokenizer()
TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=2)
PROMPTS = [[1, *TOK.encode("count 7 step 10:")], [1, *TOK.encode("count 123 step 10:")], [1, 40]]


@pytest.fixture
def policies(tmp_path):
    """Two model folders with different weights (seeds 0 and 1)."""
    return [save_policy(build_model(TINY, TOK.vocab_size, seed=seed), TOK, str(tmp_path / f"v{seed}"))
            for seed in (0, 1)]


def recomputed_logprobs(model, prompt, tokens, temperature: float = 1.0) -> np.ndarray:
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(tokens).long()[:, None])[:, 0].numpy()


def max_logprob_error(engine, model, outputs, temperature: float = 1.0) -> float:
    return max(float(np.abs(g.logprobs - recomputed_logprobs(model, prompt, g.token_ids, temperature)).max())
               for prompt, gens in zip(PROMPTS, outputs) for g in gens)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced_recompute(policies, temperature):
    engine = HFRolloutEngine(policies[0], RolloutConfig(max_new_tokens=24, temperature=temperature), version=3)
    outputs = engine.generate(PROMPTS, n=3, seed=0)
    assert [len(gens) for gens in outputs] == [3, 3, 3]
    assert max_logprob_error(engine, engine.model, outputs, temperature) < 1e-4
    for gens in outputs:
        for g in gens:
            assert g.token_ids.dtype == np.int32 and g.logprobs.dtype == np.float32
            assert len(g.token_ids) == len(g.logprobs) == len(g.versions) and (g.versions == 3).all()
            assert (g.token_ids == EOS_ID).sum() == int(g.finished)
            assert g.token_ids[-1] == EOS_ID if g.finished else len(g.token_ids) == 24


def test_top_p_logprobs_are_under_the_truncated_distribution(policies):
    engine = HFRolloutEngine(policies[0], RolloutConfig(max_new_tokens=16, top_p=0.5))
    outputs = engine.generate(PROMPTS, n=2, seed=0)
    for prompt, gens in zip(PROMPTS, outputs):
        for g in gens:
            full = recomputed_logprobs(engine.model, prompt, g.token_ids)
            assert (g.logprobs >= full - 1e-5).all() and (g.logprobs <= 0).all()


def test_load_version_switches_to_the_new_weights(policies):
    from dora_tasks.model import load_policy

    engine = HFRolloutEngine(policies[0], RolloutConfig(max_new_tokens=16))
    model_object = engine.model
    old_model, _ = load_policy(policies[0])
    new_model, _ = load_policy(policies[1])
    engine.load_version(7, policies[1])
    assert engine.version == 7 and engine.model is model_object
    outputs = engine.generate(PROMPTS, n=2, seed=1)
    assert all((g.versions == 7).all() for gens in outputs for g in gens)
    assert max_logprob_error(engine, new_model, outputs) < 1e-4
    assert max_logprob_error(engine, old_model, outputs) > 1e-2


def test_load_version_rejects_a_folder_that_does_not_fit(policies, tmp_path):
    engine = HFRolloutEngine(policies[0], RolloutConfig(max_new_tokens=4))
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        engine.load_version(1, str(tmp_path))
    other = save_policy(build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2), TOK.vocab_size), TOK,
                        str(tmp_path / "one_layer"))
    with pytest.raises(WeightsError, match="missing"):
        engine.load_version(1, other)
    assert engine.version == 0


def test_generate_is_seeded_and_leaves_the_global_rng_alone(policies):
    engine = HFRolloutEngine(policies[0], RolloutConfig(max_new_tokens=12), max_batch=4)  # several batches
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    first = engine.generate(PROMPTS, n=2, seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)
    again = engine.generate(PROMPTS, n=2, seed=5)
    other = engine.generate(PROMPTS, n=2, seed=6)
    flat = lambda outs: [g.token_ids.tolist() for gens in outs for g in gens]  # noqa: E731
    assert flat(first) == flat(again) and flat(first) != flat(other)


def test_max_new_tokens_override_and_greedy(policies):
    engine = HFRolloutEngine(policies[0], RolloutConfig(max_new_tokens=20), do_sample=False)
    assert engine.max_new_tokens == 20
    short = engine.generate(PROMPTS, n=2, seed=0, max_new_tokens=3)
    assert all(len(g.token_ids) <= 3 for gens in short for g in gens)
    full = engine.generate(PROMPTS, n=2, seed=9)
    for gens_short, gens_full in zip(short, full):
        assert gens_full[0].token_ids.tolist() == gens_full[1].token_ids.tolist()  # greedy: identical samples
        assert gens_full[0].token_ids[:3].tolist() == gens_short[0].token_ids.tolist()
    assert max_logprob_error(engine, engine.model, full) < 1e-4
