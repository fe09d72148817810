"""The simulator's settings: the cluster, the mode and the paper's step (512 prompts x 16 samples)."""
from __future__ import annotations

from dataclasses import dataclass


class SimulatorError(ValueError):
    """A simulator setting is wrong; the message says which and why."""


@dataclass(frozen=True)
class SimConfig:
    gpus: int = 64
    mode: str = "dora"  # sync | one-step | partial | dora (pipelines.simulator.modes)
    max_staleness: int = 3  # K of dora and partial (sync is 0, one-step 1)
    prompts_per_step: int = 512
    group_size: int = 16
    train_batch_size: int = 512  # TBS of dora and partial, in groups: one version per step by default
    rollout_batch_size: int = 1024  # RBS of dora and partial: two steps' prompts, so each instance holds about
    #                                 twice the rows its engine runs and backfills ended rows from its own queue
    switching: str = "migrate"  # how instances leave an older version (pipelines.switching): drain | queue | migrate
    max_rows: int = 256  # rows one engine decodes at once (vLLM 0.8's default max_num_seqs)
    trainer_gpus: int = 0  # disaggregated modes: trainer accelerators, 0 = chosen by `split`
    split: str = "rule"  # how trainer_gpus=0 is chosen (pipelines.simulator.modes): rule | searched
    steps: int = 8
    warmup_steps: int = 2  # left out of the steady-state figures
    decision_interval_s: float = 1.0  # the orchestrator and gate decide at most this often (0: at every event)
    check: bool = False  # validate the gate and the orchestrator after every decision
    versions_per_instance: int = 1  # M versions one instance serves at once (LoRA adapters; dora with drain only)
    # what the orchestrator is told: "request" (every request end and KV use, a moved group there at once) or
    # "group" (request ends only of groups that moved, no KV use, a moved group "arriving" until it ends: what a
    # driver learns from its tasks' ends alone)
    reports: str = "request"
    # virtual seconds a moved group's requests are between instances (neither decodes them): the Dask driver's order,
    # the source's chunk boundary and the resume task; 0 moves them at once
    handover_s: float = 0.0
    # streamed updates (`VersionGate.stream`): a batch is handed over before its stragglers complete and the trainer
    # computes the complete groups meanwhile, the stragglers as they complete (`dora.stream_updates` on Dask)
    stream_updates: bool = False

    def validate(self) -> "SimConfig":
        def require(ok: bool, key: str, why: str) -> None:
            if not ok:
                raise SimulatorError(f"{key}: {why}")

        for key in ("gpus", "prompts_per_step", "group_size", "train_batch_size", "rollout_batch_size", "max_rows",
                    "steps"):
            require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        require(self.max_staleness >= 0, "max_staleness", f"must be >= 0, got {self.max_staleness}")
        require(self.rollout_batch_size >= self.train_batch_size, "rollout_batch_size",
                f"RBS must be >= TBS ({self.train_batch_size}), got {self.rollout_batch_size}")
        require(self.prompts_per_step % self.train_batch_size == 0, "train_batch_size",
                f"must divide prompts_per_step ({self.prompts_per_step}), got {self.train_batch_size}")
        require(0 <= self.warmup_steps < self.steps, "warmup_steps", f"must be in [0, steps), got {self.warmup_steps}")
        require(0 <= self.trainer_gpus < self.gpus, "trainer_gpus", f"must be in [0, gpus), got {self.trainer_gpus}")
        require(self.split in ("rule", "searched"), "split", f"allowed: rule, searched; got {self.split!r}")
        require(self.split == "rule" or self.trainer_gpus == 0, "split",
                f"searched chooses trainer_gpus itself; got trainer_gpus={self.trainer_gpus}")
        require(self.switching in ("drain", "queue", "migrate"), "switching",
                f"allowed: drain, queue, migrate; got {self.switching!r}")
        require(self.reports in ("request", "group"), "reports", f"allowed: request, group; got {self.reports!r}")
        require(self.handover_s >= 0, "handover_s", f"must be >= 0, got {self.handover_s}")
        require(self.decision_interval_s >= 0, "decision_interval_s", "must be >= 0")
        require(self.versions_per_instance >= 1, "versions_per_instance",
                f"must be >= 1, got {self.versions_per_instance}")
        require(not self.stream_updates or self.mode == "dora", "stream_updates",
                f"streams a batch into a trainer of its own: mode dora only, got mode {self.mode!r}")
        if self.versions_per_instance > 1:
            require(self.mode == "dora" and self.switching == "drain", "versions_per_instance",
                    f"{self.versions_per_instance} replaces how an instance leaves its version: mode dora with "
                    f"switching drain only, got mode {self.mode!r}, switching {self.switching!r}")
        return self
