"""The forms a reward function may take, found once from its signature, and how a unit of its calls runs.

Forms (README, Rewards):
- `fn(response, *, prompt, answer, row) -> float`: `row` is the dataset row as a dict of JSON values (a fresh dict
  per call);
- `fn(prompt, response, answer) -> float`: the earlier three-argument form;
- a batch reward, marked with `@batch_reward` (or a truthy attribute `dora_batch_reward`):
  `fn(responses, *, prompts, answers, rows) -> sequence of floats`, called once for all the responses one scorer
  hands over (whole groups);
- any of these as `async def` (a coroutine function, or an object whose `__call__` is one): the calls of one hand-over
  run concurrently on one event loop, each within the call timeout.

`reward_function(fn, name)` reads the form from the signature, once, and raises `RewardError` when `fn` fits none. A
signature that takes both per-call forms is called in the three-argument one unless it names a parameter `row`:
a wrapper `(*args, **kwargs)` of an existing reward expects three positional arguments.

A scorer splits its calls into units (`RewardFunction.units`): one call each for a plain function, all at once for a
batch or async one, and waits for each unit within `unit_timeout`. `RewardFunction.run` returns one
`(reward, error)` per call of a unit and raises for nothing the function does but MemoryError (a reward process ends
itself on it). Only the standard library is imported here, since reward processes unpickle this class.
"""
from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from dora_tasks.workloads.reward_worker import TIMEOUT, as_reward, describe

BATCH_ATTRIBUTE = "dora_batch_reward"
ASYNC_GRACE_S = 1.0  # an async unit's own per-call timeouts end first; past this the unit as a whole timed out

Outcome = tuple[float, str]


class RewardError(ValueError):
    """A reward function cannot be resolved or called as a reward; the message names it and why."""


class RewardCall(NamedTuple):
    """What one reward call gets: the prompt text, the response text, the answer and the dataset row."""

    prompt: str
    response: str
    answer: str
    row: str = ""  # the dataset row as JSON text (`Prompt.row_json`); "" reaches the function as {}

    def row_dict(self) -> dict[str, Any]:
        return json.loads(self.row) if self.row else {}


def batch_reward(fn: Callable) -> Callable:
    """Marks `fn(responses, *, prompts, answers, rows) -> list[float]` as a batch reward (called once with lists)."""
    setattr(fn, BATCH_ATTRIBUTE, True)
    return fn


@dataclass(frozen=True, eq=False)
class RewardFunction:
    """A reward callable with its form; pickles with `fn` (by reference when `fn` is a module-level function)."""

    fn: Callable
    name: str
    takes_row: bool  # called as fn(response, *, prompt, answer, row); else fn(prompt, response, answer)
    batch: bool
    is_async: bool

    @property
    def scores_together(self) -> bool:
        """Whether one invocation (a batch, or one event loop) takes several calls."""
        return self.batch or self.is_async

    def units(self, calls: Sequence[RewardCall]) -> list[list[RewardCall]]:
        if self.scores_together:
            return [list(calls)] if calls else []
        return [[call] for call in calls]

    def unit_timeout(self, timeout_s: float) -> float:
        return timeout_s + ASYNC_GRACE_S if self.is_async else timeout_s

    def run(self, calls: Sequence[RewardCall], timeout_s: float) -> list[Outcome]:
        """`(reward, error)` per call: a number, or `(nan, why)`; MemoryError is the one exception raised."""
        try:
            values = self._invoke(calls, timeout_s)
        except MemoryError:
            raise
        except BaseException as exc:  # noqa: BLE001 - anything the user's function raises is recorded
            return [(float("nan"), describe(exc))] * len(calls)
        return [_outcome(value) for value in values]

    def __call__(self, prompt: str, response: str, answer: str, row: dict | str | None = None) -> Any:
        """One call without a timeout, whatever the form (for callers that score one response directly)."""
        text = row if isinstance(row, str) else json.dumps(row) if row else ""
        (value,) = self._invoke([RewardCall(prompt, response, answer, text)], None)
        if isinstance(value, BaseException):
            raise value
        return value

    def _invoke(self, calls: Sequence[RewardCall], timeout_s: float | None) -> list:
        """The function's value (or, from an async one, exception) per call."""
        if self.batch:
            (value,) = self._values([_batch_arguments(calls)], timeout_s)
            return _split(value, len(calls))
        return self._values([self._arguments(call) for call in calls], timeout_s)

    def _arguments(self, call: RewardCall) -> tuple[tuple, dict]:
        if self.takes_row:
            return (call.response,), {"prompt": call.prompt, "answer": call.answer, "row": call.row_dict()}
        return (call.prompt, call.response, call.answer), {}

    def _values(self, invocations: list[tuple[tuple, dict]], timeout_s: float | None) -> list:
        if not self.is_async:
            return [self.fn(*args, **kwargs) for args, kwargs in invocations]
        import asyncio  # only async rewards pay for its import in a reward process

        return asyncio.run(_gather(self.fn, invocations, timeout_s))


async def _gather(fn: Callable, invocations: list[tuple[tuple, dict]], timeout_s: float | None) -> list:
    import asyncio

    async def one(args: tuple, kwargs: dict):
        return await asyncio.wait_for(fn(*args, **kwargs), timeout_s)

    return await asyncio.gather(*(one(args, kwargs) for args, kwargs in invocations), return_exceptions=True)


def _batch_arguments(calls: Sequence[RewardCall]) -> tuple[tuple, dict]:
    return ([c.response for c in calls],), {"prompts": [c.prompt for c in calls],
                                            "answers": [c.answer for c in calls],
                                            "rows": [c.row_dict() for c in calls]}


def _split(value: Any, n: int) -> list:
    """A batch's value per call; an exception, or a value that is not n numbers, fails every call of the batch."""
    if isinstance(value, BaseException):
        return [value] * n
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
        return [ValueError(f"a batch reward returned {type(value).__name__}, expected a sequence of {n} numbers")] * n
    if len(value) != n:
        return [ValueError(f"a batch reward returned {len(value)} values for {n} responses")] * n
    return list(value)


def _outcome(value: Any) -> Outcome:
    if isinstance(value, TimeoutError):  # an async call past its timeout (asyncio.wait_for)
        return float("nan"), TIMEOUT
    if isinstance(value, BaseException):
        return float("nan"), describe(value)
    return as_reward(value)


def reward_function(fn: Callable, name: str) -> RewardFunction:
    """`fn` with its form read from its signature; RewardError when it is no reward function."""
    if isinstance(fn, RewardFunction):
        return fn
    if inspect.isclass(fn):
        raise RewardError(f"reward_fn {name!r} is a class; pass an instance (an object with __call__) or a function")
    if not callable(fn):
        raise RewardError(f"reward_fn {name!r}: a {type(fn).__name__} is not a callable")
    batch = bool(getattr(fn, BATCH_ATTRIBUTE, False))
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
    return RewardFunction(fn, name, _takes_row(fn, name, batch), batch, is_async)


def _takes_row(fn: Callable, name: str, batch: bool) -> bool:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: called in the form it most likely has
        return batch
    shown = _plain(signature)
    if batch:
        if _binds(signature, ([""],), {"prompts": [""], "answers": [""], "rows": [{}]}):
            return True
        raise RewardError(f"reward_fn {name!r} takes {shown}; a batch reward is called as "
                          f"fn(responses, *, prompts, answers, rows) with one list each")
    with_row = _binds(signature, ("",), {"prompt": "", "answer": "", "row": {}})
    three = _binds(signature, ("", "", ""), {})
    if with_row and (not three or "row" in signature.parameters):
        return True
    if three:
        return False
    raise RewardError(f"reward_fn {name!r} takes {shown}; a reward is called as "
                      f"fn(response, *, prompt, answer, row) or fn(prompt, response, answer)")


def _plain(signature: inspect.Signature) -> inspect.Signature:
    """The signature without annotations, as an error message shows it: `(response, *, prompt)`."""
    empty = inspect.Parameter.empty
    return signature.replace(parameters=[p.replace(annotation=empty) for p in signature.parameters.values()],
                             return_annotation=empty)


def _binds(signature: inspect.Signature, args: tuple, kwargs: dict) -> bool:
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def as_reward_function(fn: Callable) -> RewardFunction:
    """`fn` as a RewardFunction: as it is if it is one, else with its form read (once per hashable callable)."""
    if isinstance(fn, RewardFunction):
        return fn
    try:
        return _form_of(fn)
    except TypeError:  # an unhashable callable object: read its form again
        return reward_function(fn, callable_name(fn))


@functools.lru_cache(maxsize=64)
def _form_of(fn: Callable) -> RewardFunction:
    return reward_function(fn, callable_name(fn))


def callable_name(fn: Callable) -> str:
    """`module.qualname` of a function, or of an object's class."""
    target = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(fn).__name__)}"
