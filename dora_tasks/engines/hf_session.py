"""Continuous batching on the transformers engine with the KV cache kept across chunks (`DecodeSession`).

`HFRolloutEngine.generate` re-encodes prompt + tokens so far at every chunk of a continuously batched response. A
session instead keeps one KV cache for its rows between chunks: a row joining is prefilled once (alone with the
other joiners), then every step decodes one token for every live row; a row leaves at its eos or its budget. Rows
are right-aligned in the cache (left padding, masked), each with its own position ids; a joiner's cache is padded
on the left to the live rows' length (or theirs to its) and concatenated on the batch axis, and columns no live row
uses any more are cut off, so the cache is as long as the longest live row. A row handed over by another session
(`adopt`) joins from its cache the way a prefilled joiner does, with no forward.

Sampling and log-probs follow `HFRolloutEngine` (see its module): temperature, then top-p, and each token's log-prob
under the distribution it was sampled from; greedy picks the argmax and records the raw log-softmax.

One session serves one loaded version (the rollout server never swaps weights under live rows, C1); the
partial-rollout baseline, which does, opens a new session after each load and re-encodes its rows into it.
"""
from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import torch
from transformers import DynamicCache

from dora_tasks.core.handover import RowCache
from dora_tasks.core.records import Generation
from dora_tasks.engines.decoding import SessionRows, left_pad, sample_next


class DecodeSession(SessionRows):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long)  # [B, L] 1 on real tokens
        self.positions = torch.zeros(0, dtype=torch.long)  # [B] position of each row's next token

    @torch.no_grad()
    def decode(self, steps: dict[Hashable, int], seed: int) -> dict[Hashable, Generation]:
        """Up to `steps[key]` new tokens for every row (0 or missing: none this call). A row that samples an eos
        leaves the session (its generation is `finished`); the others stay for the next call."""
        self._prefill_joiners()
        budget = torch.tensor([steps.get(k, 0) for k in self.keys], dtype=torch.long)
        out: dict[Hashable, tuple[list[int], list[float]]] = {k: ([], []) for k in self.keys}
        finished: set[Hashable] = set()
        generator = torch.Generator().manual_seed(seed)
        for t in range(int(budget.max()) if len(budget) else 0):
            active = (budget > t).nonzero().squeeze(1)
            if len(active) == 0:
                break
            tokens, logprobs = sample_next(self.next_logits.index_select(0, active), generator, self.temperature,
                                           self.top_p, self.do_sample, self._streams_of(active))
            for i, tok, lp in zip(active.tolist(), tokens.tolist(), logprobs.tolist()):
                out[self.keys[i]][0].append(tok)
                out[self.keys[i]][1].append(lp)
            ended = torch.isin(tokens, self.eos)
            finished |= {self.keys[i] for i in active[ended].tolist()}
            continuing = active[~ended]
            if len(continuing):
                self._step(continuing, tokens[~ended])
            if ended.any():
                alive = [i for i, k in enumerate(self.keys) if k not in finished]
                budget = budget[alive]
                self._keep(alive)
        return {k: Generation(np.array(toks, np.int32), np.array(lps, np.float32),
                              np.full(len(toks), self.version, np.int32), k in finished)
                for k, (toks, lps) in out.items()}

    # ---- internals -----------------------------------------------------------------------------------------------
    def _step(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Feed `tokens` to `rows` (the other rows are idle this step: they stay, and get a masked column)."""
        n = len(self.keys)
        ids = torch.full((n, 1), self.pad_id, dtype=torch.long)
        ids[rows, 0] = tokens
        column = torch.zeros((n, 1), dtype=torch.long)
        column[rows, 0] = 1
        mask = torch.cat([self.mask, column], dim=1)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=self.positions[:, None],
                            past_key_values=self.cache, use_cache=True).logits[:, -1]
        self.mask = mask
        self.positions = self.positions + column[:, 0]
        self.next_logits = torch.where(column.bool(), logits, self.next_logits)

    def _prefill_joiners(self) -> None:
        if not self._joining:
            return
        keys = [k for k, _ in self._joining]
        ids, mask = left_pad([prompt for _, prompt in self._joining], self.pad_id)
        self._joining = []
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                            use_cache=True).logits[:, -1]
        self._merge(keys, cache, mask, mask.sum(1), logits)
        self.prefill_tokens += int(mask.sum())

    def _row_cache(self, row: int) -> RowCache:
        """The row's real columns (a row's idle steps left masked columns among them), in position order."""
        real = self.mask[row].bool()
        return RowCache([layer.keys[row][:, real].clone() for layer in self.cache.layers],
                        [layer.values[row][:, real].clone() for layer in self.cache.layers],
                        self.next_logits[row].clone())

    def _insert(self, key: Hashable, cache: RowCache) -> None:
        """Append a row after the others from its cache, merged as a prefilled joiner would be (no forward)."""
        length = cache.length
        own = DynamicCache([(k[None], v[None]) for k, v in zip(cache.keys, cache.values)])
        self._merge([key], own, torch.ones((1, length), dtype=torch.long), torch.tensor([length]),
                    cache.next_logits[None])

    def _merge(self, keys: list, cache: DynamicCache, mask: torch.Tensor, positions: torch.Tensor,
               logits: torch.Tensor) -> None:
        if not self.keys:  # empty session (no cache yet, or every row gone)
            self.keys, self.cache, self.mask, self.positions, self.next_logits = keys, cache, mask, positions, logits
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_pad_left(mine.keys, width, 2), _pad_left(theirs.keys, width, 2)])
            mine.values = torch.cat([_pad_left(mine.values, width, 2), _pad_left(theirs.values, width, 2)])
        self.mask = torch.cat([_pad_left(self.mask, width, 1), _pad_left(mask, width, 1)])
        self.keys = self.keys + keys
        self.positions = torch.cat([self.positions, positions])
        self.next_logits = torch.cat([self.next_logits, logits])

    def _keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in order), then cut the leading columns no kept row uses."""
        if len(rows) == len(self.keys):
            return
        self.keys = [self.keys[i] for i in rows]
        if not rows:
            self.cache, self.mask, self.next_logits = None, self.mask[:0, :0], None
            self.positions = self.positions[:0]
            return
        index = torch.tensor(rows, dtype=torch.long)
        self.mask = self.mask.index_select(0, index)
        start = int(self.mask.any(0).nonzero()[0])
        self.mask = self.mask[:, start:]
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]
        self.positions = self.positions.index_select(0, index)
        self.next_logits = self.next_logits.index_select(0, index)


def _pad_left(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)
