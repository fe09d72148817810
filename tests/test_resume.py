"""Kill the driver of a running job by its PID (SIGKILL), resume it: nothing lost, nothing trained twice."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from storage.audit import audit_store
from storage.checkpoint import CheckpointStore
from storage.trajectory_store import TrajectoryStore
from conftest import SMALL_RUN as SMALL_RUN_ARGS
from processes import dora, kill_group, resume_to_end

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.long  # default suite: test_chaos's driver trial (killed by PID, resumed, the same checks and MLflow's)
def test_driver_killed_by_pid_then_resumed_trains_every_prompt_once(tmp_path):
    run_dir = tmp_path / "run"
    K, N = 1, 6
    overrides = SMALL_RUN_ARGS + [f"storage.run_dir={run_dir}", f"tracking.mlflow_uri=sqlite:///{tmp_path}/ml.db",
                                  f"dora.max_staleness={K}", f"dora.num_updates={N}", "storage.checkpoint_interval=2"]
    proc = dora(tmp_path / "run.log", "run", "--config", "configs/cpu_demo.yaml", *overrides)
    checkpoints = CheckpointStore(str(run_dir / "checkpoints"))
    deadline = time.time() + 600
    try:
        while time.time() < deadline and proc.poll() is None:
            done = checkpoints.updates()
            if done and done[-1] >= 1:  # a checkpoint after update 1 exists: the run is past it
                break
            time.sleep(0.2)
        assert proc.poll() is None, (tmp_path / "run.log").read_text()
        os.kill(proc.pid, signal.SIGKILL)  # the driver, by its PID
        proc.wait(30)
    finally:
        kill_group(proc)
    store_path = str(run_dir / "trajectories.zarr")
    before = TrajectoryStore.open(store_path).num_rows("updates")
    assert before < N, "the run finished before it was killed"

    resume_to_end(tmp_path / "resume.log", run_dir, "tracking.live_view=false")

    report = audit_store(store_path, K)
    assert report.ok, report.to_text()
    store = TrajectoryStore.open(store_path)
    updates = store.read_table("updates")
    assert updates["update"].tolist() == list(range(N))  # no gap, no repeat across the crash
    assert updates["published_version"].tolist() == list(range(1, N + 1))
    t = store.read_table("trajectories")
    G, TBS = 4, 4
    keys = list(zip(t["group_id"].tolist(), t["sample_idx"].tolist()))
    assert len(keys) == len(set(keys)) == N * TBS * G
    assert sorted(set(t["group_id"].tolist())) == list(range(N * TBS))
    staleness = t["consumed_by"] - t["version"]
    assert staleness.max() <= K and staleness.min() >= 0
    assert np.all(np.isfinite(t["reward"]))


def test_resume_of_a_run_that_does_not_exist_is_one_clear_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pipelines.cli", "resume", str(tmp_path / "nope")],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2
    assert "nope" in out.stderr and "Traceback" not in out.stderr
