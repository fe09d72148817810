"""Reward functions: resolved once from a dotted path, scored safely (timeout, exception, non-number never raise).

A reward function is any callable `fn(prompt_text, response_text, answer) -> float`. `resolve_reward_fn("pkg.mod.fn")`
imports it once at load time (the callable pickles by reference to Dask workers); the empty string means the
countdown task's own reward. `score(fn, ...)` runs it with a timeout and returns `(reward, error)`: a failed score is
`(nan, why)`, recorded on the trajectory rather than raised, so one bad response never kills a run.

Adapters: `math_verify_reward` (answers of math datasets, through the `math-verify` package) and
`reasoning_gym_reward` (the scorer of a `reasoning-gym` task, imported lazily since the package is optional).
`score_all(fn, calls, timeout_s)` scores many responses (a group) with one hand-over to a scoring thread.

Simplified: the timeout runs the function in a daemon thread and stops waiting after `timeout_s`; Python cannot kill a
thread, so a function stuck in pure Python keeps its thread (and one CPU) until it returns. A process per call would
give hard timeouts at ~10 ms a call, too dear for the rewards of every trajectory; reward functions are expected to
be cheap and a timeout to be rare. The calls of one `score_all` run one after the other in one thread (a fresh one
after a timeout): in a process whose other threads are busy (a Dask worker's event loop), every hand-over between
threads waits for the interpreter's switch interval (5 ms), which a thread per call paid for every response.
"""
from __future__ import annotations

import importlib
import math
import numbers
import queue
import threading
from collections.abc import Callable, Sequence

from dora_tasks.workloads import countdown

RewardFn = Callable[[str, str, str], float]


class RewardError(ValueError):
    """A reward function path cannot be resolved to a callable; the message names the path and why."""


def resolve_reward_fn(dotted: str) -> RewardFn:
    """`""` -> the countdown reward; `"pkg.mod.fn"` -> that function, imported now."""
    if not dotted:
        return countdown.reward
    module_name, _, attr = dotted.rpartition(".")
    if not module_name or not attr:
        raise RewardError(f"reward_fn {dotted!r}: expected a dotted path 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or anything the module raises while importing
        raise RewardError(f"reward_fn {dotted!r}: cannot import module {module_name!r} "
                          f"({type(exc).__name__}: {exc})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardError(f"reward_fn {dotted!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise RewardError(f"reward_fn {dotted!r}: {attr!r} is a {type(fn).__name__}, not a callable")
    return fn


def score(fn: RewardFn, prompt_text: str, response_text: str, answer: str, timeout_s: float) -> tuple[float, str]:
    """`(reward, "")` on success; `(nan, "timeout" | "<ExcType>: msg" | "non-number: ...")` otherwise. Never raises."""
    return score_all(fn, [(prompt_text, response_text, answer)], timeout_s)[0]


def score_all(fn: RewardFn, calls: Sequence[tuple[str, str, str]], timeout_s: float) -> list[tuple[float, str]]:
    """`score` of every `(prompt_text, response_text, answer)`, in order, each with its own `timeout_s`."""
    results: list[tuple[float, str]] = []
    while len(results) < len(calls):
        pending = calls[len(results):]
        done: queue.SimpleQueue = queue.SimpleQueue()
        abandoned = threading.Event()
        threading.Thread(target=_call_each, args=(fn, pending, done, abandoned), name="reward-fn",
                         daemon=True).start()
        for _ in pending:
            try:
                results.append(done.get(timeout=timeout_s))
            except queue.Empty:  # this call hangs: its thread is left behind, the next calls get a new one
                abandoned.set()
                results.append((float("nan"), "timeout"))
                break
    return results


def _call_each(fn: RewardFn, calls: Sequence[tuple[str, str, str]], done: queue.SimpleQueue,
               abandoned: threading.Event) -> None:
    for prompt_text, response_text, answer in calls:
        if abandoned.is_set():
            return
        try:
            outcome = as_reward(fn(prompt_text, response_text, answer))
        except BaseException as exc:  # noqa: BLE001 - anything the user's function raises is recorded
            outcome = (float("nan"), f"{type(exc).__name__}: {exc}")
        done.put(outcome)


def as_reward(value: object) -> tuple[float, str]:
    """A finite real number (bools included) becomes a float reward; anything else is an error."""
    if isinstance(value, numbers.Real):
        reward = float(value)
        if math.isfinite(reward):
            return reward, ""
    return float("nan"), f"non-number: {value!r}"[:200]


def math_verify_reward(prompt_text: str, response_text: str, answer: str) -> float:
    """1.0 when `math-verify` finds the response's final answer equal to `answer` (LaTeX or plain), else 0.0."""
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
    predicted = parse(response_text)
    return 1.0 if gold and predicted and verify(gold, predicted) else 0.0


def reasoning_gym_reward(prompt_text: str, response_text: str, answer: str) -> float:
    """Score with `reasoning_gym`'s default answer check (`score_answer` against an entry holding `answer`).

    Datasets that need the full generated entry (metadata) should pass their own function instead.
    """
    try:
        from reasoning_gym.dataset import ProceduralDataset
    except ImportError:
        raise RewardError("reasoning_gym_reward needs the optional package reasoning-gym "
                          "(pip install reasoning-gym); it is not installed") from None
    entry = {"question": prompt_text, "answer": answer, "metadata": {}}
    return float(ProceduralDataset.score_answer(None, response_text, entry))
