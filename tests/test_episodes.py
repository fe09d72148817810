"""Multi-turn episodes: the environment contract, the calculator, episodes on a real rollout server (with a scripted
engine), the loss mask in the trainer's objective, the store and the audit, a multi-turn Dask run, and learning to
use the tool.

A scripted engine stands in for a policy where exact tokens matter: it writes `<calc>a*b</calc>`, then copies the
result an environment put in its context, and without one writes a wrong result itself.
"""
from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import torch

from dora_tasks.core.config import ConfigError, TrainConfig, load_config
from dora_tasks.core.contracts import RolloutEngine
from dora_tasks.core.records import ENVIRONMENT_VERSION, Generation, Group, Prompt, TrainBatch, Trajectory
from dora_tasks.episodes import Episode, EpisodeSpec, StopStrings, call_all, run_episodes
from dora_tasks.model import CharTokenizer
from dora_tasks.rollout_rows import PartialResponse
from dora_tasks.rollout_server import RolloutServer
from dora_tasks.workloads import calculator
from dora_tasks.workloads.calculator import CalculatorEnvironment, CalculatorError, evaluate
from dora_tasks.workloads.environments import Environment, EnvironmentLoadError, Step, check_environment
from waiting import wait_until

TOK = CharTokenizer()
CALCULATOR = "dora_tasks.workloads.calculator.CalculatorEnvironment"
SPEC = EpisodeSpec(CALCULATOR, max_turns=4, max_turn_tokens=0, timeout_s=5.0)


# ---- the calculator and the environment contract -----------------------------------------------------------------
@pytest.mark.parametrize("expression, value", [("47*86", 4042), ("2+3*4", 14), ("(2+3)*4", 20), ("-7//2", -4),
                                                ("7/2", 3.5), ("10%4", 2), (" 1.5*2 ", 3.0)])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os')", "2**10", "abs(-1)", "x+1", "1/0", "9" * 17,
                                        "1" * 65, "[1]", "'a'*3", "1e300*1e300"])
def test_the_calculator_refuses_anything_but_bounded_arithmetic(expression):
    with pytest.raises(CalculatorError):
        evaluate(expression)


def test_the_calculator_environment_answers_a_call_and_ends_on_an_answer():
    env = CalculatorEnvironment()
    assert env.stop == ("</calc>",)
    assert env.step("<calc>47*86</calc>") == Step("<result>4042</result>", done=False, tool_call=True)
    assert env.step("<calc>7/0</calc>") == Step("<result>error</result>", done=False, tool_call=True)
    assert env.step("4042") == Step(done=True)
    assert calculator.show(7 / 2) == "3.5" and calculator.show(6.0) == "6"


def test_the_arithmetic_reward_ignores_tool_spans_and_needs_the_stated_answer():
    assert calculator.reward("47*86=", "<calc>47*86</calc><result>4042</result>4042", "4042") == 1.0
    assert calculator.reward("47*86=", "4042", "4042") == 1.0
    assert calculator.reward("47*86=", "<calc>47*86</calc><result>4042</result>", "4042") == 0.0
    assert calculator.reward("47*86=", "4041", "4042") == 0.0


def test_demonstrations_use_the_tool_on_every_second_prompt():
    prompts = calculator.make_prompts(4, seed=0, tokenizer=TOK)
    demos = [calculator.demonstration(p) for p in prompts]
    assert ["<calc>" in d for d in demos] == [True, False, True, False]
    assert all(calculator.reward(p.text, d, p.answer) == 1.0 for p, d in zip(prompts, demos))


def test_environments_load_by_dotted_path_with_errors_naming_the_key():
    check_environment(CALCULATOR)
    for bad, why in [("calculator", "dotted path"), ("no_such_module.Env", "cannot import"),
                     ("dora_tasks.workloads.calculator.Missing", "has no attribute"),
                     ("dora_tasks.workloads.calculator.MAX_MAGNITUDE", "not a callable")]:
        with pytest.raises(EnvironmentLoadError, match=why):
            check_environment(bad)


def test_config_refuses_environments_with_engines_or_switching_that_move_an_episode(tmp_path):
    base = ["task.name=arithmetic", f"task.environment={CALCULATOR}"]
    cfg = load_config(None, base)
    assert cfg.task.reward_fn == "dora_tasks.workloads.calculator.reward"
    for extra, key in [("rollout.switching=migrate", "switching"), ("rollout.partial_rollout=true", "partial"),
                       ("rollout.engine=vllm", "rollout.engine"), ("task.max_turns=0", "task.max_turns")]:
        with pytest.raises(ConfigError, match=key):
            load_config(None, base + [extra])
    assert cfg.rollout.switching == "auto" and cfg.switching == "drain"  # the default leaves episodes where they are


# ---- episode bookkeeping -------------------------------------------------------------------------------------------
def generation(text: str, version: int, finished: bool) -> Generation:
    ids = TOK.encode(text) + ([TOK.eos_id] if finished else [])
    return Generation(np.array(ids, np.int32), np.full(len(ids), -0.5, np.float32),
                      np.full(len(ids), version, np.int32), finished)


def test_an_episode_marks_model_and_environment_tokens_and_keeps_the_arrays_aligned():
    episode = Episode(CalculatorEnvironment(), [TOK.bos_id], budget=64)
    episode.add_turn(generation("<calc>2*3</calc>", 5, False))
    episode.take(Step("<result>6</result>", tool_call=True), TOK.encode("<result>6</result>"), max_turns=4)
    episode.add_turn(generation("6", 5, True))
    episode.take(Step(done=True), [], max_turns=4)
    t = episode.trajectory(0, 0)
    assert TOK.decode(t.response_ids) == "<calc>2*3</calc><result>6</result>6"
    n = len(t.response_ids)
    assert len(t.versions) == len(t.behaviour_logprobs) == len(t.loss_mask) == n and t.loss_mask.dtype == np.int8
    env = t.loss_mask == 0
    assert TOK.decode(t.response_ids[env]) == "<result>6</result>"
    assert (t.versions[env] == ENVIRONMENT_VERSION).all() and (t.versions[~env] == 5).all()
    assert (t.behaviour_logprobs[env] == 0).all() and (t.behaviour_logprobs[~env] == -0.5).all()
    assert (t.turns, t.tool_calls, t.finished, t.env_error) == (2, 1, True, "")
    assert t.distinct_versions == {5}


def test_an_episode_stops_at_its_budget_and_at_max_turns():
    short = Episode(CalculatorEnvironment(), [TOK.bos_id], budget=20)
    short.add_turn(generation("<calc>2*3</calc>", 0, False))  # 16 tokens: the observation is cut to 4
    short.take(Step("<result>6</result>"), TOK.encode("<result>6</result>"), max_turns=4)
    assert short.ended and not short.finished and len(short.tokens) == 20
    capped = Episode(CalculatorEnvironment(), [TOK.bos_id], budget=200)
    capped.add_turn(generation("<calc>2*3</calc>", 0, False))
    capped.take(Step("<result>6</result>"), TOK.encode("<result>6</result>"), max_turns=1)
    assert capped.ended and not capped.finished and capped.turns == 1
    assert capped.mask == [1] * 16  # nothing of an observation that no turn follows


def test_stop_strings_cut_a_turn_right_after_the_stop_and_drop_what_followed():
    stop = StopStrings(TOK, ("</calc>",))
    row = PartialResponse([TOK.bos_id], limit=40, stop=stop)
    row.extend(generation("<calc>2*", 0, False), 40)
    assert not row.done(100)
    row.extend(generation("3</calc><res", 0, True), 40)  # an eos after the stop goes with the rest
    assert TOK.decode(row.tokens) == "<calc>2*3</calc>" and row.stopped and not row.finished and row.done(100)
    assert len(row.tokens) == len(row.logprobs) == len(row.versions)
    assert PartialResponse([1], limit=3).room(100) == 3 and PartialResponse([1]).room(100) == 100


def test_environment_calls_that_raise_or_hang_are_recorded_not_raised():
    never = threading.Event()

    def boom():
        raise RuntimeError("tool crashed")

    outcomes = call_all([lambda: 1, boom, never.wait, lambda: 4], timeout_s=0.2)
    assert outcomes == [(1, ""), (None, "RuntimeError: tool crashed"), (None, "timeout"), (4, "")]
    never.set()


# ---- episodes on a real rollout server -----------------------------------------------------------------------------
class ScriptedEngine(RolloutEngine):
    """Writes `<calc>a*b</calc>` for a prompt `a*b=`, then the result an environment put in its context followed by
    eos; with no result in its context it writes a wrong one (`<result>0</result>0`). Log-prob -0.5 a token."""

    def __init__(self, budget: int = 64):
        self.version, self.budget, self.loads = 0, budget, [0]

    def load_version(self, version, weights_path):
        self.version = version
        self.loads.append(version)

    @property
    def max_new_tokens(self):
        return self.budget

    def generate(self, prompts, n, seed, *, max_new_tokens=None):
        limit = max_new_tokens or self.budget
        return [[self._continue(TOK.decode(p), limit) for _ in range(n)] for p in prompts]

    def _continue(self, text: str, limit: int) -> Generation:
        prompt, _, response = text.partition("=")
        call = f"<calc>{prompt}</calc>"
        result = re.search(r"<result>(.*?)</result>$", response)
        if result is not None:
            target, ends = response + result.group(1), True
        elif response.startswith(call):
            target, ends = response + "<result>0</result>0", True
        else:
            target, ends = call + "<result>0</result>0", True
        ids = TOK.encode(target[len(response):]) + ([TOK.eos_id] if ends else [])
        ids = ids[:limit]
        finished = ends and len(ids) and ids[-1] == TOK.eos_id
        return Generation(np.array(ids, np.int32), np.full(len(ids), -0.5, np.float32),
                          np.full(len(ids), self.version, np.int32), bool(finished))


def prompt_of(text: str, prompt_id: int = 0) -> Prompt:
    return Prompt(prompt_id, text, str(eval(text.rstrip("="))), (TOK.bos_id, *TOK.encode(text)))  # noqa: S307


def serve(engine: ScriptedEngine, chunk: int = 4) -> RolloutServer:
    return RolloutServer(lambda: engine, chunk_tokens=chunk, keep_kv_cache=False)


@pytest.mark.parametrize("chunk", [0, 4])
def test_episodes_on_a_rollout_server_call_the_tool_and_state_its_result(chunk):
    server = serve(ScriptedEngine(), chunk)
    try:
        trajectories = run_episodes(server, SPEC, TOK, prompt_of("12*34="), 0, "", 3, seed=7, budget=64, group_id=9)
    finally:
        server.close()
    assert [t.sample_idx for t in trajectories] == [0, 1, 2] and {t.group_id for t in trajectories} == {9}
    for t in trajectories:
        assert TOK.decode(t.response_ids) == "<calc>12*34</calc><result>408</result>408"
        assert calculator.reward("12*34=", TOK.decode(t.response_ids), "408") == 1.0
        assert (t.turns, t.tool_calls, t.finished, t.env_error) == (2, 1, True, "")
        env = t.loss_mask == 0
        assert TOK.decode(t.response_ids[env]) == "<result>408</result>"
        assert (t.versions[env] == -1).all() and (t.versions[~env] == 0).all()
        assert (t.behaviour_logprobs[env] == 0).all() and t.response_ids[-1] == TOK.eos_id


def test_without_the_tool_the_scripted_policy_answers_wrong():
    """The same engine with no environment (the baseline): it writes the result itself, and gets it wrong."""
    server = serve(ScriptedEngine())
    try:
        (g,) = server.generate(0, "", list(prompt_of("12*34=").token_ids), 1, seed=0)
    finally:
        server.close()
    assert calculator.reward("12*34=", TOK.decode(g.token_ids), "408") == 0.0


class Crashing(Environment):
    stop = ("</calc>",)

    def step(self, turn):
        raise ValueError("the tool is down")


class Hanging(Environment):
    stop = ("</calc>",)

    def __init__(self, release: threading.Event):
        self.release = release

    def step(self, turn):
        self.release.wait()
        return Step(done=True)


@pytest.mark.parametrize("hangs, error", [(False, "ValueError: the tool is down"), (True, "timeout")])
def test_an_environment_failure_ends_the_episode_on_the_trajectory_without_raising(hangs, error):
    server, release = serve(ScriptedEngine()), threading.Event()
    spec = EpisodeSpec((lambda: Hanging(release)) if hangs else Crashing, max_turns=4, max_turn_tokens=0,
                       timeout_s=0.3)
    try:
        trajectories = run_episodes(server, spec, TOK, prompt_of("12*34="), 0, "", 2, seed=1, budget=64, group_id=0)
    finally:
        release.set()
        server.close()
    for t in trajectories:
        assert t.env_error == error and t.turns == 1 and not t.finished
        assert TOK.decode(t.response_ids) == "<calc>12*34</calc>" and (t.loss_mask == 1).all()


def test_a_turn_limit_cuts_each_turn_and_the_budget_bounds_the_episode():
    server = serve(ScriptedEngine())
    try:
        cut = EpisodeSpec(CALCULATOR, max_turns=4, max_turn_tokens=5, timeout_s=5.0)
        (t,) = run_episodes(server, cut, TOK, prompt_of("12*34="), 0, "", 1, seed=1, budget=64, group_id=0)
        assert TOK.decode(t.response_ids) == "<calc" and t.turns == 1 and t.finished  # the answer ended it
        (t,) = run_episodes(server, SPEC, TOK, prompt_of("12*34="), 0, "", 1, seed=1, budget=24, group_id=0)
        assert len(t.response_ids) == 24 and not t.finished and t.turns == 1
    finally:
        server.close()


def test_no_other_version_loads_between_the_turns_of_an_episode():
    """C1 across turns: while an episode holds version 0, a request of version 1 that is already waiting is not
    served between its turns; it is served once the episode lets go."""
    engine = ScriptedEngine()
    server = serve(engine)
    other: dict = {}
    newer = threading.Thread(target=lambda: other.update(g=server.generate(1, "", list(prompt_of("2*3=").token_ids),
                                                                             1, seed=0)))
    try:
        with server.hold(0):
            newer.start()
            wait_until(lambda: server._waiting, 10, "the version-1 request waits at the server")
            for turn in range(3):
                server.generate_turns(0, "", [list(prompt_of("12*34=").token_ids)], [turn], [8])
            assert engine.loads == [0] and not other
        newer.join(30)
        assert engine.loads == [0, 1] and other["g"][0].versions.tolist() == [1] * len(other["g"][0].versions)
    finally:
        server.close()


# ---- the trainer's loss leaves environment tokens out --------------------------------------------------------------
def episode_trajectory(sample: int, version: int = 0, advantage: float = 1.0, env_version: int = -1) -> Trajectory:
    """`<calc>2*3</calc>` (model), `<result>6</result>` (environment), `6` eos (model), behaviour log-prob -1."""
    parts = [("<calc>2*3</calc>", 1), ("<result>6</result>", 0), ("6", 1)]
    ids = [i for text, _ in parts for i in TOK.encode(text)] + [TOK.eos_id]
    mask = np.array([m for text, m in parts for _ in text] + [1], np.int8)
    versions = np.where(mask == 1, version, env_version).astype(np.int32)
    logprobs = np.where(mask == 1, -1.0, 0.0).astype(np.float32)
    return Trajectory(0, sample, np.array([TOK.bos_id, *TOK.encode("2*3=")], np.int32), np.array(ids, np.int32),
                      versions, logprobs, True, reward=float(sample), advantage=advantage, loss_mask=mask, turns=2,
                      tool_calls=1)


def loss_and_grads(model, trajectories) -> tuple[float, list[torch.Tensor]]:
    from dora_tasks.algorithms.objective import batch_tensors, policy_objective

    group = Group(0, prompt_of("2*3="), 0, "a", 0, trajectories)
    model.zero_grad()
    loss, _ = policy_objective(model, batch_tensors(TrainBatch(0, [group], 1)), TrainConfig())
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


def test_the_loss_and_its_gradient_ignore_environment_tokens():
    from dora_tasks.core.config import ModelConfig
    from dora_tasks.model import build_model

    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2), TOK.vocab_size, seed=0)
    base = [episode_trajectory(0, advantage=1.0), episode_trajectory(1, advantage=-1.0)]
    loss, grads = loss_and_grads(model, base)
    changed = [episode_trajectory(0, advantage=1.0), episode_trajectory(1, advantage=-1.0)]
    for t in changed:
        t.behaviour_logprobs[t.loss_mask == 0] = -7.0  # what the environment's tokens "had": must not matter
    loss2, grads2 = loss_and_grads(model, changed)
    assert loss2 == loss and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    unmasked = [episode_trajectory(0, advantage=1.0), episode_trajectory(1, advantage=-1.0)]
    for t in unmasked:  # the same change on tokens counted as the model's does change the loss
        t.behaviour_logprobs[t.loss_mask == 0] = -7.0
        t.loss_mask[:] = 1
    assert loss_and_grads(model, unmasked)[0] != loss


# ---- the store keeps the mask; the audit checks C1 over the model's tokens -------------------------------------------
META = {"group_size": 2, "max_staleness": 1}


def episode_store(path, env_version: int = -1, env_error: str = ""):
    from storage.trajectory_store import TrajectoryStore

    store = TrajectoryStore.create(path, META)
    trajectories = [episode_trajectory(0, version=0, env_version=env_version), episode_trajectory(1, version=0)]
    trajectories[1].env_error = env_error
    store.append_dispatch(0, 0, 0, 0, 0.0)
    store.append_consumed([Group(0, prompt_of("2*3="), 0, "a", 0, trajectories, 1.0, 2.0)], 0, 3.0)
    store.append_update(0, 2.0, 3.0, 1, 0.1, {})
    store.close()
    return path


def test_the_store_round_trips_the_mask_turns_tool_calls_and_environment_errors(tmp_path):
    from storage.audit import audit_store
    from storage.trajectory_store import TrajectoryStore

    path = episode_store(tmp_path / "s.zarr", env_error="timeout")
    store = TrajectoryStore.open(path)
    expected = episode_trajectory(0)
    for mask in store.read_ragged("loss_mask", [0, 1]):
        assert mask.dtype == np.int8 and mask.tolist() == expected.loss_mask.tolist()
    table = store.read_table("trajectories")
    assert table["turns"].tolist() == [2, 2] and table["tool_calls"].tolist() == [1, 1]
    assert table["env_error"].tolist() == ["", "timeout"]
    report = audit_store(path)
    assert report.ok, report.to_text()
    assert report.episodes == {"multi_turn_trajectories": 2, "turns_mean": 2.0, "tool_calls": 2,
                               "environment_tokens": 2 * len("<result>6</result>")}
    assert report.env_errors == {"timeout": 1} and "environment failures: 1" in report.to_text()
    bad = audit_store(episode_store(tmp_path / "bad.zarr", env_version=0))  # environment tokens with a version
    assert bad.count("environment_token_version") == 1, bad.to_text()


def test_a_store_of_schema_version_2_reads_as_single_turn_and_gains_the_mask_when_appended_to(tmp_path):
    import shutil

    import zarr

    from storage.audit import audit_store
    from storage.synthetic import make_group
    from storage.trajectory_store import SCHEMA_VERSION, TrajectoryStore

    rng = np.random.default_rng(0)
    old = tmp_path / "v2.zarr"  # single-turn rows, then stripped of what version 3 added
    with TrajectoryStore.create(old, META) as store:
        store.append_dispatch(0, 0, 0, 0, 0.0)
        store.append_consumed([make_group(0, 0, rng, group_size=2)], 0, 3.0)
    for array in ("ragged/loss_mask", "trajectories/turns", "trajectories/tool_calls", "trajectories/env_error"):
        shutil.rmtree(old / array)
    root = zarr.open_group(old, mode="r+")
    vocab = {k: v for k, v in root.attrs["vocab"].items() if k != "env_error"}
    root.attrs.update({"schema_version": 2, "vocab": vocab})
    reader = TrajectoryStore.open(old)
    assert reader.schema_version == 2
    assert all((m == 1).all() for m in reader.read_ragged("loss_mask", [0, 1]))
    table = reader.read_table("trajectories")
    assert table["turns"].tolist() == [1, 1] and table["env_error"].tolist() == ["", ""]
    assert audit_store(old).ok
    writer = TrajectoryStore.open(old, mode="a")
    writer.append_dispatch(1, 1, 0, 0, 0.0)
    writer.append_consumed([make_group(1, 0, rng, group_size=2)], 1, 4.0)
    writer.close()
    upgraded = TrajectoryStore.open(old)
    assert upgraded.schema_version == SCHEMA_VERSION
    masks = upgraded.read_ragged("loss_mask", [0, 1, 2, 3])
    assert all((m == 1).all() for m in masks) and upgraded.read_table("trajectories")["turns"].tolist() == [1] * 4
    assert audit_store(old).ok


# ---- a multi-turn run on a real Dask cluster -------------------------------------------------------------------------
# The policy of both runs: the arithmetic task's warm start (shared through the warm-start cache, and with
# benchmarks/tool_use.py), long enough that the tiny policy copies operands and results often enough to start from.
TOOL_POLICY = ["task.name=arithmetic", "task.num_prompts=2048", "model.warmstart_steps=800",
               "rollout.max_new_tokens=48", "task.eval_prompts=8", "dora.max_staleness=1"]
EPISODE_RUN = [*TOOL_POLICY, f"task.environment={CALCULATOR}", "dora.num_updates=4"]


@pytest.mark.slow
def test_a_multi_turn_run_keeps_c1_over_the_model_tokens_and_records_turns_and_tool_calls(small_config, shared_cluster):
    """Queued switching on one instance (groups of a newer version may reach it while episodes of an older one still
    run there: they wait, `RolloutServer.hold`, checked exactly by the server test above): the audit finds every
    model token of a trajectory from its group's version and every environment token marked, and the store and
    the update metrics hold the turns and tool calls."""
    from pipelines.inputs import RunInputs
    from pipelines.streaming import run_pipeline
    from storage.audit import audit_store
    from storage.trajectory_store import TrajectoryStore

    cfg = small_config(*EPISODE_RUN, "rollout.switching=queue", "rollout.instances=1", "rollout.slots=2")
    summary = run_pipeline(cfg, RunInputs(client=shared_cluster(cfg)))
    report = audit_store(summary.store, 1)
    assert report.ok, report.to_text()
    store = TrajectoryStore.open(summary.store)
    t = store.read_table("trajectories")
    G, TBS, N = cfg.rollout.group_size, cfg.dora.train_batch_size, cfg.dora.num_updates
    assert len(t["group_id"]) == G * TBS * N
    multi = np.flatnonzero(t["turns"] > 1)
    assert len(multi) > 0 and t["tool_calls"].sum() >= len(multi), report.to_text()
    masks = store.read_ragged("loss_mask", multi)
    versions = store.read_ragged("token_versions", multi)
    for row, mask, version in zip(multi, masks, versions):
        assert (mask == 0).any() and set(version[mask == 1].tolist()) == {int(t["version"][row])}
        assert (version[mask == 0] == ENVIRONMENT_VERSION).all()
    assert report.episodes["tool_calls"] == int(t["tool_calls"].sum()) and report.episodes["environment_tokens"] > 0
    updates = store.read_table("updates")
    assert np.allclose(updates["metrics/turns_mean"],
                       [t["turns"][t["consumed_by"] == u].mean() for u in updates["update"]])
    assert updates["metrics/tool_calls"].sum() == t["tool_calls"].sum()
    assert "episodes:" in report.to_text() and "environment failures: none" in report.to_text()


@pytest.mark.slow
def test_reward_rises_with_the_tool_and_above_the_no_tool_baseline(small_config, shared_cluster, tmp_path):
    """RL learns to use the calculator: from the warm start (tool calls on ~1 response in 10, most of them with a
    miscopied operand or result), 20 updates of 8 groups of 8 raise the tool calls per response and the reward,
    while the same policy, seed and updates without the tool stay near zero (benchmarks/tool_use.py: the same
    comparison at the benchmark's size, docs/benchmark.md, "Tool use")."""
    common = [*TOOL_POLICY, "dora.num_updates=20", "rollout.group_size=8", "dora.train_batch_size=8",
              "dora.rollout_batch_size=16", "rollout.slots=2"]
    tool = reward_and_calls(small_config(*common, f"task.environment={CALCULATOR}"), shared_cluster)
    baseline = reward_and_calls(small_config(*common, f"storage.run_dir={tmp_path / 'no_tool'}"), shared_cluster)
    print(f"tool: reward first/last 5 updates {tool[0]}, tool calls per response {tool[1]}; "
          f"no tool: reward {baseline[0]}")
    assert tool[0][1] > tool[0][0] + 0.05 and tool[1][1] > tool[1][0] + 0.2, tool
    assert tool[0][1] > baseline[0][1] + 0.05 and baseline[1] == (0.0, 0.0), (tool, baseline)


def reward_and_calls(cfg, shared_cluster) -> tuple[tuple[float, float], tuple[float, float]]:
    """A run's (mean reward, tool calls per trajectory) over its first 5 and its last 5 updates; its audit passes."""
    from pipelines.inputs import RunInputs
    from pipelines.streaming import run_pipeline
    from storage.audit import audit_store
    from storage.trajectory_store import TrajectoryStore

    summary = run_pipeline(cfg, RunInputs(client=shared_cluster(cfg)))
    assert audit_store(summary.store, cfg.dora.max_staleness).ok
    t = TrajectoryStore.open(summary.store).read_table("trajectories", ["consumed_by", "reward", "tool_calls"])
    first, last = t["consumed_by"] < 5, t["consumed_by"] >= cfg.dora.num_updates - 5
    reward = (round(float(np.nanmean(t["reward"][first])), 3), round(float(np.nanmean(t["reward"][last])), 3))
    return reward, (round(float(t["tool_calls"][first].mean()), 3), round(float(t["tool_calls"][last].mean()), 3))
