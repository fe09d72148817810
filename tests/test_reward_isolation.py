"""Process-isolated rewards on real processes: calls that hang in C, spin, allocate without bound or kill their process
are ended within their limits and recorded as failures, and scoring goes on in a fresh process; the same inside a
Dask worker; held-out evaluation with a reward that always hangs costs about one timeout, not one per prompt."""
from __future__ import annotations

import math
import os
import sys
import time

import numpy as np
import pytest
import reward_fixtures as fx
from distributed import Client, LocalCluster

from dora_tasks import steps
from dora_tasks.core.config import ConfigError, ModelConfig, load_config
from dora_tasks.core.records import Group, Prompt, Trajectory
from dora_tasks.model import CharTokenizer, build_model
from dora_tasks.warmstart import rewards_of
from dora_tasks.workloads import countdown
from dora_tasks.workloads.reward_pool import RewardPool
from dora_tasks.workloads.rewards import NOT_SCORED, score_isolated, score_parallel

MEMORY = 256 * 2**20
SLACK_S = 3.0  # a kill, a process start and a loaded 2-core machine


@pytest.fixture
def pool():
    pool = RewardPool(MEMORY)
    yield pool
    pool.close()


def calls_of(*responses: str) -> list[tuple[str, str, str]]:
    return [("p", r, "a") for r in responses]


def assert_failed(outcome: tuple[float, str], error: str) -> None:
    assert math.isnan(outcome[0]) and outcome[1].startswith(error), outcome


@pytest.mark.parametrize("behaviour, timeout_s, error", [
    ("hang", 1.0, "timeout"), ("spin", 1.0, "timeout"), ("die", 1.0, "process died (exit code 3)"),
    ("grow", 20.0, "memory limit: past task.reward_memory_bytes=268435456"),  # ended by its limit, not the timeout
])
def test_a_call_that_hangs_spins_dies_or_grows_is_ended_and_the_next_runs_in_a_new_process(pool, behaviour,
                                                                                           timeout_s, error):
    with pool.lane() as lane:
        start = time.perf_counter()
        first, failed, after = lane.score_all(fx.by_response, calls_of("pid", behaviour, "pid"), timeout_s)
        elapsed = time.perf_counter() - start
    assert_failed(failed, error)
    assert elapsed < timeout_s + SLACK_S
    assert first[1] == after[1] == "" and first[0] != after[0]  # the pool replaced the ended process
    assert os.getpid() not in (first[0], after[0])


def test_a_timeout_kills_what_the_reward_started_too(pool, tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    with pool.lane() as lane:
        (outcome,) = lane.score_all(fx.start_a_child_and_hang, [("p", "r", str(pid_file))], 1.0)
    assert_failed(outcome, "timeout")
    deadline = time.monotonic() + SLACK_S
    while is_running(int(pid_file.read_text())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_running(int(pid_file.read_text()))


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie waits only for its reaper
    except FileNotFoundError:
        return False


def test_processes_are_reused_across_calls_and_results_keep_their_order(pool):
    with pool.lane() as lane:
        pids = [value for value, _ in lane.score_all(fx.process_id, calls_of("x", "y"), 5.0)]
        pids += [value for value, _ in lane.score_all(fx.process_id, calls_of("z"), 5.0)]
        assert lane.score_all(fx.by_response, calls_of("a", "b", "a"), 5.0) == [(1.0, ""), (0.0, ""), (1.0, "")]
    assert len(set(pids)) == 1


def test_a_function_that_raises_or_returns_no_number_is_recorded(pool):
    with pool.lane() as lane:
        assert lane.score_all(lambda *a: 0.5, calls_of("x"), 5.0) == [(0.5, "")]  # pickled by value
        assert_failed(lane.score_all(lambda *a: "yes", calls_of("x"), 5.0)[0], "non-number: 'yes'")
        assert_failed(lane.score_all(lambda *a: 1 / 0, calls_of("x"), 5.0)[0], "ZeroDivisionError")


def test_a_function_the_reward_process_cannot_import_is_recorded_on_every_call(pool, tmp_path, monkeypatch):
    (tmp_path / "vanishing_reward.py").write_text("def score(prompt, response, answer):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import vanishing_reward

    monkeypatch.undo()  # the reward process inherits an import path without it; here it stays imported
    try:
        with pool.lane() as lane:
            results = lane.score_all(vanishing_reward.score, calls_of("x", "y"), 5.0)
    finally:
        del sys.modules["vanishing_reward"]
    for outcome in results:
        assert_failed(outcome, "RuntimeError: cannot load the reward function in the reward process")


def test_thread_isolation_scores_as_before():
    assert score_isolated(fx.exact, calls_of("a", "b"), 5.0, "thread", MEMORY) == [(1.0, ""), (0.0, "")]
    assert score_isolated(fx.process_id, calls_of("a"), 5.0, "thread", MEMORY) == [(float(os.getpid()), "")]


def test_config_checks_the_isolation_and_memory():
    cfg = load_config(None, ["task.reward_isolation=process", f"task.reward_memory_bytes={MEMORY}"])
    assert (cfg.task.reward_isolation, cfg.task.reward_memory_bytes) == ("process", MEMORY)
    with pytest.raises(ConfigError, match="task.reward_isolation"):
        load_config(None, ["task.reward_isolation=fork"])
    with pytest.raises(ConfigError, match="task.reward_memory_bytes"):
        load_config(None, ["task.reward_memory_bytes=0"])


def scoring_batch(tokenizer: CharTokenizer, *responses: tuple[str, ...]) -> list[Group]:
    groups = []
    for gid, texts in enumerate(responses):
        prompt = Prompt(gid, "p", "a", tuple(tokenizer.prompt_ids("p")))
        trajectories = [Trajectory(gid, i, np.asarray(prompt.token_ids, np.int32),
                                   np.asarray(tokenizer.encode(text), np.int32), np.zeros(len(text), np.int32),
                                   np.zeros(len(text), np.float32), True) for i, text in enumerate(texts)]
        groups.append(Group(gid, prompt, 0, trajectories=trajectories))
    return groups


def test_reward_task_in_a_dask_worker_ends_hung_and_growing_calls(tmp_path):
    tokenizer = CharTokenizer()
    tokenizer.save(str(tmp_path))
    batch = scoring_batch(tokenizer, ("pid", "hang", "a"), ("grow", "b", "pid"))
    timeout_s = 3.0  # the growing call reaches its memory limit well within it
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        client.submit(steps.reward, scoring_batch(tokenizer, ("a",)), str(tmp_path), "reward_fixtures.exact", 5.0,
                      "process", MEMORY, pure=False).result(timeout=60)  # the worker and its reward process start
        start = time.perf_counter()
        scored = client.submit(steps.reward, batch, str(tmp_path), "reward_fixtures.by_response", timeout_s,
                               "process", MEMORY, pure=False).result(timeout=60)
        elapsed = time.perf_counter() - start
        worker_pid = next(iter(client.run(os.getpid).values()))
    (pid, hung, right), (grown, wrong, pid_after) = [[(t.reward, t.reward_error) for t in g.trajectories]
                                                     for g in scored]
    assert_failed(hung, "timeout")
    assert_failed(grown, "memory limit")
    assert (right, wrong) == ((1.0, ""), (0.0, ""))
    assert pid[0] != pid_after[0] and worker_pid not in (pid[0], pid_after[0])
    assert elapsed < 2 * timeout_s + SLACK_S  # one timeout and one memory limit, each followed by a fresh process


@pytest.mark.parametrize("isolation, fn", [("thread", fx.sleep_briefly_in_c), ("process", fx.sleep_in_c)])
def test_scoring_a_reward_that_always_hangs_costs_one_timeout_per_lane_not_per_call(isolation, fn):
    timeout_s, lanes, n = 0.5, 2, 16
    start = time.perf_counter()
    results = score_parallel(fn, calls_of(*["a"] * n), timeout_s, isolation, MEMORY, lanes)
    elapsed = time.perf_counter() - start
    assert sum(error == "timeout" for _, error in results) == lanes
    assert sum(error == NOT_SCORED for _, error in results) == n - lanes
    assert elapsed < timeout_s + SLACK_S  # one timeout per call would be n * timeout_s / lanes = 4 s


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_lane_that_timed_out_stops_and_the_others_score_the_rest(isolation):
    responses = ["a"] * 5 + ["hang" if isolation == "process" else "x"] + ["a", "b"] * 5
    fn = fx.by_response if isolation == "process" else _brief_hang_on_x
    results = score_parallel(fn, calls_of(*responses), 0.5, isolation, MEMORY, 2)
    assert [error for _, error in results].count("timeout") == 1
    assert all(error == "" for r, (_, error) in zip(responses, results) if r in "ab")


def _brief_hang_on_x(prompt: str, response: str, answer: str) -> float:
    return fx.sleep_briefly_in_c(prompt, response, answer) if response == "x" else fx.exact(prompt, response, answer)


def test_evaluation_uses_the_reward_isolation_and_is_bounded_by_one_timeout():
    tokenizer = CharTokenizer()
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2), tokenizer.vocab_size)
    prompts = countdown.make_prompts(12, seed=0, tokenizer=tokenizer, max_count=20)
    pids = rewards_of(model, prompts, fx.process_id, max_new_tokens=2, reward_isolation="process",
                      reward_memory_bytes=MEMORY)
    assert os.getpid() not in set(pids.tolist())
    start = time.perf_counter()
    hung = rewards_of(model, prompts, fx.sleep_in_c, max_new_tokens=2, reward_timeout_s=0.5,
                      reward_isolation="process", reward_memory_bytes=MEMORY)
    assert np.isnan(hung).all() and time.perf_counter() - start < 0.5 + SLACK_S
