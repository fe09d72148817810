"""Reward failures watched update by update, a part of the driver (a mixin of `pipelines.driver.Driver`)."""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

from dora_tasks.core.records import Group
from pipelines.metrics import reward_errors

log = logging.getLogger("dora")
REWARD_WARNING_EVERY_S = 30.0  # the reward-failure warning would otherwise repeat at every update


class RewardFailureError(RuntimeError):
    """Every reward of `task.reward_failure_stop_updates` updates in a row failed: the reward function is broken."""


@dataclass
class RateLimit:
    """True at most once every `every_s` seconds (a warning that would repeat at every update)."""

    every_s: float
    last: float = float("-inf")

    def ready(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.every_s:
            return False
        self.last = now
        return True


class RewardChecks:
    """Needs the driver's `cfg`, `counters` and `_reward_warnings` (a `RateLimit`)."""

    def check_rewards(self, metrics: dict[str, float], groups: list[Group]) -> None:
        """Warn when more than `task.reward_failure_warn_share` of a batch's rewards failed; stop the run once every
        reward of `task.reward_failure_stop_updates` updates in a row failed (a reward function that always raises
        or returns no number would otherwise train on zeros in silence). Counts are the update's metrics."""
        t, c = self.cfg.task, self.counters
        failed, share = int(metrics["reward_failures"]), metrics["reward_failure_share"]
        c["all_rewards_failed"] = c["all_rewards_failed"] + 1 if share == 1.0 else 0
        example = Counter(reward_errors(groups)).most_common(1)[0][0] if failed else ""
        if t.reward_failure_stop_updates and c["all_rewards_failed"] >= t.reward_failure_stop_updates:
            raise RewardFailureError(
                f"every reward of the last {c['all_rewards_failed']} updates failed (task.reward_fn="
                f"{t.reward_fn or '(the task default)'}; most frequent error: {example}); fix the reward function "
                f"and continue with `dora resume {self.cfg.storage.run_dir}`, or set "
                "task.reward_failure_stop_updates=0 to train on failed rewards as 0")
        if failed and share > t.reward_failure_warn_share and self._reward_warnings.ready():
            log.warning("%d of %d rewards of this update failed (most frequent: %s)", failed,
                        sum(len(g.trajectories) for g in groups), example)
