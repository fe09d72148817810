"""Light rollout engine on transformers `generate` (CPU, fp32): the fallback when vLLM is not wanted or not there.

It serves one policy version at a time, like a vLLM instance: `load_version` copies a published folder's safetensors
into the live model in place, `generate` samples `n` responses per prompt in left-padded batches.

Log-probs: each sampled token's log-prob is taken under the distribution it was actually sampled from, i.e. the
log-softmax of the processed scores (`logits / temperature`, then top-p truncation, renormalised). With
`top_p == 1` this is exactly `log_softmax(logits / temperature)`, and with `temperature == 1` the raw policy
log-prob, which is what a trainer recomputes. Greedy decoding (`do_sample=False`, for evaluation) records the raw
log-softmax of the logits.

`generate` decodes a batch until its longest row ends (greedy `generate` on the fast session: in chunks, ended rows
leaving between them; evaluation is greedy); the rollout server's continuous batching uses
`open_session`, which keeps the KV cache of running rows between chunks: `dora_tasks.engines.fast_session` (the
decode step written out in plain torch, `rollout.fast_decode`, Qwen2/Llama layouts) or
`dora_tasks.engines.hf_session` (transformers' forward).

LoRA (`train.lora`): a version published as an adapter folder is merged into a copy of the base weights (the
folder the engine started from, read once) and copied into the live model like any version, so both sessions decode
over plain weights; the adapter's recorded base must be this base (`lora.check_base`).

Several versions at once (``rollout.versions_per_instance`` = M > 1): the engine keeps up to M versions resident,
each merged into its own copy of the model (`resident`, least recently used first out, never a version with rows
running in the rollout server's batch); loading a resident version costs nothing. Memory: M copies of the
weights plus the base's tensors kept for merging, (M + 1) x the model's bytes. The rollout server decodes each
version's rows in that version's own session (`open_session(version)`), one version after the other at every chunk
(time-sliced, `dora_tasks.server_sessions.TimeSlicedSession`); `generate(..., versions=)` likewise runs one
`generate` per version.
"""
from __future__ import annotations

import contextlib
import copy
import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import transformers
from safetensors.torch import load_file

from dora_tasks.core.config import RolloutConfig
from dora_tasks.core.contracts import RolloutEngine
from dora_tasks.core.records import Generation
from dora_tasks.engines import lora
from dora_tasks.engines.decoding import left_pad
from dora_tasks.engines.resident import ResidentVersions
from dora_tasks.model import EOS_ID, load_causal_lm

GREEDY_CHUNK = 16  # tokens per decode call of greedy `generate` on the fast session: ended rows leave between calls


class WeightsError(ValueError):
    """A weights folder is missing, or its tensors do not fit the live model."""


def read_safetensors(folder: str) -> dict[str, torch.Tensor]:
    """All tensors of the `*.safetensors` files of a Hugging Face folder (sharded or not)."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise WeightsError(f"no *.safetensors file in {folder!r}")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(path))
    return state


def load_weights_in_place(model: torch.nn.Module, folder: str) -> None:
    """Copy a folder's tensors into `model`; tied weights absent from the file (lm_head) follow their tie."""
    state = read_safetensors(folder)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise WeightsError(f"{folder!r} does not fit the model: missing {sorted(set(missing) - tied)}, "
                           f"unexpected {sorted(unexpected)}")


def lora_base_folder(adapter_folder: str) -> str:
    """A local copy of the base model an adapter folder names (an object store's through the worker cache)."""
    from storage.objectstore import local_folder

    return local_folder(lora.read_base(adapter_folder).path)


def cut_at_eos(tokens: np.ndarray, logprobs: np.ndarray, version: int,
               eos_ids: Sequence[int] = (EOS_ID,)) -> Generation:
    """One row of generated tokens, cut after the first eos (kept) or left whole when there is none."""
    eos = np.flatnonzero(np.isin(tokens, list(eos_ids)))
    end = int(eos[0]) + 1 if len(eos) else len(tokens)
    return Generation(token_ids=tokens[:end].astype(np.int32), logprobs=logprobs[:end].astype(np.float32),
                      versions=np.full(end, version, dtype=np.int32), finished=bool(len(eos)))


def _joined(parts: Sequence[Generation], version: int) -> Generation:
    tokens = np.concatenate([g.token_ids for g in parts]) if parts else np.zeros(0, np.int32)
    logprobs = np.concatenate([g.logprobs for g in parts]) if parts else np.zeros(0, np.float32)
    return Generation(tokens, logprobs, np.full(len(tokens), version, np.int32), bool(parts and parts[-1].finished))


def special_ids(config) -> tuple[tuple[int, ...], int]:
    """(eos ids, pad id) of a model config: the project's policies use eos=2, pad=0; a pretrained model its own."""
    eos = config.eos_token_id if config.eos_token_id is not None else EOS_ID
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    pad = config.pad_token_id if config.pad_token_id is not None else eos_ids[0]
    return eos_ids, int(pad)


@dataclass
class _Held:
    """A resident version: its copy of the model, and the weights its adapter changed (None: all are its own)."""

    model: transformers.PreTrainedModel
    adapted: set[str] | None


class HFRolloutEngine(RolloutEngine):
    """A transformers causal LM serving one version (or M, `resident`); see the module docstring."""

    opens_version_sessions = True  # `open_session(version)` opens a session on any resident version

    def __init__(self, model_path: str, rollout_cfg: RolloutConfig, version: int = 0, *,
                 do_sample: bool = True, max_batch: int = 256, threads: int | None = 1) -> None:
        """`threads`: torch intra-op threads of this process (one per instance on a small CPU machine; None keeps
        the process setting)."""
        if threads is not None:
            torch.set_num_threads(threads)
        adapter = model_path if lora.is_adapter_folder(model_path) else None
        base_folder = lora_base_folder(adapter) if adapter else model_path
        self._init(load_causal_lm(base_folder), rollout_cfg, version, do_sample, max_batch, base_folder)
        if adapter:
            self.load_version(version, adapter)
        else:
            self._hold_current()

    @classmethod
    def from_model(cls, model: transformers.PreTrainedModel, rollout_cfg: RolloutConfig, version: int = 0, *,
                   do_sample: bool = True, max_batch: int = 256) -> HFRolloutEngine:
        """Serve an in-memory model (shared, not copied): for evaluation during warm start and for tests. It has
        no base folder, so it cannot load LoRA adapters."""
        engine = cls.__new__(cls)
        engine._init(model, rollout_cfg, version, do_sample, max_batch, None)
        engine._hold_current()
        return engine

    def _init(self, model, rollout_cfg: RolloutConfig, version: int, do_sample: bool, max_batch: int,
              base_folder: str | None) -> None:
        self.base_folder = base_folder  # the model folder started from: the base of LoRA adapters
        self._base_state: dict[str, torch.Tensor] | None = None  # its weights, read at the first adapter
        self._adapted: set[str] | None = None  # weights an adapter changed, when all others are the base's
        self.model = model.float().eval()
        self.cfg = rollout_cfg
        self.version = version
        self.max_batch = max_batch
        self.eos_ids, self.pad_id = special_ids(model.config)
        self.generation_config = self._generation_config(rollout_cfg, do_sample)
        versions = getattr(rollout_cfg, "versions_per_instance", 1)
        self.resident: ResidentVersions[_Held] | None = ResidentVersions(versions) if versions > 1 else None

    def _hold_current(self) -> None:
        """Record the loaded version as resident (with several versions held)."""
        if self.resident is not None:
            self.resident.put(self.version, _Held(self.model, self._adapted))

    def _generation_config(self, cfg: RolloutConfig, do_sample: bool) -> transformers.GenerationConfig:
        sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": 0} if do_sample else {}
        return transformers.GenerationConfig(
            do_sample=do_sample, max_new_tokens=cfg.max_new_tokens, eos_token_id=list(self.eos_ids),
            pad_token_id=self.pad_id, return_dict_in_generate=True, output_scores=True, **sampling)

    def open_session(self, version: int | None = None):
        """A session on the loaded version (or on the resident `version`): continuous batching with the KV cache kept
        across chunks; the `FastDecodeSession` where `rollout.fast_decode` is on and the model's layout is one it
        knows, else the `DecodeSession` on transformers' forward."""
        from dora_tasks.engines import fast_session
        from dora_tasks.engines.hf_session import DecodeSession

        with self._serving(self.version if version is None else version):
            kind = fast_session.FastDecodeSession if self._fast_session_available() else DecodeSession
            return kind(self.model, self.eos_ids, self.pad_id, self.version, self.cfg.temperature, self.cfg.top_p,
                        do_sample=self.generation_config.do_sample)

    def load_version(self, version: int, weights_path: str) -> None:
        """Make `version` the loaded one. With several versions held, a resident one costs nothing, and a new one is
        loaded into the copy of the least recently used version not running (or a new copy while fewer than M)."""
        from storage.objectstore import local_folder

        if self.resident is not None and version in self.resident:
            held = self.resident.get(version)
            self.model, self._adapted, self.version = held.model, held.adapted, version
            return
        loaded = self.model, self._adapted
        try:
            if self.resident is not None:
                self._make_room()
            folder = local_folder(weights_path)  # object store: via the worker's cache
            with torch.no_grad():
                if lora.is_adapter_folder(folder):
                    self._load_adapter(folder)
                else:
                    load_weights_in_place(self.model, folder)
                    self._adapted = None
        except BaseException:
            if self.resident is not None:
                self._forget_failed_load(loaded)
            raise
        self.version = version
        self._hold_current()

    def _make_room(self) -> None:
        """Point `model` at the copy the next version loads into: the evicted version's, the live model while no
        version holds it, else a new copy (the base tensors of the copied version's unadapted weights go with it)."""
        victim = self.resident.victim()
        if victim is not None:
            held = self.resident.pop(victim)
            self.model, self._adapted = held.model, held.adapted
        elif any(held.model is self.model for held in self.resident.values()):
            self.model = copy.deepcopy(self.model)

    def _forget_failed_load(self, loaded: tuple) -> None:
        """After a failed load the copy it went into holds no version: the loaded version is served again, unless
        that copy was its own (it was the least recently used: then no version is loaded until the next load)."""
        if self.model is loaded[0] and self.version not in self.resident:
            self.version = -1
        else:
            self.model, self._adapted = loaded

    @contextlib.contextmanager
    def _serving(self, version: int):
        """The resident `version` as the loaded one for the block (the loaded one is restored after)."""
        saved = self.model, self._adapted, self.version
        if version != self.version:
            if self.resident is None:
                raise ValueError(f"version {version} is not loaded (this engine holds version {self.version} only)")
            held = self.resident.get(version)
            self.model, self._adapted, self.version = held.model, held.adapted, version
        try:
            yield
        finally:
            self.model, self._adapted, self.version = saved

    def _load_adapter(self, folder: str) -> None:
        """The base with the adapter of `folder` merged: only the weights it or the previous adapter changed are
        copied when the rest already is the base's."""
        if self.base_folder is None:
            raise WeightsError(f"{folder!r} is a LoRA adapter, but this engine serves an in-memory model and "
                               "holds no base folder to merge it into")
        lora.check_base(folder, lora.base_identity(self.base_folder))
        if self._base_state is None:
            self._base_state = read_safetensors(self.base_folder)
        base = self._base_state
        merged = lora.merged_state(base, folder)
        restore = base if self._adapted is None else {k: base[k] for k in self._adapted - merged.keys()}
        self.model.load_state_dict({**restore, **merged}, strict=False)
        self._adapted = set(merged)

    @property
    def max_new_tokens(self) -> int:
        return self.cfg.max_new_tokens

    def generate(self, prompts: Sequence[Sequence[int]], n: int, seed: int, *, max_new_tokens: int | None = None,
                 versions: Sequence[int] | None = None) -> list[list[Generation]]:
        """`n` samples per prompt; `max_new_tokens` overrides the config's budget (chunks of a partial rollout);
        `versions`: each prompt's resident version (default: all on the loaded one), one `generate` per version.

        Sampling is seeded by `seed` (and the batch offset) under a forked RNG, so the global RNG is untouched.
        """
        if versions is not None:
            return self._generate_per_version(prompts, n, seed, max_new_tokens, versions)
        rows = [p for p in prompts for _ in range(n)]
        budget = max_new_tokens if max_new_tokens is not None else self.cfg.max_new_tokens
        if not self.generation_config.do_sample and self._fast_session_available():
            flat = self._greedy_in_session(rows, budget)
        else:
            generation_config = self.generation_config
            if budget != generation_config.max_new_tokens:
                generation_config = copy.deepcopy(generation_config)
                generation_config.max_new_tokens = budget
            flat = [g for start in range(0, len(rows), self.max_batch)
                    for g in self._generate_batch(rows[start:start + self.max_batch], seed + start, generation_config)]
        return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _generate_per_version(self, prompts, n, seed, max_new_tokens, versions) -> list[list[Generation]]:
        out: list[list[Generation]] = [[] for _ in prompts]
        for version in dict.fromkeys(versions):
            mine = [i for i, v in enumerate(versions) if v == version]
            with self._serving(version):
                for i, gens in zip(mine, self.generate([prompts[i] for i in mine], n, seed,
                                                       max_new_tokens=max_new_tokens)):
                    out[i] = gens
        return out

    def _fast_session_available(self) -> bool:
        from dora_tasks.engines import fast_session

        return self.cfg.fast_decode and fast_session.supports(self.model)

    def _greedy_in_session(self, rows: Sequence[Sequence[int]], budget: int) -> list[Generation]:
        """Greedy decoding of every row through one `FastDecodeSession`, in chunks of `GREEDY_CHUNK` tokens, so a
        row that ended leaves the batch instead of being decoded as padding until the longest one ends (the tokens
        are `generate`'s: `tests/test_hf_session.py`)."""
        grown: list[list[Generation]] = [[] for _ in rows]
        produced = [0] * len(rows)
        live = set(range(len(rows))) if budget > 0 else set()
        session = self.open_session()
        for key in live:
            session.add(key, rows[key])
        while live:
            for key, g in session.decode({k: min(GREEDY_CHUNK, budget - produced[k]) for k in live}, 0).items():
                grown[key].append(g)
                produced[key] += len(g.token_ids)
                if g.finished or produced[key] >= budget:
                    live.discard(key)
            session.drop([k for k in session.keys if k not in live])
        return [_joined(parts, self.version) for parts in grown]

    def _generate_batch(self, rows: Sequence[Sequence[int]], seed: int,
                        generation_config: transformers.GenerationConfig) -> list[Generation]:
        input_ids, mask = left_pad(rows, self.pad_id)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, generation_config=generation_config)
        tokens = out.sequences[:, input_ids.shape[1]:]
        scores = torch.stack(out.scores, dim=1).float()  # [B, T, V], the processed (sampling) scores
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        tokens_np, logprobs_np = tokens.numpy(), logprobs.numpy()
        return [cut_at_eos(tokens_np[r], logprobs_np[r], self.version, self.eos_ids) for r in range(len(rows))]
