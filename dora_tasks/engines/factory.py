"""Choose the training backend from `train.engine`. DeepSpeed is imported only when it is chosen."""
from __future__ import annotations

from dora_tasks.core.contracts import TrainEngine


def make_train_engine(model_path: str, train_cfg, version: int = 0, temperature: float = 1.0) -> TrainEngine:
    """`TorchTrainEngine` for train.engine="torch", `DeepSpeedTrainEngine` for "deepspeed" (validated first).

    `temperature` is the rollout's sampling temperature (`rollout.temperature`): the trainer's log-probs are taken at
    it, so that importance ratios compare the same distributions the behaviour log-probs came from.
    """
    train_cfg.validate()
    if train_cfg.engine == "deepspeed":
        from dora_tasks.engines.deepspeed_trainer import DeepSpeedTrainEngine

        return DeepSpeedTrainEngine(model_path, train_cfg, version=version, temperature=temperature)
    from dora_tasks.engines.torch_trainer import TorchTrainEngine

    return TorchTrainEngine(model_path, train_cfg, version=version, temperature=temperature)
