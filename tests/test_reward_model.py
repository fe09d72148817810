"""Reward models on their own workers: the `reward` config section, the batcher that merges concurrent scoring tasks
into one forward pass, classifier and judge scores, the combine rules, and a run whose reward-model scoring ran on
the REWARD worker (read back from the store and from the scored groups) with a clean audit."""
from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest
import torch

from dora_tasks.core.config import ConfigError, ModelConfig, config_from_dict
from dora_tasks.core.config_reward import RewardConfig
from dora_tasks.core.records import Group, Prompt, Trajectory
from dora_tasks.model import CharTokenizer, build_model, save_policy
from dora_tasks.workloads.reward_batcher import ForwardBatcher, Scored
from dora_tasks.workloads.reward_model import apply_scores, combine, load_reward_model
from dora_tasks.workloads.reward_model_training import agreement, examples, train_reward_model


@pytest.fixture(scope="session")
def classifier_folder(tmp_path_factory):
    """The project's small countdown classifier, trained for a few seconds (1 layer, 32 wide)."""
    folder = str(tmp_path_factory.mktemp("reward-classifier"))
    train_reward_model(folder, "classifier", steps=120, batch=16, hidden=32, layers=1)
    return folder


@pytest.fixture(scope="session")
def judge_folder(tmp_path_factory):
    """An untrained tiny causal LM with the character tokenizer: a judge whose scores can be checked by hand."""
    folder = str(tmp_path_factory.mktemp("reward-judge"))
    tokenizer = CharTokenizer()
    save_policy(build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2), tokenizer.vocab_size, seed=3),
                tokenizer, folder)
    return folder


# ---- configuration -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reward, key", [
    ({"kind": "reranker"}, "reward.kind"),
    ({"combine": "max"}, "reward.combine"),
    ({"weight": 0}, "reward.weight"),
    ({"batch_size": 0}, "reward.batch_size"),
    ({"max_length": 2}, "reward.max_length"),
    ({"template": "{prompt} {reply}"}, "reward.template"),
    ({"template": "{prompt} only"}, "reward.template"),
    ({"template": "{response"}, "reward.template"),
    ({"kind": "judge", "judge_yes": " , "}, "reward.judge_yes"),
    ({"model": "/no/such/folder"}, "reward.model"),
    ({"model": "s3://bucket/rm"}, "reward.model"),
])
def test_reward_config_errors_name_the_key(reward, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict({"reward": reward})


def test_a_model_folder_of_the_other_kind_is_refused_with_the_kind_to_set(classifier_folder, judge_folder):
    with pytest.raises(ConfigError, match="reward.kind=classifier"):
        config_from_dict({"reward": {"model": classifier_folder, "kind": "judge"}})
    with pytest.raises(ConfigError, match="reward.kind=judge"):
        config_from_dict({"reward": {"model": judge_folder, "kind": "classifier"}})
    with pytest.raises(ConfigError, match="reward.positive_label: 'GOOD' is not a label .*wrong, right"):
        config_from_dict({"reward": {"model": classifier_folder, "positive_label": "GOOD"}})
    cfg = config_from_dict({"reward": {"model": judge_folder, "kind": "judge", "combine": "gate"}})
    assert cfg.reward.scoring_template.endswith("correct? ")


# ---- the batcher -------------------------------------------------------------------------------------------------
def _score_in_threads(batcher, calls):
    results = [None] * len(calls)

    def run(i):
        results[i] = batcher.score(calls[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_the_batcher_merges_concurrent_calls_into_one_forward():
    seen = []

    def forward(items):
        seen.append(list(items))
        return [10.0 * x for x in items]

    batcher = ForwardBatcher(forward, batch_size=6, window_s=30.0)  # the batch fills long before the window ends
    try:
        calls = [[1, 2], [3, 4], [5, 6]]
        results = _score_in_threads(batcher, calls)
    finally:
        batcher.close()
    assert len(seen) == 1 and sorted(seen[0]) == [1, 2, 3, 4, 5, 6]  # three calls, one forward
    for call, result in zip(calls, results):
        assert result.scores.tolist() == [10.0 * x for x in call]  # each caller gets its own scores, in order
        assert [b.size for b in result.batches] == [6] and result.batches[0].calls == 3 and result.shares == [2]
    assert sum(r.seconds for r in results) == pytest.approx(batcher.history[0].seconds)


def test_the_batcher_splits_a_large_call_and_fails_only_the_callers_of_a_failing_forward():
    def forward(items):
        if -1 in items:
            raise ValueError("bad text")
        return [float(x) for x in items]

    batcher = ForwardBatcher(forward, batch_size=4, window_s=0.0)
    try:
        big = batcher.score(list(range(10)))
        with pytest.raises(ValueError, match="bad text"):
            batcher.score([1, -1])
        after = batcher.score([7])
    finally:
        batcher.close()
    assert big.scores.tolist() == list(range(10)) and [b.size for b in big.batches] == [4, 4, 2]
    assert after.scores.tolist() == [7.0]
    with pytest.raises(RuntimeError, match="closed"):
        batcher.score([1])


# ---- scores ------------------------------------------------------------------------------------------------------
def test_the_trained_classifier_scores_right_answers_above_wrong_ones(classifier_folder):
    model = load_reward_model(RewardConfig(model=classifier_folder))
    data = examples(16, seed=5, max_count=200, template=RewardConfig().scoring_template)
    scores = model.score([e.text for e in data])
    assert scores.shape == (len(data),) and scores.dtype == np.float32
    assert ((scores >= 0) & (scores <= 1)).all()
    measured = agreement(classifier_folder, n_prompts=64, seed=7)
    assert measured["auc"] > 0.7 and measured["right_mean"] > measured["wrong_mean"] + 0.2, measured


def test_judge_score_is_the_yes_share_of_the_next_token(judge_folder):
    cfg = RewardConfig(model=judge_folder, kind="judge", judge_yes="yes,Yes", judge_no="no")
    judge = load_reward_model(cfg)
    texts = ["count 3 step 10: 3\nIs this answer correct? ", "count 25 step 10: 25 15 5 0\nIs this answer correct? "]
    scores = judge.score(texts)
    assert scores.shape == (2,)
    tok = CharTokenizer()
    for text, score in zip(texts, scores):  # one text at a time, no padding: the reference
        with torch.no_grad():
            probs = torch.softmax(judge.model(torch.tensor([tok.prompt_ids(text)])).logits[0, -1], -1)
        yes = probs[tok.encode("y")[0]] + probs[tok.encode("Y")[0]]
        assert score == pytest.approx(float(yes / (yes + probs[tok.encode("n")[0]])), abs=1e-5)


def test_judge_yes_and_no_words_must_start_with_different_tokens(judge_folder):
    from dora_tasks.workloads.reward_model import RewardModelError

    with pytest.raises(RewardModelError, match="share the token"):
        load_reward_model(RewardConfig(model=judge_folder, kind="judge", judge_yes="yes", judge_no="yeah"))


@pytest.mark.parametrize("how", ["model", "sum", "gate"])
def test_combine_rules(how):
    rule = np.array([1.0, 0.0, -0.5, np.nan, 2.0])
    model = np.array([0.9, 0.2, 0.4, 0.7, 0.1])
    expected = []
    for r, m in zip(rule, 0.5 * model):  # the rules as stated in config_reward.py, one response at a time
        expected.append({"model": m, "sum": r + m, "gate": (m if r > 0 else r)}[how])
    np.testing.assert_allclose(combine(rule, model, how, 0.5), expected)
    with pytest.raises(ValueError, match="reward.combine"):
        combine(rule, model, "max", 1.0)


def _group(gid, rewards):
    trajectories = [Trajectory(gid, i, np.array([1], np.int32), np.array([5, 6], np.int32), np.zeros(2, np.int32),
                               np.zeros(2, np.float32), True, reward=r, reward_error="boom" if math.isnan(r) else "")
                    for i, r in enumerate(rewards)]
    return Group(gid, Prompt(gid, "p", "a"), 0, trajectories=trajectories)


def test_model_scores_are_combined_and_recorded_on_each_group():
    from dora_tasks.workloads.reward_batcher import ForwardBatch

    groups = [_group(0, [1.0, 0.0]), _group(1, [float("nan"), 1.0])]
    batch = ForwardBatch(size=4, calls=2, seconds=0.4)
    scored = Scored(np.array([0.5, 0.25, 0.75, 1.0], np.float32), [batch], [4])
    apply_scores(RewardConfig(combine="sum"), groups, scored, "tcp://w:1", "REWARD")
    assert [t.reward for t in groups[0].trajectories] == [1.5, 0.25]
    assert np.isnan(groups[1].trajectories[0].reward) and groups[1].trajectories[0].reward_error == "boom"
    record = groups[1].reward_model
    assert record.scores == (0.75, 1.0) and record.worker == "tcp://w:1" and record.role == "REWARD"
    assert record.batch_sizes == (4,) and record.tasks_per_batch == 2
    assert sum(g.reward_model.seconds for g in groups) == pytest.approx(0.4)


# ---- end to end --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_run_scores_on_the_reward_worker_and_keeps_the_constraints(small_config, classifier_folder):
    """The embedded cluster starts a REWARD worker; every consumed response was scored by the model there (the
    groups name its address, the store's update rows the share scored on REWARD workers) and the audit passes."""
    from pipelines.cluster import labelled_workers
    from pipelines.run import open_run
    from pipelines.streaming import stream
    from storage.trajectory_store import TrajectoryStore

    cfg = small_config("dora.num_updates=3", "dora.max_staleness=1", "task.eval_prompts=4", "rollout.instances=1",
                       "dora.train_batch_size=2", "dora.rollout_batch_size=4",
                       f"reward.model={classifier_folder}", "reward.combine=model")
    scored_on, reward_workers = set(), []

    def watch(d):
        reward_workers[:] = labelled_workers(d.client).reward
        scored_on.update((g.reward_model.worker, g.reward_model.role) for g in d.complete.values())

    with open_run(cfg) as run:
        stream(run.driver, on_turn=watch)
        summary = run.finish()
    assert summary.audit_ok, summary.audit_text
    assert len(reward_workers) == 1 and scored_on == {(reward_workers[0], "REWARD")}
    store = TrajectoryStore.open(summary.store)
    updates, consumed = store.read_table("updates"), store.read_table("trajectories")
    per_update = cfg.rollout.group_size * cfg.dora.train_batch_size
    assert updates["metrics/reward_model_responses"].tolist() == [per_update] * 3
    assert (updates["metrics/reward_model_on_reward_workers"] == 1.0).all()
    rewards = consumed["reward"]  # combine=model: the stored reward is the model's score
    assert ((rewards > 0) & (rewards < 1)).all()
    for u in range(3):
        assert updates["metrics/reward_model_score_mean"][u] == pytest.approx(
            rewards[consumed["consumed_by"] == u].mean(), abs=1e-5)
    assert summary.metrics["reward_model_on_reward_workers"] == 1.0
    assert summary.metrics["reward_model_responses_per_s"] > 0
    print(json.dumps({k: v for k, v in summary.metrics.items() if k.startswith("reward_model")}))
