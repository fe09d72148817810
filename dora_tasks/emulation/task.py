"""The emulated task (`task.name=emulated`): synthetic prompts, responses and rewards, no model and no tokenizer.

Token layout, chosen so that an emulated engine needs nothing but the prompt's token ids:
* a prompt is ``[PROMPT_MARK, prompt_id, FILLER, ...]``, `LengthModel.prompt_tokens(prompt_id)` tokens long, so the
  engine reads the prompt id (which decides its responses' lengths) from the second token;
* a response is ``[SAMPLE_BASE + sample, FILLER, ...]``: its first token names the sample index the engine drew its
  length for, which the synthetic reward reads back through `SyntheticTokenizer.decode`.

The reward is synthetic and marked so (`synthetic_reward`): 1 with probability `emulation.reward_rate`, decided by a
hash of (prompt id, sample), carried to the reward function in the prompt's text and `answer` ("reward_rate=0.5").
The held-out "accuracy" of an emulated model is the same synthetic reward of sample 0 of each held-out prompt: it
does not change with the version (nothing learns), it only keeps the evaluation path running.

An emulated model folder holds one `config.json` naming the emulated model and its version (`write_model_folder`);
`is_emulated_model` tells it from a Hugging Face folder.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

import numpy as np

from dora_tasks.core.records import Prompt

PROMPT_MARK = 1
FILLER = 2
SAMPLE_BASE = 1000  # a response's first token is SAMPLE_BASE + its sample index
MODEL_TYPE = "dora-emulated"
_PROMPT_TEXT = re.compile(r"emulated prompt (\d+)")
_RESPONSE_TEXT = re.compile(r"sample (\d+)")
_RATE = re.compile(r"reward_rate=([0-9.eE+-]+)")


def prompt_token_ids(prompt_id: int, length: int) -> tuple[int, ...]:
    return (PROMPT_MARK, prompt_id) + (FILLER,) * max(0, length - 2)


def prompt_id_of(token_ids: Sequence[int]) -> int:
    if len(token_ids) < 2 or token_ids[0] != PROMPT_MARK:
        raise ValueError("not an emulated prompt (expected [PROMPT_MARK, prompt_id, ...]; task.name=emulated)")
    return int(token_ids[1])


def make_prompts(ids: range, lengths, reward_rate: float) -> list[Prompt]:
    """Prompts of these ids; `lengths` is a `LengthModel` (its `prompt_tokens`)."""
    return [Prompt(i, f"emulated prompt {i}", f"reward_rate={reward_rate:g}",
                   prompt_token_ids(i, lengths.prompt_tokens(i))) for i in ids]


def emulated_prompts(num_prompts: int, eval_prompts: int, emulation, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out): ids 0..num_prompts-1 and the next `eval_prompts` ids."""
    from dora_tasks.emulation.lengths import length_model_from

    lengths = length_model_from(emulation, seed)
    return (make_prompts(range(num_prompts), lengths, emulation.reward_rate),
            make_prompts(range(num_prompts, num_prompts + eval_prompts), lengths, emulation.reward_rate))


def response_token_ids(sample: int, start: int, count: int) -> np.ndarray:
    """Tokens `start .. start + count - 1` of the response of sample `sample`."""
    tokens = np.full(count, FILLER, np.int32)
    if start == 0 and count:
        tokens[0] = SAMPLE_BASE + sample
    return tokens


class SyntheticTokenizer:
    """Decodes an emulated response to the little the synthetic reward reads: its sample index and length."""

    def decode(self, token_ids) -> str:
        ids = np.asarray(token_ids)
        sample = int(ids[0]) - SAMPLE_BASE if len(ids) else -1
        return f"sample {sample} ({len(ids)} tokens)"


def synthetic_reward(prompt_text: str, response_text: str, answer: str) -> float:
    """SYNTHETIC reward: 1.0 with probability reward_rate, deterministic in (prompt id, sample)."""
    prompt_id = int(_PROMPT_TEXT.fullmatch(prompt_text).group(1))
    sample = int(_RESPONSE_TEXT.match(response_text).group(1))
    rate = float(_RATE.fullmatch(answer).group(1))
    return 1.0 if np.random.default_rng([7, prompt_id, sample]).random() < rate else 0.0


def synthetic_accuracy(prompts: Sequence[Prompt], reward_fn) -> float:
    """The SYNTHETIC held-out accuracy: the reward of sample 0 of each prompt."""
    tokenizer = SyntheticTokenizer()
    rewards = [reward_fn(p.text, tokenizer.decode(response_token_ids(0, 0, 1)), p.answer) for p in prompts]
    return float(np.mean(rewards)) if rewards else float("nan")


# ---- the emulated model folder -----------------------------------------------------------------------------------
def write_model_folder(folder: str, model: str, version: int) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": MODEL_TYPE, "emulated_model": model, "version": version}, f)


def is_emulated_model(path: str) -> bool:
    """True for a folder `write_model_folder` wrote (an emulated policy), False for anything else."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False
