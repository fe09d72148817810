"""Advantage estimators (one group's rewards -> one scalar per trajectory) and policy losses against slow loop
references, the registry, the advantage task and batch_tensors."""
from __future__ import annotations

import itertools
import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_tasks.algorithms import (LossNorm, UnknownAlgorithmError, advantage_names, get_advantage, get_loss,
                                   group_advantages, group_is_degenerate, loss_names, overlong_shaping,
                                   register_advantage)
from dora_tasks.algorithms import registry
from dora_tasks.algorithms.objective import batch_tensors, micro_batches, plan_micro_batches
from dora_tasks.core.records import Group, Prompt, TrainBatch, Trajectory
from dora_tasks.core.config import ConfigError, TrainConfig

torch.set_num_threads(1)
SETTINGS = settings(max_examples=60, deadline=None)
ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_pp_group", "dapo"]
LOSSES = ["ppo_clip", "decoupled_ppo", "tis"]
AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


# ---------------------------------------------------------------- slow references (plain loops, float64)

def ref_advantages(name: str, rewards) -> list[float]:
    """One group's advantages, trajectory by trajectory (float64); a group of one has no baseline: mean 0, std 1."""
    rewards, n = list(map(float, rewards)), len(rewards)
    mean = sum(rewards) / n if n > 1 else 0.0
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1)) if n > 1 else 1.0
    out = []
    for i, r in enumerate(rewards):
        if name in ("grpo", "dapo"):
            out.append((r - mean) / (std + 1e-6))
        elif name == "dr_grpo":
            out.append(r - mean)
        elif name == "rloo":
            out.append(r - sum(rewards[j] for j in range(n) if j != i) / (n - 1) if n > 1 else r)
        elif name == "reinforce_pp_group":  # centre, then whiten the centred values (verl's masked_whiten, per group)
            centred = [x - mean for x in rewards]
            m = sum(centred) / n
            var = sum((x - m) ** 2 for x in centred) / (n - 1) if n > 1 else 0.0
            out.append((centred[i] - m) / math.sqrt(var + 1e-8) if n > 1 else r)  # nothing to whiten in one
    return out


def ref_aggregate(per_token: list[list], mask, mode: str, norm_len: int):
    """Loop version of the three aggregations over a list of lists of (torch scalar) per-token losses."""
    rows = len(per_token)
    lengths = [sum(int(m) for m in mask[i]) for i in range(rows)]
    if mode == "token_mean":
        total = sum(per_token[i][t] for i in range(rows) for t in range(len(mask[i])) if mask[i][t])
        return total / max(sum(lengths), 1)
    if mode == "seq_mean_token_mean":
        return sum(sum(per_token[i][t] for t in range(len(mask[i])) if mask[i][t]) / max(lengths[i], 1)
                   for i in range(rows)) / rows
    divisor = max(norm_len or max(lengths), 1)
    return sum(sum(per_token[i][t] for t in range(len(mask[i])) if mask[i][t]) / divisor for i in range(rows)) / rows


def ref_loss(name: str, logp: torch.Tensor, behaviour, advantages, mask, cfg, proximal=None):
    """Per-token loop: (loss value, a loss whose gradient wrt logp is the expected one, clip_fraction, approx_kl)."""
    rows, cols = logp.shape
    values, grads_src, clipped, kl3 = [], [], [], []
    for i in range(rows):
        values.append([]), grads_src.append([])
        for t in range(cols):
            lp, b, a = logp[i, t], float(behaviour[i, t]), float(advantages[i, t])
            r_behaviour = math.exp(float(lp.detach()) - b)
            if mask[i][t]:
                kl3.append(r_behaviour - 1 - math.log(r_behaviour))
            if name == "tis":
                w = min(r_behaviour, cfg.importance_cap)
                values[i].append(torch.tensor(-w * a, dtype=torch.float64))
                grads_src[i].append(-w * a * lp)
                if mask[i][t]:
                    clipped.append(float(r_behaviour > cfg.importance_cap))
                continue
            anchor = b if name == "ppo_clip" else (float(lp.detach()) if proximal is None else float(proximal[i, t]))
            weight = 1.0 if name == "ppo_clip" else min(math.exp(anchor - b), cfg.importance_cap)
            r = torch.exp(lp - anchor)
            r_clipped = torch.clamp(r, 1 - cfg.clip_low, 1 + cfg.clip_high)
            plain, capped = -a * r, -a * r_clipped
            use_clipped = float(capped.detach()) > float(plain.detach())
            loss_t = weight * (capped if use_clipped else plain)
            values[i].append(loss_t)
            grads_src[i].append(loss_t)
            if mask[i][t]:
                clipped.append(float(use_clipped))
    value = ref_aggregate(values, mask, cfg.loss_agg, cfg.loss_norm_len)
    grad_loss = ref_aggregate(grads_src, mask, cfg.loss_agg, cfg.loss_norm_len)
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return float(torch.as_tensor(value).detach()), grad_loss, mean(clipped), mean(kl3)


# ---------------------------------------------------------------- strategies

REWARDS = st.sampled_from([0.0, 1.0, 0.5, -1.0, 2.5, 0.25])


@st.composite
def group_rewards(draw):
    return draw(st.lists(REWARDS, min_size=1, max_size=10))


@st.composite
def loss_inputs(draw):
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**16))
    mask = draw(st.lists(st.lists(st.integers(0, 1), min_size=cols, max_size=cols), min_size=rows, max_size=rows))
    cfg = TrainConfig(clip_low=draw(st.sampled_from([0.1, 0.2])), clip_high=draw(st.sampled_from([0.2, 0.28, 0.5])),
                      loss_agg=draw(st.sampled_from(AGGS)), loss_norm_len=draw(st.sampled_from([0, 7])),
                      importance_cap=draw(st.sampled_from([1.0, 1.5, 3.0])))
    with_proximal = draw(st.booleans())
    return seed, rows, cols, mask, cfg, with_proximal


# ---------------------------------------------------------------- estimators

@SETTINGS
@given(group_rewards(), st.sampled_from(ESTIMATORS))
def test_estimators_match_loop_reference(rewards, name):
    given = torch.tensor(rewards, dtype=torch.float64)
    got = get_advantage(name)(given)
    assert got.shape == (len(rewards),) and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), ref_advantages(name, rewards), rtol=1e-4, atol=1e-4)
    assert given.tolist() == rewards  # pure: the input is not modified


@SETTINGS
@given(group_rewards(), st.sampled_from(ESTIMATORS), st.randoms(use_true_random=False))
def test_estimators_see_one_group_in_any_order(rewards, name, rnd):
    """One scalar per trajectory from its group's rewards alone: permuting the group permutes the advantages."""
    order = list(range(len(rewards)))
    rnd.shuffle(order)
    got = get_advantage(name)(torch.tensor(rewards))
    permuted = get_advantage(name)(torch.tensor([rewards[i] for i in order]))
    np.testing.assert_allclose(permuted.numpy(), got.numpy()[order], rtol=1e-6, atol=1e-6)


def test_estimators_signs_and_degenerate_groups():
    for name in ESTIMATORS:
        got = get_advantage(name)(torch.tensor([1.0, 0.0, 1.0, 0.0]))
        assert got[0] > 0 > got[1], name
        assert torch.all(get_advantage(name)(torch.tensor([2.0, 2.0, 2.0])) == 0), name
        with pytest.raises(ValueError, match=r"one group's rewards \[G\]"):
            get_advantage(name)(torch.zeros(2, 3))  # a padded batch is not a group
        with pytest.raises(ValueError, match="G >= 1"):
            get_advantage(name)(torch.zeros(0))


def test_group_advantages_dispatches_by_name_and_counts_failed_rewards_as_zero():
    got = group_advantages("dr_grpo", np.array([1.0, float("nan"), 0.5], np.float32))
    assert got.dtype == torch.float32 and got.tolist() == pytest.approx([0.5, -0.5, 0.0])
    with pytest.raises(UnknownAlgorithmError, match="valid names: .*grpo"):
        group_advantages("gae", [1.0])


def test_the_advantage_task_computes_each_group_alone():
    """`steps.group_advantage` calls the estimator on one group's rewards: a group's advantages do not depend on the
    other groups of the batch (REINFORCE++'s batch whitening is not silently turned into something else)."""
    from dora_tasks import steps

    for name in ESTIMATORS:
        a = _group(0, [1.0, 0.0, float("nan"), 1.0])
        b = _group(1, [5.0, -3.0])
        scored = steps.advantage([a, b], name)
        assert [t.advantage for t in scored[0].trajectories] == pytest.approx(ref_advantages(name, [1, 0, 0, 1]),
                                                                              abs=1e-4)
        assert [t.advantage for t in scored[1].trajectories] == pytest.approx(ref_advantages(name, [5, -3]),
                                                                              abs=1e-4)
        assert np.isnan(a.trajectories[2].reward) and a.trajectories[2].reward_error == "boom"  # still recorded
    degenerate = steps.group_advantage(_group(2, [1.0, 1.0]), "grpo", filter_degenerate=True)
    assert degenerate.filtered == "zero_variance"


def test_group_is_degenerate():
    assert group_is_degenerate([1.0, 1.0, 1.0])
    assert group_is_degenerate(np.zeros(4))
    assert group_is_degenerate(torch.tensor([0.5]))
    assert not group_is_degenerate([1.0, 0.0])
    assert not group_is_degenerate([1.0, float("nan")])


def test_overlong_shaping_matches_dapo_formula():
    max_len, cache = 10, 4
    lengths = list(range(13))
    expected = [0.0 if n <= 6 else ((6 - n) / cache if n <= 10 else -1.0) for n in lengths]
    np.testing.assert_allclose(overlong_shaping(np.array(lengths), max_len, cache), expected, atol=1e-6)
    as_tensor = overlong_shaping(torch.tensor(lengths), max_len, cache)
    assert isinstance(as_tensor, torch.Tensor)
    np.testing.assert_allclose(as_tensor.numpy(), expected, atol=1e-6)
    np.testing.assert_allclose(overlong_shaping([9, 10, 11], 10, 0), [0.0, 0.0, -1.0])
    with pytest.raises(ValueError, match="cache_len"):
        overlong_shaping([1], 10, 11)


# ---------------------------------------------------------------- losses

@SETTINGS
@given(loss_inputs(), st.sampled_from(LOSSES))
def test_losses_match_loop_reference(inputs, name):
    seed, rows, cols, mask, cfg, with_proximal = inputs
    gen = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 3
    logp_init = behaviour + torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 0.4
    proximal = (behaviour + torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 0.3
                if with_proximal and name == "decoupled_ppo" else None)
    advantages = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    mask_t = torch.tensor(mask, dtype=torch.float64)

    logp = logp_init.clone().requires_grad_(True)
    loss, metrics = get_loss(name)(logp, behaviour, advantages, mask_t, cfg, proximal)
    loss.backward()

    ref_logp = logp_init.clone().requires_grad_(True)
    ref_value, ref_grad_loss, ref_clip, ref_kl = ref_loss(name, ref_logp, behaviour, advantages, mask, cfg, proximal)
    if isinstance(ref_grad_loss, torch.Tensor) and ref_grad_loss.requires_grad:
        ref_grad_loss.backward()
    ref_grad = ref_logp.grad if ref_logp.grad is not None else torch.zeros_like(ref_logp)

    assert loss.dim() == 0
    assert float(loss.detach()) == pytest.approx(ref_value, rel=1e-6, abs=1e-9)
    torch.testing.assert_close(logp.grad, ref_grad, rtol=1e-6, atol=1e-9)
    assert metrics["clip_fraction"] == pytest.approx(ref_clip, abs=1e-9)
    assert metrics["approx_kl"] == pytest.approx(ref_kl, rel=1e-6, abs=1e-9)
    assert all(isinstance(v, float) for v in metrics.values())


@SETTINGS
@given(loss_inputs(), st.sampled_from(LOSSES), st.integers(1, 3))
def test_micro_batch_losses_sum_to_full_batch_loss(inputs, name, size):
    seed, rows, cols, mask, cfg, _ = inputs
    gen = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(rows, cols, generator=gen) * 3
    logp = behaviour + torch.randn(rows, cols, generator=gen) * 0.4
    advantages = torch.randn(rows, cols, generator=gen)
    mask_t = torch.tensor(mask, dtype=torch.float32)
    full, _ = get_loss(name)(logp, behaviour, advantages, mask_t, cfg)
    norm = LossNorm.of(mask_t, cfg)
    parts = [get_loss(name)(logp[s:s + size], behaviour[s:s + size], advantages[s:s + size], mask_t[s:s + size],
                            cfg, norm=norm)[0] for s in range(0, rows, size)]
    assert float(sum(parts)) == pytest.approx(float(full), rel=1e-5, abs=1e-6)


def test_losses_report_ratio_and_entropy_metrics():
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.1]]))
    behaviour = torch.log(torch.tensor([[0.25, 0.2, 0.3]]))
    entropy = torch.tensor([[1.0, 2.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    for name in LOSSES:
        loss, metrics = get_loss(name)(logp, behaviour, torch.ones(1, 3), mask, TrainConfig(), entropy=entropy)
        assert metrics["ratio_max"] == pytest.approx(2.0)
        assert metrics["ratio_mean"] == pytest.approx(1.5)
        assert metrics["entropy"] == pytest.approx(1.5)
        assert torch.isfinite(loss)


def test_clip_higher_is_asymmetric():
    behaviour = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.25, 0.75]]))  # ratios 1.25 and 0.75
    mask = torch.ones(1, 2)
    symmetric = TrainConfig(clip_low=0.2, clip_high=0.2)
    higher = TrainConfig(clip_low=0.2, clip_high=0.3)
    pos = torch.ones(1, 2)
    assert get_loss("ppo_clip")(logp, behaviour, pos, mask, symmetric)[1]["clip_fraction"] == pytest.approx(0.5)
    assert get_loss("ppo_clip")(logp, behaviour, pos, mask, higher)[1]["clip_fraction"] == pytest.approx(0.0)


# ---------------------------------------------------------------- registry and config

def test_registry_lists_valid_names_on_unknown():
    assert set(ESTIMATORS) <= set(advantage_names())
    assert set(LOSSES) <= set(loss_names())
    with pytest.raises(UnknownAlgorithmError) as err:
        get_advantage("gae")
    assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)
    assert all(name in str(err.value) for name in ESTIMATORS) and "'gae'" in str(err.value)
    with pytest.raises(ValueError, match="ppo_clip.*tis|tis.*ppo_clip"):
        get_loss("sft")


def test_register_custom_and_duplicate_names():
    @register_advantage("test_only_constant")
    def constant(rewards):
        return torch.ones_like(rewards, dtype=torch.float32)

    try:
        assert get_advantage("test_only_constant") is constant
        assert group_advantages("test_only_constant", [3.0, 4.0]).tolist() == [1.0, 1.0]
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("grpo")(constant)
    finally:
        registry._ADVANTAGES.pop("test_only_constant")


def test_train_config_validates_new_fields():
    TrainConfig().validate()
    with pytest.raises(ConfigError, match="train.loss_agg"):
        TrainConfig(loss_agg="sum").validate()
    with pytest.raises(ConfigError, match="train.importance_cap"):
        TrainConfig(importance_cap=0.5).validate()
    with pytest.raises(ConfigError, match="train.loss_norm_len"):
        TrainConfig(loss_norm_len=-1).validate()


# ---------------------------------------------------------------- batch_tensors

def _traj(group: int, idx: int, prompt, response, reward, advantage=float("nan")) -> Trajectory:
    n = len(response)
    return Trajectory(group_id=group, sample_idx=idx, prompt_ids=np.array(prompt, np.int32),
                      response_ids=np.array(response, np.int32), versions=np.zeros(n, np.int32),
                      behaviour_logprobs=-np.arange(1, n + 1, dtype=np.float32), finished=True, reward=reward,
                      advantage=advantage)


def _group(group: int, rewards) -> Group:
    trajectories = [_traj(group, i, [1, 2], [3 + i] * (i + 1), r) for i, r in enumerate(rewards)]
    for t in trajectories:
        t.reward_error = "boom" if np.isnan(t.reward) else ""
    return Group(group_id=group, prompt=Prompt(group, "", ""), version=0, trajectories=trajectories)


def _batch(groups_spec) -> TrainBatch:
    groups = [Group(group_id=g, prompt=Prompt(g, "", ""), version=0, trajectories=trajs, filtered=filtered)
              for g, trajs, filtered in groups_spec]
    return TrainBatch(update=1, groups=groups, max_staleness=1)


def test_batch_tensors_layout_and_alignment():
    batch = _batch([(3, [_traj(3, 0, [5, 6], [7, 8, 9], 1.0, 0.5), _traj(3, 1, [5, 6], [10], 0.0, -0.5)], ""),
                    (4, [_traj(4, 0, [1, 2, 3, 4], [11, 12], 1.0)], "dapo_zero_var")])
    t = batch_tensors(batch, pad_id=63)
    assert t["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 6, 10, 63, 63]]
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert t["response_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]
    assert t["behaviour_logp"].tolist() == [[0, 0, -1, -2, -3], [0, 0, -1, 0, 0]]
    assert t["advantages"].tolist() == [[0, 0, 0.5, 0.5, 0.5], [0, 0, -0.5, 0, 0]]
    assert t["group_index"].tolist() == [3, 3] and t["rewards"].tolist() == [1.0, 0.0]


def test_batch_tensors_estimates_missing_advantages_with_the_named_estimator():
    batch = _batch([(0, [_traj(0, 0, [1], [2, 3], 1.0), _traj(0, 1, [1], [4], 0.0)], ""),
                    (1, [_traj(1, 0, [1], [2], 2.0, advantage=7.0)], "")])
    t = batch_tensors(batch, advantage="dr_grpo")
    assert t["advantages"].tolist() == [[0, 0.5, 0.5], [0, -0.5, 0], [0, 7.0, 0]]
    assert np.isnan(batch.groups[0].trajectories[0].advantage)  # the batch is not modified


@pytest.mark.parametrize("name", ESTIMATORS)
def test_batch_tensors_fill_missing_advantages_exactly_as_the_advantage_task_sets_them(name):
    """One place computes advantages: a trajectory that skipped the advantage task gets the same value from
    `batch_tensors` as the task would have given it, failed rewards included; the trainer only broadcasts."""
    from dora_tasks import steps

    spec = [(0, [1.0, 0.0, float("nan"), 1.0]), (1, [2.5, -1.0]), (2, [0.5])]
    skipped = TrainBatch(1, [_group(g, r) for g, r in spec], 1)
    scored = TrainBatch(1, steps.advantage([_group(g, r) for g, r in spec], name), 1)
    filled, given = batch_tensors(skipped, advantage=name), batch_tensors(scored, advantage="gae")  # never consulted
    torch.testing.assert_close(filled["advantages"], given["advantages"], rtol=0, atol=0)
    assert torch.all(filled["advantages"][filled["response_mask"] == 0] == 0)


def test_batch_tensors_rejects_empty_prompt_and_handles_empty_batch():
    with pytest.raises(ValueError, match="empty prompt"):
        batch_tensors(_batch([(0, [_traj(0, 0, [], [2], 1.0)], "")]))
    t = batch_tensors(_batch([(0, [_traj(0, 0, [1], [2], 1.0)], "filtered")]))
    assert t["input_ids"].shape == (0, 0) and t["response_mask"].sum() == 0


def test_micro_batches_trim_padding():
    batch = _batch([(0, [_traj(0, 0, [1], [2, 3, 4, 5], 1.0), _traj(0, 1, [1], [2], 0.0)], "")])
    chunks = micro_batches(batch_tensors(batch), 1)
    assert [c["input_ids"].shape for c in chunks] == [(1, 5), (1, 2)]
    chunks = micro_batches(batch_tensors(batch), 2, call_tokens=1)  # padding 3 tokens costs more than a call
    assert [c["input_ids"].shape for c in chunks] == [(1, 5), (1, 2)]
    chunks = micro_batches(batch_tensors(batch), 2, call_tokens=5)
    assert [c["input_ids"].shape for c in chunks] == [(2, 5)]


def _plan_cost(lengths, runs, call_tokens):
    return sum(int(max(lengths[i] for i in run)) * len(run) + call_tokens for run in runs)


@SETTINGS
@given(st.lists(st.integers(1, 60), min_size=1, max_size=8), st.integers(1, 4), st.integers(0, 100))
def test_plan_micro_batches_is_the_cheapest_cut_of_the_sorted_rows(lengths, max_rows, call_tokens):
    runs = plan_micro_batches(lengths, max_rows, call_tokens)
    flat = np.concatenate(runs)
    assert sorted(flat.tolist()) == list(range(len(lengths)))  # every row once
    assert [lengths[i] for i in flat] == sorted(lengths, reverse=True)  # longest first, runs consecutive
    assert all(1 <= len(run) <= max_rows for run in runs)
    ordered = sorted(lengths, reverse=True)
    best = min(  # brute force over every set of cut points of the sorted rows
        sum(ordered[a] * (b - a) + call_tokens for a, b in zip((0, *cuts), (*cuts, len(ordered))))
        for k in range(len(ordered)) for cuts in itertools.combinations(range(1, len(ordered)), k)
        if all(b - a <= max_rows for a, b in zip((0, *cuts), (*cuts, len(ordered)))))
    assert _plan_cost(lengths, runs, call_tokens) == best
    first_slice = ordered[0] * min(max_rows, len(ordered))
    assert all(max(lengths[i] for i in run) * len(run) <= first_slice for run in runs)


def test_plan_micro_batches_separates_a_long_tail_only_when_padding_costs_more_than_a_call():
    lengths = [100, 10, 10, 10, 10, 10]
    assert [len(r) for r in plan_micro_batches(lengths, 32, 50)] == [1, 5]  # 100 + 50 + 50 + 50 < 600 + 50
    assert [len(r) for r in plan_micro_batches(lengths, 32, 1000)] == [6]
    assert _plan_cost(lengths, plan_micro_batches(lengths, 2, 0), 0) == 100 + 5 * 10
    with pytest.raises(ValueError, match="max_rows"):
        plan_micro_batches(lengths, 0, 10)


def test_micro_batch_call_tokens_must_not_be_negative():
    with pytest.raises(ConfigError, match="train.micro_batch_call_tokens"):
        TrainConfig(micro_batch_call_tokens=-1).validate()
