"""Choose the training backend from `train.engine`. Each backend (torch, DeepSpeed, emulated) is imported only when
it is chosen."""
from __future__ import annotations

from dora_tasks.core.contracts import TrainEngine


def make_train_engine(model_path: str, train_cfg, version: int = 0, temperature: float = 1.0, base_path: str = "",
                      **engine_options) -> TrainEngine:
    """`TorchTrainEngine` for train.engine="torch", `DeepSpeedTrainEngine` for "deepspeed", `EmulatedTrainEngine`
    for "emulated" (a timing model for scale studies; it needs `engine_options["emulation"]`), validated first.

    `temperature` is the rollout's sampling temperature (`rollout.temperature`): the trainer's log-probs are taken at
    it, so that importance ratios compare the same distributions the behaviour log-probs came from.
    A `model_path` on an object store (the weight store's URL) is read from a local copy (worker cache).
    `base_path`: where workers read the base model, for `train.lora` (`dora_tasks/engines/lora.py`).
    """
    from storage.objectstore import local_folder

    train_cfg.validate()
    model_path = local_folder(model_path)
    if train_cfg.engine == "emulated":
        from dora_tasks.emulation.trainer import EmulatedTrainEngine

        return EmulatedTrainEngine(model_path, train_cfg, version=version, **engine_options)
    if train_cfg.engine == "deepspeed":
        from dora_tasks.engines.deepspeed_trainer import DeepSpeedTrainEngine

        return DeepSpeedTrainEngine(model_path, train_cfg, version=version, temperature=temperature,
                                    base_path=base_path)
    from dora_tasks.engines.torch_trainer import TorchTrainEngine

    return TorchTrainEngine(model_path, train_cfg, version=version, temperature=temperature, base_path=base_path)
