"""Plain-PyTorch training backend: one process, one device, AdamW, gradient accumulation over micro-batches.

The fallback for machines without DeepSpeed and the reference the DeepSpeed backend is checked against.
Simplifications, and why: fp32 only and no LR schedule (a constant `train.lr`, as in most async-RL recipes);
AdamW with weight decay 0 (so a zero gradient leaves the weights alone); the optional reference model for
`train.kl_coef > 0` is a frozen copy of `model_path`, i.e. the policy the run started from, also after a resume.
No randomness is used in a step (no dropout), so a restored checkpoint reproduces the next step exactly.
With `train.lora` the policy is the base with a `peft` adapter (`dora_tasks/engines/lora.py`): only the adapter
trains, is published and checkpointed, and the KL reference is the base with the adapter switched off (adapter
dropout, when set, is the one source of randomness in a step).
"""
from __future__ import annotations

import os

import torch

from dora_tasks.algorithms.losses import UNIT_NORM, LossNorm
from dora_tasks.algorithms.objective import policy_objective
from dora_tasks.core.contracts import TrainEngine
from dora_tasks.core.records import TrainBatch
from dora_tasks.engines.hf_io import (
    check_train_config,
    default_device,
    read_tokenizer_files,
    timed_train_step,
    write_hf_folder,
)
from dora_tasks.engines.lora import (
    adapter_dropout,
    adapter_state,
    load_adapter_state,
    load_trainable_policy,
    reference_policy,
    write_adapter_folder,
)
from dora_tasks.engines.streamed_parts import StreamsUpdates

CHECKPOINT_FILE = "trainer.pt"


class TorchTrainEngine(StreamsUpdates, TrainEngine):
    def __init__(self, model_path: str, train_cfg, version: int = 0, temperature: float = 1.0,
                 device: str | torch.device | None = None, base_path: str = ""):
        """`base_path`: where workers read the base model (train.lora: recorded with each adapter)."""
        check_train_config(train_cfg)
        self.cfg = train_cfg
        self.tokenizer_files = read_tokenizer_files(model_path)
        self.version = version
        self.temperature = temperature  # the rollout's sampling temperature (see objective.py)
        self.device = torch.device(device) if device is not None else default_device()
        self.model, self.base = load_trainable_policy(model_path, train_cfg.lora, self.device, base_path)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=train_cfg.lr, weight_decay=0.0)
        self.ref_model = reference_policy(self.model, model_path, self.device, train_cfg, self.base)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step over the whole batch (micro-batches accumulate gradients); advances `version`."""
        metrics = timed_train_step(batch, self.cfg.advantage, self._update)
        self.version += 1
        return metrics

    def start_parts(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def part_backward(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        return self._backward(tensors, UNIT_NORM)

    def divided_step(self, divisor: float) -> float:
        return self._step(divisor)

    def _update(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self._backward(tensors)
        metrics["grad_norm"] = self._step()
        return metrics

    def _backward(self, tensors: dict[str, torch.Tensor], norm: LossNorm | None = None) -> dict[str, float]:
        with adapter_dropout(self.model, self.cfg.lora.dropout > 0):
            _, metrics = policy_objective(self.model, tensors, self.cfg, self.ref_model,
                                          backward=lambda loss, last: loss.backward(), device=self.device,
                                          temperature=self.temperature, norm=norm)
        return metrics

    def _step(self, divisor: float = 1.0) -> float:
        """Clip and step; `divisor`: what the accumulated gradient is divided by first. Returns the gradient norm."""
        trainable = [p for p in self.model.parameters() if p.grad is not None]
        if divisor != 1.0:
            for p in trainable:
                p.grad.div_(divisor)
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, max_norm)
        self.optimizer.step()
        return float(grad_norm)

    def save_weights(self, path: str) -> None:
        """The policy as a Hugging Face folder; with LoRA, the adapter folder alone (with the base's identity)."""
        if self.base is not None:
            write_adapter_folder(self.model, path, self.base)
        else:
            write_hf_folder(self.model, path, self.tokenizer_files)

    def state_dict(self) -> dict:
        """Weights (with LoRA: the adapter's only), optimizer state and version."""
        weights = adapter_state(self.model) if self.base is not None else self.model.state_dict()
        return {"model": weights, "optimizer": self.optimizer.state_dict(), "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        if self.base is not None:
            load_adapter_state(self.model, state["model"])
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])

    def save_checkpoint(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        final = os.path.join(directory, CHECKPOINT_FILE)
        torch.save(self.state_dict(), final + ".tmp")
        os.replace(final + ".tmp", final)

    def load_checkpoint(self, directory: str) -> None:
        state = torch.load(os.path.join(directory, CHECKPOINT_FILE), map_location=self.device, weights_only=True)
        self.load_state_dict(state)

    def load_optimizer_state(self, directory: str) -> bool:
        state = torch.load(os.path.join(directory, CHECKPOINT_FILE), map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        return True

    def close(self) -> None:
        """Nothing to release (kept for symmetry with DeepSpeedTrainEngine)."""
