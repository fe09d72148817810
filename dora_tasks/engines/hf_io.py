"""Loading and writing Hugging Face model folders, and the metrics both trainers report.

Shared by `torch_trainer` and `deepspeed_trainer` so the two backends read, write and report identically.
Simplifications: the policy is always fp32 (mixed precision is left to a GPU run), dropout is switched off by keeping
the module in eval mode (so the trainer's log-probs match the sampler's), and a folder is published atomically by
writing next to it and renaming (a reader never sees a half-written folder when the target is new).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np
import torch
from safetensors.torch import save_file

from dora_tasks.algorithms import get_advantage, get_loss
from dora_tasks.core.records import TrainBatch

SINGLE_FILE_BYTES = 2 << 30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "chat_template.jinja")


def check_train_config(train_cfg) -> None:
    """Raise before any model or process group exists: ConfigError for bad values, UnknownAlgorithmError for names."""
    train_cfg.validate()
    get_loss(train_cfg.loss)
    get_advantage(train_cfg.advantage)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_policy(model_path: str, device: torch.device | str = "cpu", trainable: bool = True):
    """AutoModelForCausalLM in fp32 on `device`, dropout off; frozen (no grads) when not `trainable`."""
    from dora_tasks.model import load_causal_lm

    model = load_causal_lm(model_path).to(device)
    model.eval()
    if not trainable:
        model.requires_grad_(False)
    return model


def read_tokenizer_files(source_path: str) -> dict[str, bytes]:
    """The tokenizer files of the model folder `source_path` that exist, read once: a trainer built from a published
    version keeps them after the weight store deletes that version."""
    files = {}
    for name in TOKENIZER_FILES:
        src = os.path.join(source_path, name)
        if os.path.isfile(src):
            with open(src, "rb") as f:
                files[name] = f.read()
    return files


def write_hf_folder(model, path: str, tokenizer_files: dict[str, bytes], state_dict: dict | None = None) -> None:
    """A Hugging Face model folder (config, safetensors) in `path`, plus `tokenizer_files` (`read_tokenizer_files`).
    A policy up to `SINGLE_FILE_BYTES` is written as one `model.safetensors` by `safetensors` directly (the
    trainer publishes every update: 3 ms against 14-23 ms for `save_pretrained` on a 128-wide policy); a larger one,
    or one whose shared tensors are not the tied embedding, goes through `save_pretrained` (sharded)."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", dir=parent)
    try:
        tensors = single_file_state(model, state_dict if state_dict is not None else model.state_dict())
        if tensors is None:
            model.save_pretrained(staging, state_dict=state_dict)
        else:
            save_file(tensors, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
            model.config.to_json_file(os.path.join(staging, "config.json"))
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.to_json_file(os.path.join(staging, "generation_config.json"))
        for name, content in tokenizer_files.items():
            with open(os.path.join(staging, name), "wb") as f:
                f.write(content)
        _move_into_place(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def single_file_state(model, state: dict) -> dict | None:
    """`state` with each shared tensor once (the tied lm_head left out, as `save_pretrained` does), contiguous; None
    when it should go through `save_pretrained` instead: above `SINGLE_FILE_BYTES`, or sharing other than the tie."""
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    seen: set[tuple[int, int]] = set()
    tensors, size = {}, 0
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            if name not in tied:
                return None
            continue
        seen.add(key)
        tensors[name] = tensor.detach().contiguous()
        size += tensor.numel() * tensor.element_size()
    return tensors if size <= SINGLE_FILE_BYTES else None


def _move_into_place(staging: str, path: str) -> None:
    try:
        os.rename(staging, path)  # atomic when `path` does not exist yet
    except OSError:
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(staging):
            os.replace(os.path.join(staging, name), os.path.join(path, name))


def batch_summary(batch: TrainBatch) -> dict[str, float]:
    """Metrics of the batch itself (not of the update): sizes, tokens, rewards, staleness; filtered groups are left
    out of the sizes, as they are of the loss."""
    staleness = batch.staleness or [0]
    trajectories = [t for g in batch.groups if not g.filtered for t in g.trajectories]
    rewards = [t.reward for t in trajectories]
    return {
        "trajectories": float(len(trajectories)),
        "groups_filtered": float(sum(1 for g in batch.groups if g.filtered)),
        "tokens": float(sum(t.num_tokens for t in trajectories)),  # prompt + response tokens trained on
        "response_tokens": float(sum(float(np.sum(t.loss_mask)) for t in trajectories)),
        "reward_mean": float(np.mean(rewards)) if rewards else 0.0,
        "staleness_mean": float(sum(staleness) / len(staleness)),
        "staleness_max": float(max(staleness)),
    }


def empty_update_metrics() -> dict[str, float]:
    """Defaults of the update metrics, reported as they are when a batch has no response token to train on."""
    return {"loss": 0.0, "clip_fraction": 0.0, "approx_kl": 0.0, "entropy": 0.0, "grad_norm": 0.0}


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start


def timed_train_step(batch: TrainBatch, advantage: str, update) -> dict[str, float]:
    """The engines' shared `train_step` body: tensors, batch summary, `update(tensors)` when there are response
    tokens to learn from, and the seconds it all took. `advantage` (the configured estimator) is used only for
    trajectories that skipped the advantage task (`batch_tensors`); the others bring their own."""
    from dora_tasks.algorithms.objective import batch_tensors

    clock = Stopwatch()
    tensors = batch_tensors(batch, advantage=advantage)
    metrics = {**batch_summary(batch), **empty_update_metrics()}
    if metrics["response_tokens"] > 0:
        metrics.update(update(tensors))
    metrics["seconds"] = clock.seconds()
    return metrics
