"""Rewards for reasoning-gym tasks: `task.reward_fn=dora_tasks.workloads.reasoning_gym.reasoning_gym_reward`.

Rows are reasoning-gym entries written to a file, e.g. one JSON line per entry of
`reasoning_gym.create_dataset(name, size=..., seed=...)` (`question`, `answer`, `metadata` with `source_dataset`), read
with `task.prompt_key=question task.answer_key=answer`. A row is scored by the scorer of the task it came from,
`reasoning_gym.get_score_answer_fn(metadata["source_dataset"])(answer=response, entry=row)`, so a file may mix tasks
(a `composite` dataset's entries name their own task) and every task's own rules apply, those that read the entry's
metadata included.

Simplified, and why: the response is scored as it is. reasoning-gym's scorers expect the bare answer; a prompt that
asks the model for tags (`<answer>...</answer>`) needs a reward that extracts it first
(`reasoning_gym.utils.extract_answer`) and calls this one. The package is imported with this module, so a missing
package fails when the reward is resolved, before any work, and its import is not paid inside a call's timeout.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

try:
    import reasoning_gym
except ImportError as exc:  # an optional dependency: say which package and extra bring it
    raise ImportError(f"the reasoning-gym rewards need the package reasoning-gym (pip install -e '.[data]'): "
                      f"{exc}") from exc


def reasoning_gym_reward(response: str, *, prompt: str, answer: str, row: dict[str, Any]) -> float:
    """The score reasoning-gym's own scorer gives `response` for the entry `row` (its question and answer default to
    the prompt and answer when the row lacks them)."""
    metadata = row.get("metadata")
    name = metadata.get("source_dataset") if isinstance(metadata, dict) else None
    if not name:
        raise ValueError("the row has no metadata.source_dataset: write rows from reasoning_gym.create_dataset "
                         "entries (question, answer, metadata)")
    entry = {"question": prompt, "answer": answer, **row}
    return scorer(name)(answer=response, entry=entry)


@functools.cache
def scorer(name: str) -> Callable[..., float]:
    """The `score_answer` of reasoning-gym task `name`, built once per process (its dataset object is built too)."""
    return reasoning_gym.get_score_answer_fn(name)
