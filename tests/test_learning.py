"""Learning plumbing: the trainer sees exactly the policy the rollout sampled from, and every registered algorithm
trains through the config.

What made RL lower held-out accuracy (0.625 -> 0.25 in 5 updates at train.lr=1e-3) was not a plumbing bug: these
tests pin that the behaviour log-probs, the trainer's recompute (left-padded generation against right-padded
training), the published weights and the sign of the loss all agree. It was the step size: Adam at 1e-3 moves every
weight of a 0.1-0.3M-parameter policy by about 1e-3 per update on a batch with a handful of informative groups, and
the policy collapses to "first token, then eos" (the answer of the one-digit counts, which are the only groups it
always gets rewarded on). See pipelines/config.py (TrainConfig.lr).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dora_tasks import steps
from dora_tasks.algorithms import advantage_names, loss_names
from dora_tasks.algorithms.objective import batch_tensors, sequence_logprobs
from dora_tasks.engines.hf_rollout import HFRolloutEngine
from dora_tasks.engines.torch_trainer import TorchTrainEngine
from dora_tasks.model import CharTokenizer, build_model, save_policy
from dora_tasks.records import Group, Prompt, TrainBatch, Trajectory
from dora_tasks.workloads import countdown
from pipelines.config import ConfigError, ModelConfig, RolloutConfig, TrainConfig, load_config

TOK = CharTokenizer()
COUNTS = (3, 17, 42, 150, 1009)  # prompts of 4 different lengths: left padding differs from row to row


def countdown_prompt(i: int, count: int) -> Prompt:
    text = countdown.prompt_text(count, 10)
    return Prompt(i, text, countdown.answer_text(count, 10), (TOK.bos_id, *TOK.encode(text)))


PROMPTS = [countdown_prompt(i, c) for i, c in enumerate(COUNTS)]


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> str:
    model = build_model(ModelConfig(hidden_size=32, num_layers=2, num_heads=2), TOK.vocab_size, seed=0)
    return save_policy(model, TOK, str(tmp_path_factory.mktemp("policy")))


def rollout_groups(engine: HFRolloutEngine, version: int, group_size: int = 4, seed: int = 0) -> list[Group]:
    """What the rollout and reward steps produce: one group per prompt, generated in one left-padded batch."""
    groups = []
    for p, gens in zip(PROMPTS, engine.generate([p.token_ids for p in PROMPTS], group_size, seed)):
        trajectories = [Trajectory(p.prompt_id, i, np.asarray(p.token_ids, np.int32), g.token_ids, g.versions,
                                   g.logprobs, g.finished) for i, g in enumerate(gens)]
        for i, t in enumerate(trajectories):
            t.reward = float(i % 2)  # a mixed group, so every estimator gives non-zero advantages
        groups.append(Group(p.prompt_id, p, version, trajectories=trajectories))
    return groups


def max_behaviour_gap(trainer: TorchTrainEngine, groups: list[Group]) -> tuple[float, float]:
    """(max |trainer log-prob - behaviour log-prob|, mean ratio) over every response token of `groups`."""
    tensors = batch_tensors(TrainBatch(trainer.version, groups, 0))
    with torch.no_grad():
        logp, _ = sequence_logprobs(trainer.model, tensors["input_ids"], tensors["attention_mask"],
                                    trainer.temperature, with_entropy=False)
    mask = tensors["response_mask"] > 0
    gap = (logp - tensors["behaviour_logp"])[mask]
    return float(gap.abs().max()), float(gap.exp().mean())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_recomputes_the_behaviour_logprobs_before_and_after_an_update(policy, tmp_path, temperature):
    """Staleness 0 means ratio 1: at version 0 and, after one update published and loaded by the rollout engine,
    at version 1, the trainer's log-probs of the consumed tokens equal the ones the rollout recorded."""
    cfg = TrainConfig(lr=1e-2)
    engine = HFRolloutEngine(policy, RolloutConfig(max_new_tokens=24, temperature=temperature))
    trainer = TorchTrainEngine(policy, cfg, temperature=temperature, device="cpu")
    groups = rollout_groups(engine, 0)
    lengths = {len(t.response_ids) for g in groups for t in g.trajectories}
    assert len(lengths) > 1 and len({len(p.token_ids) for p in PROMPTS}) > 1  # both paddings are exercised
    gap, ratio = max_behaviour_gap(trainer, groups)
    assert gap < 1e-4 and ratio == pytest.approx(1.0, abs=1e-5)

    groups = [steps.advantage(g, cfg.advantage) for g in groups]
    metrics = trainer.train_step(TrainBatch(0, groups, 0))
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and metrics["grad_norm"] > 0
    trainer.save_weights(str(tmp_path / "v1"))
    engine.load_version(1, str(tmp_path / "v1"))
    assert max_behaviour_gap(trainer, groups)[0] > 1e-3  # the update changed the policy ...
    fresh = rollout_groups(engine, 1, seed=1)
    gap, ratio = max_behaviour_gap(trainer, fresh)  # ... and the rollout serves exactly the trainer's version 1
    assert gap < 1e-4 and ratio == pytest.approx(1.0, abs=1e-5)


def test_a_positive_advantage_raises_the_rewarded_response_and_lowers_the_others(policy):
    """The sign of the whole path (advantage step -> loss -> optimizer): rewarded responses become likelier."""
    trainer = TorchTrainEngine(policy, TrainConfig(lr=3e-3), device="cpu")
    groups = [steps.advantage(g, "grpo") for g in rollout_groups(HFRolloutEngine(policy, RolloutConfig(
        max_new_tokens=24)), 0)]

    def response_logp() -> np.ndarray:
        tensors = batch_tensors(TrainBatch(0, groups, 0))
        with torch.no_grad():
            logp, _ = sequence_logprobs(trainer.model, tensors["input_ids"], tensors["attention_mask"],
                                        with_entropy=False)
        return (logp * tensors["response_mask"]).sum(-1).numpy()

    before = response_logp()
    for update in range(3):
        trainer.train_step(TrainBatch(update, groups, 0))
    change = response_logp() - before
    rewarded = np.array([t.reward == 1.0 for g in groups for t in g.trajectories])
    assert change[rewarded].mean() > 0 > change[~rewarded].mean()


# ---- every registered algorithm, chosen by name through the config --------------------------------------------
@pytest.mark.parametrize("advantage,loss", list(itertools.product(
    ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "dapo"], ["ppo_clip", "decoupled_ppo", "tis"])))
def test_registered_algorithms_run_through_the_advantage_and_update_steps(policy, advantage, loss):
    cfg = load_config(None, [f"train.advantage={advantage}", f"train.loss={loss}", "train.lr=1e-2"])
    groups = rollout_groups(HFRolloutEngine(policy, RolloutConfig(max_new_tokens=12)), 0, seed=2)
    groups = [steps.advantage(g, cfg.train.advantage, cfg.train.filter_degenerate) for g in groups]
    advantages = np.array([t.advantage for g in groups for t in g.trajectories])
    assert np.isfinite(advantages).all() and np.abs(advantages).max() > 0
    trainer = TorchTrainEngine(policy, cfg.train, device="cpu")
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_step(TrainBatch(0, groups, 0))
    assert trainer.version == 1 and all(np.isfinite(v) for v in metrics.values()), metrics
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and metrics["grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_every_registered_name_is_accepted_and_an_unknown_one_is_refused_at_load_with_the_valid_names():
    for name in advantage_names():
        load_config(None, [f"train.advantage={name}"])
    for name in loss_names():
        load_config(None, [f"train.loss={name}"])
    with pytest.raises(ConfigError, match="train.advantage") as err:
        load_config(None, ["train.advantage=gae"])
    assert "'gae'" in str(err.value) and all(n in str(err.value) for n in advantage_names())
    with pytest.raises(ConfigError, match="train.loss") as err:
        load_config(None, ["train.loss=sft"])
    assert all(n in str(err.value) for n in loss_names())


# ---- reward rises over a short real pipeline run ----------------------------------------------------------------
WARM_START = [  # counts 1..30, a 128-wide policy warm-started to be partly right (sampled accuracy ~0.2)
    "task.max_count=30", "rollout.max_new_tokens=16", "model.hidden_size=128", "model.warmstart_steps=50",
    "model.warmstart_batch=16", "task.num_prompts=4096",
]
LEARNING_RUN = [
    # 64 prompts = 8 updates of 8 groups: the first and the last WINDOW updates train on the same prompts, so the
    # comparison is not swamped by which prompts (the short ones are easy) a batch happened to draw
    "task.num_prompts=64", "rollout.group_size=8", "dora.train_batch_size=8", "dora.rollout_batch_size=8",
    "dora.max_staleness=0", "dora.num_updates=32", "task.eval_prompts=16",
]
WINDOW = 8  # updates averaged at each end: one pass over the prompt pool
MARGIN = 0.1  # measured rises (3 seeds) in the module docstring
