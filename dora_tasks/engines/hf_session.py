"""Continuous batching on the transformers engine with the KV cache kept across chunks (`DecodeSession`).

`HFRolloutEngine.generate` re-encodes prompt + tokens so far at every chunk of a continuously batched response. A
session instead keeps one KV cache for its rows between chunks: a row joining is prefilled once (alone with the
other joiners), then every step decodes one token for every live row; a row leaves at its eos or its budget. Rows
are right-aligned in the cache (left padding, masked), each with its own position ids; a joiner's cache is padded
on the left to the live rows' length (or theirs to its) and concatenated on the batch axis, and columns no live row
uses any more are cut off, so the cache is as long as the longest live row.

Sampling and log-probs follow `HFRolloutEngine` (see its module): temperature, then top-p, and each token's log-prob
under the distribution it was sampled from; greedy picks the argmax and records the raw log-softmax.

One session serves one loaded version (the rollout server never swaps weights under live rows, C1); the
partial-rollout baseline, which does, opens a new session after each load and re-encodes its rows into it.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch
from transformers import DynamicCache

from dora_tasks.engines.hf_rollout import left_pad
from dora_tasks.records import Generation


class SessionRows:
    """What both decode sessions share: the loaded version, the sampling settings, the rows (in cache order) and the
    rows waiting to be prefilled at the next `decode`. A subclass keeps its cache and implements `decode` and
    `_keep(rows)` (keep only those rows, in order)."""

    def __init__(self, model, eos_ids: Sequence[int], pad_id: int, version: int, temperature: float = 1.0,
                 top_p: float = 1.0, do_sample: bool = True) -> None:
        self.model, self.version = model, version
        self.eos = torch.tensor(list(eos_ids), dtype=torch.long)
        self.pad_id = pad_id
        self.temperature, self.top_p, self.do_sample = temperature, top_p, do_sample
        self.keys: list[Hashable] = []  # row keys, in cache order
        self.next_logits: torch.Tensor | None = None  # [B, V] distribution of each row's next token
        self._joining: list[tuple[Hashable, list[int]]] = []

    def __len__(self) -> int:
        return len(self.keys) + len(self._joining)

    def add(self, key: Hashable, ids: Sequence[int]) -> None:
        """Queue a row (its prompt, or prompt + tokens so far); it is prefilled at the next `decode`."""
        if len(ids) == 0:
            raise ValueError(f"row {key!r} has no tokens; a row starts from at least one prompt token")
        self._joining.append((key, list(ids)))

    def drop(self, keys: Sequence[Hashable]) -> None:
        """Remove rows (their response ended elsewhere: a budget the caller tracks)."""
        gone = set(keys)
        self._joining = [(k, ids) for k, ids in self._joining if k not in gone]
        self._keep([i for i, k in enumerate(self.keys) if k not in gone])

    def _keep(self, rows: list[int]) -> None:
        raise NotImplementedError


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
                                           self.top_p, self.do_sample)
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


def sample_next(logits: torch.Tensor, generator: torch.Generator, temperature: float, top_p: float,
                do_sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], log-probs [B]) of one draw per row: temperature, then top-p; greedy takes the argmax and records
    the raw log-softmax."""
    logits = logits.float()
    if not do_sample:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(1)
    scores = logits / temperature
    if top_p < 1.0:
        scores = _top_p(scores, top_p)
    logp = torch.log_softmax(scores, -1)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(1)


def _pad_left(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Scores outside the smallest set of tokens whose probability reaches `top_p` set to -inf (as transformers'
    TopPLogitsWarper: the most likely token always stays)."""
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(-1).cumsum(-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(1, order, remove_sorted)
    return scores.masked_fill(remove, float("-inf"))
