"""The `train.lora` config section: train LoRA adapters on a frozen base instead of every weight."""
from __future__ import annotations

from dataclasses import dataclass, field

from dora_tasks.core.config_checks import _require

LINEAR_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # Qwen2/Llama names


@dataclass
class LoraConfig:
    """LoRA adapters (the `peft` library) on the trainers; rank 0 trains every weight. With rank > 0 each published
    version after 0 is the adapter alone plus the base model's identity (`dora_tasks/engines/lora.py`), and rollout
    instances serve it over the base they hold."""

    rank: int = 0  # r of every adapter; 0 = off (full weights)
    alpha: float = 16.0  # the adapter's update is scaled by alpha / rank
    target_modules: list[str] = field(default_factory=lambda: list(LINEAR_TARGETS))  # Linear modules adapted, by name
    dropout: float = 0.0  # dropout on the adapter's input, during updates only (sampling never uses it)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def validate(self) -> None:
        _require(self.rank >= 0, "train.lora.rank", f"must be >= 0 (0 = off), got {self.rank}")
        _require(self.alpha > 0, "train.lora.alpha", f"must be > 0, got {self.alpha}")
        _require(0 <= self.dropout < 1, "train.lora.dropout", f"must be in [0, 1), got {self.dropout}")
        names = self.target_modules
        _require(isinstance(names, list) and bool(names) and all(isinstance(n, str) and n for n in names),
                 "train.lora.target_modules", f"must be a non-empty list of module names, e.g. [q_proj, v_proj]; "
                 f"got {names!r}")
