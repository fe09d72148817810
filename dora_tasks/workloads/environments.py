"""The environment of a multi-turn episode: what answers the model's turns (a tool, a game, a user simulator).

The contract (one small class; `task.environment` names a factory of it by dotted path, one instance per episode):

    class MyEnvironment(Environment):
        stop = ("</call>",)                          # strings that end a model turn (eos always does)

        def reset(self, prompt: Prompt) -> str:      # optional: the episode starts from the dataset's prompt
            return ""                                # text added after the prompt ("" = the prompt as it is)

        def step(self, turn: str) -> Step:           # the model's turn, decoded (its stop string included)
            return Step(observation="<out>...</out>", done=False, reward=None, tool_call=True)

`prompt` is the `records.Prompt` of the dataset row (its `text`, `answer`, token ids). `step` runs after every model
turn, the last one included: its observation is appended to the response as environment tokens (stored, left out
of the loss), unless the episode ends there. An episode ends when `step` says `done`, when the turn ended with eos,
after `task.max_turns` model turns, or when `rollout.max_new_tokens` (the budget of the whole response: model and
environment tokens) is spent. Its reward is the sum of the rewards its steps returned; when every step returned
None, the task's reward function scores the whole response text (`task.reward_fn`). A `reset` or `step` that
raises or outlives `task.environment_timeout_s` ends the episode and is recorded on the trajectory
(`env_error`), never raised. Environments run on the rollout workers, in the rollout task's threads.

Built in: `dora_tasks.workloads.calculator.CalculatorEnvironment` (arithmetic task, `<calc>expr</calc>`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from dora_tasks.core.dotted import import_callable
from dora_tasks.core.records import Prompt


@dataclass(frozen=True)
class Step:
    """What an environment answers to one model turn."""

    observation: str = ""  # appended after the turn as environment tokens (dropped when the episode ends here)
    done: bool = False  # the episode ends after this turn
    reward: float | None = None  # added to the episode's reward; None: this step gives none
    tool_call: bool = False  # the turn called a tool (counted per episode: `tool_calls`)


class Environment(ABC):
    """One episode's environment (see the module docstring)."""

    stop: tuple[str, ...] = ()

    def reset(self, prompt: Prompt) -> str:
        """Text added after the prompt before the first model turn ("" by default)."""
        return ""

    @abstractmethod
    def step(self, turn: str) -> Step:
        """Answer one model turn."""


EnvironmentFactory = Callable[[], Environment]


class EnvironmentLoadError(ValueError):
    """`task.environment` cannot be resolved to a factory of environments; the message says why."""


def load_environment(spec: str | EnvironmentFactory) -> EnvironmentFactory:
    """A factory of environments: `spec` itself when callable, else the object its dotted path names."""
    if callable(spec):
        return spec
    factory = import_callable(str(spec), "task.environment", EnvironmentLoadError, "package.module.Class")
    return factory


def check_environment(spec: str | EnvironmentFactory) -> None:
    """The environment resolves and its factory makes an `Environment`, before any cluster starts."""
    made = load_environment(spec)()
    if not isinstance(made, Environment) and not (callable(getattr(made, "step", None))):
        raise EnvironmentLoadError(f"task.environment {spec!r} made a {type(made).__name__}, which has no "
                                   "step(turn) method (subclass dora_tasks.workloads.environments.Environment)")
    if not all(isinstance(s, str) and s for s in getattr(made, "stop", ())):
        raise EnvironmentLoadError(f"task.environment {spec!r}: stop must be a tuple of non-empty strings, got "
                                   f"{getattr(made, 'stop', None)!r}")
