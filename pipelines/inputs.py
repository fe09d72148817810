"""What a run takes besides its configuration: the user's Python objects (`pipelines.api.Pipeline`).

`UserCode` is what the workers call: the reward function and the multi-turn environment, each a Python object or
the config's dotted path. The driver passes them to its tasks as they are; Dask pickles them with cloudpickle (a
module's function by reference, one defined in a script or notebook by value), and `check_picklable` tries exactly
that before any work starts. The run folder's config records an object by its import path where it has one, so
`dora resume` finds it again; an object without one (defined in `__main__`, a lambda, an instance) is recorded as
`python-object:<module>.<name>`, and such a run resumes through `Pipeline.resume` given the same object.
`RunInputs` carries all of it, with dataset rows given in Python and a Dask client to attach to, into `open_run`.
"""
from __future__ import annotations

import importlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dora_tasks.core.config import Config
from dora_tasks.workloads.datasets import read_jsonl, row_json

PYTHON_OBJECT = "python-object:"  # config value of an object that cannot be imported by name
ROWS_FILE = "dataset.jsonl"  # the rows a run was given in Python, kept in its folder (resume reads them back)
ENVIRONMENT_KEY = "environment"  # TaskConfig field of the multi-turn environment's dotted path


class UserCodeError(ValueError):
    """A reward function, environment or dataset given in Python cannot be used; the message names it and why."""


@dataclass(frozen=True)
class UserCode:
    """The reward function and the environment the tasks get: Python objects, or dotted paths ("" = the default:
    the task's own reward; single-turn responses)."""

    reward: Any = ""
    environment: Any = ""


@dataclass
class RunInputs:
    """Python objects given for one run; None leaves the config's setting."""

    rows: list[dict] | None = None  # dataset rows (kept in the run folder as ROWS_FILE)
    reward: Any = None
    environment: Any = None
    client: Any = None  # a `distributed.Client` to attach to (left open at the end)

    def code(self, cfg: Config) -> UserCode:
        """The objects given, else the config's paths; a path recorded for an object that was given in Python
        before needs that object again."""
        reward = self.reward if self.reward is not None else _configured(cfg.task.reward_fn, "reward", "task.reward_fn")
        environment = self.environment
        if environment is None:
            environment = _configured(getattr(cfg.task, ENVIRONMENT_KEY, ""), "environment", "task.environment")
        return UserCode(reward, environment)


def _configured(value: str, what: str, key: str) -> str:
    if value.startswith(PYTHON_OBJECT):
        raise UserCodeError(f"{key}: this run's {what} was a Python object ({value[len(PYTHON_OBJECT):]}) given to "
                            f"Pipeline; resume it from Python with the same object: Pipeline.from_run_dir(RUN_DIR, "
                            f"{what}=...).resume()")
    return value


# ---- objects -----------------------------------------------------------------------------------------------------
def describe(obj: Any) -> str:
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{getattr(obj, '__module__', None) or type(obj).__module__}.{name}"


def import_path(obj: Any) -> str:
    """`module.name` when importing that gives back this very object (what a worker or `dora resume` can do), else
    ""."""
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not name or module == "__main__" or "<" in name:
        return ""
    try:
        found: Any = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return ""
    return f"{module}.{name}" if found is obj else ""


def config_value(obj: Any) -> str:
    """How the run folder's config records an object given in Python."""
    return import_path(obj) or PYTHON_OBJECT + describe(obj)


def check_picklable(what: str, obj: Any) -> None:
    """`obj` survives cloudpickle (how Dask sends it to the workers), or a `UserCodeError` naming it and why."""
    import cloudpickle

    try:
        cloudpickle.loads(cloudpickle.dumps(obj))
    except Exception as exc:  # noqa: BLE001 - pickling fails in many ways; each is reported the same way
        raise UserCodeError(
            f"{what} {describe(obj)} cannot be sent to the Dask workers: cloudpickle failed ({type(exc).__name__}: "
            f"{exc}); keep what cannot be pickled (locks, open files or sockets, clients, loaded engines) out of it, "
            "or create it on the worker at first use") from None


# ---- rows --------------------------------------------------------------------------------------------------------
def as_rows(dataset: Iterable) -> list[dict]:
    """A list of dict rows from a list of mappings or a Hugging Face `datasets.Dataset` (iterated row by row)."""
    if isinstance(dataset, Mapping):
        raise UserCodeError("dataset: expected rows (a list of dicts or a datasets.Dataset), a file path or "
                            "'hf:<name>', got a single mapping; for a DatasetDict pick a split: dataset['train']")
    try:
        rows = list(dataset)
    except TypeError:
        raise UserCodeError(f"dataset: expected rows, a file path or 'hf:<name>', got {type(dataset).__name__}") \
            from None
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, Mapping):
            raise UserCodeError(f"dataset row {number}: expected a dict, got {type(row).__name__}")
    if not rows:
        raise UserCodeError("dataset: no rows given")
    return [dict(row) for row in rows]


def write_rows(rows: list[dict], path: str) -> None:
    """The rows as JSON lines, each as the reward sees it (`row_json`: a value JSON cannot hold becomes its str())."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("".join(row_json(row) + "\n" for row in rows))


def check_same_rows(rows: list[dict], path: str) -> None:
    """A resumed run trains on the rows it started with: rows given again must be those."""
    kept = read_jsonl(path) if os.path.isfile(path) else None
    if kept != [json.loads(row_json(row)) for row in rows]:
        raise UserCodeError(f"dataset: the rows given differ from those this run started with ({path}); a resumed "
                            "run trains on its own rows (leave dataset out to resume)")
