"""Warm start: a small policy built from scratch and fine-tuned on the task's demonstrations, so RL starts from a
model that sometimes succeeds (no pretrained weights are reachable here).

`warm_start(cfg, out_dir)` builds the tokenizer and a tiny Qwen2, runs `model.warmstart_steps` steps of supervised
fine-tuning (AdamW, `model.warmstart_lr` with a short warm-up then cosine decay, `model.warmstart_batch` prompts per
step, loss on response tokens and eos only), and saves the policy. It is cached: a folder holding a finished policy
for the same settings (`warmstart.json`) is returned at once.

The loss is the mean over examples of each example's mean token loss, not a mean over all tokens: on a long-tailed
task a token mean is dominated by the few long answers, and the model then learns the middle of long answers before
it learns to copy the count and stop.

Simplified: the demonstration of a prompt is its answer (for countdown that is `countdown.demonstration`); a step's
batch is sorted by length and run in chunks of similar length with gradient accumulation (same gradient as one
padded batch, a fraction of the padding on a long-tailed task); no validation-based early stop, since the target is
a model that is partly right, not a good one.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Callable, Sequence

import numpy as np
import torch

from dora_tasks.core.config import Config, RolloutConfig, TaskConfig
from dora_tasks.core.contracts import RolloutEngine
from dora_tasks.core.records import Prompt
from dora_tasks.engines.hf_rollout import HFRolloutEngine
from dora_tasks.model import CharTokenizer, build_model, load_tokenizer, save_policy
from dora_tasks.workloads import calculator, countdown
from dora_tasks.workloads.datasets import load_prompts
from dora_tasks.workloads.rewards import score_parallel

SETTINGS_FILE = "warmstart.json"
CHUNK_TOKENS = 2048  # padded tokens per forward pass inside a step
WARMUP_FRACTION = 0.05
FINAL_LOSS_STEPS = 10  # the reported final loss: the mean over this many last steps
IGNORE_INDEX = -100  # a label the loss skips (prompt and padding), as in transformers
EVAL_REWARD_LANES = 4  # held-out rewards are scored by up to this many parallel lanes (at most one per core)

RewardFn = Callable[[str, str, str], float]


def warm_start(cfg: Config, out_dir: str) -> str:
    """Build, fine-tune and save the initial policy into `out_dir` (or reuse a finished one); returns `out_dir`."""
    settings = warmstart_settings(cfg)
    if cached(out_dir, settings):
        return out_dir
    forget_settings(out_dir)  # a crash before the new record is written must not leave an old record behind
    tokenizer = CharTokenizer()
    train, _ = load_prompts(cfg.task, tokenizer, cfg.dora.seed)
    model = build_model(cfg.model, tokenizer.vocab_size, seed=cfg.dora.seed)
    start = time.perf_counter()
    losses = supervised_finetune(model, examples(train, tokenizer, demonstrations(cfg.task)), cfg.model.warmstart_steps,
                                 cfg.model.warmstart_lr, cfg.model.warmstart_batch, cfg.dora.seed)
    save_policy(model, tokenizer, out_dir)
    record = {"settings": settings, "seconds": time.perf_counter() - start,
              "final_loss": float(np.mean(losses[-FINAL_LOSS_STEPS:])) if losses else float("nan")}
    with open(os.path.join(out_dir, SETTINGS_FILE), "w") as f:
        json.dump(record, f, indent=1)
    return out_dir


def warmstart_settings(cfg: Config) -> dict:
    """Everything the warm-started weights depend on; a cached folder is reused only when this matches."""
    m, t = cfg.model, cfg.task
    return {"hidden_size": m.hidden_size, "num_layers": m.num_layers, "num_heads": m.num_heads,
            "steps": m.warmstart_steps, "lr": m.warmstart_lr, "batch": m.warmstart_batch, "seed": cfg.dora.seed,
            "task": t.name, "dataset": t.dataset, "prompt_key": t.prompt_key, "answer_key": t.answer_key,
            "num_prompts": t.num_prompts, "max_count": t.max_count, "format": 1,
            **({"tool_demo_every": calculator.TOOL_DEMO_EVERY} if t.name == "arithmetic" else {})}


def cached(out_dir: str, settings: dict) -> bool:
    path = os.path.join(out_dir, SETTINGS_FILE)
    if not (os.path.isfile(path) and os.path.isfile(os.path.join(out_dir, "model.safetensors"))):
        return False
    try:
        with open(path) as f:
            return json.load(f).get("settings") == settings
    except (OSError, ValueError):
        return False


def forget_settings(out_dir: str) -> None:
    try:
        os.remove(os.path.join(out_dir, SETTINGS_FILE))
    except FileNotFoundError:
        pass


def examples(prompts: Sequence[Prompt], tokenizer: CharTokenizer,
             demonstrate: Callable[[Prompt], str] = lambda p: p.answer) -> list[tuple[list[int], int]]:
    """(prompt + demonstration + eos token ids, prompt length) per prompt."""
    return [(list(p.token_ids) + tokenizer.encode(demonstrate(p)) + [tokenizer.eos_id], len(p.token_ids))
            for p in prompts]


def demonstrations(task: TaskConfig) -> Callable[[Prompt], str]:
    """What the warm start imitates for a prompt: its answer, or for the arithmetic task a tool-using response on
    some prompts (`calculator.demonstration`)."""
    if task.name == "arithmetic":
        return calculator.demonstration
    return lambda p: p.answer


def supervised_finetune(model: torch.nn.Module, data: Sequence[tuple[list[int], int]], steps: int, lr: float,
                        batch: int, seed: int) -> list[float]:
    """`steps` AdamW steps of next-token loss on the response part of `data`; returns the per-step losses."""
    if steps == 0:
        return []
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps))
    model.train()
    losses = []
    for _ in range(steps):
        picked = [data[i] for i in rng.choice(len(data), size=batch, replace=len(data) < batch)]
        losses.append(accumulate_batch(model, picked))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    return losses


def lr_factor(step: int, steps: int) -> float:
    warmup = max(1, int(WARMUP_FRACTION * steps))
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def accumulate_batch(model: torch.nn.Module, batch: Sequence[tuple[list[int], int]]) -> float:
    """Backward of the batch loss (per-example mean of response-token losses, averaged over examples), run in
    length-sorted chunks; returns the loss."""
    batch = sorted(batch, key=lambda ex: len(ex[0]))
    loss_sum = 0.0
    for chunk in length_chunks(batch):
        input_ids, labels = pad_right(chunk)
        per_example = example_losses(model(input_ids=input_ids).logits, labels)
        (per_example.sum() / len(batch)).backward()
        loss_sum += per_example.sum().item()
    return loss_sum / len(batch)


def example_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy per row [B] over the positions whose label is not `IGNORE_INDEX`."""
    targets = labels[:, 1:]
    token_losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), targets, ignore_index=IGNORE_INDEX,
                                                     reduction="none")
    counts = (targets != IGNORE_INDEX).sum(dim=1).clamp(min=1)
    return token_losses.sum(dim=1) / counts


def length_chunks(batch: Sequence[tuple[list[int], int]]) -> list[list[tuple[list[int], int]]]:
    """Consecutive chunks of a length-sorted batch, each at most CHUNK_TOKENS once padded (at least one row)."""
    chunks, current = [], []
    for ex in batch:
        if current and (len(current) + 1) * len(ex[0]) > CHUNK_TOKENS:
            chunks.append(current)
            current = []
        current.append(ex)
    return chunks + [current] if current else chunks


def pad_right(chunk: Sequence[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) [B, L]: pad on the right (causal attention never looks ahead, so no mask is needed);
    labels are `IGNORE_INDEX` on the prompt and the padding."""
    width = max(len(ids) for ids, _ in chunk)
    input_ids = torch.zeros((len(chunk), width), dtype=torch.long)
    labels = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, prompt_len) in enumerate(chunk):
        input_ids[row, :len(ids)] = torch.as_tensor(ids)
        labels[row, prompt_len:len(ids)] = torch.as_tensor(ids[prompt_len:])
    return input_ids, labels


def evaluate(policy, prompts: Sequence[Prompt], reward_fn: RewardFn | None = None, *, greedy: bool = False,
             seed: int = 0, max_new_tokens: int = 256, temperature: float = 1.0,
             tokenizer: CharTokenizer | None = None, **reward_limits) -> float:
    """Held-out accuracy: the share of prompts whose one response gets reward 1 (arguments as `rewards_of`)."""
    rewards = rewards_of(policy, prompts, reward_fn, greedy=greedy, seed=seed, max_new_tokens=max_new_tokens,
                         temperature=temperature, tokenizer=tokenizer, **reward_limits)
    return float(np.mean(rewards == 1.0)) if len(rewards) else float("nan")


def rewards_of(policy, prompts: Sequence[Prompt], reward_fn: RewardFn | None = None, *, greedy: bool = False,
               seed: int = 0, max_new_tokens: int = 256, temperature: float = 1.0,
               tokenizer: CharTokenizer | None = None, reward_timeout_s: float = TaskConfig.reward_timeout_s,
               reward_isolation: str = TaskConfig.reward_isolation,
               reward_memory_bytes: int = TaskConfig.reward_memory_bytes) -> np.ndarray:
    """The reward of one response per prompt, float32 [len(prompts)].

    `policy` is a model folder, an in-memory model, or a `RolloutEngine` (used as it is configured); responses are
    sampled at `temperature` or greedy. `reward_fn` defaults to the countdown reward and is run through
    `rewards.score_parallel` with the `task.reward_*` limits (a failed, timed-out or unscored reward is nan, which
    counts as wrong); `tokenizer` defaults to the folder's, else the built-in character tokenizer.
    """
    engine = evaluation_engine(policy, greedy, max_new_tokens, temperature)
    tokenizer = tokenizer or (load_tokenizer(policy) if isinstance(policy, str) else CharTokenizer())
    reward_fn = reward_fn or countdown.reward
    generations = engine.generate([p.token_ids for p in prompts], 1, seed)
    calls = [(p.text, tokenizer.decode(g[0].token_ids), p.answer, p.row_json) for p, g in zip(prompts, generations)]
    lanes = min(EVAL_REWARD_LANES, os.cpu_count() or 1)
    scored = score_parallel(reward_fn, calls, reward_timeout_s, reward_isolation, reward_memory_bytes, lanes)
    return np.array([value for value, _ in scored], dtype=np.float32)


def evaluation_engine(policy, greedy: bool, max_new_tokens: int, temperature: float) -> RolloutEngine:
    if isinstance(policy, RolloutEngine):
        return policy
    rollout_cfg = RolloutConfig(max_new_tokens=max_new_tokens, temperature=temperature)
    if isinstance(policy, str):
        return HFRolloutEngine(policy, rollout_cfg, do_sample=not greedy)
    return HFRolloutEngine.from_model(policy, rollout_cfg, do_sample=not greedy)
