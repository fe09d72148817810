"""What the transformers rollout engine and its two decode sessions share: left padding of prompts (`left_pad`), the
rows of a session (`SessionRows`, with the hand-over of a row between sessions: `export` and `adopt`) and one sampling
draw per row with its log-prob (`sample_next`).

A row may have its own random stream (`add(..., stream=seed)`): it then draws the same tokens whichever rows share its
batch and whichever session it continues in, which is what lets a handed-over response continue exactly. Rows without
one draw together from the stream of each `decode` call (one draw for the whole batch, the cheaper default).

`hf_rollout` opens the sessions of `hf_session` (transformers' forward) and `fast_session` (the step in plain torch);
both build on this module, which imports neither, so the three form no import cycle.
"""
from __future__ import annotations

import time
from collections.abc import Hashable, Sequence

import torch

from dora_tasks.core.handover import Continuation, MigrationCost, RowCache, RowState, check_cache_fits, check_version
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
    """What both decode sessions share: the loaded version, the sampling settings, the rows (in cache order), the
    rows waiting to be prefilled at the next `decode` and the rows' own random streams. A subclass keeps its cache and
    implements `decode`, `_keep(rows)` (keep only those rows, in order), `_row_cache(row)` (one row's cache, no
    padding) and `_insert(key, cache)` (append a row from its cache)."""

    def __init__(self, model, eos_ids: Sequence[int], pad_id: int, version: int, temperature: float = 1.0,
                 top_p: float = 1.0, do_sample: bool = True) -> None:
        self.model, self.version = model, version
        self.eos = torch.tensor(list(eos_ids), dtype=torch.long)
        self.pad_id = pad_id
        self.temperature, self.top_p, self.do_sample = temperature, top_p, do_sample
        self.keys: list[Hashable] = []  # row keys, in cache order
        self.next_logits: torch.Tensor | None = None  # [B, V] distribution of each row's next token
        self._joining: list[tuple[Hashable, list[int]]] = []
        self.streams: dict[Hashable, torch.Generator] = {}  # the rows that have their own random stream
        self.prefill_tokens = 0  # tokens encoded by prefills so far (an adopted row adds none)

    def __len__(self) -> int:
        return len(self.keys) + len(self._joining)

    def add(self, key: Hashable, ids: Sequence[int], stream: int | bytes | None = None) -> None:
        """Queue a row (its prompt, or prompt + tokens so far); it is prefilled at the next `decode`.
        `stream`: the row's own random stream, a seed or a saved state (`sampler_state`); None: the row draws from
        each `decode` call's shared stream."""
        if len(ids) == 0:
            raise ValueError(f"row {key!r} has no tokens; a row starts from at least one prompt token")
        self._joining.append((key, list(ids)))
        self._start_stream(key, stream)

    def drop(self, keys: Sequence[Hashable]) -> None:
        """Remove rows (their response ended elsewhere: a budget the caller tracks)."""
        gone = set(keys)
        self._joining = [(k, ids) for k, ids in self._joining if k not in gone]
        self._keep([i for i, k in enumerate(self.keys) if k not in gone])
        for key in gone:
            self.streams.pop(key, None)

    def sampler_state(self, key: Hashable) -> bytes | None:
        """The state of the row's own random stream (None: it has none)."""
        stream = self.streams.get(key)
        return None if stream is None else stream.get_state().numpy().tobytes()

    def export(self, key: Hashable) -> RowState:
        """Take a row out of the session with what another session of the same weights needs to continue it: its
        KV cache and next-token logits (none if it was not prefilled yet) and its random stream."""
        sampler = self.sampler_state(key)
        self.streams.pop(key, None)
        if any(k == key for k, _ in self._joining):
            self._joining = [(k, ids) for k, ids in self._joining if k != key]
            return RowState(self.version, None, sampler)
        row = self.keys.index(key)
        cache = self._row_cache(row)
        self._keep([i for i in range(len(self.keys)) if i != row])
        return RowState(self.version, cache, sampler)

    def adopt(self, key: Hashable, continuation: Continuation) -> MigrationCost:
        """Take in a row another session of this version exported: its cache is inserted, not recomputed, and it
        continues its own random stream. Raises `VersionMismatch` for another version (C1)."""
        check_version(self.version, continuation)
        cache = check_cache_fits(continuation)
        start = time.perf_counter()
        self._insert(key, cache)
        self._start_stream(key, continuation.row.sampler)
        return MigrationCost.of(continuation, 0, time.perf_counter() - start)

    def _start_stream(self, key: Hashable, stream: int | bytes | None) -> None:
        if stream is None:
            self.streams.pop(key, None)
        elif isinstance(stream, bytes):
            self.streams[key] = torch.Generator()
            self.streams[key].set_state(torch.frombuffer(bytearray(stream), dtype=torch.uint8))
        else:
            self.streams[key] = torch.Generator().manual_seed(int(stream))

    def _streams_of(self, rows: torch.Tensor) -> list[torch.Generator | None] | None:
        """Each row's own stream (None where it has none); None when no row of the session has one."""
        if not self.streams:
            return None
        return [self.streams.get(self.keys[i]) for i in rows.tolist()]

    def _keep(self, rows: list[int]) -> None:
        raise NotImplementedError

    def _row_cache(self, row: int) -> RowCache:
        raise NotImplementedError

    def _insert(self, key: Hashable, cache: RowCache) -> None:
        raise NotImplementedError


def sample_next(logits: torch.Tensor, generator: torch.Generator, temperature: float, top_p: float,
                do_sample: bool, streams: Sequence[torch.Generator | None] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], log-probs [B]) of one draw per row: temperature, then top-p; greedy takes the argmax and records
    the raw log-softmax. `streams`: per row, its own random stream, or None to draw from `generator`."""
    logits = logits.float()
    if not do_sample:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(1)
    scores = logits / temperature
    if top_p < 1.0:
        scores = _top_p(scores, top_p)
    logp = torch.log_softmax(scores, -1)
    tokens = _draw(logp.exp(), generator, streams)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(1)


def _draw(probs: torch.Tensor, generator: torch.Generator,
          streams: Sequence[torch.Generator | None] | None) -> torch.Tensor:
    """One token per row: the rows without a stream of their own in one draw from `generator`, each other row from
    its own stream (so its tokens do not depend on which rows share its batch)."""
    if streams is None or all(s is None for s in streams):
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    tokens = torch.empty(len(probs), dtype=torch.long)
    shared = [i for i, s in enumerate(streams) if s is None]
    if shared:
        tokens[shared] = torch.multinomial(probs[shared], 1, generator=generator).squeeze(1)
    for i, stream in enumerate(streams):
        if stream is not None:
            tokens[i] = torch.multinomial(probs[i:i + 1], 1, generator=stream)[0, 0]
    return tokens


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Scores outside the smallest set of tokens whose probability reaches `top_p` set to -inf (as transformers'
    TopPLogitsWarper: the most likely token always stays)."""
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(-1).cumsum(-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(1, order, remove_sorted)
    return scores.masked_fill(remove, float("-inf"))
