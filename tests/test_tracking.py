"""MLflow tracking against a REAL `mlflow server` (sqlite backend) and a local sqlite store; failures never raise."""
from __future__ import annotations

import inspect
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from pipelines import plots
from dora_tasks.core.config import load_config
from pipelines.tracking import (NullTracker, Tracker, TrackingWarning, empty_store, finite_metrics, resolve_tracking_uri,
                                seed_sqlite_store)
from synthetic_run import synthetic_tables

SERVER_READY_TIMEOUT_S = 180
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")  # inside MLflow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"mlflow server not ready after {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    """TERM the server's own process group (it was started in a new session), then KILL if it lingers."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    exe = Path(sys.executable).with_name("mlflow")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mlflow"]
    cmd += ["server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
            "--default-artifact-root", (root / "artifacts").as_uri(),
            "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(root / "server.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, SERVER_READY_TIMEOUT_S)
        yield url
    finally:
        stop(proc)


def make_cfg(tmp_path, *overrides: str):
    return load_config(None, [f"storage.run_dir={tmp_path / 'run'}", "dora.max_staleness=2", *overrides])


@pytest.fixture(scope="module")
def pngs(tmp_path_factory) -> list[str]:
    """Two small real plots to log as artifacts (drawn once for the module)."""
    out = tmp_path_factory.mktemp("pngs")
    updates = synthetic_tables(num_updates=4)["updates"]
    view = {"update": updates["update"], "end_time": updates["end"] - updates["start"][0],
            "reward_mean": updates["reward_mean"], "accuracy": updates["accuracy"]}
    return [plots.plot_learning(view, str(out / "learning.png")),
            plots.plot_staleness(np.array([0, 1, 1, 2]), 2, str(out / "staleness.png"))]


def log_a_run(tracker, pngs: list[str], updates: int = 4) -> None:
    for u in range(updates):
        tracker.log_update(u, {"reward_mean": 0.1 * u, "loss": 1.0 / (u + 1), "kl": float("nan"),
                               "staleness_max": np.int64(u % 3), "note": "not a number"})
    for png in pngs:
        tracker.log_artifact(png, "plots")
    tracker.log_text("config.yaml", "dora:\n  max_staleness: 2\n")


def check_run(uri: str, run_id: str, cfg, updates: int = 4) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {k: str(v) for k, v in cfg.flat().items()}
    for key in ("reward_mean", "loss", "staleness_max"):
        history = client.get_metric_history(run_id, key)
        assert sorted(m.step for m in history) == list(range(updates)), key
    assert client.get_metric_history(run_id, "kl") == [] and "note" not in run.data.metrics
    assert run.data.tags["dora.max_staleness"] == "2"
    assert run.data.tags["dora.algorithm"] == f"{cfg.train.advantage}/{cfg.train.loss}"
    assert {"dora.rollout_engine", "dora.train_engine", "dora.code_version"} <= set(run.data.tags)
    top = {a.path for a in client.list_artifacts(run_id)}
    assert top == {"config.yaml", "plots"}
    assert {a.path for a in client.list_artifacts(run_id, "plots")} == {"plots/learning.png", "plots/staleness.png"}


@pytest.mark.slow
def test_tracker_against_a_real_mlflow_server(mlflow_server, pngs, tmp_path):
    cfg = make_cfg(tmp_path, f"tracking.mlflow_uri={mlflow_server}", "tracking.run_name=server-test")
    with Tracker(cfg) as tracker:
        assert tracker.run_id and tracker.tracking_uri == mlflow_server
        log_a_run(tracker, pngs)
    assert tracker.failures == 0
    check_run(mlflow_server, tracker.run_id, cfg)
    assert tracker.ui_command().startswith(f"open {mlflow_server}/#/experiments/")


def test_tracker_with_the_default_local_sqlite_store(pngs, tmp_path):
    cfg = make_cfg(tmp_path)
    run_dir = (tmp_path / "run").resolve()
    assert resolve_tracking_uri(cfg) == f"sqlite:///{run_dir}/mlflow.db"
    with pytest.warns(TrackingWarning, match="does-not-exist.png"):  # a failing call warns, the run goes on
        with Tracker(cfg) as tracker:
            tracker.log_artifact(str(tmp_path / "does-not-exist.png"))
            log_a_run(tracker, pngs)
    assert tracker.failures == 1
    check_run(tracker.tracking_uri, tracker.run_id, cfg)
    assert (run_dir / "mlflow.db").is_file()
    assert list((run_dir / "mlartifacts").rglob("learning.png")), "artifacts must live under the run folder"
    assert "mlflow ui --backend-store-uri" in tracker.ui_command() and str(run_dir) in tracker.ui_command()

    resumed = make_cfg(tmp_path, "dora.num_updates=20")  # a resume is a new run that supersedes the killed one
    with Tracker(resumed, resume=True) as again:
        again.log_update(4, {"reward_mean": 0.4})
    assert again.run_id != tracker.run_id and again.failures == 0
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    old, new = client.get_run(tracker.run_id), client.get_run(again.run_id)
    assert old.data.tags["dora.superseded_by"] == again.run_id and old.info.status == "FINISHED"
    assert new.data.tags["dora.resumed_from"] == tracker.run_id
    assert new.data.params["dora.num_updates"] == "20"
    assert (run_dir / "mlflow_run_id.txt").read_text().strip() == again.run_id


def test_a_new_sqlite_store_is_a_copy_of_the_cached_empty_one_and_opens_like_a_created_one(tmp_path, monkeypatch):
    import sqlite3

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("DORA_CACHE", str(tmp_path / "cache"))
    created, seeded = tmp_path / "created.db", tmp_path / "run" / "seeded.db"
    MlflowClient(tracking_uri=f"sqlite:///{created}").search_experiments()
    seed_sqlite_store(f"sqlite:///{seeded}")
    assert empty_store().parent.parent == tmp_path / "cache" / "mlflow" and seeded.is_file()

    def schema(path) -> list:  # a table's constraints come in any order from MLflow's migrations: lines sorted
        with sqlite3.connect(path) as db:
            rows = db.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall()
            return [(kind, name, sorted((sql or "").split("\n"))) for kind, name, sql in rows] + \
                db.execute("SELECT * FROM alembic_version").fetchall()

    assert schema(seeded) == schema(created)  # the same tables, indexes and migrations
    experiments = MlflowClient(tracking_uri=f"sqlite:///{seeded}").search_experiments()
    assert [(e.experiment_id, e.name) for e in experiments] == [("0", "Default")]  # added as MLflow opened it

    with sqlite3.connect(seeded) as db:
        db.execute("CREATE TABLE mine (x)")
    seed_sqlite_store(f"sqlite:///{seeded}")  # an existing store is never replaced
    assert ("table", "mine") in [row[:2] for row in schema(seeded)]
    assert not list(seeded.parent.glob(".*.tmp"))


def test_a_cache_that_cannot_be_written_leaves_the_store_to_mlflow(tmp_path, monkeypatch):
    monkeypatch.setenv("DORA_CACHE", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("not a folder")
    cfg = make_cfg(tmp_path)
    with Tracker(cfg) as tracker:
        tracker.log_update(0, {"reward_mean": 0.5})
    assert tracker.failures == 0 and (tmp_path / "run" / "mlflow.db").is_file()


@pytest.mark.parametrize("flush_s, batches", [(3600.0, 1), (0.0, 5)])
def test_metrics_reach_mlflow_in_batches_and_all_by_the_end(tmp_path, flush_s, batches):
    """`tracking.metrics_flush_s` batches updates into one MLflow write; closing flushes what is left."""
    from mlflow.tracking import MlflowClient

    cfg = make_cfg(tmp_path, f"tracking.metrics_flush_s={flush_s}")
    tracker = Tracker(cfg).start()
    calls = []
    log_batch = tracker._client.log_batch
    tracker._client.log_batch = lambda *a, **kw: (calls.append(len(kw["metrics"])), log_batch(*a, **kw))
    for u in range(5):
        tracker.log_update(u, {"reward_mean": 0.1 * u, "loss": 1.0})
    tracker.close()
    assert calls == [10 // batches] * batches
    history = MlflowClient(tracking_uri=tracker.tracking_uri).get_metric_history(tracker.run_id, "reward_mean")
    assert sorted(m.step for m in history) == [0, 1, 2, 3, 4]
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])


def test_unreachable_server_warns_and_the_run_goes_on(tmp_path):
    cfg = make_cfg(tmp_path, f"tracking.mlflow_uri=http://127.0.0.1:{free_port()}")
    with pytest.warns(TrackingWarning, match="no MLflow server"):
        tracker = Tracker(cfg).start()
    assert tracker.run_id is None and tracker.ui_command() == ""
    tracker.log_update(0, {"reward_mean": 1.0})
    tracker.log_artifact(str(tmp_path / "missing.png"))
    tracker.close()


def test_finite_metrics_keeps_only_finite_numbers():
    assert finite_metrics({"a": 1, "b": 2.5, "c": float("nan"), "d": float("inf"), "e": None, "f": "x",
                           "g": True, "h": np.float32(0.25)}) == {"a": 1.0, "b": 2.5, "g": 1.0, "h": 0.25}


def test_null_tracker_has_the_same_interface():
    public = {name for name, _ in inspect.getmembers(Tracker) if not name.startswith("_")}
    assert public <= set(dir(NullTracker)), public - set(dir(NullTracker))
    for name in public:
        member = getattr(Tracker, name)
        if callable(member):
            assert inspect.signature(member).parameters.keys() == \
                inspect.signature(getattr(NullTracker, name)).parameters.keys() or name == "__init__", name
    with NullTracker(None) as tracker:
        tracker.log_update(0, {"x": 1.0})
        assert tracker.run_id is None and tracker.ui_command() == ""


@pytest.mark.slow
def test_a_real_run_is_tracked_in_a_real_mlflow_server(mlflow_server, small_config, shared_cluster):
    """A short pipeline run against `mlflow server` on 127.0.0.1, read back with MLflow's client."""
    from mlflow.tracking import MlflowClient

    from pipelines.inputs import RunInputs
    from pipelines.streaming import run_pipeline

    cfg = small_config(f"tracking.mlflow_uri={mlflow_server}", "tracking.plots=true", "dora.num_updates=3")
    summary = run_pipeline(cfg, RunInputs(client=shared_cluster(cfg)))
    client = MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(summary.mlflow_run_id)
    assert run.data.params == {k: str(v) for k, v in cfg.flat().items()}
    for key in ("reward_mean", "loss", "staleness_max", "step_time_s", "weight_sync_s", "clip_fraction"):
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert steps == [0, 1, 2], key
    assert "summary/throughput_tokens_per_s" in run.data.metrics
    assert run.data.tags["dora.max_staleness"] == str(cfg.dora.max_staleness)
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/timeline.png", "plots/staleness.png", "plots/learning.png"} <= plots
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "audit.txt"} <= top
