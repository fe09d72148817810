"""Continuous batching on the transformers engine with the decode step written out in plain torch (`FastDecodeSession`).

`DecodeSession` calls the transformers forward at every decode step. On a small policy that forward is mostly
per-step bookkeeping, not arithmetic: the attention mask is rebuilt, the cache object concatenates one column per
layer, the rotary table and the mask grow with the longest row. This session keeps the same interface, sampling and
log-probs, and runs the step itself in plain torch over the weights of the version loaded when it opened (a session
serves one version; the rollout server opens a new one after every load, `DecodeSession` likewise):

- the q/k/v projections fused into one matrix and the MLP's gate/up into another, captured at open; norms as
  `F.rms_norm`, rotary cos/sin from the model's own rotary module, tabulated once per buffer length;

- one preallocated key/value buffer per layer, [rows, kv heads, length, head dim], grown by doubling;
- every row left-aligned with its own length (a token's position is its index, no padding inside a row), so a
  step writes one column per row in place and attends over the first `max(length) + 1` columns with a length mask;
- joining rows are prefilled together (right-padded, causal and length mask) and appended on the batch axis;
- rows that end during a `decode` call stop being fed at once and leave the buffers at its end (one compaction per
  call instead of one per ended row);
- a row handed over by another session (`adopt`) is written into the buffers from its cache, with no forward.

What a step gains over the transformers forward: `benchmarks/decode_step.py`, figures in docs/benchmark.md.

Supported models (`supports`): the Llama layout of transformers (`model_type` qwen2 or llama, every layer full
attention, no per-head q/k norms); anything else is served by `DecodeSession`.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dora_tasks.core.handover import RowCache
from dora_tasks.core.records import Generation
from dora_tasks.engines.decoding import SessionRows, sample_next

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
_MIN_LENGTH = 64


def supports(model) -> bool:
    """True when `model` has the layout this session's step is written for (see the module docstring)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(config, "use_sliding_window", False):
        return False
    if any(kind != "full_attention" for kind in (getattr(config, "layer_types", None) or [])):
        return False
    if getattr(model.model.rotary_emb, "rope_type", "default") in ("dynamic", "longrope"):
        return False  # their frequencies depend on the sequence length: no fixed table
    layers = model.model.layers
    return not any(hasattr(layer.self_attn, "q_norm") for layer in layers)


class FastDecodeSession(SessionRows):
    def __init__(self, model, eos_ids: Sequence[int], pad_id: int, version: int, temperature: float = 1.0,
                 top_p: float = 1.0, do_sample: bool = True) -> None:
        if not supports(model):
            raise ValueError(f"FastDecodeSession does not support {type(model).__name__} "
                             f"(model_type {getattr(model.config, 'model_type', None)!r}); use DecodeSession")
        super().__init__(model, eos_ids, pad_id, version, temperature, top_p, do_sample)
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self._capture_weights(model)
        self.lengths = torch.zeros(0, dtype=torch.long)  # [B] tokens in the cache of each row
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []

    def _capture_weights(self, model) -> None:
        """The loaded version's weights, q/k/v and gate/up fused into one matrix each (a session serves one
        version: the rollout server opens a new one after every load), and the rotary table."""
        inner = model.model
        self._embed = inner.embed_tokens
        self._final_norm, self._lm_head = inner.norm.weight.detach(), model.lm_head.weight.detach()
        self._layers = [_LayerWeights.of(layer) for layer in inner.layers]
        self._cos = self._sin = torch.zeros(0)  # [positions, D], grown with the buffers (`_rotary_table`)

    @torch.no_grad()
    def decode(self, steps: dict[Hashable, int], seed: int) -> dict[Hashable, Generation]:
        """Up to `steps[key]` new tokens for every row (0 or missing: none this call). A row that samples an eos
        leaves the session (its generation is `finished`); the others stay for the next call."""
        self._prefill_joiners()
        budget = torch.tensor([steps.get(k, 0) for k in self.keys], dtype=torch.long)
        longest = int(budget.max()) if len(budget) else 0
        tokens_out = torch.zeros((len(self.keys), longest), dtype=torch.long)
        logprobs_out = torch.zeros((len(self.keys), longest), dtype=torch.float32)
        produced = torch.zeros(len(self.keys), dtype=torch.long)  # a row's tokens are a prefix of the steps
        ended_rows = torch.zeros(len(self.keys), dtype=torch.bool)
        generator = torch.Generator().manual_seed(seed)
        for t in range(longest):
            active = ((budget > t) & ~ended_rows).nonzero().squeeze(1)
            if len(active) == 0:
                break
            tokens, logprobs = sample_next(self.next_logits.index_select(0, active), generator, self.temperature,
                                           self.top_p, self.do_sample, self._streams_of(active))
            tokens_out[active, t], logprobs_out[active, t] = tokens, logprobs
            produced[active] += 1
            ended = torch.isin(tokens, self.eos)
            ended_rows[active[ended]] = True
            continuing = active[~ended]
            if len(continuing):
                self._step(continuing, tokens[~ended])
        result = {k: Generation(tokens_out[i, :n].numpy().astype(np.int32), logprobs_out[i, :n].numpy().copy(),
                                np.full(n, self.version, np.int32), bool(done))
                  for i, (k, n, done) in enumerate(zip(self.keys, produced.tolist(), ended_rows.tolist()))}
        self._keep((~ended_rows).nonzero().squeeze(1).tolist())
        return result

    # ---- the forward, written out ------------------------------------------------------------------------------
    def _step(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Feed `tokens` to `rows`; every other row is fed a pad that is written past its length and never read."""
        n = len(self.keys)
        ids = torch.full((n, 1), self.pad_id, dtype=torch.long)
        ids[rows, 0] = tokens
        width = int(self.lengths.max()) + 1
        self._reserve(width)
        visible = torch.arange(width)[None, :] <= self.lengths[:, None]  # [B, width]
        logits = self._forward(ids, self.lengths[:, None], visible[:, None, None, :], write_at=self.lengths)
        fed = torch.zeros(n, dtype=torch.bool)
        fed[rows] = True
        self.lengths = self.lengths + fed.long()
        self.next_logits = torch.where(fed[:, None], logits[:, -1], self.next_logits)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, write_at: torch.Tensor,
                 first_row: int = 0) -> torch.Tensor:
        """Logits [b, T, V] of `ids` [b, T] at `positions` [b, T]; their keys and values are written into buffer
        rows `first_row .. first_row + b - 1` from column `write_at` [b] on; attention over the columns [0, the
        mask's width) of those rows."""
        b, steps = ids.shape
        width = mask.shape[-1]
        heads, kv, dim = self.heads, self.kv_heads, self.head_dim
        x = self._embed(ids)
        cos, sin = self._cos[positions][:, :, None], self._sin[positions][:, :, None]  # [b, T, 1, D]
        rows = torch.arange(first_row, first_row + b)[:, None]
        columns = write_at[:, None] + torch.arange(steps)[None, :]  # [b, T]
        for w, k_buf, v_buf in zip(self._layers, self._k, self._v):
            h = F.rms_norm(x, (x.shape[-1],), w.input_norm, self.eps)
            qkv = F.linear(h, w.qkv, w.qkv_bias).view(b, steps, heads + 2 * kv, dim)
            qk = _rotate(qkv[:, :, :heads + kv], cos, sin)
            k_buf[rows, :, columns] = qk[:, :, heads:]
            v_buf[rows, :, columns] = qkv[:, :, heads + kv:]
            o = F.scaled_dot_product_attention(qk[:, :, :heads].transpose(1, 2),
                                               k_buf[first_row:first_row + b, :, :width],
                                               v_buf[first_row:first_row + b, :, :width], attn_mask=mask,
                                               enable_gqa=kv != heads)
            x = x + F.linear(o.transpose(1, 2).reshape(b, steps, heads * dim), w.o_proj, w.o_bias)
            h = F.rms_norm(x, (x.shape[-1],), w.post_norm, self.eps)
            gate, up = F.linear(h, w.gate_up).chunk(2, dim=-1)
            x = x + F.linear(w.act(gate) * up, w.down)
        return F.linear(F.rms_norm(x, (x.shape[-1],), self._final_norm, self.eps), self._lm_head)

    # ---- rows joining and leaving ------------------------------------------------------------------------------
    def _prefill_joiners(self) -> None:
        if not self._joining:
            return
        keys = [k for k, _ in self._joining]
        prompts = [ids for _, ids in self._joining]
        self._joining = []
        first = len(self.keys)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        width = int(lengths.max())
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, :len(p)] = torch.tensor(p, dtype=torch.long)
        self._grow_rows(first + len(prompts))
        self._reserve(width)
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        mask = causal[None] & (torch.arange(width)[None, None, :] < lengths[:, None, None])  # [b, T, T]
        positions = torch.arange(width)[None, :].expand(len(prompts), width)
        logits = self._forward(ids, positions, mask[:, None], write_at=torch.zeros(len(prompts), dtype=torch.long),
                               first_row=first)
        last = logits[torch.arange(len(prompts)), lengths - 1]
        self.keys = self.keys + keys
        self.lengths = torch.cat([self.lengths, lengths])
        self.next_logits = last if self.next_logits is None else torch.cat([self.next_logits, last])
        self.prefill_tokens += int(lengths.sum())

    def _row_cache(self, row: int) -> RowCache:
        length = int(self.lengths[row])
        return RowCache([k[row, :, :length].clone() for k in self._k], [v[row, :, :length].clone() for v in self._v],
                        self.next_logits[row].clone())

    def _insert(self, key: Hashable, cache: RowCache) -> None:
        """Append a row after the others from its cache (written into the buffers, no forward)."""
        row, length = len(self.keys), cache.length
        self._grow_rows(row + 1)
        self._reserve(length)
        for buf, part in zip(self._k + self._v, cache.keys + cache.values):
            buf[row, :, :length] = part
        self.keys = self.keys + [key]
        self.lengths = torch.cat([self.lengths, torch.tensor([length])])
        logits = cache.next_logits[None].to(self._lm_head.dtype)
        self.next_logits = logits if self.next_logits is None else torch.cat([self.next_logits, logits])

    def _keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in order) at the front of the buffers."""
        if len(rows) == len(self.keys):
            return
        self.keys = [self.keys[i] for i in rows]
        if not rows:
            self.lengths, self.next_logits = self.lengths[:0], None
            return
        index = torch.tensor(rows, dtype=torch.long)
        width = int(self.lengths.max())
        for buf in self._k + self._v:
            buf[:len(rows), :, :width] = buf[:, :, :width].index_select(0, index)
        self.lengths = self.lengths.index_select(0, index)
        self.next_logits = self.next_logits.index_select(0, index)

    def _grow_rows(self, rows: int) -> None:
        have = self._k[0].shape[0] if self._k else 0
        if rows <= have:
            return
        self._resize(max(rows, 2 * have), self._k[0].shape[2] if self._k else _MIN_LENGTH)

    def _reserve(self, length: int) -> None:
        """Room for `length` columns in every buffer."""
        have = self._k[0].shape[2]
        if length > have:
            self._resize(self._k[0].shape[0], max(length, 2 * have))

    def _rotary_table(self, length: int) -> None:
        """cos and sin of positions 0 .. length - 1 (static rotary types only, see `supports`)."""
        if len(self._cos) < length:
            cos, sin = self.model.model.rotary_emb(self._final_norm[None, None], torch.arange(length)[None])
            self._cos, self._sin = cos[0], sin[0]

    def _resize(self, rows: int, length: int) -> None:
        self._rotary_table(length)
        shape = (rows, self.kv_heads, length, self.head_dim)
        dtype = self.model.lm_head.weight.dtype
        layers = len(self.model.model.layers)
        old_k, old_v = self._k, self._v
        self._k = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        self._v = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        for new, old in zip(self._k + self._v, old_k + old_v):
            r, c = min(rows, old.shape[0]), min(length, old.shape[2])
            new[:r, :, :c] = old[:r, :, :c]


@dataclass
class _LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    act: torch.nn.Module

    @classmethod
    def of(cls, layer) -> "_LayerWeights":
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        biases = [p.bias for p in projections]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else p.weight.new_zeros(p.out_features) for b, p in zip(biases, projections)])
        return cls(layer.input_layernorm.weight.detach(), torch.cat([p.weight for p in projections]).detach(),
                   None if bias is None else bias.detach(), attn.o_proj.weight.detach(),
                   None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
                   layer.post_attention_layernorm.weight.detach(),
                   torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(), mlp.down_proj.weight.detach(),
                   mlp.act_fn)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
