"""LoRA policies: a published version is an adapter folder over a frozen base, and the base's identity goes with it.

An adapter folder holds what `peft` writes and vLLM reads (`adapter_config.json`, `adapter_model.safetensors`, keys
without the adapter name) plus `base_model.json`: where workers read the base (`path`, as the run shares it: a local
folder or an object-store URL) and the SHA-256 of its safetensors files (`sha256`). Whoever serves or trains an
adapter checks that hash against the base it holds and refuses a mismatch (`BaseModelMismatch`), since an adapter
over another base is a different policy that no log-prob or audit would reveal.

The trainers wrap the base with `peft` (`attach_adapter`); the transformers rollout engine serves an adapter merged
into a copy of the base weights (`merged_state`: W + alpha/r B A), so its decode paths run over plain weights.

Simplified, and why:
- Only Linear targets are merged by hand (the attention and MLP projections of Qwen2/Llama); an embedding adapter is
  refused when merged, with the names it holds.
- The hash reads every byte of the base once per process (cached by file names, sizes and times): exact, and a
  32B base costs about a minute of reading, once per worker.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass

import torch
from safetensors.torch import load_file, save_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_FILE = "base_model.json"
PEFT_PREFIX = "base_model.model."


class BaseModelMismatch(ValueError):
    """An adapter was trained over another base model than the one it is loaded on."""


class AdapterError(ValueError):
    """An adapter folder is incomplete, or its adapter cannot be applied as asked."""


@dataclass(frozen=True)
class BaseIdentity:
    path: str  # where workers read the base (as the run shares it: folder or object-store URL)
    sha256: str  # of the base's safetensors files, in name order


def is_adapter_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def base_identity(shared_path: str, local_path: str | None = None) -> BaseIdentity:
    """The identity of the base at `shared_path`, hashed from its local copy `local_path` (default: the same)."""
    return BaseIdentity(shared_path, weights_sha256(local_path or shared_path))


def weights_sha256(folder: str) -> str:
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise AdapterError(f"no *.safetensors file in {folder!r}: not a base model folder")
    stamp = tuple((os.path.basename(f), os.path.getsize(f), os.path.getmtime(f)) for f in files)
    return _hash_files(tuple(files), stamp)


@functools.lru_cache(maxsize=8)
def _hash_files(files: tuple[str, ...], stamp: tuple) -> str:  # `stamp` keys the cache on the files' state
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


def read_base(folder: str) -> BaseIdentity:
    path = os.path.join(folder, BASE_FILE)
    if not os.path.isfile(path):
        raise AdapterError(f"{folder!r} is an adapter folder without {BASE_FILE}: its base model is unknown")
    with open(path) as f:
        data = json.load(f)
    return BaseIdentity(str(data["path"]), str(data["sha256"]))


def check_base(folder: str, held: BaseIdentity) -> None:
    """Raise `BaseModelMismatch` unless the adapter in `folder` was trained over the base `held`."""
    recorded = read_base(folder)
    if recorded.sha256 != held.sha256:
        raise BaseModelMismatch(
            f"adapter {folder!r} was trained over the base at {recorded.path!r} (sha256 {recorded.sha256[:16]}...), "
            f"but the base loaded here is {held.path!r} (sha256 {held.sha256[:16]}...): serve it over the same base "
            "model (model.path) it was trained on")


# ---- the trainers' side: peft ----------------------------------------------------------------------------------------
def peft_config(lora_cfg):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, target_modules=list(lora_cfg.target_modules),
                          lora_dropout=lora_cfg.dropout, bias="none")


def attach_adapter(model, lora_cfg, adapter_folder: str | None = None, seed: int = 0):
    """`model` (the base, frozen by peft) with a trainable adapter: a fresh one (B = 0, so it starts as the base;
    A drawn from `seed`) or the one in `adapter_folder`, whose rank, alpha and targets must be `lora_cfg`'s."""
    from peft import get_peft_model, set_peft_model_state_dict

    config = peft_config(lora_cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            wrapped = get_peft_model(model, config)
        except ValueError as exc:  # peft names the targets it did not find
            raise AdapterError(f"train.lora.target_modules={list(lora_cfg.target_modules)}: {exc}") from None
    if adapter_folder is not None:
        _check_same_shape(adapter_folder, lora_cfg)
        result = set_peft_model_state_dict(wrapped, load_file(os.path.join(adapter_folder, ADAPTER_WEIGHTS)))
        if getattr(result, "unexpected_keys", None):
            raise AdapterError(f"{adapter_folder!r} holds tensors this adapter lacks: {result.unexpected_keys[:4]}")
    wrapped.eval()  # dropout of the base stays off; `adapter_dropout` turns the adapter's on during an update
    return wrapped


def _check_same_shape(folder: str, lora_cfg) -> None:
    saved = read_adapter_config(folder)
    wanted = {"r": lora_cfg.rank, "lora_alpha": float(lora_cfg.alpha), "target_modules": sorted(lora_cfg.target_modules)}
    found = {"r": saved["r"], "lora_alpha": float(saved["lora_alpha"]), "target_modules": sorted(saved["target_modules"])}
    if found != wanted:
        raise AdapterError(f"adapter {folder!r} has {found}, train.lora asks for {wanted}")


def read_adapter_config(folder: str) -> dict:
    with open(os.path.join(folder, ADAPTER_CONFIG)) as f:
        return json.load(f)


@contextlib.contextmanager
def adapter_dropout(model, active: bool):
    """The adapter's dropout layers in train mode for the block (the base stays in eval mode)."""
    layers = [m for name, m in model.named_modules() if name.endswith("lora_dropout")] if active else []
    for layer in layers:
        layer.train()
    try:
        yield
    finally:
        for layer in layers:
            layer.eval()


class AdapterDisabled:
    """The reference policy of a LoRA trainer: the same module with its adapter switched off (the base), no copy."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, *args, **kwargs):
        with self.model.disable_adapter():
            return self.model(*args, **kwargs)

    def parameters(self):
        return self.model.parameters()


_ADAPTER_KEY = re.compile(r"\.(lora_[AB])\.default\.")


def adapter_state(model, state_dict: dict | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors in peft's saved layout (no adapter name), contiguous copies. Picked by name rather than
    by `peft.get_peft_model_state_dict`, which re-reads the model's config on every call (~0.1 s a publish)."""
    named = state_dict.items() if state_dict is not None else model.named_parameters()
    return {_ADAPTER_KEY.sub(r".\1.", k): v.detach().to("cpu").contiguous().clone()
            for k, v in named if _ADAPTER_KEY.search(k)}


def write_adapter_folder(model, path: str, base: BaseIdentity, state_dict: dict | None = None) -> None:
    """The adapter of the peft `model` as an adapter folder at `path` (created): config, tensors, base identity."""
    os.makedirs(path, exist_ok=True)
    save_file(adapter_state(model, state_dict), os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = model.peft_config["default"].to_dict()
    config["target_modules"] = sorted(config["target_modules"])
    config["base_model_name_or_path"] = base.path
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=1, default=list)
    with open(os.path.join(path, BASE_FILE), "w") as f:
        json.dump(asdict(base), f)


def load_adapter_state(model, state: dict[str, torch.Tensor]) -> None:
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, state)


# ---- the rollout side: merged weights ------------------------------------------------------------------------------
def merged_state(base: dict[str, torch.Tensor], folder: str) -> dict[str, torch.Tensor]:
    """The weights the adapter in `folder` changes, merged: W + scale * B @ A for each adapted Linear of `base`
    (keys as in the base's state dict; untouched weights are left out)."""
    config = read_adapter_config(folder)
    rank = int(config["r"])
    scale = float(config["lora_alpha"]) / (rank ** 0.5 if config.get("use_rslora") else rank)
    tensors = load_file(os.path.join(folder, ADAPTER_WEIGHTS))
    other = [k for k in tensors if ".lora_A." not in k and ".lora_B." not in k]
    if other:
        raise AdapterError(f"{folder!r}: only adapters of Linear modules are merged, found {other[:4]}")
    merged = {}
    for key_a in (k for k in tensors if ".lora_A." in k):
        module = key_a.removeprefix(PEFT_PREFIX).split(".lora_A.")[0]
        weight_key = f"{module}.weight"
        if weight_key not in base:
            raise AdapterError(f"{folder!r}: adapted module {module!r} is not in the base model")
        delta = tensors[key_a.replace(".lora_A.", ".lora_B.")].float() @ tensors[key_a].float()
        merged[weight_key] = (base[weight_key].float() + scale * delta).to(base[weight_key].dtype)
    return merged


# ---- building a trainer's policy -----------------------------------------------------------------------------------
def load_trainable_policy(model_path: str, lora_cfg, device, base_path: str = ""):
    """(policy, base identity or None) for a trainer starting at the version folder `model_path`: the full model when
    LoRA is off; else the base (at `base_path`, as the run shares it; by default the folder an adapter names, or
    `model_path` itself when it is a full model: version 0) with a fresh adapter, or the adapter of `model_path`."""
    from dora_tasks.engines.hf_io import load_policy

    adapter = model_path if is_adapter_folder(model_path) else None
    if not lora_cfg.enabled:
        if adapter:
            raise AdapterError(f"{model_path!r} is a LoRA adapter folder, but train.lora.rank is 0: set train.lora "
                               "as the run that published it did")
        return load_policy(model_path, device), None
    from storage.objectstore import local_folder

    shared = base_path or (read_base(adapter).path if adapter else model_path)
    local = local_folder(shared)
    base = base_identity(shared, local)
    if adapter:
        check_base(adapter, base)
    return attach_adapter(load_policy(local, device), lora_cfg, adapter).to(device), base


def reference_policy(model, model_path: str, device, train_cfg, base: BaseIdentity | None):
    """The KL reference (train.kl_coef > 0, else None): the base under the adapter switched off with LoRA, else a
    frozen copy of `model_path`."""
    from dora_tasks.engines.hf_io import load_policy

    if train_cfg.kl_coef <= 0:
        return None
    return AdapterDisabled(model) if base is not None else load_policy(model_path, device, trainable=False)
