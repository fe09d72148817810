"""Reward functions: resolved once from a dotted path or a callable, scored safely (timeout, exception, non-number
never raise).

A reward function is `fn(response, *, prompt, answer, row) -> float` (`row`: the dataset row's fields), the earlier
`fn(prompt, response, answer) -> float`, or either as a batch (`@batch_reward`) or `async def` form
(`reward_forms`). `resolve_reward_fn("pkg.mod.fn")` imports it once at load time (the callable pickles by reference
to Dask workers) and reads its form from its signature; it also takes a callable as it is; the empty string means
the countdown task's own reward. `score(fn, ...)` runs it with a timeout and returns `(reward, error)`: a failed
score is `(nan, why)`, recorded on the trajectory rather than raised, so one bad response never kills a run.

Adapters: `math_verify_reward` (answers of math datasets, through the `math-verify` package); reasoning-gym tasks are
scored by `dora_tasks.workloads.reasoning_gym.reasoning_gym_reward`. `score_all(fn, calls, timeout_s)` scores many
responses (a group) with one hand-over to a scoring thread; `score_isolated` scores them the way
`task.reward_isolation` says, and `score_parallel` (evaluation) in a few lanes. A call is
`(prompt, response, answer[, row])`, the row as JSON text (`RewardCall`).

Isolation: "thread" runs the function in a daemon thread and stops waiting after `timeout_s`; Python cannot kill a
thread, so a function stuck in pure Python or in C keeps its thread (and maybe a CPU) until it returns, and nothing
bounds its memory. "process" (`reward_pool`) runs the calls in reward processes that are killed past the timeout or
their memory limit, at a higher cost per call (README, Rewards). The calls of one `score_all` run one after the other
in one thread (a fresh one after a timeout): in a process whose other threads are busy (a Dask worker's event loop),
every hand-over between threads waits for the interpreter's switch interval, which a thread per call paid for every
response.
"""
from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from dora_tasks.core.dotted import import_callable
from dora_tasks.workloads import countdown
from dora_tasks.workloads.reward_forms import (RewardCall, RewardError, RewardFunction, as_reward_function,
                                               batch_reward, callable_name, reward_function)
from dora_tasks.workloads.reward_pool import shared_pool
from dora_tasks.workloads.reward_worker import TIMEOUT, describe

__all__ = ["RewardCall", "RewardError", "RewardFunction", "batch_reward", "check_reward_fn", "math_verify_reward",
           "resolve_reward_fn", "score", "score_all", "score_isolated", "score_parallel"]

RewardFn = RewardFunction | Callable[..., float]
Call = RewardCall | tuple  # (prompt, response, answer[, row JSON])
ScoreAll = Callable[[RewardFn, Sequence[Call], float], list[tuple[float, str]]]
ISOLATIONS = ("thread", "process")
NOT_SCORED = "not scored: every scoring lane stopped after a timeout"


def resolve_reward_fn(spec: str | Callable) -> RewardFunction:
    """`""` -> the countdown reward; `"pkg.mod.fn"` -> that function, imported now; a callable as it is. Its form is
    read from its signature (RewardError when it fits none)."""
    if callable(spec):
        return reward_function(spec, callable_name(spec))
    if not isinstance(spec, str):
        raise RewardError(f"reward_fn {spec!r}: expected a dotted path 'package.module.function' or a callable")
    return reward_function(_imported(spec) if spec else countdown.reward, spec or "countdown.reward")


def _imported(dotted: str) -> Callable:
    return import_callable(dotted, "reward_fn", RewardError, "package.module.function")


def check_reward_fn(spec: str | Callable) -> None:
    """The reward function resolves and takes one of the reward forms, before any cluster starts."""
    resolve_reward_fn(spec)


def score(fn: RewardFn, prompt_text: str, response_text: str, answer: str, timeout_s: float,
          row: str = "") -> tuple[float, str]:
    """`(reward, "")` on success; `(nan, "timeout" | "<ExcType>: msg" | "non-number: ...")` otherwise. Never raises."""
    return score_all(fn, [RewardCall(prompt_text, response_text, answer, row)], timeout_s)[0]


def score_all(fn: RewardFn, calls: Sequence[Call], timeout_s: float) -> list[tuple[float, str]]:
    """`score` of every call, in order, each unit (a call, or a batch) within its timeout."""
    fn = as_reward_function(fn)
    units = fn.units([RewardCall(*call) for call in calls])
    results: list[tuple[float, str]] = []
    scored = 0
    while scored < len(units):
        pending = units[scored:]
        done: queue.SimpleQueue = queue.SimpleQueue()
        abandoned = threading.Event()
        threading.Thread(target=_run_each, args=(fn, pending, timeout_s, done, abandoned), name="reward-fn",
                         daemon=True).start()
        for unit in pending:
            scored += 1
            try:
                results += done.get(timeout=fn.unit_timeout(timeout_s))
            except queue.Empty:  # this unit hangs: its thread is left behind, the next units get a new one
                abandoned.set()
                results += [(float("nan"), TIMEOUT)] * len(unit)
                break
    return results


def _run_each(fn: RewardFunction, units: Sequence[list[RewardCall]], timeout_s: float, done: queue.SimpleQueue,
              abandoned: threading.Event) -> None:
    for unit in units:
        if abandoned.is_set():
            return
        try:
            outcomes = fn.run(unit, timeout_s)
        except MemoryError as exc:  # nothing bounds a thread's memory: recorded like any other exception
            outcomes = [(float("nan"), describe(exc))] * len(unit)
        done.put(outcomes)


@contextlib.contextmanager
def scorer(isolation: str, memory_bytes: int) -> Iterator[ScoreAll]:
    """A `score_all` for one caller at a time: the thread one, or a lane (process) of this process's reward pool."""
    if isolation == "thread":
        yield score_all
    elif isolation == "process":
        with shared_pool(memory_bytes).lane() as lane:
            yield lane.score_all
    else:
        raise RewardError(f"reward isolation {isolation!r}: allowed {', '.join(ISOLATIONS)}")


def score_isolated(fn: RewardFn, calls: Sequence[Call], timeout_s: float, isolation: str,
                   memory_bytes: int) -> list[tuple[float, str]]:
    """`score_all` in the given isolation ("thread" or "process"; `memory_bytes` limits a reward process)."""
    with scorer(isolation, memory_bytes) as score_calls:
        return score_calls(fn, calls, timeout_s)


def score_parallel(fn: RewardFn, calls: Sequence[Call], timeout_s: float, isolation: str, memory_bytes: int,
                   lanes: int) -> list[tuple[float, str]]:
    """`score_isolated` of every call by `lanes` parallel scorers that take the calls one at a time from one queue.

    A lane whose call timed out takes no more calls, and the calls left when every lane stopped are
    `(nan, NOT_SCORED)`: a reward that hangs on every call then costs about one timeout in all (its lanes wait in
    parallel), not one per call, and one that hangs on a few inputs costs a lane each while the others go on. A batch
    or async reward gets the calls in one share per lane.
    """
    fn = as_reward_function(fn)
    results = [(float("nan"), NOT_SCORED)] * len(calls)
    n = max(1, min(lanes, len(calls)))
    share = max(1, -(-len(calls) // n)) if fn.scores_together else 1
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for start in range(0, len(calls), share):
        todo.put(range(start, min(start + share, len(calls))))

    def lane() -> None:
        with scorer(isolation, memory_bytes) as score_calls:
            while True:
                try:
                    indices = todo.get_nowait()
                except queue.Empty:
                    return
                outcomes = score_calls(fn, [calls[i] for i in indices], timeout_s)
                for i, outcome in zip(indices, outcomes):
                    results[i] = outcome
                if any(error.startswith(TIMEOUT) for _, error in outcomes):
                    return

    with ThreadPoolExecutor(n, thread_name_prefix="reward-lane") as pool:
        for done in [pool.submit(lane) for _ in range(n)]:
            done.result()
    return results


def math_verify_reward(prompt_text: str, response_text: str, answer: str) -> float:
    """1.0 when `math-verify` finds the response's final answer equal to `answer` (LaTeX or plain), else 0.0."""
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
    predicted = parse(response_text)
    return 1.0 if gold and predicted and verify(gold, predicted) else 0.0
