"""The reward model's workers (`reward.model`): its plugin registered and its model loaded before the clock starts,
and what the run reports of where and how fast it scored.

Where scoring ran is recorded on every scored group (`Group.reward_model`: the worker's address and its REWARD role)
and summed per update into metrics of the store and MLflow (`pipelines.metrics.reward_model_metrics`); the run's
summary adds the whole run's throughput from the store's update rows.
"""
from __future__ import annotations

import numpy as np
from distributed import Client

from dora_tasks import steps
from dora_tasks.core.config import Config
from dora_tasks.plugins import RewardModelPlugin
from pipelines.cluster import REWARD_MODEL, labelled_workers


def start_reward_model(client: Client, cfg: Config) -> list[str]:
    """Register the reward-model plugin and load the model on every reward worker (one warm-up task each); returns
    their addresses. Nothing without `reward.model`."""
    if not cfg.reward.model:
        return []
    client.register_plugin(RewardModelPlugin(cfg.reward))
    workers = labelled_workers(client).reward
    futures = [client.submit(steps.warm_up_reward_model, key=("warm-up-reward-model", a), workers=[a],
                             resources=REWARD_MODEL, pure=False) for a in workers]
    return client.gather(futures)


def reward_model_summary(updates: dict[str, np.ndarray]) -> dict[str, float]:
    """The run's reward-model scoring from the store's update rows (`read_table("updates")`): responses scored, the
    forward seconds, responses per forward second, and the share scored on REWARD-labelled workers (empty without
    a reward model)."""
    responses = updates.get("metrics/reward_model_responses")
    if responses is None or not len(responses):
        return {}
    seconds = float(np.nansum(updates["metrics/reward_model_s"]))
    on_reward = np.nansum(updates["metrics/reward_model_on_reward_workers"] * responses)
    total = float(np.nansum(responses))
    return {"reward_model_responses": total, "reward_model_s": seconds,
            "reward_model_responses_per_s": total / seconds if seconds > 0 else float("nan"),
            "reward_model_on_reward_workers": float(on_reward / total) if total else float("nan")}
