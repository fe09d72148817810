"""Countdown: a procedural task with a verifiable reward and a long-tailed answer length.

Prompt `count 374 step 10:`, answer `374 364 354 ... 4` (from the count down to the smallest non-negative number, by
the step). Each number follows from the previous one, so a 2-layer transformer learns the task from demonstrations in
a CPU minute; long answers are where it slips (a borrow across the hundreds, the stop), so a warm-started model gets
short prompts right and long ones often wrong, and RL has something to improve.

The long tail: the count is drawn log-uniformly from [1, max_count], so half the counts are below sqrt(max_count)
while the longest answers hold max_count / 10 numbers. With max_count=400 the answer length in tokens (eos included)
has median 8, p99 141 (p99/median 17.6 over 10k prompts) and maximum 153, inside `rollout.max_new_tokens=256`;
`max_answer_tokens(max_count)` gives the budget a cap needs (max_count=600 still fits: 233).

Simplified, and why: the step is always 10. Steps 7-9 (a real subtraction with borrows at every number) were not
learned by a 2-layer, 128-wide model in a few hundred CPU steps (sampled accuracy ~0.1, mostly one-number answers),
which left RL nothing to work with. The task space is small (max_count distinct prompts), so the held-out set is
disjoint by prompt id and seed, not by text. The reward is exact match after collapsing whitespace: 1.0 or 0.0, no
partial credit. A prompt's row holds its numbers (`{"count": ..., "step": ...}`) for rewards that take the row.
"""
from __future__ import annotations

import json
import math
import re

import numpy as np

from dora_tasks.core.records import Prompt

STEPS = (10,)  # a tuple so that more steps can come back; every helper below handles any set
_PROMPT = re.compile(r"count (\d+) step (\d+):")


def prompt_text(count: int, step: int) -> str:
    return f"count {count} step {step}:"


def answer_text(count: int, step: int) -> str:
    return " ".join(str(x) for x in range(count, -1, -step))


def parse_prompt(text: str) -> tuple[int, int]:
    """(count, step) of a countdown prompt; ValueError if the text is not one."""
    match = _PROMPT.fullmatch(text.strip())
    if not match:
        raise ValueError(f"not a countdown prompt: {text!r}")
    return int(match.group(1)), int(match.group(2))


def sample_counts(rng: np.random.Generator, n: int, max_count: int) -> np.ndarray:
    """Log-uniform integers in [1, max_count]: heavy-tailed, half of them below sqrt(max_count)."""
    u = rng.random(n)
    return np.minimum(np.floor(np.exp(u * math.log(max_count + 1))), max_count).astype(np.int64)


def make_prompts(n: int, seed: int, tokenizer, max_count: int, start_id: int = 0) -> list[Prompt]:
    """`n` countdown prompts with ids `start_id .. start_id + n - 1`; token ids are bos + the encoded prompt."""
    if max_count < 1:
        raise ValueError(f"max_count must be >= 1, got {max_count}")
    rng = np.random.default_rng(seed)
    counts = sample_counts(rng, n, max_count)
    steps = rng.choice(STEPS, size=n)
    prompts = []
    for i, (count, step) in enumerate(zip(counts.tolist(), steps.tolist())):
        text = prompt_text(count, step)
        ids = (tokenizer.bos_id, *tokenizer.encode(text))
        prompts.append(Prompt(prompt_id=start_id + i, text=text, answer=answer_text(count, step), token_ids=ids,
                              row_json=json.dumps({"count": count, "step": step})))
    return prompts


def demonstration(prompt: Prompt) -> str:
    """The correct response text (what warm start imitates)."""
    return answer_text(*parse_prompt(prompt.text))


def max_answer_tokens(max_count: int) -> int:
    """Longest response (eos included) over every prompt with count <= max_count, in character tokens.

    answer(c + step) is answer(c) with one more number in front, so the longest answer for a step has a count in
    (max_count - step, max_count]; checking the last max(STEPS) counts is enough.
    """
    return max(len(answer_text(count, step)) + 1 for count in range(max(1, max_count - max(STEPS) + 1), max_count + 1)
               for step in STEPS)


def reward(prompt_text: str, response_text: str, answer: str) -> float:
    """1.0 when the response is exactly the answer (whitespace collapsed), else 0.0."""
    return 1.0 if " ".join(response_text.split()) == " ".join(answer.split()) else 0.0
