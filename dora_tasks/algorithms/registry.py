"""One registry for advantage estimators and policy losses (verl's `core_algos.py` style).

Everything that trains dispatches through `get_advantage(name)` / `get_loss(name)`; nothing branches on the names
elsewhere. Registration happens when `dora_tasks.algorithms` is imported (its `__init__` imports the two modules that
define the functions), so a name is always resolvable once the package is importable.

Signatures (shapes documented in `advantages.py` and `losses.py`):
- advantage: `fn(rewards[G]) -> advantages[G]`, one group's rewards to one float32 scalar per trajectory (called only
  by `advantages.group_advantages`, the one place advantages are computed)
- loss: `fn(logp[B,T], behaviour_logp[B,T], advantages[B,T], mask[B,T], cfg, proximal_logp=None, *, entropy=None,
  norm=None) -> (loss scalar, metrics dict of floats)`
"""
from __future__ import annotations

from typing import Callable, TypeVar

from dora_tasks.core.config import ConfigError

F = TypeVar("F", bound=Callable)

_ADVANTAGES: dict[str, Callable] = {}
_LOSSES: dict[str, Callable] = {}


class UnknownAlgorithmError(KeyError, ValueError):
    """No estimator or loss of that name; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0]) if self.args else ""


def _register(table: dict[str, Callable], kind: str, name: str) -> Callable[[F], F]:
    def decorator(fn: F) -> F:
        if name in table and table[name] is not fn:
            raise ValueError(f"{kind} {name!r} is already registered (by {table[name].__qualname__})")
        table[name] = fn
        return fn

    return decorator


def _lookup(table: dict[str, Callable], kind: str, name: str) -> Callable:
    try:
        return table[name]
    except KeyError:
        raise UnknownAlgorithmError(f"unknown {kind} {name!r}; valid names: {', '.join(sorted(table))}") from None


def register_advantage(name: str) -> Callable[[F], F]:
    """Decorator: register `fn(rewards[G]) -> advantages[G]` (one group, one scalar per trajectory) under `name`."""
    return _register(_ADVANTAGES, "advantage estimator", name)


def register_loss(name: str) -> Callable[[F], F]:
    """Decorator: register `fn(logp, behaviour_logp, advantages, mask, cfg, ...) -> (loss, metrics)` under `name`."""
    return _register(_LOSSES, "policy loss", name)


def get_advantage(name: str) -> Callable:
    return _lookup(_ADVANTAGES, "advantage estimator", name)


def get_loss(name: str) -> Callable:
    return _lookup(_LOSSES, "policy loss", name)


def advantage_names() -> list[str]:
    return sorted(_ADVANTAGES)


def loss_names() -> list[str]:
    return sorted(_LOSSES)


def check_config_names(train_cfg) -> None:
    """`ConfigError` naming the key and the registered names unless `train.advantage` and `train.loss` (a
    `TrainConfig`) are registered. The config lives below the registry and cannot check them itself: whoever loads
    a config to run it calls this (`dora config`, `dora run`, the engine preflight)."""
    for key, name, names in (("train.advantage", train_cfg.advantage, advantage_names()),
                             ("train.loss", train_cfg.loss, loss_names())):
        if name not in names:
            raise ConfigError(f"{key}: got {name!r}, allowed: {', '.join(names)}")
