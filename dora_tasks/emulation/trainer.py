"""The emulated train engine (`train.engine=emulated`): an update is the time the cost model gives it, nothing learns.

`train_step` sleeps `CostModel.train_s(prompt + response length of every trajectory, emulation.trainer_gpus)` divided
by `emulation.speedup` and advances the version; its metrics are the emulated train time and the tokens trained.
`save_weights` writes an emulated model folder (`dora_tasks.emulation.task.write_model_folder`: the emulated model's
name and the version), which the emulated rollout engine loads. Publishing is not charged on the trainer: the
weight-transfer time is paid by each instance that loads the version (`EmulatedRolloutEngine.load_version`).
Checkpoints hold the version only (there is no optimizer state to keep).

Streamed updates (`dora.stream_updates`): `accumulate` sleeps each part's `train_s`, a part of stragglers at least
its longest sequence's time on one accelerator (data parallel: a sequence runs on one), as the simulator charges it;
`finish_update` advances the version.
"""
from __future__ import annotations

import json
import os

from dora_tasks.core.clock import Clock
from dora_tasks.core.contracts import TrainEngine
from dora_tasks.core.records import TrainBatch
from dora_tasks.emulation.cost_model import cost_model_from
from dora_tasks.emulation.task import write_model_folder

STATE_FILE = "emulated_trainer.json"


class EmulatedTrainEngine(TrainEngine):
    def __init__(self, model_path: str, train_cfg, version: int = 0, *, emulation, **_ignored):
        self.version = version
        self.cost = cost_model_from(emulation)
        self.gpus = emulation.trainer_gpus
        self.model = emulation.model
        self.clock = Clock(emulation.speedup)
        self.parts = [0.0, 0.0]  # a streamed update so far: emulated seconds, tokens

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        lengths = [t.num_tokens for g in batch.groups for t in g.trajectories]
        seconds = self.cost.train_s(lengths, self.gpus)
        self.clock.sleep(seconds)
        self.version += 1
        return {"emulated_train_s": seconds, "tokens_trained": float(sum(lengths))}

    def accumulate(self, batch: TrainBatch, stragglers: bool) -> None:
        lengths = [t.num_tokens for g in batch.groups for t in g.trajectories]
        if not lengths:
            return
        seconds = (self.cost.straggler_train_s if stragglers else self.cost.train_s)(lengths, self.gpus)
        self.clock.sleep(seconds)
        self.parts[0] += seconds
        self.parts[1] += sum(lengths)

    def finish_update(self) -> dict[str, float]:
        (seconds, tokens), self.parts = self.parts, [0.0, 0.0]
        self.version += 1
        return {"emulated_train_s": seconds, "tokens_trained": float(tokens)}

    def save_weights(self, path: str) -> None:
        write_model_folder(path, self.model, self.version)

    def save_checkpoint(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, STATE_FILE), "w") as f:
            json.dump({"version": self.version, "model": self.model}, f)

    def load_checkpoint(self, directory: str) -> None:
        with open(os.path.join(directory, STATE_FILE)) as f:
            self.version = int(json.load(f)["version"])

    def load_optimizer_state(self, directory: str) -> bool:
        return os.path.isfile(os.path.join(directory, STATE_FILE))  # nothing to take: there is no optimizer

    def close(self) -> None:
        pass
