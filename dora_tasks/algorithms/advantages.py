"""Advantage estimators: pure tensor functions, registered by name.

Shapes: `rewards` float [B] (one scalar per trajectory), `group_index` long [B] (any integer id; equal ids = same
prompt's group), `response_mask` [B,T] (1 on response tokens). Every estimator returns float32 [B,T]: the trajectory's
scalar advantage broadcast over its response tokens, 0 elsewhere.

How these differ from their papers, and why:
- All are outcome-reward estimators (one scalar per response): the tasks here have verifiable final-answer rewards,
  so there is no per-token reward or value model (no GAE/PPO critic).
- `grpo` (DeepSeekMath): (r - mean_g) / (std_g + eps) with the unbiased (Bessel) group std, as verl and TRL compute
  it. A group of one has no baseline and keeps its raw reward (verl's convention), so G=1 degrades to REINFORCE.
- `dr_grpo` (Dr. GRPO, Liu et al. 2025): r - mean_g, no std division (which the paper shows biases towards too-easy
  and too-hard prompts). Its other half, the length-unbiased loss aggregation, is `train.loss_agg =
  seq_mean_token_sum_norm`.
- `rloo` (Ahmadian et al. 2024): r_i - mean of the other G-1 rewards of the group, i.e. G/(G-1) (r_i - mean_g).
- `reinforce_pp_baseline` (REINFORCE++ with a group baseline, as in verl): r - mean_g, broadcast to tokens, then
  whitened over all response tokens of the batch (so longer responses weigh more in the statistics, as in verl).
  REINFORCE++'s per-token KL-in-reward is not folded in here; KL to a reference is a loss term (`train.kl_coef`).
- `dapo` (Yu et al. 2025): DAPO's advantage is GRPO's. Its other parts live elsewhere: clip-higher is
  `train.clip_high > train.clip_low`, token-level aggregation is `train.loss_agg = token_mean`, dynamic sampling is
  `group_is_degenerate` (the caller records the group as filtered, it is never dropped silently) and the soft
  overlong punishment is `overlong_shaping` (added to the reward by the caller).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from dora_tasks.algorithms.registry import register_advantage

EPS = 1e-6  # added to the group std (verl's default epsilon)
WHITEN_EPS = 1e-8  # added to the variance when whitening (verl's masked_whiten)


def _group_stats(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-trajectory (group mean, unbiased group std, group size), each [B]; a singleton group gets mean 0, std 1."""
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    counts_f = counts.to(rewards.dtype)
    sums = torch.zeros_like(counts_f).index_add_(0, inverse, rewards)
    mean = sums / counts_f
    squares = torch.zeros_like(counts_f).index_add_(0, inverse, (rewards - mean[inverse]) ** 2)
    std = torch.sqrt(squares / (counts_f - 1).clamp(min=1))
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[inverse], std[inverse], counts_f[inverse]


def _per_token(scores: Tensor, response_mask: Tensor) -> Tensor:
    return scores[:, None] * response_mask.to(torch.float32)


@register_advantage("grpo")
def grpo(rewards: Tensor, group_index: Tensor, response_mask: Tensor) -> Tensor:
    """(r - group mean) / (group std + eps), broadcast over response tokens. [B],[B],[B,T] -> [B,T]."""
    rewards = rewards.to(torch.float32)
    mean, std, _ = _group_stats(rewards, group_index)
    return _per_token((rewards - mean) / (std + EPS), response_mask)


@register_advantage("dr_grpo")
def dr_grpo(rewards: Tensor, group_index: Tensor, response_mask: Tensor) -> Tensor:
    """r - group mean (no std division). [B],[B],[B,T] -> [B,T]."""
    rewards = rewards.to(torch.float32)
    mean, _, _ = _group_stats(rewards, group_index)
    return _per_token(rewards - mean, response_mask)


@register_advantage("rloo")
def rloo(rewards: Tensor, group_index: Tensor, response_mask: Tensor) -> Tensor:
    """r_i - mean of the group's other rewards = G/(G-1) (r_i - group mean); singletons keep r.

    [B],[B],[B,T] -> [B,T].
    """
    rewards = rewards.to(torch.float32)
    mean, _, counts = _group_stats(rewards, group_index)
    scale = torch.where(counts > 1, counts / (counts - 1).clamp(min=1), torch.ones_like(counts))
    return _per_token(scale * (rewards - mean), response_mask)


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline(rewards: Tensor, group_index: Tensor, response_mask: Tensor) -> Tensor:
    """r - group mean, broadcast to tokens, whitened over the batch's response tokens. [B],[B],[B,T] -> [B,T]."""
    rewards = rewards.to(torch.float32)
    mean, _, _ = _group_stats(rewards, group_index)
    mask = response_mask.to(torch.float32)
    scores = _per_token(rewards - mean, mask)
    n = mask.sum()
    if n < 2:  # no variance to speak of: centre only
        return scores
    token_mean = (scores * mask).sum() / n
    token_var = (((scores - token_mean) ** 2) * mask).sum() / (n - 1)
    return (scores - token_mean) * torch.rsqrt(token_var + WHITEN_EPS) * mask


@register_advantage("dapo")
def dapo(rewards: Tensor, group_index: Tensor, response_mask: Tensor) -> Tensor:
    """DAPO's advantage is GRPO's; see the module docstring for where DAPO's other parts live."""
    return grpo(rewards, group_index, response_mask)


def group_is_degenerate(rewards) -> bool:
    """True when a group's rewards have zero variance (all equal, or a single one): its GRPO advantages are all 0.

    DAPO's dynamic sampling excludes such groups; the caller must record the exclusion (set `Group.filtered`)
    rather than drop the group silently. Any NaN reward makes the group non-degenerate (it is an error to surface).
    """
    values = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if values.size <= 1:
        return True
    return bool(np.all(values == values[0]))


def overlong_shaping(lengths, max_len: int, cache_len: int):
    """DAPO's soft overlong punishment, to be added to the reward. lengths [B] -> penalty [B] in [-1, 0].

    0 up to `max_len - cache_len` tokens, then linear down to -1 at `max_len`, -1 beyond. With `cache_len = 0` it is a
    step: -1 only beyond `max_len`. Returns a float32 tensor for a tensor input, a float32 numpy array otherwise.
    """
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"cache_len must be in [0, max_len={max_len}], got {cache_len}")
    as_tensor = isinstance(lengths, Tensor)
    length = torch.as_tensor(lengths, dtype=torch.float32)
    if cache_len == 0:
        penalty = torch.where(length > max_len, -1.0, 0.0)
    else:
        penalty = ((max_len - cache_len - length) / cache_len).clamp(min=-1.0, max=0.0)
    return penalty if as_tensor else penalty.numpy()
