"""Reward functions of every form for tests/test_reward_row.py, in a module of their own so that reward processes
and Dask workers import them by their dotted path (`row_rewards.<name>`).

Each scores `response == answer` (plus the row's `bonus` where it takes the row) and does what the response names:
"raise" raises, "text" returns no number, "hang" waits the row's `hang_s` seconds.
"""
from __future__ import annotations

import asyncio
import time

from dora_tasks.workloads.rewards import batch_reward


def _misbehave(response: str, row: dict) -> object | None:
    if response == "raise":
        raise KeyError("no such entry")
    if response == "text":
        return "correct"
    if response == "hang":
        time.sleep(row.get("hang_s", 0.0))
    return None


def three_arguments(prompt: str, response: str, answer: str) -> float:
    bad = _misbehave(response, {"hang_s": 2.0})
    return bad if bad is not None else float(response == answer)


def with_row(response: str, *, prompt: str, answer: str, row: dict) -> float:
    bad = _misbehave(response, row)
    value = bad if bad is not None else float(response == answer) + row["bonus_given"]
    row["bonus_given"] = -100.0  # a reward may change its row: the next call of the group still gets its own
    return value


@batch_reward
def batched(responses: list[str], *, prompts: list[str], answers: list[str], rows: list[dict]) -> list:
    for response, row in zip(responses, rows):
        if response in ("raise", "hang"):  # a batch fails or hangs as a whole
            _misbehave(response, row)
    if "short" in responses:
        return [0.0] * (len(responses) - 1)
    return ["correct" if r == "text" else float(r == a) + row["bonus_given"]
            for r, a, row in zip(responses, answers, rows)]


async def async_with_row(response: str, *, prompt: str, answer: str, row: dict) -> float:
    if response == "hang":
        await asyncio.sleep(row["hang_s"])  # only this call times out; the others of its batch go on
    await asyncio.sleep(0)
    bad = _misbehave(response if response != "hang" else "", row)
    return bad if bad is not None else float(response == answer) + row["bonus_given"]


@batch_reward
async def async_batched(responses: list[str], *, prompts: list[str], answers: list[str], rows: list[dict]) -> list:
    await asyncio.sleep(0)
    return [float(r == a) + row["bonus_given"] for r, a, row in zip(responses, answers, rows)]


class RowScorer:
    """A callable object with state, unhashable (it defines __eq__): the form a Python pipeline may pass."""

    def __init__(self, weight: float):
        self.weight = weight

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowScorer) and other.weight == self.weight

    def __call__(self, response: str, *, prompt: str, answer: str, row: dict) -> float:
        return self.weight * float(response == answer) + row["bonus_given"]


def takes_one_argument(response: str) -> float:
    return 0.0


@batch_reward
def batch_of_three_lists(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    return [0.0] * len(responses)
