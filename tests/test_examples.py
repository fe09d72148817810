"""The runnable examples under examples/, run as a user runs them (a script starting the embedded cluster of worker
processes), with tiny settings; and the quiet terminal: library output in the run log, a short terminal, Ctrl-C."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from conftest import SMALL_RUN
from processes import dora, kill_group, resume_to_end

from pipelines.cache import cache_root
from storage.audit import audit_store
from storage.checkpoint import CheckpointStore
from storage.trajectory_store import TrajectoryStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model.hidden_size=64", "model.num_heads=2", "rollout.instances=1", "rollout.slots=4", "rollout.group_size=4",
        "dora.train_batch_size=4", "dora.rollout_batch_size=4", "dora.num_updates=2", "task.eval_prompts=4",
        "storage.checkpoint_interval=0", "tracking.plots=false"]
MAX_TERMINAL_LINES = 40  # two lines at the start, the live view (a line per 5 s on a pipe) and the summary
LIBRARY_LINES = ("Loading weights", "Creating initial MLflow database tables")  # workers: transformers; driver: MLflow


def fresh_cache(tmp_path) -> dict:
    """The environment of a run whose cache holds the warm-started policies but no empty MLflow store yet: its driver
    creates one, and MLflow logs that."""
    cache = tmp_path / "cache"
    cache.mkdir()
    warm = os.path.join(cache_root(), "warmstart")
    os.makedirs(warm, exist_ok=True)
    (cache / "warmstart").symlink_to(warm)
    return {**os.environ, "DORA_CACHE": str(cache)}


def run_example(name: str, tmp_path, *overrides: str) -> tuple[subprocess.CompletedProcess, str]:
    run_dir = str(tmp_path / "run")
    proc = subprocess.run([sys.executable, os.path.join("examples", name), f"storage.run_dir={run_dir}",
                           f"tracking.mlflow_uri=sqlite:///{tmp_path}/ml.db", *TINY, *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, check=False,
                          env=fresh_cache(tmp_path))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc, run_dir


def assert_quiet(proc: subprocess.CompletedProcess, run_dir: str) -> None:
    terminal = proc.stdout + proc.stderr
    with open(os.path.join(run_dir, "run.log")) as f:
        log = f.read()
    assert len(terminal.splitlines()) <= MAX_TERMINAL_LINES, terminal
    assert "audit: PASS" in proc.stdout and f"engine and library logs: {run_dir}/run.log" in proc.stderr
    for line in LIBRARY_LINES:
        assert line in log and line not in terminal, line
    assert "Traceback" not in terminal


def test_custom_dataset_and_reward_example(tmp_path):
    proc, run_dir = run_example("custom_dataset_reward.py", tmp_path, "model.warmstart_steps=20")
    assert_quiet(proc, run_dir)
    with open(os.path.join(run_dir, "dataset.jsonl")) as f:
        assert sum(1 for _ in f) == 1024  # the rows built in Python, kept in the run folder
    rewards = TrajectoryStore.open(os.path.join(run_dir, "trajectories.zarr")).read_table("trajectories")["reward"]
    assert len(rewards) == 2 * 4 * 4 and set(np.unique(rewards)) <= {0.0, 0.5, 1.0}


def test_tool_environment_example(tmp_path):
    proc, run_dir = run_example("tool_environment.py", tmp_path, "model.warmstart_steps=150")
    assert_quiet(proc, run_dir)
    with open(os.path.join(run_dir, "config.yaml")) as f:
        assert yaml.safe_load(f)["task"]["environment"] == "python-object:__main__.BudgetCalculator"
    t = TrajectoryStore.open(os.path.join(run_dir, "trajectories.zarr")).read_table("trajectories")
    assert t["tool_calls"].sum() > 0 and t["turns"].max() > 1 and "episodes:" in proc.stdout


@pytest.mark.slow
def test_ctrl_c_stops_a_run_in_one_line_and_the_folder_resumes(tmp_path):
    run_dir = tmp_path / "run"
    overrides = SMALL_RUN + [f"storage.run_dir={run_dir}", f"tracking.mlflow_uri=sqlite:///{tmp_path}/ml.db",
                             "dora.num_updates=500", "storage.checkpoint_interval=2", "dora.max_staleness=1"]  # stopped long before its end
    proc = dora(tmp_path / "run.txt", "run", "--config", "configs/cpu_demo.yaml", *overrides)
    checkpoints = CheckpointStore(str(run_dir / "checkpoints"))
    deadline = time.time() + 600
    try:
        while proc.poll() is None and not checkpoints.updates() and time.time() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, (tmp_path / "run.txt").read_text()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in its terminal does: every process of the group
        assert proc.wait(120) == 130
    finally:
        kill_group(proc)
    terminal = (tmp_path / "run.txt").read_text()
    stopped = [line for line in terminal.splitlines() if "stopped" in line]
    assert stopped == [f"dora: stopped (Ctrl-C); continue with: dora resume {run_dir}"], terminal
    assert len(terminal.splitlines()) <= 4, terminal  # the log's path, the dashboard, the stop line
    for noise in ("Traceback", "KeyboardInterrupt", "leaked semaphore"):
        assert noise not in terminal and noise not in (run_dir / "run.log").read_text(), noise

    total = max(checkpoints.updates()) + 4  # the resumed run trains three updates past its last checkpoint
    resume_to_end(tmp_path / "resume.txt", run_dir, f"dora.num_updates={total}")
    assert audit_store(str(run_dir / "trajectories.zarr"), 1).ok
    assert TrajectoryStore.open(str(run_dir / "trajectories.zarr")).read_table("updates")["update"].tolist() \
        == list(range(total))


def worker_log(*messages: tuple) -> str:
    """What the embedded workers' log filter lets through of these `logger.exception` calls, each under an OSError."""
    import io
    import logging

    from dora_tasks.worker_preload import PeerClosedConnection

    stream = io.StringIO()
    logger = logging.getLogger("test.worker_preload")
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    logger.addFilter(PeerClosedConnection())
    try:
        for message in messages:
            try:
                raise OSError("stream closed")
            except OSError:
                logger.exception(*message)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def test_a_worker_logs_a_fetch_its_client_abandoned_in_one_line_and_other_failures_whole():
    from dora_tasks.worker_preload import CLIENT_LEFT_MID_FETCH

    text = worker_log(*((CLIENT_LEFT_MID_FETCH, "tcp://127.0.0.1:1", who) for who in (None, "tcp://127.0.0.1:2")))
    client_left, worker_failed = text.split("failed during get data")[1:]
    assert "Traceback" not in client_left and "-> None" in client_left
    assert "Traceback" in worker_failed and "OSError: stream closed" in worker_failed


def test_a_worker_logs_a_heartbeat_to_a_closed_scheduler_in_one_line():
    from dora_tasks.worker_preload import HEARTBEAT_LOST

    text = worker_log((HEARTBEAT_LOST,), ("Unexpected exception during heartbeat. Closing worker.",))
    lost, unexpected = text.split("during heartbeat")[1:]
    assert "Traceback" not in lost
    assert "Traceback" in unexpected and "OSError: stream closed" in unexpected
