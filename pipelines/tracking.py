"""MLflow tracking of a run: params, per-update metrics, tags and artifacts, without ever killing the run.

`Tracker(cfg)` is a context manager around one MLflow run:
- tracking URI: `cfg.tracking.mlflow_uri`, or `sqlite:///<abs run_dir>/mlflow.db` (a local sqlite store; the plain
  file store needs MLFLOW_ALLOW_FILE_STORE in MLflow 3);
- experiment `cfg.tracking.experiment`, created with an explicit artifact location `<run_dir>/mlartifacts` when the
  store is local (otherwise MLflow would write `./mlruns` wherever the process happens to run);
- params: `cfg.flat()`; tags: K, algorithm, engines, the clock (wall or emulated seconds), code version
  (`git rev-parse --short HEAD`, else the package version);
- `log_update(update, metrics)` logs with `step=update`, dropping non-finite and non-numeric values.

Simplifications, and why:
- Writes go through one background thread, in order. A slow or dead tracking server then costs a warning, not a
  stalled training loop; `close()` flushes for at most `flush_timeout_s` and abandons the rest with a warning.
- Every MLflow failure (at start or later) becomes a `TrackingWarning`; after a failed start the tracker is a no-op.
  A remote server is probed at `/health` first, because the MLflow client retries an unreachable host for minutes.
- The MLflow client (`MlflowClient`) is used instead of the fluent `mlflow.start_run` API: no process-global active
  run, so several trackers (tests, benchmark sweeps) can coexist in one process. `mlflow` is imported lazily (it takes
  seconds to import), so `NullTracker` and this module cost nothing when tracking is off.
- A resume starts a new MLflow run (tag `dora.resumed_from`) and the killed one is closed (tag
  `dora.superseded_by`): the killed run logged updates after its last checkpoint that the resume trains again, and
  MLflow cannot delete logged values. The pipeline logs the store's kept updates into the new run first, so it holds
  every step once.
- A new local sqlite store starts as a copy of an empty one at this MLflow's schema, kept in the cache
  (`pipelines.cache`): creating and migrating its tables takes seconds per run, a copy milliseconds. The copy lacks
  MLflow's default experiment, which MLflow adds as it opens the store, as it does for a new one.
- Runs share an experiment's artifact location: with a shared `mlflow_uri`, artifacts land under the run folder of the
  run that created the experiment. Per-run-folder stores (the default) avoid that.
"""
from __future__ import annotations

import importlib.metadata
import math
import os
import queue
import shlex
import shutil
import sqlite3
import subprocess
import threading
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

from dora_tasks.core.config import Config
from pipelines.cache import cache_root

RUN_ID_FILE = "mlflow_run_id.txt"  # in the run folder: the MLflow run of its latest start or resume
MAX_PARAMS_PER_BATCH = 100  # MLflow's log_batch limit
MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limit
GIT_TIMEOUT_S = 5.0
MAX_PARAM_CHARS = 6000


class TrackingWarning(RuntimeWarning):
    """MLflow failed; the run goes on without (some) tracking."""


def _warn(what: str, exc: BaseException) -> None:
    warnings.warn(f"MLflow {what} failed, the run continues: {type(exc).__name__}: {exc}", TrackingWarning,
                  stacklevel=3)


# ----------------------------------------------------------------------------------------------- resolution helpers
def resolve_tracking_uri(cfg: Config) -> str:
    if cfg.tracking.mlflow_uri:
        return cfg.tracking.mlflow_uri
    return f"sqlite:///{Path(cfg.storage.run_dir).resolve() / 'mlflow.db'}"  # absolute: sqlite:////abs/mlflow.db


def is_local_store(uri: str) -> bool:
    return uri.startswith(("sqlite:", "file:")) or "://" not in uri


def sqlite_path(uri: str) -> Path | None:
    """The file of a `sqlite:///path` URI (None for any other store, or one with query arguments)."""
    prefix = "sqlite:///"
    return Path(uri[len(prefix):]) if uri.startswith(prefix) and "?" not in uri else None


def seed_sqlite_store(uri: str) -> None:
    """Where `uri` names a sqlite file that does not exist yet, copy the empty store there (never over a file that
    another process created meanwhile)."""
    path = sqlite_path(uri)
    if path is None or path.exists():
        return
    try:
        template = empty_store()
    except (OSError, sqlite3.Error):  # a cache it cannot write: MLflow creates the store itself, as it used to
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    shutil.copyfile(template, scratch)
    try:
        os.link(scratch, path)
    except FileExistsError:
        pass
    finally:
        scratch.unlink()


def empty_store() -> Path:
    """An empty sqlite store at this MLflow's schema, built once per MLflow version, without the default experiment
    (MLflow adds it with its artifact location and time as it opens a copy)."""
    from mlflow.tracking import MlflowClient

    template = Path(cache_root()) / "mlflow" / importlib.metadata.version("mlflow") / "empty.db"
    if template.exists():
        return template
    template.parent.mkdir(parents=True, exist_ok=True)
    scratch = template.with_name(f".empty.{os.getpid()}.db")
    MlflowClient(tracking_uri=f"sqlite:///{scratch}").search_experiments()  # creates and migrates the tables
    with sqlite3.connect(scratch) as db:
        db.execute("DELETE FROM experiments")
    os.replace(scratch, template)
    return template


def artifact_location(cfg: Config) -> str:
    return (Path(cfg.storage.run_dir).resolve() / "mlartifacts").as_uri()


def code_version() -> str:
    """Short git commit of this checkout, else the installed package version, else "unknown"."""
    repo = Path(__file__).resolve().parents[1]
    if (repo / ".git").exists():
        try:
            out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                                 timeout=GIT_TIMEOUT_S)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        return importlib.metadata.version("dora-dask")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def run_tags(cfg: Config) -> dict[str, str]:
    return {
        "dora.max_staleness": str(cfg.dora.max_staleness),
        "dora.algorithm": f"{cfg.train.advantage}/{cfg.train.loss}",
        "dora.advantage": cfg.train.advantage,
        "dora.loss": cfg.train.loss,
        "dora.rollout_engine": cfg.rollout.engine,
        "dora.switching": cfg.switching,  # rollout.switching, "auto" resolved
        "dora.train_engine": cfg.train.engine if cfg.train.engine != "deepspeed"
        else f"deepspeed-zero{cfg.train.zero_stage}",
        "dora.code_version": code_version(),
        "dora.clock": cfg.clock(0.0).unit,  # every time and rate of the run: wall or EMULATED seconds
        "dora.emulated": str(cfg.emulated).lower(),
        "dora.reward_model": f"{cfg.reward.kind} {cfg.reward.model} ({cfg.reward.combine})" if cfg.reward.model
        else "none",  # scored on REWARD workers: the reward_model_* metrics say where and how fast
        "dora.run_dir": str(Path(cfg.storage.run_dir).resolve()),
    }


def default_run_name(cfg: Config) -> str:
    return cfg.tracking.run_name or f"{Path(cfg.storage.run_dir).resolve().name}-K{cfg.dora.max_staleness}"


def finite_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Keep the values that are finite numbers (bools count as 0/1); drop NaN, inf, None, strings."""
    out = {}
    for key, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            out[str(key)] = number
    return out


def server_reachable(uri: str, timeout_s: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except Exception:  # noqa: BLE001 - any failure means "not reachable"
        return False


# ----------------------------------------------------------------------------------------------- background writer
class _Writer:
    """One daemon thread running MLflow calls in order; failures become warnings."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self.failures = 0
        self._thread = threading.Thread(target=self._loop, name="dora-mlflow-writer", daemon=True)
        self._thread.start()

    def submit(self, what: str, fn: Callable, *args: Any, **kwargs: Any) -> None:
        self._queue.put((what, fn, args, kwargs))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            what, fn, args, kwargs = item
            try:
                fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - tracking must never raise into the run
                self.failures += 1
                _warn(what, exc)

    def close(self, timeout_s: float) -> bool:
        """Flush and stop; False when the queue did not drain in time (the thread is then abandoned)."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


# ----------------------------------------------------------------------------------------------- trackers
class Tracker:
    """One MLflow run for one pipeline run. Use as `with Tracker(cfg) as tracker: ...`."""

    def __init__(self, cfg: Config, resume: bool = False, flush_timeout_s: float = 60.0) -> None:
        self.cfg = cfg
        self.resume = resume
        self.flush_timeout_s = flush_timeout_s
        self.tracking_uri = resolve_tracking_uri(cfg)
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self._client = None
        self._writer: _Writer | None = None
        self._closed_failures = 0
        self._buffered: list = []  # metrics not yet handed to the writer (see `tracking.metrics_flush_s`)
        self._flushed = time.time()

    # lifecycle -------------------------------------------------------------------------------------------------
    def __enter__(self) -> "Tracker":
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        status = "FINISHED" if exc_type is None else ("KILLED" if exc_type is KeyboardInterrupt else "FAILED")
        self.close(status)
        return False

    def start(self) -> "Tracker":
        try:
            self._start_run()
        except Exception as exc:  # noqa: BLE001
            _warn(f"start (tracking URI {self.tracking_uri})", exc)
            self.run_id = None
            return self
        self._writer = _Writer()
        return self

    def close(self, status: str = "FINISHED") -> None:
        if self._writer is None:
            return
        self.flush_metrics()
        self._writer.submit("end of run", self._client.set_terminated, self.run_id, status)
        if not self._writer.close(self.flush_timeout_s):
            warnings.warn(f"MLflow did not flush within {self.flush_timeout_s:.0f} s; later metrics may be missing",
                          TrackingWarning, stacklevel=2)
        self._closed_failures += self._writer.failures
        self._writer = None

    @property
    def failures(self) -> int:
        """MLflow calls that failed after the start (each gave a TrackingWarning)."""
        return self._closed_failures + (self._writer.failures if self._writer else 0)

    # logging ---------------------------------------------------------------------------------------------------
    def log_update(self, update: int, metrics: Mapping[str, Any]) -> None:
        values = finite_metrics(metrics)
        if self._writer is None or not values:
            return
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self._buffered += [Metric(key, value, now_ms, int(update)) for key, value in values.items()]
        if time.time() - self._flushed >= self.cfg.tracking.metrics_flush_s:
            self.flush_metrics()

    def flush_metrics(self) -> None:
        """Hand the buffered metrics to the writer, in batches within MLflow's limit."""
        batch, self._buffered, self._flushed = self._buffered, [], time.time()
        if self._writer is None or not batch:
            return
        steps = f"updates {batch[0].step}..{batch[-1].step}"
        for i in range(0, len(batch), MAX_METRICS_PER_BATCH):
            self._writer.submit(f"metrics of {steps}", self._client.log_batch, self.run_id,
                                metrics=batch[i:i + MAX_METRICS_PER_BATCH])

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        if self._writer is not None:
            self._writer.submit(f"artifact {path}", self._client.log_artifact, self.run_id, str(path), artifact_path)

    def log_text(self, name: str, text: str) -> None:
        if self._writer is not None:
            self._writer.submit(f"text artifact {name}", self._client.log_text, self.run_id, text, name)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self._writer is None:
            return
        from mlflow.entities import RunTag

        self._writer.submit("tags", self._client.log_batch, self.run_id,
                            tags=[RunTag(str(k), str(v)) for k, v in tags.items()])

    def ui_command(self) -> str:
        """The shell line that opens this run's store in the MLflow UI ("" when tracking is off)."""
        if self.run_id is None:
            return ""
        if not is_local_store(self.tracking_uri):
            return f"open {self.tracking_uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return (f"MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui --backend-store-uri "
                f"{shlex.quote(self.tracking_uri)} --host 127.0.0.1 --port 5000 --workers 1")

    # start-up --------------------------------------------------------------------------------------------------
    def _start_run(self) -> None:
        if self.tracking_uri.startswith(("http://", "https://")) and not server_reachable(self.tracking_uri):
            raise ConnectionError(f"no MLflow server answers at {self.tracking_uri}/health")
        if is_local_store(self.tracking_uri):
            Path(self.cfg.storage.run_dir).mkdir(parents=True, exist_ok=True)
        seed_sqlite_store(self.tracking_uri)
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        self.experiment_id = self._experiment_id()
        previous = self._previous_run_id() if self.resume else None
        tags = run_tags(self.cfg) | ({"dora.resumed_from": previous} if previous else {})
        run = self._client.create_run(self.experiment_id, run_name=default_run_name(self.cfg), tags=tags)
        self.run_id = run.info.run_id
        self._log_params()
        if previous:  # the killed run holds metrics of updates the resume trains again: it is closed, not continued
            self._client.set_tag(previous, "dora.superseded_by", self.run_id)
            if self._client.get_run(previous).info.status == "RUNNING":  # its driver was killed
                self._client.set_terminated(previous, "KILLED")
        self._remember_run_id()

    def _experiment_id(self) -> str:
        name = self.cfg.tracking.experiment
        found = self._client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = artifact_location(self.cfg) if is_local_store(self.tracking_uri) else None
        try:
            return self._client.create_experiment(name, artifact_location=location)
        except Exception:  # another process created it meanwhile
            found = self._client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _log_params(self) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in self.cfg.flat().items()]
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=items[i:i + MAX_PARAMS_PER_BATCH])

    def _previous_run_id(self) -> str | None:
        path = Path(self.cfg.storage.run_dir) / RUN_ID_FILE
        if not path.is_file():
            return None
        run_id = path.read_text().strip()
        try:
            self._client.get_run(run_id)
        except Exception:  # noqa: BLE001 - a run of another store, or deleted: start a new one
            return None
        return run_id

    def _remember_run_id(self) -> None:
        run_dir = Path(self.cfg.storage.run_dir)
        if run_dir.is_dir():
            (run_dir / RUN_ID_FILE).write_text(self.run_id + "\n")


class NullTracker:
    """Same interface as Tracker, records nothing (tests, `tracking` switched off)."""

    run_id = None
    experiment_id = None
    tracking_uri = ""
    failures = 0

    def __init__(self, cfg: Config | None = None, **_: Any) -> None:
        self.cfg = cfg

    def __enter__(self) -> "NullTracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return False

    def start(self) -> "NullTracker":
        return self

    def close(self, status: str = "FINISHED") -> None:
        pass

    def log_update(self, update: int, metrics: Mapping[str, Any]) -> None:
        pass

    def flush_metrics(self) -> None:
        pass

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        pass

    def log_text(self, name: str, text: str) -> None:
        pass

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        pass

    def ui_command(self) -> str:
        return ""
