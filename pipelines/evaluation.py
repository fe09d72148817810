"""Held-out evaluation of published versions, a part of the driver (a mixin of `pipelines.driver.Driver`).

An evaluation runs on a CPU worker behind the pipeline's own tasks; one that fails is tried once more, then skipped:
a failed evaluation never stops training.
"""
from __future__ import annotations

import logging

from distributed import Future

from dora_tasks import steps
from pipelines.cluster import CPU
from pipelines.events import Evaluated, EvaluationTask

log = logging.getLogger("dora")
MAX_EVAL_ATTEMPTS = 2  # an evaluation that fails is tried once more, then skipped with a warning
EVALUATION_PRIORITY = -10  # evaluations wait behind the pipeline's own CPU tasks


class Evaluations:
    """Needs the driver's `cfg`, `client`, `weights`, `eval_prompts`, `model_path`, `tracked`, `accuracy`,
    `counters`, `track`, `emit`, `retain_weights` and `reward_fn`."""

    def evaluation_due(self, version: int) -> bool:
        interval = self.cfg.task.eval_interval
        return version in (0, self.cfg.dora.num_updates) or bool(interval and version % interval == 0)

    def evaluations(self) -> list[Future]:
        return [f for f, t in self.tracked.items() if isinstance(t, EvaluationTask)]

    def submit_evaluation(self, version: int, attempt: int = 0) -> None:
        t, seed = self.cfg.task, self.cfg.dora.seed
        future = self.client.submit(steps.evaluate, self.weights.path_for(version), self.eval_prompts,
                                    self.model_path, self.reward_fn, self.cfg.rollout.max_new_tokens, seed,
                                    t.reward_timeout_s, t.reward_isolation, t.reward_memory_bytes,
                                    key=self.task_key("evaluate", version, *((attempt,) if attempt else ())),
                                    resources=CPU, pure=False, priority=EVALUATION_PRIORITY)
        self.track(future, EvaluationTask(version, attempt))

    def on_evaluated(self, task: EvaluationTask, future: Future) -> None:
        """The held-out accuracy of the evaluated version; a failure is tried again once, then skipped: a failed
        evaluation never stops training."""
        if future.status != "error":
            self.accuracy[task.version] = float(future.result())
            self.retain_weights()
            self.emit(Evaluated(task.version, self.accuracy[task.version]))
            return
        exc = future.exception()
        self.counters["eval_failures"] += 1
        if task.attempt + 1 < MAX_EVAL_ATTEMPTS and task.version in self.weights.versions():
            log.warning("evaluation of version %d failed (%s: %s); trying once more", task.version,
                        type(exc).__name__, exc)
            self.submit_evaluation(task.version, task.attempt + 1)
        else:  # reported by the run's observer (`pipelines.run.live_observer`)
            self.retain_weights()
            self.emit(Evaluated(task.version, None, f"{type(exc).__name__}: {exc}"))
