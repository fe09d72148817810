"""Policy losses: pure tensor functions, registered by name.

Shapes: `logp`, `behaviour_logp`, `advantages`, `mask`, `proximal_logp`, `entropy` are all [B,T] and aligned (position t
holds the log-prob of token t); `mask` is 1 on response tokens. Each loss returns `(loss scalar, metrics)` where the
metrics are plain floats: `clip_fraction`, `approx_kl` (k3 estimate of KL(behaviour || current) on the sampled tokens),
`ratio_mean`, `ratio_max` (current / behaviour), and `entropy` when given.

Aggregation (`cfg.loss_agg`) and its normalisers (`LossNorm`): a micro-batch's loss is divided by the normalisers of the
WHOLE batch, so the micro-batch losses of one update sum exactly to the full-batch loss (correct gradient accumulation).
Called without `norm`, the normalisers come from the given mask (the loss of that batch alone).
A streamed update, whose batch is whole only at its last part, takes each part with `UNIT_NORM` and divides the summed
gradient by `LossNorm.divisor` of the whole batch.
- `token_mean`: sum over all response tokens / number of response tokens (DAPO's token-level loss).
- `seq_mean_token_mean`: mean over trajectories of each trajectory's token mean (the original GRPO).
- `seq_mean_token_sum_norm`: mean over trajectories of token sum / a constant (Dr. GRPO): `cfg.loss_norm_len`, or the
  longest response of the batch when 0 (Dr. GRPO uses the generation budget; set loss_norm_len to it to match).

How these differ from their papers, and why:
- `ppo_clip` (PPO / GRPO / DAPO): the ratio is taken against each trajectory's OWN behaviour log-probs (those of the
  version that generated each token), which is what makes multi-version (stale) batches correct. Asymmetric clip
  bounds [1-clip_low, 1+clip_high] give DAPO's clip-higher. No dual-clip and no value loss (outcome rewards only).
- `decoupled_ppo` (AReaL, Fu et al. 2025): loss = w * max(-A r, -A clip(r)), with w = pi_prox / pi_behaviour (detached)
  and r = pi_theta / pi_prox. AReaL recomputes pi_prox with the weights before the update; our trainers take ONE
  optimizer step per batch, so the proximal policy IS the current policy at the start of the step and, when
  `proximal_logp` is not given, `logp.detach()` is used (r = 1 in value, the clip never binds, the gradient is
  w A grad log pi). w is truncated at `cfg.importance_cap` (AReaL instead zeroes tokens above its cap: truncation keeps
  their signal and shares one knob with `tis`).
- `tis` (truncated importance sampling, IMPALA-style policy gradient): REINFORCE with per-token weights
  min(pi/mu, C), C = `cfg.importance_cap`, detached. Written as the surrogate -w A exp(logp - sg(logp)) whose value is
  -w A (comparable with ppo_clip's) and whose gradient is -w A grad log pi. No trust region.
- KL to a reference is not a loss here; `reference_kl` gives the per-token k3 term the objective adds (kl_coef > 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from dora_tasks.algorithms.registry import register_loss

LOG_RATIO_LIMIT = 20.0  # clamp log-ratios before exp (verl does the same) so one wild token cannot overflow


@dataclass(frozen=True)
class LossNorm:
    """Normalisers of the whole batch, so that micro-batch losses add up to the full-batch loss."""

    tokens: float  # response tokens of the batch (token_mean)
    sequences: float  # trajectories of the batch (seq_mean_*)
    seq_len: float  # per-trajectory divisor of seq_mean_token_sum_norm

    @classmethod
    def of(cls, mask: Tensor, cfg) -> "LossNorm":
        """Normalisers of the batch whose response mask [B,T] is `mask`."""
        return cls.of_lengths(mask.sum(-1).tolist(), cfg)

    @classmethod
    def of_lengths(cls, lengths: Sequence[float], cfg) -> "LossNorm":
        """Normalisers of a batch whose trajectories have `lengths` response tokens each."""
        return cls(tokens=max(float(sum(lengths)), 1.0), sequences=max(float(len(lengths)), 1.0),
                   seq_len=max(float(cfg.loss_norm_len) or float(max(lengths, default=0.0)), 1.0))

    def divisor(self, mode: str) -> float:
        """What `aggregate` divides by in `mode`: aggregate(.., norm) == aggregate(.., UNIT_NORM) / norm.divisor(mode),
        so gradients taken with `UNIT_NORM` become the batch's by one division (a streamed update's parts)."""
        divisors = {"token_mean": self.tokens, "seq_mean_token_mean": self.sequences,
                    "seq_mean_token_sum_norm": self.seq_len * self.sequences}
        if mode not in divisors:
            raise ValueError(f"unknown loss_agg {mode!r}; valid: {', '.join(divisors)}")
        return divisors[mode]


UNIT_NORM = LossNorm(tokens=1.0, sequences=1.0, seq_len=1.0)  # sums, to be divided once the whole batch is known


def aggregate(per_token: Tensor, mask: Tensor, mode: str, norm: LossNorm) -> Tensor:
    """Reduce a [B,T] per-token loss to a scalar with `mode` (see the module docstring) and the batch normalisers."""
    masked = per_token * mask
    if mode == "token_mean":
        return masked.sum() / norm.tokens
    if mode == "seq_mean_token_mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / norm.sequences
    if mode == "seq_mean_token_sum_norm":
        return masked.sum() / norm.seq_len / norm.sequences
    raise ValueError(f"unknown loss_agg {mode!r}; valid: token_mean, seq_mean_token_mean, seq_mean_token_sum_norm")


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_max(x: Tensor, mask: Tensor) -> float:
    return float(x[mask > 0].max()) if bool((mask > 0).any()) else 0.0


def log_ratio(logp: Tensor, other_logp: Tensor) -> Tensor:
    """log(pi / pi_other), clamped to +-LOG_RATIO_LIMIT."""
    return (logp - other_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def reference_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1 >= 0. [B,T] -> [B,T]."""
    delta = log_ratio(ref_logp, logp)
    return torch.exp(delta) - delta - 1


def _common_metrics(logp: Tensor, behaviour_logp: Tensor, mask: Tensor, entropy: Tensor | None) -> dict[str, float]:
    with torch.no_grad():
        lr = log_ratio(logp.detach(), behaviour_logp)
        ratio = torch.exp(lr)
        metrics = {
            "approx_kl": float(masked_mean(ratio - 1 - lr, mask)),  # k3 of KL(behaviour || current)
            "ratio_mean": float(masked_mean(ratio, mask)),
            "ratio_max": masked_max(ratio, mask),
        }
        if entropy is not None:
            metrics["entropy"] = float(masked_mean(entropy, mask))
    return metrics


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, cfg) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic per-token loss max(-A r, -A clip(r)) and where the clip binds, both [B,T]."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).to(ratio.dtype)


@register_loss("ppo_clip")
def ppo_clip(logp: Tensor, behaviour_logp: Tensor, advantages: Tensor, mask: Tensor, cfg,
             proximal_logp: Tensor | None = None, *, entropy: Tensor | None = None,
             norm: LossNorm | None = None) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate with the ratio against the behaviour policy. `proximal_logp` is ignored."""
    mask = mask.to(logp.dtype)
    norm = norm or LossNorm.of(mask, cfg)
    per_token, clipped = _clipped_surrogate(torch.exp(log_ratio(logp, behaviour_logp)), advantages, cfg)
    loss = aggregate(per_token, mask, cfg.loss_agg, norm)
    metrics = _common_metrics(logp, behaviour_logp, mask, entropy)
    metrics["clip_fraction"] = float(masked_mean(clipped, mask))
    return loss, metrics


@register_loss("decoupled_ppo")
def decoupled_ppo(logp: Tensor, behaviour_logp: Tensor, advantages: Tensor, mask: Tensor, cfg,
                  proximal_logp: Tensor | None = None, *, entropy: Tensor | None = None,
                  norm: LossNorm | None = None) -> tuple[Tensor, dict[str, float]]:
    """AReaL's decoupled objective: clip against the proximal policy, reweight behaviour -> proximal."""
    mask = mask.to(logp.dtype)
    norm = norm or LossNorm.of(mask, cfg)
    proximal = logp.detach() if proximal_logp is None else proximal_logp.detach()
    raw_weight = torch.exp(log_ratio(proximal, behaviour_logp))
    behaviour_weight = raw_weight.clamp(max=cfg.importance_cap)
    per_token, clipped = _clipped_surrogate(torch.exp(log_ratio(logp, proximal)), advantages, cfg)
    loss = aggregate(behaviour_weight * per_token, mask, cfg.loss_agg, norm)
    metrics = _common_metrics(logp, behaviour_logp, mask, entropy)
    metrics["clip_fraction"] = float(masked_mean(clipped, mask))
    metrics["behaviour_weight_mean"] = float(masked_mean(behaviour_weight, mask))
    metrics["behaviour_capped_fraction"] = float(masked_mean((raw_weight > cfg.importance_cap).to(mask.dtype), mask))
    return loss, metrics


@register_loss("tis")
def tis(logp: Tensor, behaviour_logp: Tensor, advantages: Tensor, mask: Tensor, cfg,
        proximal_logp: Tensor | None = None, *, entropy: Tensor | None = None,
        norm: LossNorm | None = None) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE with truncated importance weights min(pi/mu, C). `proximal_logp` is ignored."""
    mask = mask.to(logp.dtype)
    norm = norm or LossNorm.of(mask, cfg)
    ratio = torch.exp(log_ratio(logp.detach(), behaviour_logp))
    weight = ratio.clamp(max=cfg.importance_cap)
    per_token = -weight * advantages * torch.exp(logp - logp.detach())
    loss = aggregate(per_token, mask, cfg.loss_agg, norm)
    metrics = _common_metrics(logp, behaviour_logp, mask, entropy)
    metrics["clip_fraction"] = float(masked_mean((ratio > cfg.importance_cap).to(mask.dtype), mask))
    return loss, metrics
