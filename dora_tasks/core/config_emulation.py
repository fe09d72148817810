"""The `emulation` config section: timing models of GPU engines for scale studies, never a default."""
from __future__ import annotations

from dataclasses import dataclass

from dora_tasks.core.config_checks import _choice, _require


@dataclass
class EmulationConfig:
    """Timing models of GPU engines for scale studies (`rollout.engine=emulated`, `train.engine=emulated`,
    `task.name=emulated`); never a default. Every figure of an emulated run is in emulated seconds.
    Cost model: `dora_tasks/emulation/cost_model.py`; lengths: `dora_tasks/emulation/lengths.py`."""

    accelerator: str = "H800"  # dora_tasks/emulation/hardware.py ACCELERATORS
    model: str = "qwen2.5-32b"  # dora_tasks/emulation/hardware.py MODELS
    tp: int = 2  # accelerators per rollout instance (tensor parallel): the smallest group that holds the 32B weights
    #              (65 GB) with room for a KV cache on 80 GB parts
    trainer_gpus: int = 32  # accelerators the emulated trainer's time is computed for
    bandwidth_efficiency: float = 0.5  # achieved share of HBM bandwidth in decode
    decode_mfu: float = 0.5
    prefill_mfu: float = 0.5
    train_mfu: float = 0.25
    train_flops_factor: float = 8.0  # FLOPs per parameter per token of an update
    store_bandwidth: float = 2e9  # bytes/s per accelerator reading the weight store
    speedup: float = 20.0  # emulated seconds per wall second
    response_p50: float = 1200.0
    prompt_sigma: float = 0.75
    sample_sigma: float = 0.75
    response_cap: int = 30720
    prompt_p50: float = 180.0
    reward_rate: float = 0.5  # share of synthetic rewards that are 1 (synthetic: no model answers anything)
    weight_source: str = "peer"  # where an instance loads a new version from: "peer" (an instance holding it, over
    #                              the network, as DORA's weight transfer) or "store" (the weight store's bandwidth)
    max_rows: int = 256  # sequences one instance decodes at once at most (vLLM's max_num_seqs)
    lora_rank: int = 0  # the emulated policy trains rank-r LoRA adapters: versions after 0 move as adapters and decode
    #                     steps pay for their adapters (cost_model.py); 0 = full weights
    lora_step_s: float = 2e-3  # per decode step of batched multi-adapter kernels (Punica, arXiv:2310.18547)

    def validate(self) -> None:
        from_names = {"accelerator": ("H800", "H100", "H200"), "model": ("qwen2.5-32b", "qwen2.5-7b")}
        for key, allowed in from_names.items():
            _choice(getattr(self, key), f"emulation.{key}", allowed)
        for key in ("tp", "trainer_gpus", "response_cap"):
            _require(getattr(self, key) >= 1, f"emulation.{key}", f"must be >= 1, got {getattr(self, key)}")
        for key in ("bandwidth_efficiency", "decode_mfu", "prefill_mfu", "train_mfu"):
            value = getattr(self, key)
            _require(0 < value <= 1, f"emulation.{key}", f"must be in (0, 1], got {value}")
        for key in ("speedup", "store_bandwidth", "response_p50", "prompt_p50", "train_flops_factor"):
            _require(getattr(self, key) > 0, f"emulation.{key}", f"must be > 0, got {getattr(self, key)}")
        _require(0 <= self.reward_rate <= 1, "emulation.reward_rate", f"must be in [0, 1], got {self.reward_rate}")
        _choice(self.weight_source, "emulation.weight_source", ("peer", "store"))
        _require(self.max_rows >= 1, "emulation.max_rows", f"must be >= 1, got {self.max_rows}")
        _require(self.lora_rank >= 0, "emulation.lora_rank", f"must be >= 0 (0 = full weights), got {self.lora_rank}")
        _require(self.lora_step_s >= 0, "emulation.lora_step_s", f"must be >= 0, got {self.lora_step_s}")
