"""Reward functions that fail in the ways users' rewards do, importable by dotted path (`faulty_rewards.<name>`)."""
from __future__ import annotations


def always_raises(prompt: str, response: str, answer: str) -> float:
    raise KeyError("the scorer's lookup table has no such entry")


def returns_text(prompt: str, response: str, answer: str) -> str:
    return "correct"


def takes_one_argument(response: str) -> float:
    return 0.0
