"""Checks of a run with multi-turn episodes (`task.environment`) that span config sections."""
from __future__ import annotations

from dora_tasks.core.config_checks import _require

ARITHMETIC_REWARD = "dora_tasks.workloads.calculator.reward"  # task.reward_fn of task.name=arithmetic when unset


def check_episodes(cfg) -> None:
    """An environment needs a real engine that keeps a response on one instance and one version: the transformers
    engine, without request migration or the partial-rollout baseline (both move a response under a running
    episode). Sets the arithmetic task's own reward when none is given."""
    if cfg.task.name == "arithmetic" and not cfg.task.reward_fn:
        cfg.task.reward_fn = ARITHMETIC_REWARD
    if not cfg.task.environment:
        return
    _require(cfg.rollout.engine == "hf", "task.environment",
             f"multi-turn episodes run on rollout.engine=hf, got rollout.engine={cfg.rollout.engine!r}")
    _require(cfg.switching != "migrate", "task.environment",
             "an episode stays on its instance between turns: use rollout.switching=auto, drain or queue, not migrate")
    _require(not cfg.rollout.partial_rollout, "task.environment",
             "an episode keeps one policy version for all its turns (C1): rollout.partial_rollout must be false")
