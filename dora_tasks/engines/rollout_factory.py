"""Build the rollout engine a `RolloutConfig` names ("vllm", "hf" or "emulated"), importing only that backend.

Both backends are imported lazily, by module name, inside `make_rollout_engine`: importing this module costs nothing
(no torch, no vllm), so it is safe to import in the driver, in spawned processes and in Dask workers that never serve
rollouts.

`EngineConfigError` lives here because it is engine-agnostic and this module is the one every caller goes through.
(Simplification: it would sit better in `dora_tasks.core.contracts`, next to `RolloutEngine`.)
"""
from __future__ import annotations

import importlib

from dora_tasks.core.config import RolloutConfig
from dora_tasks.core.contracts import RolloutEngine


class EngineConfigError(ValueError):
    """An engine cannot start with the given model or settings; the message names the setting and what would work."""


# rollout.engine -> (module, class); every class takes (model_path, rollout_cfg, version=0, **engine_options).
ROLLOUT_ENGINES: dict[str, tuple[str, str]] = {
    "vllm": ("dora_tasks.engines.vllm_rollout", "VLLMRolloutEngine"),
    "hf": ("dora_tasks.engines.hf_rollout", "HFRolloutEngine"),
    "emulated": ("dora_tasks.emulation.rollout", "EmulatedRolloutEngine"),  # a timing model, for scale studies only
}


def rollout_engine_class(name: str) -> type[RolloutEngine]:
    """The engine class registered under `name`, imported on first use."""
    if name not in ROLLOUT_ENGINES:
        raise EngineConfigError(f"rollout.engine: got {name!r}, allowed: {', '.join(ROLLOUT_ENGINES)}")
    module_name, class_name = ROLLOUT_ENGINES[name]
    return getattr(importlib.import_module(module_name), class_name)


def make_rollout_engine(model_path: str, rollout_cfg: RolloutConfig, version: int = 0,
                        **engine_options) -> RolloutEngine:
    """A rollout engine serving `model_path` as policy `version`, of the kind `rollout_cfg.engine` names.
    `engine_options`: what that kind needs besides (the emulated engine: `emulation` and `seed`; see
    `pipelines.run.engine_options`). A `model_path` on an object store is read from a local copy (worker cache)."""
    from storage.objectstore import local_folder

    return rollout_engine_class(rollout_cfg.engine)(local_folder(model_path), rollout_cfg, version, **engine_options)
