"""Reward functions: resolved once from a dotted path, scored safely (timeout, exception, non-number never raise).

A reward function is any callable `fn(prompt_text, response_text, answer) -> float`. `resolve_reward_fn("pkg.mod.fn")`
imports it once at load time (the callable pickles by reference to Dask workers); the empty string means the
countdown task's own reward. `score(fn, ...)` runs it with a timeout and returns `(reward, error)`: a failed score is
`(nan, why)`, recorded on the trajectory rather than raised, so one bad response never kills a run.

Adapters: `math_verify_reward` (answers of math datasets, through the `math-verify` package) and
`reasoning_gym_reward` (the scorer of a `reasoning-gym` task, imported lazily since the package is optional).
`score_all(fn, calls, timeout_s)` scores many responses (a group) with one hand-over to a scoring thread;
`score_isolated` scores them the way `task.reward_isolation` says, and `score_parallel` (evaluation) in a few lanes.

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
import importlib
import inspect
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from dora_tasks.workloads import countdown
from dora_tasks.workloads.reward_pool import TIMEOUT, shared_pool
from dora_tasks.workloads.reward_worker import as_reward, describe

RewardFn = Callable[[str, str, str], float]
Call = tuple[str, str, str]
ScoreAll = Callable[[RewardFn, Sequence[Call], float], list[tuple[float, str]]]
ISOLATIONS = ("thread", "process")
NOT_SCORED = "not scored: every scoring lane stopped after a timeout"


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


def check_reward_fn(dotted: str) -> None:
    """The reward function resolves and takes (prompt, response, answer), before any cluster starts."""
    fn = resolve_reward_fn(dotted)
    try:
        inspect.signature(fn).bind("prompt", "response", "answer")
    except TypeError as exc:
        raise RewardError(f"task.reward_fn {dotted!r}: cannot be called as fn(prompt, response, answer): "
                          f"{exc}") from None
    except ValueError:  # a builtin without a signature: it is called as it is
        pass


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
                results.append((float("nan"), TIMEOUT))
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
            outcome = (float("nan"), describe(exc))
        done.put(outcome)


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
    parallel), not one per call, and one that hangs on a few inputs costs a lane each while the others go on.
    """
    results = [(float("nan"), NOT_SCORED)] * len(calls)
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for i in range(len(calls)):
        todo.put(i)

    def lane() -> None:
        with scorer(isolation, memory_bytes) as score_calls:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                results[i] = score_calls(fn, [calls[i]], timeout_s)[0]
                if results[i][1].startswith(TIMEOUT):
                    return

    n = max(1, min(lanes, len(calls)))
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
