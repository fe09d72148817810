"""Learning algorithms: advantage estimators and policy losses behind one registry, and the policy objective.

Importing this package registers every estimator and loss (the two modules below define them); nothing else happens
at import time. Dispatch only through `get_advantage(name)` / `get_loss(name)`; advantages are computed only by
`group_advantages(name, rewards)`, one group at a time.
"""
from dora_tasks.algorithms import advantages, losses  # noqa: F401  (registers the built-in algorithms)
from dora_tasks.algorithms.advantages import group_advantages, group_is_degenerate, overlong_shaping
from dora_tasks.algorithms.losses import LossNorm, aggregate, reference_kl
from dora_tasks.algorithms.registry import (UnknownAlgorithmError, advantage_names, check_config_names, get_advantage,
                                            get_loss, loss_names, register_advantage, register_loss)

__all__ = ["UnknownAlgorithmError", "advantage_names", "check_config_names", "get_advantage", "get_loss", "loss_names",
           "register_advantage", "register_loss", "group_advantages", "group_is_degenerate", "overlong_shaping",
           "LossNorm", "aggregate", "reference_kl"]
