"""Seconds of accelerator work, from public specifications and a few stated efficiencies.

One rollout instance is one data-parallel rollout group of `tp` accelerators (tensor parallel): weights and KV cache
are split over them, so bandwidth and FLOP/s add up. The formulas (each a roofline: the slower of memory and compute):

* decode step of `rows` sequences holding `context` tokens in all: reads the weights once and every cached key and
  value, ``(W + context * kv) / (tp * HBM * bandwidth_efficiency)``; computes ``2 P rows + 4 L d context`` FLOPs
  (matmuls plus attention over the cache) at ``tp * peak * decode_mfu``; plus two all-reduces per layer of
  ``rows * hidden`` activations over the intra-node links when ``tp > 1``;
* prefill of `n` tokens: ``2 P n + 2 L d n^2`` FLOPs at ``tp * peak * prefill_mfu`` (one causal attention square);
* training on sequences of lengths ``l_i``: ``f P sum(l_i) + f L d sum(l_i^2)`` FLOPs at ``gpus * peak * train_mfu``,
  with ``f = train_flops_factor`` (8: a forward for the old log-probs, then forward and backward; causal attention);
  a streamed update's stragglers take at least their longest sequence on one accelerator;
* weights moved: ``W`` bytes over the bandwidth of the path (each of the `tp` accelerators takes its shard in
  parallel over its own link); with LoRA (`lora_rank` > 0) a version after the base moves as its adapter alone,
  ``A`` bytes (rank-r adapters on every attention and MLP projection, `ModelSpec.adapter_bytes`);
* LoRA decode: a step whose rows use `a` distinct adapters (one per policy version an instance serves at once) adds
  ``lora_step_s + a * A / (tp * HBM * bandwidth_efficiency)``: a flat cost of the batched multi-adapter kernels,
  plus each distinct adapter's weights read once a step (S-LoRA, arXiv:2311.03285, and Punica's SGMV,
  arXiv:2310.18547, gather each adapter once per batch). The flat term is outside the roofline's max (an upper
  bound: it is not hidden under a memory-bound step).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from dora_tasks.emulation.hardware import ACCELERATORS, MODELS, Accelerator, ModelSpec


@dataclass(frozen=True)
class CostModel:
    accelerator: Accelerator
    model: ModelSpec
    tp: int = 2  # accelerators per rollout instance
    bandwidth_efficiency: float = 0.5  # achieved share of HBM bandwidth in decode
    decode_mfu: float = 0.5
    prefill_mfu: float = 0.5
    train_mfu: float = 0.25  # RL batches of mixed lengths, below the 40-50% Megatron-LM reaches in pre-training
    train_flops_factor: float = 8.0
    memory_utilization: float = 0.9  # share of HBM an engine may use (vLLM's gpu_memory_utilization)
    store_bandwidth: float = 2e9  # bytes/s per accelerator reading the weight store
    lora_rank: int = 0  # rank of the policy's LoRA adapters; 0 = full weights (no adapter cost, full-weight loads)
    lora_step_s: float = 2e-3  # added per decode step by batched multi-adapter LoRA kernels: Punica reports "only
    #                            adding 2ms latency per token" (Chen et al., arXiv:2310.18547, abstract)

    @classmethod
    def named(cls, accelerator: str, model: str, **settings) -> "CostModel":
        return cls(ACCELERATORS[accelerator], MODELS[model], **settings)

    # ---- rollout ---------------------------------------------------------------------------------------------------
    def kv_capacity_tokens(self) -> int:
        """Tokens whose keys and values fit in one instance beside its weights."""
        free = self.tp * self.accelerator.hbm_bytes * self.memory_utilization - self.model.weight_bytes
        if free <= 0:
            raise ValueError(f"{self.model.name} does not fit on {self.tp} x {self.accelerator.name}")
        return int(free // self.model.kv_bytes_per_token)

    def decode_step_s(self, rows: int, context: int, adapters: int = 0) -> float:
        """One decode step of `rows` sequences whose caches hold `context` tokens in all, using `adapters` distinct
        LoRA adapters (ignored when `lora_rank` is 0)."""
        if rows <= 0:
            return 0.0
        return (max(a + b * context for a, b in self._decode_lines(rows)) + self._all_reduce_s(rows)
                + self.adapter_step_s(adapters))

    def adapter_step_s(self, adapters: int) -> float:
        """What a decode step pays for its rows' `adapters` distinct LoRA adapters (see the module's formulas)."""
        if self.lora_rank <= 0 or adapters <= 0:
            return 0.0
        bandwidth = self.tp * self.accelerator.hbm_bandwidth * self.bandwidth_efficiency
        return self.lora_step_s + adapters * self.adapter_bytes / bandwidth

    @property
    def adapter_bytes(self) -> float:
        return self.model.adapter_bytes(self.lora_rank)

    def decode_steps_s(self, rows: int, context: int, steps: int, adapters: int = 0) -> float:
        """`steps` decode steps of a batch of `rows` sequences whose caches hold `context` tokens at the first and
        grow by `rows` tokens a step: the sum of `decode_step_s`, in closed form (each roofline is linear in the
        context, so the sum splits where the steeper one overtakes the other)."""
        if rows <= 0 or steps <= 0:
            return 0.0
        (a1, b1), (a2, b2) = sorted(self._decode_lines(rows), key=lambda line: line[1])
        if b2 == b1:
            crossing = steps if a1 >= a2 else 0
        else:  # steps before the context passes the crossing run on the flatter line
            crossing = min(steps, max(0, math.ceil(((a1 - a2) / (b2 - b1) - context) / rows)))

        def run(a: float, b: float, c0: float, n: int) -> float:
            return n * a + b * (n * c0 + rows * n * (n - 1) / 2)

        return (run(a1, b1, context, crossing) + run(a2, b2, context + crossing * rows, steps - crossing)
                + steps * (self._all_reduce_s(rows) + self.adapter_step_s(adapters)))

    def _decode_lines(self, rows: int) -> tuple[tuple[float, float], tuple[float, float]]:
        """Memory and compute time of a decode step as (seconds, seconds per context token)."""
        a, m = self.accelerator, self.model
        bandwidth = self.tp * a.hbm_bandwidth * self.bandwidth_efficiency
        flop_rate = self.tp * a.peak_flops * self.decode_mfu
        return ((m.weight_bytes / bandwidth, m.kv_bytes_per_token / bandwidth),
                (2 * m.params * rows / flop_rate, 4 * m.layers * m.attention_width / flop_rate))

    def prefill_s(self, tokens: int) -> float:
        """Encoding `tokens` tokens of one sequence (a prompt, or a response re-encoded)."""
        m = self.model
        flops = 2 * m.params * tokens + 2 * m.layers * m.attention_width * tokens * tokens
        return flops / (self.tp * self.accelerator.peak_flops * self.prefill_mfu) + self._all_reduce_s(tokens)

    def chunked_prefill_s(self, tokens: int, rows: int, context: int) -> float:
        """What prefilling `tokens` adds to a decode step of `rows` rows over `context` cached tokens when the two
        share the step (vLLM's chunked prefill): the prefill's FLOPs first fill the compute a memory-bound step
        leaves idle."""
        if rows <= 0:
            return self.prefill_s(tokens)
        memory, compute = (a + b * context for a, b in self._decode_lines(rows))
        return max(memory, compute + self.prefill_s(tokens)) - max(memory, compute)

    def _all_reduce_s(self, rows: int) -> float:
        if self.tp == 1:
            return 0.0
        m = self.model
        ring = 2 * (self.tp - 1) / self.tp  # a ring all-reduce sends this share of the buffer per accelerator
        return 2 * m.layers * rows * m.hidden * m.bytes_per_param * ring / self.accelerator.link_bandwidth

    # ---- training and weights ----------------------------------------------------------------------------------------
    def train_s(self, lengths: Iterable[int], gpus: int) -> float:
        """One update over sequences of these lengths (prompt + response) on `gpus` accelerators."""
        total = square = 0
        for n in lengths:
            total += n
            square += n * n
        return self.train_s_of_sums(total, square, gpus)

    def straggler_train_s(self, lengths: list[int], gpus: int) -> float:
        """A streamed update's part computed after the rest (`dora.stream_updates`): `train_s`, but at least its
        longest sequence's on one accelerator, since data parallelism runs a sequence on one."""
        return max(self.train_s(lengths, gpus), self.train_s([max(lengths)], 1))

    def train_s_of_sums(self, total: int, square: int, gpus: int) -> float:
        """`train_s` of sequences whose lengths sum to `total` and whose squared lengths sum to `square`."""
        m = self.model
        flops = self.train_flops_factor * (m.params * total + m.layers * m.attention_width * square)
        return flops / (gpus * self.accelerator.peak_flops * self.train_mfu)

    def version_bytes(self, adapter: bool = False) -> float:
        """Bytes of a version: its adapter (`adapter` and LoRA on), else the whole model."""
        return self.adapter_bytes if adapter and self.lora_rank > 0 else self.model.weight_bytes

    def weights_from_peer_s(self, adapter: bool = False) -> float:
        """An instance takes a version from an instance that holds it, each accelerator its shard over its NIC."""
        return self.version_bytes(adapter) / (self.tp * self.accelerator.network_bandwidth)

    def weights_from_store_s(self, adapter: bool = False) -> float:
        return self.version_bytes(adapter) / (self.tp * self.store_bandwidth)

    def kv_transfer_s(self, tokens: int) -> float:
        """Moving one request's KV cache of `tokens` tokens to another instance (request migration)."""
        return tokens * self.model.kv_bytes_per_token / (self.tp * self.accelerator.network_bandwidth)


def cost_model_from(emulation) -> CostModel:
    """The cost model an `EmulationConfig` describes."""
    e = emulation
    return CostModel.named(e.accelerator, e.model, tp=e.tp, bandwidth_efficiency=e.bandwidth_efficiency,
                           decode_mfu=e.decode_mfu, prefill_mfu=e.prefill_mfu, train_mfu=e.train_mfu,
                           train_flops_factor=e.train_flops_factor, store_bandwidth=e.store_bandwidth,
                           lora_rank=e.lora_rank, lora_step_s=e.lora_step_s)
