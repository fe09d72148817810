"""The Python API (`pipelines.api.Pipeline`): configs, datasets, rewards and environments given as Python objects,
checked before any work starts; the run log that keeps the terminal quiet; a run on a client given by the caller."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from dora_tasks.core.config import ConfigError, load_config
from dora_tasks.workloads.environments import Environment, Step
from pipelines import Pipeline
from pipelines.api import build_config, environment_factory
from pipelines.inputs import (
    PYTHON_OBJECT,
    RunInputs,
    UserCodeError,
    check_same_rows,
    config_value,
    import_path,
    write_rows,
)
from pipelines.run_log import RunLog
from storage.trajectory_store import TrajectoryStore

ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1), "weight": 0.5} for i in range(40)]


def half_if_right(response, *, prompt, answer, row):
    """Module-level: recorded by its import path."""
    return row["weight"] * float(response.strip() == answer)


class Counter(Environment):
    stop = ("</n>",)

    def __init__(self):
        self.turns = 0

    def step(self, turn):
        self.turns += 1
        return Step(observation=str(self.turns), done=self.turns >= 2)


def test_config_from_path_dict_and_object_with_overrides(tmp_path):
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "cpu_demo.yaml")
    from_path = build_config(path, ["dora.max_staleness=1"])
    assert from_path.dora.max_staleness == 1 and from_path.rollout.slots == 8  # the file's value stays
    from_dict = build_config({"dora": {"num_updates": 7}}, ["dora.seed=3"])
    assert (from_dict.dora.num_updates, from_dict.dora.seed) == (7, 3)
    copied = build_config(from_dict, ["dora.seed=4"])
    assert copied.dora.seed == 4 and from_dict.dora.seed == 3  # the object given is not changed
    with pytest.raises(ConfigError, match="dora.max_staleness"):
        build_config(None, ["dora.max_staleness=-1"])
    with pytest.raises(UserCodeError, match="expected a Config"):
        build_config(42, [])


def test_rows_and_reward_objects_are_recorded_in_the_config(tmp_path):
    pipeline = Pipeline(None, overrides=[f"storage.run_dir={tmp_path / 'run'}"], dataset=ROWS, reward=half_if_right)
    task = pipeline.config.task
    assert task.name == "dataset" and task.dataset == str(tmp_path / "run" / "dataset.jsonl")
    assert task.reward_fn == "test_api.half_if_right"  # importable by name: `dora resume` finds it
    assert pipeline.inputs.rows == ROWS and pipeline.inputs.reward is half_if_right
    assert not (tmp_path / "run").exists()  # nothing written before the run starts

    def local(response, *, prompt, answer, row):
        return 0.0

    assert config_value(local).startswith(PYTHON_OBJECT) and import_path(local) == ""
    assert Pipeline(dataset="data.jsonl", reward="pkg.mod.fn").config.task.dataset == "data.jsonl"


def test_unpicklable_reward_is_refused_before_any_work(tmp_path):
    lock = threading.Lock()

    def locked(response, *, prompt, answer, row):
        with lock:
            return 1.0

    with pytest.raises(UserCodeError, match=r"reward .*locked cannot be sent to the Dask workers.*lock"):
        Pipeline(None, overrides=[f"storage.run_dir={tmp_path / 'run'}"], dataset=ROWS, reward=locked)
    assert not (tmp_path / "run").exists()


def test_a_hugging_face_dataset_gives_its_rows():
    datasets = pytest.importorskip("datasets")
    pipeline = Pipeline(None, dataset=datasets.Dataset.from_list(ROWS))
    assert pipeline.inputs.rows == ROWS and pipeline.config.task.name == "dataset"


@pytest.mark.parametrize("dataset, message", [({"prompt": "a"}, "single mapping"), ([1, 2], "row 1: expected a dict"),
                                              ([], "no rows"), (3.5, "got float")])
def test_bad_datasets_name_the_problem(dataset, message):
    with pytest.raises(UserCodeError, match=message):
        Pipeline(None, dataset=dataset)


def test_an_environment_instance_gives_each_episode_a_copy():
    instance = Counter()
    make = environment_factory(instance)
    first, second = make(), make()
    first.step("x")
    assert first.turns == 1 and second.turns == 0 and instance.turns == 0
    assert environment_factory(Counter) is Counter
    with pytest.raises(UserCodeError, match="environment"):
        environment_factory(42)


def test_a_run_of_a_python_object_resumes_only_with_that_object():
    cfg = load_config(None, [f"task.reward_fn={PYTHON_OBJECT}__main__.score"])
    with pytest.raises(UserCodeError, match=r"task.reward_fn: .*__main__.score.*from_run_dir"):
        RunInputs().code(cfg)
    assert RunInputs(reward=half_if_right).code(cfg).reward is half_if_right


def test_resumed_rows_must_be_those_of_the_run(tmp_path):
    path = str(tmp_path / "dataset.jsonl")
    write_rows(ROWS, path)
    check_same_rows(ROWS, path)
    with pytest.raises(UserCodeError, match="differ"):
        check_same_rows(ROWS[:-1], path)


def test_run_log_takes_every_descriptor_write_and_keeps_the_terminal_for_the_user(tmp_path, capfd):
    logger = logging.getLogger("dora")
    with RunLog(str(tmp_path)) as run_log:
        os.write(2, b"engine noise on fd 2\n")
        os.write(1, b"library print on stdout\n")
        subprocess.run([sys.executable, "-c", "import sys; print('child process output', file=sys.stderr)"],
                       check=True)
        logger.info("resumed from a checkpoint")
        logger.warning("a warning the user must see")
    text = (tmp_path / "run.log").read_text()
    for line in ("engine noise on fd 2", "library print on stdout", "child process output",
                 "resumed from a checkpoint", "a warning the user must see"):
        assert line in text
    out, err = capfd.readouterr()
    assert out == "" and "noise" not in err and "child" not in err and "resumed" not in err
    assert err.splitlines() == [f"[dora] engine and library logs: {run_log.path}",
                                "dora: WARNING: a warning the user must see"]
    os.write(2, b"after\n")  # the descriptors are back
    assert capfd.readouterr().err == "after\n"


def test_ctrl_c_as_a_dask_call_starts_logs_tornados_line_without_the_traceback(tmp_path):
    """distributed's `sync` cancels, on Ctrl-C, a future it may not have made yet: its callback's NameError reaches
    tornado's logger with a traceback. In a run's log only the line is kept; any other error keeps its traceback."""
    import functools
    import io

    def sync():
        def cancel():
            raise NameError("cannot access free variable 'future'")
        return cancel

    def logged(callback) -> str:
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        tornado = logging.getLogger("tornado.application")
        tornado.addHandler(handler)
        try:
            try:
                callback()
            except Exception:
                tornado.error("Exception in callback %r", functools.partial(callback), exc_info=True)
        finally:
            tornado.removeHandler(handler)
        return stream.getvalue()

    def other():
        raise NameError("a bug of someone else")

    with RunLog(str(tmp_path)):
        interrupted, failed = logged(sync()), logged(other)
    assert "sync.<locals>.cancel" in interrupted and "Traceback" not in interrupted
    assert "Traceback" in failed and "a bug of someone else" in failed
    assert "Traceback" in logged(sync())  # outside a run nothing is filtered


def test_runs_on_one_cluster_never_share_a_task_key():
    """Dask hands back the future it already knows under a key: each run's keys end with a tag of its own (and keep
    their name first, the dashboard's task prefix)."""
    from pipelines.driver import Driver

    first, second = (Driver(load_config(None, []), None, None, None, None, None, "", [], []) for _ in range(2))
    key = first.task_key("rollout", 0, 7)
    assert key[:3] == ("rollout", 0, 7) and key != second.task_key("rollout", 0, 7)
    assert first.shared.run_tag == first.run_tag != second.run_tag


@pytest.mark.slow
def test_pipeline_runs_on_a_client_it_was_given_and_leaves_it_open(small_config, shared_cluster, tmp_path):
    """The run leaves the client given and its cluster open (the session's shared cluster); the next run there, of
    another model size, replaces the engines and gets no task or weights of the first."""
    tiny = ["dora.num_updates=2", "model.warmstart_steps=10", "rollout.max_new_tokens=8", "task.eval_prompts=4"]
    cfg = small_config(*tiny)
    client = shared_cluster(cfg)
    summary = Pipeline(cfg, dataset=ROWS, reward=half_if_right, client=client).run()
    assert client.status == "running" and len(client.scheduler_info()["workers"]) == 4
    assert summary.audit_ok, summary.audit_text
    rewards = TrajectoryStore.open(summary.store).read_table("trajectories")["reward"]
    assert len(rewards) == 2 * 4 * 4 and set(np.unique(rewards)) <= {0.0, 0.5}  # the row's weight, not 1.0
    assert os.path.isfile(os.path.join(summary.run_dir, "run.log"))
    wider = small_config(*tiny, "model.hidden_size=96", f"storage.run_dir={tmp_path / 'wider'}")
    second = Pipeline(wider, dataset=ROWS, reward=half_if_right, client=client).run()
    assert second.audit_ok, second.audit_text
    assert len(TrajectoryStore.open(second.store).read_table("trajectories")["reward"]) == 2 * 4 * 4
