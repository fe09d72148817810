"""Advantage estimators: pure tensor functions over one group, registered by name.

Contract: `fn(rewards: Tensor[G]) -> Tensor[G]`. `rewards` holds the outcome rewards of the G trajectories of one
prompt (any float dtype, finite, G >= 1); the result is float32 [G], one scalar advantage per trajectory, in the same
order. An estimator sees one group and nothing else: the pipeline scores each group as soon as it is complete, on a CPU
worker, before the gate decides which update it joins, so no batch exists when advantages are computed.
`group_advantages(estimator, rewards)` is the one place that calls an estimator (the advantage task,
`steps.group_advantage`, uses it); the trainer only broadcasts each trajectory's scalar over its response tokens.

How these differ from their papers, and why:
- All are outcome-reward estimators (one scalar per response): the tasks here have verifiable final-answer rewards,
  so there is no per-token reward or value model (no GAE/PPO critic).
- `grpo` (DeepSeekMath): (r - mean_g) / (std_g + eps) with the unbiased (Bessel) group std, as verl and TRL compute
  it. A group of one has no baseline and keeps its raw reward (verl's convention), so G=1 degrades to REINFORCE.
- `dr_grpo` (Dr. GRPO, Liu et al. 2025): r - mean_g, no std division (which the paper shows biases towards too-easy
  and too-hard prompts). Its other half, the length-unbiased loss aggregation, is `train.loss_agg =
  seq_mean_token_sum_norm`.
- `rloo` (Ahmadian et al. 2024): r_i - mean of the other G-1 rewards of the group, i.e. G/(G-1) (r_i - mean_g).
- `reinforce_pp_group`: REINFORCE++-baseline reduced to what one group allows. verl and OpenRLHF subtract the group
  mean and then whiten over every response token of the whole training batch; that batch does not exist here (see
  above), and whitening it in the trainer would be a second place that changes advantages, after the recorded
  `Trajectory.advantage` was written. So the estimator whitens within the group: (r - mean_g) / sqrt(var_g + 1e-8),
  the group's unbiased variance and verl's whitening epsilon. That is GRPO up to where the epsilon sits, and the name
  says so rather than promising batch statistics. Without token lengths the statistics are per trajectory, not per
  token. REINFORCE++'s per-token KL-in-reward is not folded in; KL to a reference is a loss term (`train.kl_coef`).
- `dapo` (Yu et al. 2025): DAPO's advantage is GRPO's. Its other parts live elsewhere: clip-higher is
  `train.clip_high > train.clip_low`, token-level aggregation is `train.loss_agg = token_mean`, dynamic sampling is
  `group_is_degenerate` (the caller records the group as filtered, it is never dropped silently) and the soft
  overlong punishment is `overlong_shaping` (added to the reward by the caller).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from dora_tasks.algorithms.registry import get_advantage, register_advantage

EPS = 1e-6  # added to the group std (verl's default epsilon)
WHITEN_EPS = 1e-8  # added to the variance when whitening (verl's masked_whiten)


def group_advantages(estimator: str, rewards) -> Tensor:
    """The advantages float32 [G] of one group's trajectories from their rewards [G] (array-like; NaN, a failed
    reward, counts as 0) by the registered estimator named `estimator`."""
    scores = np.nan_to_num(np.asarray(rewards, dtype=np.float32).reshape(-1), nan=0.0)
    return get_advantage(estimator)(torch.from_numpy(scores))


def _baseline(rewards: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(rewards as float32 [G], group mean, unbiased group std); a group of one has no baseline: mean 0, std 1."""
    if rewards.dim() != 1 or rewards.numel() == 0:
        raise ValueError(f"an advantage estimator takes one group's rewards [G], G >= 1; got shape "
                         f"{tuple(rewards.shape)}")
    r = rewards.to(torch.float32)
    if r.numel() == 1:
        return r, r.new_zeros(()), r.new_ones(())
    return r, r.mean(), r.std()  # torch.std is unbiased (Bessel) by default


@register_advantage("grpo")
def grpo(rewards: Tensor) -> Tensor:
    """(r - group mean) / (group std + eps). [G] -> [G]."""
    r, mean, std = _baseline(rewards)
    return (r - mean) / (std + EPS)


@register_advantage("dr_grpo")
def dr_grpo(rewards: Tensor) -> Tensor:
    """r - group mean (no std division). [G] -> [G]."""
    r, mean, _ = _baseline(rewards)
    return r - mean


@register_advantage("rloo")
def rloo(rewards: Tensor) -> Tensor:
    """r_i - mean of the group's other rewards = G/(G-1) (r_i - group mean); a group of one keeps r. [G] -> [G]."""
    r, mean, _ = _baseline(rewards)
    g = r.numel()
    return r if g == 1 else (r - mean) * (g / (g - 1))


@register_advantage("reinforce_pp_group")
def reinforce_pp_group(rewards: Tensor) -> Tensor:
    """r - group mean, whitened within the group: / sqrt(unbiased group var + 1e-8); a group of one keeps r (up to
    1e-8). [G] -> [G]."""
    r, mean, std = _baseline(rewards)
    return (r - mean) * torch.rsqrt(std ** 2 + WHITEN_EPS)


@register_advantage("dapo")
def dapo(rewards: Tensor) -> Tensor:
    """DAPO's advantage is GRPO's; see the module docstring for where DAPO's other parts live. [G] -> [G]."""
    return grpo(rewards)


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
