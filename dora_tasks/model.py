"""The policy model and its tokenizer, built offline.

No pretrained weights or tokenizers are reachable here, so the policy is a tiny Qwen2 (the architecture vLLM and
DeepSpeed know) built from a `ModelConfig`, and the tokenizer is character level:

- ids 0, 1, 2 are pad, bos and eos; then one id per character of a fixed set (printable ASCII and newline).
  A character outside the set is encoded as `?` (lossy, but never crashes on a dataset's stray unicode).
- The tokenizer lives next to the weights as a small `tokenizer.json`; it is not a Hugging Face tokenizer, so engines
  are fed token ids, never text (vLLM is run with `skip_tokenizer_init`).
- A model folder is a plain Hugging Face folder (`config.json` + `model.safetensors`), with `bos/eos/pad_token_id`
  set in the config so that generation stops at eos without a tokenizer.
"""
from __future__ import annotations

import json
import os
import threading

import torch
import transformers

from dora_tasks.core.config import ModelConfig

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_SPECIALS = 3
CHARSET = "\n" + "".join(chr(c) for c in range(32, 127))  # newline + printable ASCII (95 characters)
TOKENIZER_FILE = "tokenizer.json"
MAX_POSITIONS = 1024


class TokenizerError(ValueError):
    """A model folder's tokenizer is missing or cannot be read."""


class CharTokenizer:
    """Character-level tokenizer: pad=0, bos=1, eos=2, then one id per character of `charset`."""

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    def __init__(self, charset: str = CHARSET) -> None:
        if len(set(charset)) != len(charset) or "?" not in charset:
            raise TokenizerError("charset must hold distinct characters, including '?'")
        self.charset = charset
        self._index = {ch: i + _SPECIALS for i, ch in enumerate(charset)}

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.charset == self.charset

    @property
    def vocab_size(self) -> int:
        return _SPECIALS + len(self.charset)

    def encode(self, text: str) -> list[int]:
        """Text to ids, without bos/eos. Unknown characters become `?`."""
        unknown = self._index["?"]
        return [self._index.get(ch, unknown) for ch in text]

    def decode(self, ids) -> str:
        """Ids to text, stopping at the first eos; pad, bos and out-of-range ids are skipped."""
        chars = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if _SPECIALS <= i < self.vocab_size:
                chars.append(self.charset[i - _SPECIALS])
        return "".join(chars)

    def prompt_ids(self, prompt: str | list[dict]) -> list[int]:
        """bos + the prompt's characters; a chat-message list is rendered as its contents, one per line."""
        return [BOS_ID, *self.encode(render_messages(prompt))]

    def save(self, folder: str) -> str:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, TOKENIZER_FILE)
        spec = {"type": "char", "pad_id": PAD_ID, "bos_id": BOS_ID, "eos_id": EOS_ID, "charset": self.charset}
        with open(path, "w") as f:
            json.dump(spec, f)
        return path

    @classmethod
    def load(cls, folder: str) -> "CharTokenizer":
        path = os.path.join(folder, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise TokenizerError(f"{path!r} does not exist: not a model folder written by save_policy")
        with open(path) as f:
            spec = json.load(f)
        if spec.get("type") != "char" or (spec.get("pad_id"), spec.get("bos_id"), spec.get("eos_id")) != (0, 1, 2):
            raise TokenizerError(f"{path!r} is not a character tokenizer with pad=0, bos=1, eos=2")
        return cls(charset=spec["charset"])


def build_model(cfg: ModelConfig, vocab_size: int, seed: int = 0) -> transformers.Qwen2ForCausalLM:
    """A freshly initialised tiny Qwen2 (tied embeddings, MLP width 2x hidden, fp32), initialised from `seed`.

    With the default ModelConfig (128 wide, 2 layers) it has 342k parameters."""
    config = transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=2 * cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        use_sliding_window=False,
    )
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.eos_token_id = EOS_ID
    return model.float().eval()


def save_policy(model: transformers.PreTrainedModel, tokenizer: CharTokenizer, path: str) -> str:
    """Write a Hugging Face model folder (config.json, model.safetensors) plus tokenizer.json."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save(path)
    return path


class HFTokenizer:
    """A pretrained model's own Hugging Face tokenizer (a GPU run with `model.path`) behind the interface the
    pipeline uses: `prompt_ids` applies the model's chat template when a prompt is a chat-message list (the layout
    of DAPO-Math-17k and most RL prompt sets), `decode` drops special tokens for the reward function."""

    def __init__(self, path: str) -> None:
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        self.bos_id = self.tokenizer.bos_token_id
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id

    def __repr__(self) -> str:
        return f"HFTokenizer({self.tokenizer.name_or_path!r}, vocab_size={self.vocab_size})"

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def prompt_ids(self, prompt: str | list[dict]) -> list[int]:
        if isinstance(prompt, list) and self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            return self.encode(text)
        return list(self.tokenizer.encode(render_messages(prompt), add_special_tokens=True))


def render_messages(prompt: str | list[dict]) -> str:
    """A prompt as text: a chat-message list ([{"role", "content"}]) becomes its contents, one per line."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in prompt)


def load_tokenizer(path: str) -> CharTokenizer | HFTokenizer:
    """The tokenizer of a model folder: the project's character tokenizer (folders written by `save_policy`), or
    the folder's own Hugging Face tokenizer (a pretrained model)."""
    if not os.path.isdir(path):
        raise TokenizerError(f"{path!r} does not exist: a model folder (save_policy's, or a pretrained one) "
                             "is expected")
    spec_path = os.path.join(path, TOKENIZER_FILE)
    if os.path.isfile(spec_path):
        with open(spec_path) as f:
            try:
                is_char = json.load(f).get("type") == "char"
            except (json.JSONDecodeError, AttributeError):
                is_char = False
        if is_char:
            return CharTokenizer.load(path)
    try:
        return HFTokenizer(path)
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path!r} holds neither a character tokenizer ({TOKENIZER_FILE} of type 'char') nor "
                             f"a Hugging Face tokenizer ({type(exc).__name__}: {exc})") from None


_LOADING = threading.Lock()


def load_causal_lm(path: str) -> transformers.PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained(path)` in fp32, one load at a time per process.

    transformers' loading is not thread-safe: four threads of one process loading the same tied-embedding folder at
    once got `lm_head.weight` reported MISSING and newly initialised (held-out accuracy 0.0 instead of 0.328). Dask
    runs tasks of a worker in threads (an evaluation per CPU-worker thread, a rollout instance with several slots),
    so every model load of the project goes through here."""
    with _LOADING:
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def load_policy(path: str) -> tuple[transformers.Qwen2ForCausalLM, CharTokenizer]:
    """Load a model folder written by `save_policy` (fp32, eval mode) and its tokenizer."""
    tokenizer = load_tokenizer(path)
    return load_causal_lm(path).eval(), tokenizer
