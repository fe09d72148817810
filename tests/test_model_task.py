"""The character tokenizer, the tiny Qwen2 policy folder, the long-tailed countdown task and warm start."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch

from dora_tasks.model import (BOS_ID, EOS_ID, PAD_ID, CharTokenizer, TokenizerError, build_model, load_policy,
                              load_tokenizer, save_policy)
from dora_tasks.warmstart import evaluate, rewards_of, warm_start
from dora_tasks.workloads import countdown
from dora_tasks.core.config import Config, ModelConfig, RolloutConfig, load_config

TINY = ModelConfig(hidden_size=32, num_layers=1, num_heads=2)


def test_policy_folders_load_right_from_concurrent_threads(tmp_path):
    """Dask runs a worker's tasks in threads: loads of one folder at the same moment must all get its weights."""
    from concurrent.futures import ThreadPoolExecutor

    tok = CharTokenizer()
    model = build_model(TINY, tok.vocab_size)
    save_policy(model, tok, str(tmp_path))
    ids = torch.tensor([[BOS_ID, *tok.encode("count 5 step 10:")]])
    with ThreadPoolExecutor(4) as pool:
        loaded = list(pool.map(lambda _: load_policy(str(tmp_path))[0], range(8)))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        for other in loaded:
            torch.testing.assert_close(other(input_ids=ids).logits, expected)


def test_tokenizer_round_trip_and_specials(tmp_path):
    tok = CharTokenizer()
    text = "count 374 step 10: 374 364\n{x} ~!"
    ids = tok.encode(text)
    assert min(ids) >= 3 and tok.decode(ids) == text
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)
    assert tok.decode([BOS_ID, *ids[:5], EOS_ID, *ids[5:]]) == text[:5]  # stops at eos, skips bos
    assert tok.decode(tok.encode("é")) == "?"  # unknown characters become '?'
    tok.save(str(tmp_path))
    assert load_tokenizer(str(tmp_path)) == tok and tok.vocab_size == 3 + 96
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))


def test_policy_folder_round_trip(tmp_path):
    tok = CharTokenizer()
    model = build_model(ModelConfig(), tok.vocab_size)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    save_policy(model, tok, str(tmp_path))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"]
    assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (0, 1, 2)
    loaded, loaded_tok = load_policy(str(tmp_path))
    ids = torch.tensor([[BOS_ID, *tok.encode("count 5 step 10:")]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert loaded_tok == tok


def test_countdown_answer_length_is_long_tailed():
    tok = CharTokenizer()
    prompts = countdown.make_prompts(10_000, seed=0, tokenizer=tok, max_count=400)
    lengths = np.array([len(tok.encode(countdown.demonstration(p))) + 1 for p in prompts])  # + eos
    ratio = np.percentile(lengths, 99) / np.median(lengths)
    assert ratio >= 10, f"p99/median of answer tokens is {ratio:.1f}"
    assert lengths.max() <= countdown.max_answer_tokens(400) <= RolloutConfig().max_new_tokens
    exhaustive = max(len(countdown.answer_text(c, s)) + 1 for c in range(1, 401) for s in countdown.STEPS)
    assert countdown.max_answer_tokens(400) == exhaustive


def test_countdown_prompts_are_seeded_and_well_formed():
    tok = CharTokenizer()
    first = countdown.make_prompts(50, seed=3, tokenizer=tok, max_count=60, start_id=100)
    assert first == countdown.make_prompts(50, seed=3, tokenizer=tok, max_count=60, start_id=100)
    assert [p.prompt_id for p in first] == list(range(100, 150))
    for p in first:
        count, step = countdown.parse_prompt(p.text)
        assert 1 <= count <= 60 and step in countdown.STEPS
        assert p.token_ids == (BOS_ID, *tok.encode(p.text)) and p.answer == countdown.demonstration(p)


def test_countdown_reward():
    text = countdown.prompt_text(34, 10)
    assert countdown.answer_text(34, 10) == "34 24 14 4"
    assert countdown.answer_text(30, 10) == "30 20 10 0"
    assert countdown.reward(text, "34 24 14 4", "34 24 14 4") == 1.0
    assert countdown.reward(text, " 34  24 14 4 ", "34 24 14 4") == 1.0  # whitespace collapsed
    assert countdown.reward(text, "34 24 14", "34 24 14 4") == 0.0
    assert countdown.reward(text, "34 24 14 4 -6", "34 24 14 4") == 0.0
    assert countdown.reward(text, "", "34 24 14 4") == 0.0
    with pytest.raises(ValueError, match="not a countdown prompt"):
        countdown.parse_prompt("what is 2+2?")


def warmstart_config(tmp_path, *overrides: str) -> Config:
    return load_config(None, ["model.hidden_size=128", "model.num_heads=4", "model.warmstart_steps=100",
                              "model.warmstart_batch=16", "model.warmstart_lr=3e-3", "task.num_prompts=1024",
                              "task.eval_prompts=64", f"storage.run_dir={tmp_path}", *overrides])


@pytest.mark.slow
def test_warm_start_sometimes_succeeds_and_is_cached(tmp_path):
    cfg = warmstart_config(tmp_path)
    out = str(tmp_path / "policy")
    start = time.perf_counter()
    assert warm_start(cfg, out) == out
    train_seconds = time.perf_counter() - start
    _, held_out = countdown_split(cfg)
    rewards = rewards_of(out, held_out, seed=0, max_new_tokens=countdown.max_answer_tokens(cfg.task.max_count))
    accuracy = float(np.mean(rewards == 1.0))
    counts = np.array([countdown.parse_prompt(p.text)[0] for p in held_out])
    short, long = rewards[counts < 20].mean(), rewards[counts >= 100].mean()
    print(f"warm start {train_seconds:.1f}s, accuracy {accuracy:.2f} (short {short:.2f}, long {long:.2f})")
    assert 0.0 < accuracy < 0.9
    assert short > long

    start = time.perf_counter()
    assert warm_start(cfg, out) == out  # cached: same settings, finished folder
    assert time.perf_counter() - start < 1.0
    record = json.loads((tmp_path / "policy" / "warmstart.json").read_text())
    assert record["settings"]["steps"] == 100


def countdown_split(cfg: Config):
    from dora_tasks.workloads.datasets import load_prompts

    return load_prompts(cfg.task, CharTokenizer(), cfg.dora.seed)


def test_warm_start_cache_is_keyed_by_settings(tmp_path):
    out = str(tmp_path / "policy")
    cfg = warmstart_config(tmp_path, "model.hidden_size=16", "model.num_heads=2", "model.warmstart_steps=2",
                           "task.max_count=30", "task.num_prompts=64")
    warm_start(cfg, out)
    first = os.path.getmtime(os.path.join(out, "model.safetensors"))
    warm_start(cfg, out)
    assert os.path.getmtime(os.path.join(out, "model.safetensors")) == first
    warm_start(warmstart_config(tmp_path, "model.hidden_size=16", "model.num_heads=2", "model.warmstart_steps=3",
                                "task.max_count=30", "task.num_prompts=64"), out)
    assert json.loads(open(os.path.join(out, "warmstart.json")).read())["settings"]["steps"] == 3


def test_evaluate_accepts_folder_model_and_engine(tmp_path):
    tok = CharTokenizer()
    model = build_model(TINY, tok.vocab_size)
    save_policy(model, tok, str(tmp_path))
    prompts = countdown.make_prompts(4, seed=0, tokenizer=tok, max_count=20)
    perfect = lambda prompt, response, answer: 1.0  # noqa: E731
    assert evaluate(str(tmp_path), prompts, perfect, max_new_tokens=4) == 1.0
    assert evaluate(model, prompts, perfect, greedy=True, max_new_tokens=4) == 1.0
    assert evaluate(model, prompts, max_new_tokens=4) == 0.0  # an untrained model does not count down

    def broken(prompt, response, answer):
        raise RuntimeError("bad reward")

    assert np.isnan(rewards_of(model, prompts, broken, max_new_tokens=4)).all()  # recorded, not raised
