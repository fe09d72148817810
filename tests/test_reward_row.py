"""The reward contract with the row: every form (three arguments, the row keywords, batch, async) scores the same in
both isolations, with failures recorded; rows reach the reward from the dataset; reasoning-gym tasks scored from their
rows equal reasoning-gym's own `score_answer`, in scoring alone and in a run end to end."""
from __future__ import annotations

import json
import math
import pickle
import time

import numpy as np
import pytest
import row_rewards as rr

from dora_tasks import steps
from dora_tasks.core.config import TaskConfig
from dora_tasks.core.records import Group, Prompt, Trajectory
from dora_tasks.model import CharTokenizer
from dora_tasks.workloads import countdown
from dora_tasks.workloads.datasets import load_prompts
from dora_tasks.workloads.reward_forms import ASYNC_GRACE_S
from dora_tasks.workloads.rewards import (RewardCall, RewardError, check_reward_fn, resolve_reward_fn, score_isolated,
                                          score_parallel)

MEMORY = 512 * 2**20
SLACK_S = 3.0  # a kill, a process start and a loaded 2-core machine
ISOLATIONS = ["thread", "process"]
ROW_FORMS = [rr.with_row, rr.batched, rr.async_with_row, rr.async_batched, rr.RowScorer(1.0)]


def calls(*responses: str, hang_s: float = 0.0) -> list[RewardCall]:
    """Answer "a"; call i's row gives a bonus of i / 8, so a row that reaches the wrong call shows."""
    return [RewardCall("p", r, "a", json.dumps({"bonus_given": i / 8, "hang_s": hang_s}))
            for i, r in enumerate(responses)]


def assert_failed(outcome: tuple[float, str], error: str) -> None:
    assert math.isnan(outcome[0]) and outcome[1].startswith(error), outcome


@pytest.mark.parametrize("isolation", ISOLATIONS)
@pytest.mark.parametrize("fn", [rr.three_arguments] + ROW_FORMS, ids=lambda f: getattr(f, "__name__", "object"))
def test_every_form_scores_with_its_row_in_both_isolations(fn, isolation):
    batch = calls("a", "b", "a", "a")
    outcomes = score_isolated(fn, batch, 10.0, isolation, MEMORY)
    takes_row = resolve_reward_fn(fn).takes_row
    assert takes_row == (fn is not rr.three_arguments)
    expected = [float(c.response == c.answer) + (json.loads(c.row)["bonus_given"] if takes_row else 0.0)
                for c in batch]
    assert outcomes == [(value, "") for value in expected]


@pytest.mark.parametrize("isolation", ISOLATIONS)
@pytest.mark.parametrize("fn", [rr.three_arguments, rr.with_row, rr.async_with_row], ids=lambda f: f.__name__)
def test_a_call_that_raises_or_returns_no_number_is_recorded_and_the_others_score(fn, isolation):
    right, raised, text, wrong = score_isolated(fn, calls("a", "raise", "text", "b"), 10.0, isolation, MEMORY)
    assert right[1] == wrong[1] == "" and right[0] > wrong[0]
    assert_failed(raised, "KeyError: 'no such entry'")
    assert_failed(text, "non-number: 'correct'")


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_batch_fails_as_a_whole_but_a_non_number_only_where_it_is(isolation):
    raised = score_isolated(rr.batched, calls("a", "raise", "a"), 10.0, isolation, MEMORY)
    for outcome in raised:
        assert_failed(outcome, "KeyError: 'no such entry'")
    for outcome in score_isolated(rr.batched, calls("a", "short", "a"), 10.0, isolation, MEMORY):
        assert_failed(outcome, "ValueError: a batch reward returned 2 values for 3 responses")
    right, text, wrong = score_isolated(rr.batched, calls("a", "text", "b"), 10.0, isolation, MEMORY)
    assert (right[1], wrong[1]) == ("", "") and right[0] > wrong[0]
    assert_failed(text, "non-number: 'correct'")


@pytest.mark.parametrize("isolation", ISOLATIONS)
@pytest.mark.parametrize("fn", [rr.with_row, rr.batched, rr.async_with_row], ids=lambda f: f.__name__)
def test_timeouts_hold_for_every_form(fn, isolation):
    """A hung plain call times out alone; a hung batch times out as a whole; a hung async call times out alone
    while the calls beside it on its event loop are scored."""
    timeout_s = 0.5
    hang_s = 2.0 if isolation == "thread" and fn is not rr.async_with_row else 60.0  # a thread is never killed
    start = time.perf_counter()
    outcomes = score_isolated(fn, calls("a", "hang", "a", "b", hang_s=hang_s), timeout_s, isolation, MEMORY)
    elapsed = time.perf_counter() - start
    hung = [outcomes[1]] if fn is not rr.batched else outcomes
    for outcome in hung:
        assert_failed(outcome, "timeout")
    if fn is not rr.batched:
        assert [error for _, error in outcomes] == ["", "timeout", "", ""]
        assert outcomes[0][0] == 1.0 and outcomes[2][0] == 1.25 and outcomes[3][0] == 0.375
    assert elapsed < timeout_s + ASYNC_GRACE_S + SLACK_S


def test_evaluation_lanes_hand_a_batch_reward_one_share_each():
    batch = calls(*["a", "b"] * 6)
    outcomes = score_parallel(rr.batched, batch, 10.0, "thread", MEMORY, lanes=4)
    assert outcomes == [(float(c.response == "a") + json.loads(c.row)["bonus_given"], "") for c in batch]


def test_each_call_gets_its_own_row_even_when_the_function_changes_it():
    row = json.dumps({"bonus_given": 0.5})
    same_prompt = [RewardCall("p", "a", "a", row)] * 3
    assert score_isolated(rr.with_row, same_prompt, 10.0, "thread", MEMORY) == [(1.5, "")] * 3


@pytest.mark.parametrize("fn, named", [
    (rr.takes_one_argument, "'row_rewards.takes_one_argument' takes (response);"),
    (rr.batch_of_three_lists, "takes (prompts, responses, answers); a batch reward is called as fn(responses, "),
    (rr.RowScorer, "is a class; pass an instance"),
    (42, "expected a dotted path 'package.module.function' or a callable"),
    (lambda a, b: 0.0, "fn(response, *, prompt, answer, row) or fn(prompt, response, answer)"),
])
def test_a_function_that_fits_no_form_is_refused_with_a_clear_error(fn, named):
    with pytest.raises(RewardError) as err:
        resolve_reward_fn(fn)
    assert named in str(err.value)


def test_the_form_is_read_from_the_signature_once():
    assert not resolve_reward_fn(lambda *args, **kwargs: 0.0).takes_row  # a wrapper of an earlier reward
    assert resolve_reward_fn(lambda response, prompt=None, answer=None, row=None: 0.0).takes_row
    assert resolve_reward_fn(lambda response, **kwargs: 0.0).takes_row
    assert not resolve_reward_fn(countdown.reward).takes_row
    fn = resolve_reward_fn("row_rewards.async_batched")
    assert (fn.batch, fn.is_async, fn.takes_row) == (True, True, True)
    assert resolve_reward_fn(fn) is fn
    with pytest.raises(RewardError, match="takes_one_argument"):
        check_reward_fn("row_rewards.takes_one_argument")
    assert fn("p", "a", "a", {"bonus_given": 0.25}) == 1.25  # a direct call, whatever the form


def test_the_reward_task_takes_a_path_or_an_unhashable_callable_and_passes_each_prompt_its_row(tmp_path):
    tokenizer = CharTokenizer()
    tokenizer.save(str(tmp_path))
    assert steps._reward_fn("row_rewards.with_row") is steps._reward_fn("row_rewards.with_row")  # resolved once
    scorer = rr.RowScorer(2.0)
    with pytest.raises(TypeError):
        hash(scorer)
    assert steps._reward_fn(scorer).fn is scorer
    for isolation in ISOLATIONS:
        for spec in ("row_rewards.with_row", scorer):
            groups = steps.reward(scoring_groups(tokenizer), str(tmp_path), spec, 10.0, isolation, MEMORY)
            weight = 2.0 if spec is scorer else 1.0
            assert [[t.reward for t in g.trajectories] for g in groups] == [
                [weight + g.prompt.row["bonus_given"], g.prompt.row["bonus_given"]] for g in groups]


def scoring_groups(tokenizer: CharTokenizer) -> list[Group]:
    groups = []
    for gid in range(2):
        prompt = Prompt(gid, "p", "a", tuple(tokenizer.prompt_ids("p")), json.dumps({"bonus_given": gid / 4}))
        trajectories = [Trajectory(gid, i, np.asarray(prompt.token_ids, np.int32),
                                   np.asarray(tokenizer.encode(text), np.int32), np.zeros(len(text), np.int32),
                                   np.zeros(len(text), np.float32), True) for i, text in enumerate(("a", "b"))]
        groups.append(Group(gid, prompt, 0, trajectories=trajectories))
    return groups


def test_prompts_carry_their_rows_and_stay_small_hashable_and_picklable(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i), "metadata": {"n": [i, i + 1], "name": "é"}} for i in range(6)]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = TaskConfig(name="dataset", dataset=str(source), prompt_key="question", answer_key="answer", eval_prompts=2)
    train, held_out = load_prompts(cfg, CharTokenizer(), seed=0)
    for p in train + held_out:
        assert p.row == rows[p.prompt_id]
        assert pickle.loads(pickle.dumps(p)) == p and hash(p) == hash(pickle.loads(pickle.dumps(p)))
    p.row["metadata"]["n"].append(99)
    assert p.row == rows[p.prompt_id]  # a fresh dict each time
    count_train, _ = load_prompts(TaskConfig(num_prompts=4, eval_prompts=1, max_count=50), CharTokenizer(), seed=1)
    assert [countdown.answer_text(p.row["count"], p.row["step"]) for p in count_train] == [p.answer for p in
                                                                                           count_train]


# ---- reasoning-gym -------------------------------------------------------------------------------------------------
RG_TASKS = ("basic_arithmetic", "leg_counting", "word_sorting")
RG_SIZE = 8
RG_REWARD = "dora_tasks.workloads.reasoning_gym.reasoning_gym_reward"


@pytest.fixture
def rg():
    return pytest.importorskip("reasoning_gym")


def rg_entries(rg, tasks, size: int, seed: int) -> list[dict]:
    return [entry for i, name in enumerate(tasks) for entry in rg.create_dataset(name, size=size, seed=seed + i)]


def write_rows(path, entries) -> str:
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return str(path)


def candidate_responses(entry: dict) -> list[str]:
    """Right, wrong and near-miss responses made from the entry itself."""
    answer, meta = str(entry["answer"]), entry["metadata"]
    responses = [answer, f"The answer is {answer}", f"{answer}.", answer[:-1], answer + "0", "", "banana"]
    if "sorted_words" in meta:  # word order: reversed, first two swapped, words left out, other case
        words = list(meta["sorted_words"])
        responses += [", ".join(reversed(words)), ", ".join(words[1::-1] + words[2:]), ", ".join(words[:-1]),
                      answer.lower(), " ,".join(words)]
    if "premises" in meta:  # a premise is a valid conclusion; its negation and a foreign variable are not
        responses += [meta["premises"][0], f"¬({meta['premises'][0]})", meta["example_answer"], "(Z ∨ ¬Z)"]
    return responses


def own_scores(rg, entries: list[dict]) -> tuple[list[RewardCall], list[float]]:
    """Calls for every entry and candidate response, with reasoning-gym's own score of each (entries as generated)."""
    rewards_calls, expected = [], []
    for entry in entries:
        score_answer = rg.get_score_answer_fn(entry["metadata"]["source_dataset"])
        for response in candidate_responses(entry):
            rewards_calls.append((entry, response))
            expected.append(score_answer(answer=response, entry=entry))
    return rewards_calls, expected


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_reasoning_gym_rewards_from_jsonl_rows_equal_its_own_score_answer(rg, tmp_path, isolation):
    mixed = rg_entries(rg, RG_TASKS, RG_SIZE, seed=11)
    logic = rg_entries(rg, ("propositional_logic",), 4, seed=5)  # entries without an answer: scored from metadata alone
    checks = [(mixed, "answer"), (logic, "metadata.example_answer")]
    per_task: dict[str, list[bool]] = {}
    for n, (entries, answer_key) in enumerate(checks):
        cfg = TaskConfig(name="dataset", dataset=write_rows(tmp_path / f"rg{n}.jsonl", entries),
                         prompt_key="question", answer_key=answer_key, eval_prompts=0)
        prompts = {p.prompt_id: p for p in load_prompts(cfg, CharTokenizer(), seed=0)[0]}
        pairs, expected = own_scores(rg, entries)
        index = {id(e): i for i, e in enumerate(entries)}
        batch = [RewardCall(prompts[index[id(e)]].text, r, prompts[index[id(e)]].answer,
                            prompts[index[id(e)]].row_json) for e, r in pairs]
        outcomes = score_isolated(resolve_reward_fn(RG_REWARD), batch, 10.0, isolation, 2**30)
        assert [error for _, error in outcomes] == [""] * len(batch)
        for (entry, _), (value, _), want in zip(pairs, outcomes, expected):
            per_task.setdefault(entry["metadata"]["source_dataset"], []).append(value == want)
        assert len(set(expected)) >= 3  # right, wrong and partial credit all occur
    assert set(per_task) == {*RG_TASKS, "propositional_logic"}
    assert all(all(equal) and len(equal) >= 28 for equal in per_task.values()), {
        name: f"{sum(equal)}/{len(equal)}" for name, equal in per_task.items()}


def test_reasoning_gym_reward_names_a_row_without_its_task(rg):
    from dora_tasks.workloads.reasoning_gym import reasoning_gym_reward

    with pytest.raises(ValueError, match="metadata.source_dataset"):
        reasoning_gym_reward("4", prompt="2+2?", answer="4", row={"question": "2+2?"})
    with pytest.raises(ValueError, match="not registered"):
        reasoning_gym_reward("4", prompt="2+2?", answer="4", row={"metadata": {"source_dataset": "no_such_task"}})


@pytest.mark.slow
def test_a_run_on_mixed_reasoning_gym_tasks_from_jsonl_scores_every_response_like_reasoning_gym(rg, small_config,
                                                                                                  shared_cluster,
                                                                                                  tmp_path):
    from pipelines.inputs import RunInputs
    from pipelines.streaming import run_pipeline
    from storage.audit import audit_store
    from storage.trajectory_store import TrajectoryStore

    entries = rg_entries(rg, ("basic_arithmetic", "leg_counting", "word_sorting", "chain_sum"), 6, seed=3)
    data = write_rows(tmp_path / "rg.jsonl", entries)
    cfg = small_config("task.name=dataset", f"task.dataset={data}", "task.prompt_key=question",
                       "task.answer_key=answer", f"task.reward_fn={RG_REWARD}", "task.eval_prompts=4",
                       "model.warmstart_steps=30", "rollout.instances=1", "rollout.max_new_tokens=24",
                       "dora.num_updates=3")
    summary = run_pipeline(cfg, RunInputs(client=shared_cluster(cfg)))
    report = audit_store(summary.store, cfg.dora.max_staleness)
    assert report.ok and summary.audit_ok, report.to_text()
    assert sum(report.reward_errors.values()) == 0, report.reward_errors
    store = TrajectoryStore.open(summary.store)
    table = store.read_table("trajectories", ["prompt_id", "prompt_len", "reward"])
    tokens = store.read_ragged("tokens", np.arange(len(table["reward"])))
    assert len(tokens) == cfg.rollout.group_size * cfg.dora.train_batch_size * cfg.dora.num_updates
    assert len({entries[int(i)]["metadata"]["source_dataset"] for i in table["prompt_id"]}) >= 2  # a mix of tasks
    tokenizer = CharTokenizer()
    for prompt_id, prompt_len, reward, ids in zip(table["prompt_id"], table["prompt_len"], table["reward"], tokens):
        entry = entries[int(prompt_id)]
        response = tokenizer.decode(ids[int(prompt_len):])
        want = rg.get_score_answer_fn(entry["metadata"]["source_dataset"])(answer=response, entry=entry)
        assert reward == np.asarray(want, dtype=table["reward"].dtype), (entry, response)  # in the store's dtype
