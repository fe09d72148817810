"""TorchTrainEngine and the policy objective on a tiny random Qwen2 (CPU, one thread)."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from dora_tasks.algorithms import UnknownAlgorithmError
from dora_tasks.algorithms.losses import UNIT_NORM, LossNorm, aggregate
from dora_tasks.algorithms.objective import batch_tensors, policy_objective, sequence_logprobs
from dora_tasks.core.config import ConfigError, TrainConfig
from dora_tasks.core.records import Group, Prompt, TrainBatch, Trajectory
from dora_tasks.engines.factory import make_train_engine
from dora_tasks.engines.hf_io import load_policy
from dora_tasks.engines.torch_trainer import TorchTrainEngine

torch.set_num_threads(1)
VOCAB = 64
UPDATE_KEYS = ("loss", "clip_fraction", "approx_kl", "entropy", "grad_norm", "tokens", "reward_mean", "seconds")


def build_tiny_model(folder) -> str:
    """A random 2-layer Qwen2 (hidden 64, vocab 64) saved as a Hugging Face folder, plus a stand-in tokenizer.json."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write('{"kind": "test stand-in"}')
    return str(folder)


def make_batch(model_path: str, seed: int = 0, groups: int = 3, group_size: int = 4, update: int = 0,
               advantages: dict[tuple[int, int], float] | None = None, temperature: float = 1.0) -> TrainBatch:
    """Random prompts and responses whose behaviour log-probs are the model's own at `temperature` (on-policy).

    Rewards are random 0/1 and advantages are left NaN (the engine's estimator fills them) unless `advantages`
    gives some by (group, sample).
    """
    rng = np.random.default_rng(seed)
    model = load_policy(model_path, trainable=False)
    out = []
    for g in range(groups):
        prompt = rng.integers(3, VOCAB, rng.integers(2, 6)).astype(np.int32)
        trajectories = []
        for i in range(group_size):
            response = rng.integers(3, VOCAB, rng.integers(1, 9)).astype(np.int32)
            ids = torch.tensor(np.concatenate([prompt, response]), dtype=torch.long)[None]
            with torch.no_grad():
                logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), temperature, with_entropy=False)
            adv = (advantages or {}).get((g, i), float("nan"))
            trajectories.append(Trajectory(
                group_id=g, sample_idx=i, prompt_ids=prompt, response_ids=response,
                versions=np.full(len(response), update, np.int32),
                behaviour_logprobs=logp[0, len(prompt):].numpy().astype(np.float32), finished=True,
                reward=float(rng.integers(0, 2)), advantage=adv))
        out.append(Group(group_id=g, prompt=Prompt(g, "", ""), version=update, trajectories=trajectories))
    return TrainBatch(update=update, groups=out, max_staleness=1)


def response_logprob(model, traj: Trajectory) -> float:
    ids = torch.tensor(np.concatenate([traj.prompt_ids, traj.response_ids]), dtype=torch.long)[None]
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), with_entropy=False)
    return float(logp[0, len(traj.prompt_ids):].sum())


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="module")
def batch(tiny_model) -> TrainBatch:
    return make_batch(tiny_model)


# ---------------------------------------------------------------- objective

def test_sequence_logprobs_align_with_prefix_loop_and_ignore_padding(tiny_model):
    model = load_policy(tiny_model, trainable=False)
    rows = [[5, 9, 11, 13, 17, 19], [7, 8, 9]]
    ids = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.zeros(2, 6, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = 1
    with torch.no_grad():
        logp, entropy = sequence_logprobs(model, ids, mask)
        for r, row in enumerate(rows):
            assert logp[r, 0] == 0 and entropy[r, 0] == 0
            for t in range(1, len(row)):  # reference: the next-token distribution of the bare prefix
                dist = torch.log_softmax(model(torch.tensor([row[:t]])).logits[0, -1], -1)
                assert float(logp[r, t]) == pytest.approx(float(dist[row[t]]), abs=1e-5)
                assert float(entropy[r, t]) == pytest.approx(float(-(dist.exp() * dist).sum()), abs=1e-5)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batching_accumulates_the_full_batch_gradient(tiny_model, batch, agg):
    tensors = batch_tensors(batch)
    grads = []
    for micro, call_tokens in ((100, 256), (5, 256), (5, 0), (1, 256)):
        model = load_policy(tiny_model)
        cfg = TrainConfig(micro_batch=micro, micro_batch_call_tokens=call_tokens, loss_agg=agg)
        loss, _ = policy_objective(model, tensors, cfg, backward=lambda loss, last: loss.backward())
        grads.append((float(loss), [p.grad.clone() for p in model.parameters()]))
    for loss, grad in grads[1:]:
        assert loss == pytest.approx(grads[0][0], rel=1e-5, abs=1e-7)
        for a, b in zip(grad, grads[0][1]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def parts_of(batch: TrainBatch, first: int) -> tuple[TrainBatch, TrainBatch]:
    """The batch as a streamed update gets it: its first `first` groups, then the rest (the stragglers)."""
    return (TrainBatch(batch.update, batch.groups[:first], batch.max_staleness),
            TrainBatch(batch.update, batch.groups[first:], batch.max_staleness))


def test_unit_norm_divided_by_the_batch_divisor_is_the_batch_loss():
    rng = torch.Generator().manual_seed(0)
    per_token = torch.randn(5, 7, generator=rng)
    mask = (torch.rand(5, 7, generator=rng) > 0.3).float()
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        for norm_len in (0, 11):
            cfg = TrainConfig(loss_agg=agg, loss_norm_len=norm_len)
            norm = LossNorm.of(mask, cfg)
            assert norm == LossNorm.of_lengths(mask.sum(-1).tolist(), cfg)
            expected = aggregate(per_token, mask, agg, norm)
            assert float(aggregate(per_token, mask, agg, UNIT_NORM) / norm.divisor(agg)) == pytest.approx(
                float(expected), rel=1e-6)
    with pytest.raises(ValueError, match="unknown loss_agg 'sum'"):
        UNIT_NORM.divisor("sum")


# ---------------------------------------------------------------- engine

def test_steps_are_finite_change_weights_and_advance_version(tiny_model, batch):
    engine = TorchTrainEngine(tiny_model, TrainConfig(micro_batch=5, lr=1e-2), version=3)
    before = params(engine.model)
    for step in range(3):
        metrics = engine.train_step(batch)
        assert all(k in metrics for k in UPDATE_KEYS)
        assert all(np.isfinite(v) for v in metrics.values()), metrics
    assert engine.version == 6
    assert metrics["tokens"] == sum(t.num_tokens for g in batch.groups for t in g.trajectories)
    assert metrics["grad_norm"] > 0 and metrics["entropy"] > 0
    assert any(not torch.equal(before[k], v) for k, v in params(engine.model).items())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_first_step_on_policy_has_unit_ratio_at_the_sampling_temperature(tiny_model, temperature):
    batch = make_batch(tiny_model, seed=4, temperature=temperature)
    metrics = TorchTrainEngine(tiny_model, TrainConfig(), temperature=temperature).train_step(batch)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["clip_fraction"] == 0.0
    if temperature != 1.0:  # a trainer at the wrong temperature sees an off-policy batch
        assert TorchTrainEngine(tiny_model, TrainConfig()).train_step(batch)["approx_kl"] > 1e-3


def test_save_weights_gives_a_loadable_folder_with_the_trainers_logprobs(tiny_model, batch, tmp_path):
    engine = TorchTrainEngine(tiny_model, TrainConfig(lr=1e-2))
    engine.train_step(batch)
    out = tmp_path / "v1"
    engine.save_weights(str(out))
    engine.save_weights(str(out))  # overwriting a published folder works
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tensors = batch_tensors(batch)
    with torch.no_grad():
        mine, _ = sequence_logprobs(engine.model, tensors["input_ids"], tensors["attention_mask"])
        theirs, _ = sequence_logprobs(loaded, tensors["input_ids"], tensors["attention_mask"])
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


def test_versions_published_after_the_start_version_is_deleted_keep_its_tokenizer(tiny_model, batch, tmp_path):
    """The trainer starts on a published version that the weight store later deletes (retention): every later
    version still carries the tokenizer files, byte for byte."""
    import shutil

    from storage.weight_store import WeightStore

    store = WeightStore(str(tmp_path / "weights"))
    store.publish(0, lambda folder: shutil.copytree(tiny_model, folder, dirs_exist_ok=True))
    engine = TorchTrainEngine(store.path_for(0), TrainConfig(lr=1e-2))
    engine.train_step(batch)
    store.publish(1, engine.save_weights)
    assert store.retain({1}) == [0] and store.versions() == [1]
    engine.train_step(dataclasses.replace(batch, update=1))
    store.publish(2, engine.save_weights)
    with open(os.path.join(tiny_model, "tokenizer.json"), "rb") as f:
        expected = f.read()
    with open(os.path.join(store.path_for(2), "tokenizer.json"), "rb") as f:
        assert f.read() == expected


@pytest.fixture(scope="module")
def tied_model(tiny_model, tmp_path_factory) -> str:
    """The tiny model's shape with the embedding tied to lm_head (as `dora_tasks.model.build_model` builds them)."""
    import shutil

    config = Qwen2Config.from_pretrained(tiny_model)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    out = str(tmp_path_factory.mktemp("tiny_tied"))
    Qwen2ForCausalLM(config).save_pretrained(out)
    for name in os.listdir(tiny_model):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(tiny_model, name), out)
    return out


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("single_file", [True, False], ids=["safetensors", "save_pretrained"])
def test_published_folder_holds_what_save_pretrained_writes(tiny_model, tied_model, batch, tmp_path, monkeypatch,
                                                            single_file, tied):
    """The trainer's fast single-file write and the `save_pretrained` fallback give the same tensors under the same
    names (a tied lm_head left out) and the same config."""
    from safetensors.torch import load_file

    from dora_tasks.engines import hf_io

    if not single_file:
        monkeypatch.setattr(hf_io, "SINGLE_FILE_BYTES", 0)
    engine = TorchTrainEngine(tied_model if tied else tiny_model, TrainConfig(lr=1e-2))
    engine.train_step(batch)
    engine.save_weights(str(tmp_path / "ours"))
    engine.model.save_pretrained(str(tmp_path / "reference"))
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    reference = load_file(tmp_path / "reference" / "model.safetensors")
    assert sorted(ours) == sorted(reference) and ("lm_head.weight" in ours) == (not tied)
    assert all(torch.equal(ours[k], reference[k]) for k in ours)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    ignore = {"_name_or_path"}
    assert ({k: v for k, v in loaded.config.to_dict().items() if k not in ignore}
            == {k: v for k, v in engine.model.config.to_dict().items() if k not in ignore})
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), engine.model.state_dict().values()))


def test_checkpoint_round_trip_reproduces_the_next_step(tiny_model, tmp_path):
    first, second = make_batch(tiny_model, seed=1), make_batch(tiny_model, seed=2, update=1)
    cfg = TrainConfig(lr=1e-2, micro_batch=4)
    original = TorchTrainEngine(tiny_model, cfg)
    original.train_step(first)
    original.save_checkpoint(str(tmp_path / "ckpt"))
    expected = original.train_step(second)

    restored = TorchTrainEngine(tiny_model, cfg)
    restored.load_checkpoint(str(tmp_path / "ckpt"))
    assert restored.version == 1
    got = restored.train_step(second)
    assert restored.version == original.version == 2
    assert {k: v for k, v in got.items() if k != "seconds"} == {k: v for k, v in expected.items() if k != "seconds"}
    for k, v in params(original.model).items():
        assert torch.equal(v, params(restored.model)[k]), k


def test_load_optimizer_state_keeps_the_published_weights_and_version(tiny_model, tmp_path):
    """A trainer restarted on a later published version takes only the optimizer state of an earlier checkpoint."""
    from dora_tasks.engines.torch_trainer import CHECKPOINT_FILE

    batches = [make_batch(tiny_model, seed=s, update=s) for s in range(4)]
    cfg = TrainConfig(lr=1e-2, micro_batch=4)
    original = TorchTrainEngine(tiny_model, cfg)
    for batch in batches[:2]:
        original.train_step(batch)
    original.save_checkpoint(str(tmp_path / "ckpt"))
    saved = torch.load(tmp_path / "ckpt" / CHECKPOINT_FILE, weights_only=True)["optimizer"]
    original.train_step(batches[2])
    original.save_weights(str(tmp_path / "v3"))
    published = params(original.model)

    restarted = TorchTrainEngine(str(tmp_path / "v3"), cfg, version=3)
    assert restarted.load_optimizer_state(str(tmp_path / "ckpt")) is True
    assert restarted.version == 3
    assert all(torch.equal(v, params(restarted.model)[k]) for k, v in published.items())
    state = restarted.optimizer.state_dict()["state"]
    assert state.keys() == saved["state"].keys() and len(state) == len(published)
    for index, expected in saved["state"].items():
        assert float(expected["step"]) == 2.0
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[index][key], expected[key]), (index, key)

    reference = TorchTrainEngine(str(tmp_path / "v3"), cfg, version=3)  # the optimizer state loaded by hand
    reference.optimizer.load_state_dict(saved)
    expected, got = reference.train_step(batches[3]), restarted.train_step(batches[3])
    assert restarted.version == 4
    assert {k: v for k, v in got.items() if k != "seconds"} == {k: v for k, v in expected.items() if k != "seconds"}
    for k, v in params(reference.model).items():
        assert torch.equal(v, params(restarted.model)[k]), k


@pytest.mark.parametrize("loss", ["ppo_clip", "decoupled_ppo", "tis"])
def test_positive_advantage_raises_that_responses_logprob(tiny_model, loss):
    advantages = {(0, i): 0.0 for i in range(4)} | {(0, 2): 1.0}
    batch = make_batch(tiny_model, seed=3, groups=1, advantages=advantages)
    engine = TorchTrainEngine(tiny_model, TrainConfig(loss=loss, lr=1e-2))
    favoured, other = batch.groups[0].trajectories[2], batch.groups[0].trajectories[0]
    before = [response_logprob(engine.model, t) for t in (favoured, other)]
    engine.train_step(batch)
    after = [response_logprob(engine.model, t) for t in (favoured, other)]
    assert after[0] > before[0] + 1e-3
    assert after[0] - before[0] > after[1] - before[1]


def test_reference_kl_starts_at_zero_and_grows(tiny_model, batch):
    engine = TorchTrainEngine(tiny_model, TrainConfig(kl_coef=0.1, lr=1e-2))
    assert engine.ref_model is not None
    assert engine.train_step(batch)["kl"] == pytest.approx(0.0, abs=1e-7)
    assert engine.train_step(batch)["kl"] > 0


def test_all_filtered_batch_skips_the_update_but_advances_the_version(tiny_model, batch):
    filtered = TrainBatch(update=0, groups=[dataclasses.replace(g, filtered="zero_variance") for g in batch.groups],
                          max_staleness=1)
    engine = TorchTrainEngine(tiny_model, TrainConfig())
    before = params(engine.model)
    metrics = engine.train_step(filtered)
    assert engine.version == 1 and metrics["loss"] == 0.0 and metrics["groups_filtered"] == 3
    assert all(torch.equal(before[k], v) for k, v in params(engine.model).items())


@pytest.mark.parametrize("clip", [0.05, 0.0], ids=["clipped", "unclipped"])  # 0.05: below the gradient's norm
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_streamed_parts_step_as_one_train_step_on_their_union(tiny_model, batch, agg, clip):
    cfg = TrainConfig(micro_batch=5, lr=1e-2, loss_agg=agg, max_grad_norm=clip)
    whole = TorchTrainEngine(tiny_model, cfg)
    expected = whole.train_step(batch)
    streamed = TorchTrainEngine(tiny_model, cfg)
    first, stragglers = parts_of(batch, 1)
    streamed.accumulate(first, stragglers=False)
    streamed.accumulate(stragglers, stragglers=True)
    assert streamed.version == 0
    got = streamed.finish_update()
    assert streamed.version == 1 and expected["grad_norm"] > 0.05
    for key in ("loss", "clip_fraction", "approx_kl", "entropy", "grad_norm", "reward_mean"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    for key in ("trajectories", "tokens", "response_tokens"):
        assert got[key] == expected[key], key
    for mine, theirs in zip(streamed.model.parameters(), whole.model.parameters()):  # the clipped gradients stepped
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-7)


def test_a_streamed_update_refuses_parts_of_another_update_and_a_finish_without_parts(tiny_model, batch):
    engine = TorchTrainEngine(tiny_model, TrainConfig())
    with pytest.raises(RuntimeError, match="update 0: finish_update without a part"):
        engine.finish_update()
    engine.accumulate(TrainBatch(0, [], 1), stragglers=False)  # a part whose every group was filtered: nothing
    assert engine.streamed is None
    engine.accumulate(parts_of(batch, 1)[0], stragglers=False)
    later = TrainBatch(1, batch.groups[1:], batch.max_staleness)
    with pytest.raises(ValueError, match="a part of update 1 joined the parts of update 0"):
        engine.accumulate(later, stragglers=True)


def test_factory_and_early_errors(tiny_model):
    assert isinstance(make_train_engine(tiny_model, TrainConfig(engine="torch"), version=2), TorchTrainEngine)
    # an unknown name is refused before the engine loads anything, with the valid names in the message
    with pytest.raises((UnknownAlgorithmError, ConfigError), match="ppo_clip"):
        TorchTrainEngine(tiny_model, TrainConfig(loss="nope"))
    with pytest.raises((UnknownAlgorithmError, ConfigError), match="grpo"):
        TorchTrainEngine(tiny_model, TrainConfig(advantage="nope"))


def test_torch_backend_does_not_import_deepspeed():
    code = ("import sys, dora_tasks.engines.torch_trainer, dora_tasks.engines.factory, dora_tasks.algorithms.objective;"
            "assert 'deepspeed' not in sys.modules, 'deepspeed imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
