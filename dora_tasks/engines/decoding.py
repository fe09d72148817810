"""What the transformers rollout engine and its two decode sessions share: left padding of prompts (`left_pad`), the
rows of a session (`SessionRows`) and one sampling draw per row with its log-prob (`sample_next`).

`hf_rollout` opens the sessions of `hf_session` (transformers' forward) and `fast_session` (the step in plain torch);
both build on this module, which imports neither, so the three form no import cycle.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from dora_tasks.model import PAD_ID


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = PAD_ID) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both [B, max_len], pad on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError("empty prompt: a prompt needs at least its bos token")
        ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


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


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Scores outside the smallest set of tokens whose probability reaches `top_p` set to -inf (as transformers'
    TopPLogitsWarper: the most likely token always stays)."""
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(-1).cumsum(-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(1, order, remove_sorted)
    return scores.masked_fill(remove, float("-inf"))
