"""The policy objective: TrainBatch -> padded tensors -> per-token log-probs -> registered loss, micro-batched.

Simplifications, and why:
- Sequences are prompt + response, right-padded into one [B,L] batch (no packing): simple and exact; each micro-batch
  is trimmed to its own longest row so a long-tailed batch does not pay the longest row's padding everywhere.
- Micro-batches are runs of the batch's trajectories sorted by length (longest first), cut where padding would cost
  more than one more forward/backward (`plan_micro_batches`): a long-tailed batch does not pad its short rows to its
  long ones. The loss is normalised by the whole batch, so how rows are grouped does not change it.
- Advantages are the trajectories' own scalars (set per group by the advantage task), broadcast over their response
  tokens; the objective computes none, so what the trajectory store records is what was trained on.
- Groups with `Group.filtered` set (e.g. DAPO's zero-variance filter) are left out of the tensors entirely; the caller
  recorded why.
- Log-probs are taken at `temperature` (the rollout's sampling temperature; the rollout engines report log-probs of
  the tempered distribution). Top-p truncation is not reproduced: with top_p < 1 the behaviour log-probs are those of
  the renormalised nucleus and the ratios are biased upwards on kept tokens (as in verl); use top_p = 1 for RL.
- Entropy is a metric only (no entropy bonus), computed without gradient.
- The reference model, when given, is a plain frozen copy of the initial policy; its KL (k3) is added to the loss with
  `cfg.kl_coef`, aggregated like the policy loss.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import Tensor

from dora_tasks.algorithms.advantages import group_advantages
from dora_tasks.algorithms.losses import LossNorm, aggregate, masked_mean, reference_kl
from dora_tasks.algorithms.registry import get_loss
from dora_tasks.core.records import TrainBatch

Backward = Callable[[Tensor, bool], None]  # (micro-batch loss, is last micro-batch) -> None


def batch_tensors(batch: TrainBatch, pad_id: int = 0, advantage: str = "grpo") -> dict[str, Tensor]:
    """Padded CPU tensors of the unfiltered trajectories of `batch`; `advantage` names the estimator only for
    trajectories that skipped the advantage task (`_token_advantages`).

    Returns input_ids long [B,L] (prompt + response, right-padded with `pad_id`), attention_mask long [B,L],
    response_mask float [B,L] (1 on response tokens the model produced: a multi-turn episode's environment tokens
    are conditioned on but left out of the loss, `Trajectory.loss_mask`), behaviour_logp float [B,L] (aligned with
    the tokens), rewards float [B], advantages float [B,L] (each trajectory's `advantage` on its response tokens, see
    `_token_advantages`), group_index long [B].
    """
    groups = [g for g in batch.groups if not g.filtered]
    trajectories = [t for g in groups for t in g.trajectories]
    group_ids = [g.group_id for g in groups for _ in g.trajectories]
    width = max((t.num_tokens for t in trajectories), default=0)
    input_ids = np.full((len(trajectories), width), pad_id, dtype=np.int64)
    attention = np.zeros((len(trajectories), width), dtype=np.int64)
    response = np.zeros((len(trajectories), width), dtype=np.float32)
    behaviour = np.zeros((len(trajectories), width), dtype=np.float32)
    for row, t in enumerate(trajectories):
        if len(t.prompt_ids) == 0:
            raise ValueError(f"trajectory {t.group_id}/{t.sample_idx} has an empty prompt; nothing conditions the "
                             "first response token")
        p, n = len(t.prompt_ids), t.num_tokens
        input_ids[row, :n] = np.concatenate([t.prompt_ids, t.response_ids])
        attention[row, :n] = 1
        response[row, p:n] = t.loss_mask  # 1 on the model's tokens; 0 on an episode's environment tokens
        behaviour[row, p:n] = t.behaviour_logprobs
    tensors = {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention),
        "response_mask": torch.from_numpy(response),
        "behaviour_logp": torch.from_numpy(behaviour),
        "rewards": torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        "group_index": torch.tensor(group_ids, dtype=torch.long),
    }
    tensors["advantages"] = _token_advantages(groups, tensors["response_mask"], advantage)
    return tensors


def _token_advantages(groups, response_mask: Tensor, estimator: str) -> Tensor:
    """Each trajectory's scalar advantage broadcast over its response tokens [B,L]: broadcasting, not computing."""
    values = np.concatenate([_group_values(g, estimator) for g in groups] or [np.zeros(0, np.float32)])
    return torch.from_numpy(values)[:, None] * response_mask


def _group_values(group, estimator: str) -> np.ndarray:
    """The group's advantages [G]. A NaN one means the trajectory skipped the advantage task (engine tests, direct
    engine use): it gets what that task would have set, from `group_advantages`, the one function that computes them."""
    given = np.array([t.advantage for t in group.trajectories], dtype=np.float32)
    missing = np.isnan(given)
    if missing.any():
        given[missing] = group_advantages(estimator, group.rewards).numpy()[missing]
    return given


def sequence_logprobs(model, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0,
                      with_entropy: bool = True) -> tuple[Tensor, Tensor | None]:
    """Per-token log p(x_t | x_<t) [B,L] (0 at t=0) and the entropy of that next-token distribution [B,L] (no grad)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    token_logp = log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    zero = token_logp.new_zeros(token_logp.shape[0], 1)
    logp = torch.cat([zero, token_logp], dim=1)
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, torch.cat([zero, entropy], dim=1)


def plan_micro_batches(lengths, max_rows: int, call_tokens: int) -> list[np.ndarray]:
    """Row indices of each micro-batch: the rows sorted by length (longest first, ties in row order), cut into
    consecutive runs of at most `max_rows` that minimise the padded tokens of the runs (rows x longest row) plus
    `call_tokens` per run, the fixed cost of one forward/backward counted in padded tokens. Exact, by dynamic
    programming over the cut points (O(rows x max_rows)). No run pads more tokens than the first of the plain
    `max_rows` slices would, so peak memory is never above theirs."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    ordered = lengths[order]
    rows = len(ordered)
    best = np.full(rows + 1, np.inf)
    best[0] = 0.0
    cut = np.zeros(rows + 1, dtype=np.int64)
    for end in range(1, rows + 1):
        starts = np.arange(max(0, end - max_rows), end)
        costs = best[starts] + ordered[starts] * (end - starts) + call_tokens
        pick = int(np.argmin(costs))
        best[end], cut[end] = costs[pick], starts[pick]
    runs, end = [], rows
    while end > 0:
        runs.append(order[cut[end]:end])
        end = int(cut[end])
    return runs[::-1]


def micro_batches(tensors: dict[str, Tensor], size: int, call_tokens: int = 0) -> list[dict[str, Tensor]]:
    """The batch cut by `plan_micro_batches` (at most `size` trajectories each), each trimmed to its longest row
    (rows are right-padded). The loss sums over micro-batches with whole-batch normalisers, so the grouping and
    order of rows do not change it."""
    lengths = tensors["attention_mask"].sum(-1).numpy()
    chunks = []
    for run in plan_micro_batches(lengths, size, call_tokens):
        index = torch.from_numpy(run)
        chunk = {k: v.index_select(0, index) for k, v in tensors.items()}
        width = int(lengths[run].max())
        chunks.append({k: (v[:, :width] if v.dim() == 2 else v) for k, v in chunk.items()})
    return chunks


def policy_objective(model, tensors: dict[str, Tensor], cfg, ref_model=None, backward: Backward | None = None,
                     device: torch.device | str | None = None,
                     temperature: float = 1.0, norm: LossNorm | None = None) -> tuple[Tensor, dict[str, float]]:
    """Loss of the whole batch, computed over micro-batches of at most `cfg.micro_batch` trajectories (planned by
    `plan_micro_batches` with `cfg.micro_batch_call_tokens`).

    Each micro-batch loss is normalised by the whole batch (`LossNorm`), so they sum to the full-batch loss. With
    `backward`, each micro-batch loss is back-propagated as soon as it is computed (gradient accumulation; only one
    micro-batch's graph is alive) and the returned loss is detached; without it, the returned loss holds every
    graph. Metrics are token-weighted means over micro-batches (maxima for `*_max`) plus `loss`. Log-probs (policy
    and reference) are taken at `temperature`, which must be the one the behaviour log-probs were sampled at.
    `norm`: other normalisers than this batch's (`UNIT_NORM`: one part of a streamed update).
    """
    loss_fn = get_loss(cfg.loss)
    norm = norm or LossNorm.of(tensors["response_mask"], cfg)
    device = device if device is not None else next(model.parameters()).device
    chunks = micro_batches(tensors, cfg.micro_batch, cfg.micro_batch_call_tokens)
    total: Tensor = torch.zeros((), device=device)
    collected: list[tuple[float, dict[str, float]]] = []
    for i, chunk in enumerate(chunks):
        chunk = {k: v.to(device) for k, v in chunk.items()}
        loss, metrics = _micro_batch_loss(model, chunk, cfg, loss_fn, norm, ref_model, temperature)
        if backward is not None:
            backward(loss, i == len(chunks) - 1)
            loss = loss.detach()
        total = total + loss
        collected.append((float(chunk["response_mask"].sum()), metrics))
    merged = merge_metrics(collected)
    merged["loss"] = float(total.detach())
    return total, merged


def _micro_batch_loss(model, chunk: dict[str, Tensor], cfg, loss_fn, norm: LossNorm, ref_model,
                      temperature: float) -> tuple[Tensor, dict[str, float]]:
    mask = chunk["response_mask"]
    logp, entropy = sequence_logprobs(model, chunk["input_ids"], chunk["attention_mask"], temperature)
    loss, metrics = loss_fn(logp, chunk["behaviour_logp"], chunk["advantages"], mask, cfg,
                            chunk.get("proximal_logp"), entropy=entropy, norm=norm)
    if ref_model is not None and cfg.kl_coef > 0:
        with torch.no_grad():
            ref_logp, _ = sequence_logprobs(ref_model, chunk["input_ids"], chunk["attention_mask"], temperature,
                                            with_entropy=False)
        kl = reference_kl(logp, ref_logp)
        loss = loss + cfg.kl_coef * aggregate(kl, mask, cfg.loss_agg, norm)
        metrics["kl"] = float(masked_mean(kl.detach(), mask))
    return loss, metrics


def merge_metrics(collected: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """(weight, metrics) of micro-batches or parts -> weighted means, maxima for `*_max`."""
    weight = sum(w for w, _ in collected)
    merged: dict[str, float] = {}
    for w, metrics in collected:
        for key, value in metrics.items():
            if key.endswith("_max"):
                merged[key] = max(merged.get(key, value), value)
            else:
                merged[key] = merged.get(key, 0.0) + value * (w / weight if weight else 0.0)
    return merged
