"""Prompt datasets (countdown, jsonl, parquet, saved HF datasets) and safe reward scoring."""
from __future__ import annotations

import json
import math
import threading
import time

import pytest

from dora_tasks.core.config import TaskConfig
from dora_tasks.model import BOS_ID, CharTokenizer
from dora_tasks.workloads import countdown, rewards
from dora_tasks.workloads.datasets import DatasetError, load_prompts
from dora_tasks.workloads.rewards import RewardError, resolve_reward_fn, score, score_all

TOK = CharTokenizer()
ROWS = [{"question": f"what is {i} + {i}?", "solution": str(2 * i), "extra": i} for i in range(10)]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def dataset_cfg(source: str, **kwargs) -> TaskConfig:
    return TaskConfig(name="dataset", dataset=source, prompt_key="question", answer_key="solution", eval_prompts=3,
                      **kwargs)


def test_countdown_train_and_eval_are_disjoint_and_seeded():
    cfg = TaskConfig(num_prompts=200, eval_prompts=20, max_count=100)
    train, held_out = load_prompts(cfg, TOK, seed=5)
    assert len(train) == 200 and len(held_out) == 20
    assert not {p.prompt_id for p in train} & {p.prompt_id for p in held_out}
    assert load_prompts(cfg, TOK, seed=5) == (train, held_out)
    assert load_prompts(cfg, TOK, seed=6)[0] != train


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_file_dataset_round_trip(tmp_path, fmt):
    if fmt == "jsonl":
        source = write_jsonl(tmp_path / "d.jsonl", ROWS)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        source = str(tmp_path / "d.parquet")
        pq.write_table(pa.Table.from_pylist(ROWS), source)
    train, held_out = load_prompts(dataset_cfg(source), TOK, seed=0)
    assert len(train) == 7 and len(held_out) == 3
    everything = sorted(train + held_out, key=lambda p: p.prompt_id)
    assert [p.text for p in everything] == [r["question"] for r in ROWS]
    assert [p.answer for p in everything] == [r["solution"] for r in ROWS]
    assert everything[4].token_ids == (BOS_ID, *TOK.encode("what is 4 + 4?"))


def test_saved_hf_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "hfdata"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[:4])}).save_to_disk(str(folder))
    train, held_out = load_prompts(dataset_cfg(f"hf:{folder}:test"), TOK, seed=0)
    assert len(train) + len(held_out) == 4
    train, held_out = load_prompts(dataset_cfg(f"hf:{folder}"), TOK, seed=0)
    assert len(train) + len(held_out) == 10


def test_missing_key_names_file_row_and_key(tmp_path):
    rows = ROWS[:3] + [{"question": "no answer here"}] + ROWS[3:]
    source = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DatasetError) as info:
        load_prompts(dataset_cfg(source), TOK, seed=0)
    message = str(info.value)
    assert "bad.jsonl" in message and "row 4" in message and "'solution'" in message


def hf_tokenizer_folder(folder) -> str:
    """A Hugging Face tokenizer built offline (word level, with a chat template), saved like a pretrained model's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "what", "is", "2", "+", "?", "4"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>")
    tok.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    tok.save_pretrained(str(folder))
    return str(folder)


def test_chat_prompts_and_nested_answers_with_a_pretrained_tokenizer(tmp_path):
    from dora_tasks.model import HFTokenizer, load_tokenizer

    tok = load_tokenizer(hf_tokenizer_folder(tmp_path / "model"))
    assert isinstance(tok, HFTokenizer)
    CharTokenizer().save(str(tmp_path / "char"))
    assert load_tokenizer(str(tmp_path / "char")) == CharTokenizer()  # a save_policy folder keeps its own
    rows = [{"prompt": [{"role": "user", "content": "what is 2 + 2 ?"}], "reward_model": {"ground_truth": "4"}}] * 4
    cfg = TaskConfig(name="dataset", dataset=write_jsonl(tmp_path / "math.jsonl", rows), prompt_key="prompt",
                     answer_key="reward_model.ground_truth", eval_prompts=1)
    train, held_out = load_prompts(cfg, tok, seed=0)
    p = train[0]
    assert p.answer == "4" and p.text == "what is 2 + 2 ?"
    expected = tok.tokenizer.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert list(p.token_ids) == tok.encode(expected)
    assert tok.decode(tok.encode("what is 4")) == "what is 4" and tok.decode([tok.eos_id]) == ""
    bad = write_jsonl(tmp_path / "bad.jsonl", rows[:1] + [{"prompt": "x", "reward_model": {"score": 1}}])
    with pytest.raises(DatasetError) as info:
        load_prompts(TaskConfig(name="dataset", dataset=bad, prompt_key="prompt",
                                answer_key="reward_model.ground_truth"), tok, seed=0)
    assert "row 2" in str(info.value) and "'ground_truth' not found inside 'reward_model'" in str(info.value)


def test_missing_file_and_bad_rows(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompts(dataset_cfg(str(tmp_path / "nope.jsonl")), TOK, seed=0)
    (tmp_path / "broken.jsonl").write_text('{"question": "a", "solution": "b"}\n{not json\n')
    with pytest.raises(DatasetError, match="row 2: not valid JSON"):
        load_prompts(dataset_cfg(str(tmp_path / "broken.jsonl")), TOK, seed=0)
    (tmp_path / "d.csv").write_text("question,solution\n")
    with pytest.raises(DatasetError, match="unsupported format"):
        load_prompts(dataset_cfg(str(tmp_path / "d.csv")), TOK, seed=0)
    with pytest.raises(DatasetError, match="hf:"):
        load_prompts(dataset_cfg(f"hf:{tmp_path / 'no-such-dataset'}"), TOK, seed=0)
    with pytest.raises(DatasetError, match="expected hf:<name>"):
        load_prompts(dataset_cfg("hf:a:b:c:d"), TOK, seed=0)


def test_parse_hf_spec():
    from dora_tasks.workloads.datasets import parse_hf_spec

    assert parse_hf_spec("gsm8k") == ("gsm8k", None, "train")
    assert parse_hf_spec("gsm8k:test") == ("gsm8k", None, "test")
    assert parse_hf_spec("openai/gsm8k:main:test") == ("openai/gsm8k", "main", "test")


def test_resolve_reward_fn():
    assert resolve_reward_fn("").fn is countdown.reward
    assert resolve_reward_fn("dora_tasks.workloads.rewards.math_verify_reward").fn is rewards.math_verify_reward
    with pytest.raises(RewardError, match="cannot import module 'no_such_pkg.mod'"):
        resolve_reward_fn("no_such_pkg.mod.fn")
    with pytest.raises(RewardError, match="has no attribute 'nope'"):
        resolve_reward_fn("dora_tasks.workloads.countdown.nope")
    with pytest.raises(RewardError, match="not a callable"):
        resolve_reward_fn("dora_tasks.workloads.countdown.STEPS")
    with pytest.raises(RewardError, match="dotted path"):
        resolve_reward_fn("reward")


def raises(prompt, response, answer):
    raise KeyError("boom")


def test_score_records_failures_and_never_raises():
    assert score(countdown.reward, "count 4 step 10:", "4", "4", 1.0) == (1.0, "")
    assert score(lambda *a: True, "p", "r", "a", 1.0) == (1.0, "")
    reward, error = score(raises, "p", "r", "a", 1.0)
    assert math.isnan(reward) and error == "KeyError: 'boom'"
    release = threading.Event()  # a reward function that hangs until the test is done with it
    start = time.perf_counter()
    reward, error = score(lambda *a: release.wait(30), "p", "r", "a", 0.1)
    release.set()
    assert math.isnan(reward) and error == "timeout" and time.perf_counter() - start < 1.0
    for bad in (float("nan"), float("inf"), "1.0", None):
        reward, error = score(lambda *a, value=bad: value, "p", "r", "a", 1.0)
        assert math.isnan(reward) and error.startswith("non-number:"), (bad, error)


def test_score_all_scores_in_order_with_one_thread_until_a_timeout():
    threads = []
    release = threading.Event()

    def fn(prompt, response, answer):
        threads.append(threading.current_thread())
        if response == "hang":  # hangs until the test releases it, after score_all gave up on it
            release.wait(30)
        if response == "bad":
            raise ValueError("bad")
        return float(response == answer)

    calls = [("p", r, "a") for r in ("a", "b", "bad", "a", "hang", "a", "b")]
    start = time.perf_counter()
    results = score_all(fn, calls, 0.2)
    assert time.perf_counter() - start < 1.5
    assert [r for r, _ in results][:2] == [1.0, 0.0] and results[3] == (1.0, "") and results[5:] == [(1.0, ""), (0.0, "")]
    assert math.isnan(results[2][0]) and results[2][1] == "ValueError: bad"
    assert math.isnan(results[4][0]) and results[4][1] == "timeout"
    assert len(set(threads[:5])) == 1 and len(set(threads[5:])) == 1 and threads[5] != threads[0]
    assert threading.current_thread() not in threads
    release.set()  # the abandoned thread wakes up and stops: it scores nothing more
    threads[4].join(10)
    assert not threads[4].is_alive() and len(threads) == 7


def test_math_verify_reward():
    assert rewards.math_verify_reward("2+2?", "The answer is $\\boxed{4}$.", "4") == 1.0
    assert rewards.math_verify_reward("half?", "We get $\\frac{1}{2}$", "0.5") == 1.0
    assert rewards.math_verify_reward("2+2?", "The answer is $5$.", "4") == 0.0
    assert rewards.math_verify_reward("2+2?", "no idea", "4") == 0.0
