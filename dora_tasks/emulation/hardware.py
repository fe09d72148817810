"""Public specifications of accelerators and models the cost model needs; each figure names its source."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # dense BF16 FLOP/s
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    link_bandwidth: float  # bytes/s per direction between accelerators of one node (NVLink)
    network_bandwidth: float  # bytes/s per accelerator between nodes (one NIC per accelerator)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # MLP width
    bytes_per_param: int = 2  # BF16

    def adapter_params(self, rank: int) -> int:
        """Parameters of rank-`rank` LoRA adapters on every attention and MLP projection (A: r x in, B: out x r)."""
        kv = self.kv_heads * self.head_dim
        shapes = [(self.hidden, self.hidden), (self.hidden, kv), (self.hidden, kv), (self.hidden, self.hidden),
                  (self.hidden, self.intermediate), (self.hidden, self.intermediate), (self.intermediate, self.hidden)]
        return self.layers * sum(rank * (fan_in + fan_out) for fan_in, fan_out in shapes)

    def adapter_bytes(self, rank: int) -> float:
        return self.adapter_params(rank) * self.bytes_per_param

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """Keys and values of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    @property
    def attention_width(self) -> int:
        """Query width of one layer (q_heads x head_dim): attention FLOPs per token per context token scale with it."""
        return self.q_heads * self.head_dim


ACCELERATORS = {
    # NVIDIA H800 SXM5: H100 SXM5 compute (989.4 TFLOP/s dense BF16) and 80 GB HBM3 at 3.35 TB/s, NVLink cut to
    # 400 GB/s (NVIDIA H100/H800 datasheets); 400 Gb/s InfiniBand per GPU as in 8-NIC H800 nodes.
    "H800": Accelerator("H800-SXM5", 989.4e12, 80e9, 3.35e12, 200e9, 50e9),
    # NVIDIA H100 SXM5 datasheet: 989.4 TFLOP/s dense BF16, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (450 each way).
    "H100": Accelerator("H100-SXM5", 989.4e12, 80e9, 3.35e12, 450e9, 50e9),
    # NVIDIA H200 datasheet: H100 compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
    "H200": Accelerator("H200-SXM", 989.4e12, 141e9, 4.8e12, 450e9, 50e9),
}

MODELS = {
    # Qwen2.5-32B config.json (Hugging Face Qwen/Qwen2.5-32B): 64 layers, hidden 5120, 40 query heads, 8 KV heads of
    # 128, intermediate_size 27648; 32.5B parameters (Qwen2.5 technical report). KV cache: 2 x 64 x 8 x 128 x 2
    # bytes = 256 KiB per token.
    "qwen2.5-32b": ModelSpec("Qwen2.5-32B", 32.5e9, 64, 5120, 40, 8, 128, 27648),
    # Qwen2.5-7B config.json: 28 layers, hidden 3584, 28 query heads, 4 KV heads of 128, intermediate_size 18944;
    # 7.6B parameters.
    "qwen2.5-7b": ModelSpec("Qwen2.5-7B", 7.6e9, 28, 3584, 28, 4, 128, 18944),
}
