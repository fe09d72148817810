"""Pipelines defined in Python: the public entry point, and what `dora run` and `dora resume` call.

    from pipelines import Pipeline

    def exact(response, *, prompt, answer, row):           # or a dotted path "package.module.function"
        return float(response.strip() == answer)

    rows = [{"prompt": "2+3=", "answer": "5"}, ...]         # or a datasets.Dataset, a .jsonl/.parquet path, "hf:name"
    summary = Pipeline("configs/cpu_demo.yaml", overrides=["dora.num_updates=20"], dataset=rows, reward=exact).run()
    print(summary.to_text())

`config` is a `Config`, a dict of sections, a YAML path, or None (the defaults), with `overrides` (`section.key=value`
strings) on top. `environment` (multi-turn episodes) is an environment class or factory, an instance (each episode
gets a copy), or a dotted path. With `client` the run attaches to that Dask cluster (workers labelled as in the
README) and leaves it open; without one it starts the embedded cluster, or attaches to `cluster.scheduler_address`.
Objects given here win over the config's dotted paths (`pipelines.inputs`: how the run folder records them).
Everything is checked before any work starts: the config, the rows, the reward's form, and that each object the
workers need survives cloudpickle (how Dask sends it), with an error naming the object.

`run()` starts a run in `storage.run_dir`; `resume()` continues the run there from its last checkpoint (the folder's
saved config, `overrides` on top; the same objects given again); `Pipeline.from_run_dir(run_dir)` resumes a folder
by its path alone. Both return the run's `RunSummary`. Ctrl-C stops a run cleanly (KeyboardInterrupt once the
cluster is closed and the store flushed), and the folder can be resumed.
"""
from __future__ import annotations

import copy
import functools
import os
from collections.abc import Iterable
from typing import Any

from dora_tasks.core.config import Config, apply_overrides, config_from_dict, load_config
from pipelines.inputs import (
    ENVIRONMENT_KEY,
    ROWS_FILE,
    RunInputs,
    UserCodeError,
    as_rows,
    check_picklable,
    config_value,
)
from pipelines.run import RunSummary


class Pipeline:
    """One run defined in Python (module docstring)."""

    def __init__(self, config: Config | dict | str | os.PathLike | None = None, *, overrides: Iterable[str] = (),
                 dataset: Any = None, reward: Any = None, environment: Any = None, client: Any = None) -> None:
        self.overrides = list(overrides)
        self.config = build_config(config, self.overrides)
        self.inputs = RunInputs(client=client)
        if dataset is not None:
            self._set_dataset(dataset)
        if reward is not None:
            self._set_reward(reward)
        if environment is not None:
            self._set_environment(environment)
        self.config.validate()  # again: the dataset and environment set here take part in cross-section checks
        self._resume_dir = ""

    @classmethod
    def from_run_dir(cls, run_dir: str, overrides: Iterable[str] = (), *, reward: Any = None,
                     environment: Any = None, client: Any = None) -> Pipeline:
        """The run in `run_dir`, to `resume()`: its saved config with `overrides` on top, read when it resumes."""
        pipeline = cls.__new__(cls)
        pipeline.overrides, pipeline.config, pipeline._resume_dir = list(overrides), None, run_dir
        pipeline.inputs = RunInputs(client=client)
        if reward is not None:
            pipeline.inputs.reward = _checked("reward", reward)
        if environment is not None:
            pipeline.inputs.environment = _checked("environment", environment_factory(environment))
        return pipeline

    @property
    def run_dir(self) -> str:
        return self._resume_dir or self.config.storage.run_dir

    def run(self) -> RunSummary:
        """Start the run in `storage.run_dir` (which must hold none yet) and drive it to `dora.num_updates`."""
        if self.config is None:
            raise UserCodeError(f"this pipeline continues the run in {self.run_dir!r}: call resume(), not run()")
        from pipelines.streaming import run_pipeline

        return run_pipeline(self.config, self.inputs)

    def resume(self) -> RunSummary:
        """Continue the run in `storage.run_dir` from its last checkpoint (or its start, if it holds none)."""
        from pipelines.streaming import resume_pipeline

        return resume_pipeline(self.run_dir, self.overrides, self.inputs)

    # ---- what was given ------------------------------------------------------------------------------------------
    def _set_dataset(self, dataset: Any) -> None:
        task = self.config.task
        task.name = "dataset"
        if isinstance(dataset, (str, os.PathLike)):
            task.dataset = os.fspath(dataset)
            return
        self.inputs.rows = as_rows(dataset)
        task.dataset = os.path.abspath(os.path.join(self.config.storage.run_dir, ROWS_FILE))

    def _set_reward(self, reward: Any) -> None:
        if isinstance(reward, str):
            self.config.task.reward_fn = reward
            return
        self.inputs.reward = _checked("reward", reward)
        self.config.task.reward_fn = config_value(reward)

    def _set_environment(self, environment: Any) -> None:
        if not hasattr(self.config.task, ENVIRONMENT_KEY):
            raise UserCodeError("environment: this version has no multi-turn episodes (no task.environment)")
        if isinstance(environment, str):
            setattr(self.config.task, ENVIRONMENT_KEY, environment)
            return
        self.inputs.environment = _checked("environment", environment_factory(environment))
        setattr(self.config.task, ENVIRONMENT_KEY, config_value(environment))


def build_config(config: Config | dict | str | os.PathLike | None, overrides: list[str]) -> Config:
    """A validated copy of `config` with `overrides` applied, its algorithm names checked against the registry."""
    from dora_tasks.algorithms import check_config_names

    if config is None or isinstance(config, (str, os.PathLike)):
        cfg = load_config(config, overrides)
    elif isinstance(config, Config):
        cfg = config_from_dict(apply_overrides(config.to_dict(), overrides))
    elif isinstance(config, dict):
        cfg = config_from_dict(apply_overrides(copy.deepcopy(config), overrides))
    else:
        raise UserCodeError(f"config: expected a Config, a dict of sections or a YAML path, got "
                            f"{type(config).__name__}")
    check_config_names(cfg.train)
    return cfg


def environment_factory(environment: Any) -> Any:
    """What makes an episode's environment: a class or factory as it is; an instance, copied for each episode (so
    that episodes never share its state)."""
    if callable(environment):
        return environment
    if callable(getattr(environment, "step", None)):
        return functools.partial(copy.deepcopy, environment)
    raise UserCodeError(f"environment: expected an environment class or factory, an instance with step(turn), or a "
                        f"dotted path, got {type(environment).__name__}")


def _checked(what: str, obj: Any) -> Any:
    if not callable(obj):
        raise UserCodeError(f"{what}: expected a callable or a dotted path, got {type(obj).__name__}")
    check_picklable(what, obj)
    return obj
