"""The stores on an S3-compatible object store (moto's server on 127.0.0.1, started here), and a whole `dora run` on a
cluster whose workers share no folder with the driver.

Unit tests: weight store (publish protocol, per-worker download cache), trajectory store (append/commit/read while a
writer is live, audit), checkpoints (marker last, trainer folders written through `staged`), config validation.
End to end: a `dask scheduler` and three labelled `dask worker` processes, each with its own working folder, HOME,
TMPDIR and local directory, and a driver (`dora run`, a subprocess) in a third folder; every store on s3://. An audit
hook in each worker (tests/worker_fs_guard.py) records any access to the driver's folders; there must be none.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL_RUN
from processes import read_scheduler_file, stop_processes
from waiting import wait_until

from dora_tasks.core.config import ConfigError, load_config
from storage import objectstore
from storage.audit import audit_store
from storage.audit import main as audit_main
from storage.checkpoint import CheckpointError, CheckpointStore
from storage.synthetic import make_group, simulate_run
from storage.trajectory_store import StoreExistsError, TrajectoryStore
from storage.weight_store import MARKER, WeightStore, WeightStoreError

pytest.importorskip("s3fs")

REPO = Path(__file__).resolve().parents[1]
GUARD = REPO / "tests" / "worker_fs_guard.py"
META = {"group_size": 4, "max_staleness": 2}


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on a free loopback port; the AWS_* variables s3fs/botocore read point at it (for this
    process and the processes it starts). Yields a function that creates a fresh bucket and returns its s3:// URL."""
    port = free_port()  # its own process: moto's Flask app in this one would break vLLM's start in later tests
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    host = "127.0.0.1"
    wait_until(lambda: port_open(host, port), 60, "moto's server listens")
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)

    def bucket() -> str:
        name = f"dora-{uuid.uuid4().hex[:10]}"
        objectstore.filesystem(f"s3://{name}").mkdir(name)
        return f"s3://{name}"

    try:
        yield bucket
    finally:
        stop_processes([server])
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) == 0


def write_file(name: str, text: str):
    def write(folder: str) -> None:
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    return write


def read_text(folder: str, name: str) -> str:
    with open(os.path.join(folder, name)) as f:
        return f.read()


# ---- weight store ---------------------------------------------------------------------------------------------------
def test_weight_store_publishes_lists_and_retains_on_s3(s3):
    weights = WeightStore(f"{s3()}/run/weights")
    assert weights.versions() == [] and weights.latest() is None
    for v in range(3):
        published = weights.publish(v, write_file("model.safetensors", f"v{v}"))
        assert published.path == f"{weights.root}/v{v:06d}"
    assert weights.versions() == [0, 1, 2]
    with pytest.raises(WeightStoreError, match="already published"):
        weights.publish(2, write_file("model.safetensors", "again"))
    assert weights.retain({1, 2}) == [0] and weights.versions() == [1, 2]
    assert not objectstore.exists(weights.path_for(0))  # its files went too, not only the marker


def test_a_version_is_visible_only_once_complete(s3, monkeypatch):
    weights = WeightStore(f"{s3()}/weights")
    weights.publish(0, write_file("model.safetensors", "v0"))

    def crash(folder):
        write_file("model.safetensors", "half")(folder)
        raise RuntimeError("trainer died while writing")

    with pytest.raises(RuntimeError):
        weights.publish(1, crash)
    real_upload = objectstore.upload_folder

    def upload_then_die(local_dir, url):  # the files arrive, the process dies before the marker
        real_upload(local_dir, url)
        raise ConnectionError("lost the object store")

    monkeypatch.setattr(objectstore, "upload_folder", upload_then_die)
    with pytest.raises(ConnectionError):
        weights.publish(2, write_file("model.safetensors", "v2"))
    monkeypatch.undo()
    assert objectstore.exists(f"{weights.path_for(2)}/model.safetensors")
    assert weights.versions() == [0]  # without its marker, version 2 is not there
    with pytest.raises(objectstore.ObjectStoreError, match="not published"):
        objectstore.local_folder(weights.path_for(2))
    weights.publish(2, write_file("model.safetensors", "v2"), overwrite=True)
    assert weights.versions() == [0, 2]


def test_workers_read_versions_through_a_cache_keyed_by_publication(s3, tmp_path):
    weights = WeightStore(f"{s3()}/weights")
    cache = str(tmp_path / "cache")
    weights.publish(1, write_file("model.safetensors", "first"))
    first = objectstore.local_folder(weights.path_for(1), cache_dir=cache)
    assert read_text(first, "model.safetensors") == "first" and os.path.isfile(os.path.join(first, MARKER))
    assert objectstore.local_folder(weights.path_for(1), cache_dir=cache) == first  # downloaded once
    weights.publish(1, write_file("model.safetensors", "second"), overwrite=True)  # published again (restored trainer)
    second = objectstore.local_folder(weights.path_for(1), cache_dir=cache)
    assert second != first and read_text(second, "model.safetensors") == "second"
    for v in range(2, 2 + objectstore.CACHE_KEEP + 2):
        weights.publish(v, write_file("model.safetensors", f"v{v}"))
        objectstore.local_folder(weights.path_for(v), cache_dir=cache)
    assert len(os.listdir(cache)) == objectstore.CACHE_KEEP  # least recently used folders are evicted
    local = str(tmp_path / "plain")
    assert objectstore.local_folder(local) == local  # a local path is used as it is


def test_the_initial_model_is_shared_through_the_store(s3, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text('{"type": "char"}')
    assert WeightStore(str(tmp_path / "w")).share_initial(str(model)) == str(model)  # local store: unchanged
    weights = WeightStore(f"{s3()}/weights")
    url = weights.share_initial(str(model))
    assert url == f"{weights.root}/initial" and weights.versions() == []  # not a version: never retained
    copy = objectstore.local_folder(url, cache_dir=str(tmp_path / "cache"))
    assert read_text(copy, "tokenizer.json") == '{"type": "char"}'
    (model / "tokenizer.json").write_text("changed")
    assert weights.share_initial(str(model), overwrite=False) == url  # resume: kept as it was
    assert objectstore.filesystem(url).cat_file(f"{url}/tokenizer.json") == b'{"type": "char"}'


# ---- trajectory store ------------------------------------------------------------------------------------------------
def test_trajectory_store_appends_commits_and_audits_on_s3(s3, capsys):
    url = f"{s3()}/run/trajectories.zarr"
    with TrajectoryStore.create(url, META) as store:
        run = simulate_run(store, updates=6, groups_per_version=4, group_size=4, max_staleness=2, seed=1)
    assert objectstore.exists(url)
    with pytest.raises(StoreExistsError):
        TrajectoryStore.create(url, META)
    reader = TrajectoryStore.open(url)
    consumed = reader.read_table("trajectories")
    assert len(consumed["group_id"]) == 4 * len(run.consumed)
    assert reader.read_table("updates")["update"].tolist() == list(range(6))
    rows = np.arange(len(consumed["group_id"]))
    assert [len(v) for v in reader.read_ragged("token_versions", rows)] == consumed["response_len"].tolist()
    report = audit_store(url, 2)
    assert report.ok, report.to_text()
    assert audit_main([url]) == 0 and "RESULT: OK" in capsys.readouterr().out


def test_a_reader_sees_whole_flushes_of_a_live_writer_on_s3(s3):
    url = f"{s3()}/live.zarr"
    writer = TrajectoryStore.create(url, META)
    reader = TrajectoryStore.open(url)
    rng = np.random.default_rng(0)
    writer.append_consumed([make_group(0, 0, rng, group_size=4)], 0, 1.0)
    assert reader.num_rows("trajectories") == 0  # buffered, not committed
    writer.flush()
    assert reader.num_rows("trajectories") == 4
    writer.append_consumed([make_group(1, 0, rng, group_size=4)], 1, 2.0)
    writer.close()
    assert reader.num_rows("trajectories") == 8
    appender = TrajectoryStore.open(url, mode="a")  # reopened for appending (resume)
    appender.truncate_to({"trajectories": 4})
    appender.close()
    assert TrajectoryStore.open(url).num_rows("trajectories") == 4


# ---- checkpoints -----------------------------------------------------------------------------------------------------
def trainer_writer(text: str):
    """What the trainer does with the folder URL it is given: write locally, upload (`staged`)."""
    def write(folder: str) -> None:
        with objectstore.staged(folder) as local:
            write_file("engine.pt", text)(local)
    return write


def test_checkpoints_on_s3_are_complete_or_skipped(s3):
    root = f"{s3()}/run/checkpoints"
    ckpts = CheckpointStore(root)
    assert ckpts.latest() is None and ckpts.updates() == []
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpts.load_latest()
    saved = ckpts.save(2, {"gate": {"newest": 3}, "rows": np.int64(40)}, {"trainer": trainer_writer("u2")})
    assert saved.state == {"gate": {"newest": 3}, "rows": 40} and saved.files == ["trainer"]
    with objectstore.fetched(saved.file("trainer")) as local:
        assert read_text(local, "engine.pt") == "u2"
    fs = objectstore.filesystem(root)
    fs.pipe_file(f"{root}/ckpt-000004/state.json", b'{"gate": "half"}')  # a save that never reached COMPLETE
    assert ckpts.updates() == [2] and ckpts.latest().update == 2
    with pytest.raises(CheckpointError, match="incomplete"):
        ckpts.load(4)
    ckpts.save(2, {"again": True}, {"trainer": trainer_writer("u2 again")})  # the same update, replaced
    assert ckpts.load(2).state == {"again": True}
    for update in (6, 8):
        ckpts.save(update, {"u": update}, {"trainer": trainer_writer(f"u{update}")})
    assert ckpts.prune(keep_last=2) == [2, 4] and ckpts.updates() == [6, 8]
    assert not objectstore.exists(f"{root}/ckpt-000004")


def test_eviction_skips_a_folder_another_thread_evicted_after_the_listing(tmp_path, monkeypatch):
    """Two task threads of one worker evict at once: a folder listed by one and removed by the other before the
    first reads its time must not fail the first (a rollout task failed that way on a loaded machine)."""
    names = [f"v{v:06d}" for v in range(objectstore.CACHE_KEEP + 2)]
    for name in names:
        (tmp_path / name).mkdir()
    listing = list(os.scandir(tmp_path))
    (tmp_path / names[0]).rmdir()  # the other thread's eviction, between the listing and the stat
    real_scandir = os.scandir  # shutil.rmtree lists the folders it removes with it too
    monkeypatch.setattr(objectstore.os, "scandir",
                        lambda path, *a: iter(listing) if str(path) == str(tmp_path) else real_scandir(path, *a))
    objectstore._evict(str(tmp_path), keep=names[-1])
    assert names[-1] in os.listdir(tmp_path) and len(os.listdir(tmp_path)) == objectstore.CACHE_KEEP


def test_staged_and_fetched_leave_local_paths_alone(tmp_path):
    folder = str(tmp_path / "ckpt")
    with objectstore.staged(folder) as local:
        assert local == folder
    with objectstore.fetched(folder) as local:
        assert local == folder
    with objectstore.fetched(None) as local:
        assert local is None


# ---- configuration ---------------------------------------------------------------------------------------------------
def test_store_root_puts_every_store_under_one_url():
    storage = load_config(None, ["storage.store_root=s3://bucket/runs/a/", "storage.run_dir=runs/a"]).storage
    assert storage.resolved("trajectory_store") == "s3://bucket/runs/a/trajectories.zarr"
    assert storage.resolved("weight_store") == "s3://bucket/runs/a/weights"
    assert storage.resolved("checkpoint_store") == "s3://bucket/runs/a/checkpoints"
    local = load_config(None, ["storage.run_dir=runs/b", "storage.weight_store=s3://bucket/w"]).storage
    assert local.resolved("trajectory_store") == os.path.join("runs/b", "trajectories.zarr")
    assert local.resolved("checkpoint_store") == os.path.join("runs/b", "checkpoints")
    assert local.resolved("weight_store") == "s3://bucket/w"


@pytest.mark.parametrize("override, named, says", [
    ("storage.store_root=nosuch://bucket/x", "storage.store_root", "unsupported URL scheme 'nosuch'"),
    ("storage.weight_store=memory://w", "storage.weight_store", "inside one process"),
    ("storage.checkpoint_store=https://example.com/c", "storage.checkpoint_store", "read-only"),
    ("storage.trajectory_store=s3://", "storage.trajectory_store", "names no bucket"),
    ("storage.run_dir=s3://bucket/run", "storage.run_dir", "local folder of the driver"),
])
def test_unsupported_store_locations_are_named(override, named, says):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).startswith(named) and says in str(err.value), str(err.value)


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed")
def test_a_scheme_whose_package_is_missing_says_which():
    with pytest.raises(ConfigError, match=r"storage.store_root: 'gs://bucket/x' needs a package .*gcsfs"):
        load_config(None, ["storage.store_root=gs://bucket/x"])


# ---- end to end: no folder shared between driver and workers ---------------------------------------------------------
WORKERS = {"rollout": ("1", "GPU=1,ROLLOUT=1"), "trainer": ("2", "GPU=1,TRAINER=1"), "cpu": ("1", "CPU=1")}
RUN_TIMEOUT_S = 900


class Cluster:
    """`python -m dask scheduler|worker` processes, each in its own folder (cwd, HOME, TMPDIR, local directory)."""

    def __init__(self, root: Path, env: dict[str, str]):
        self.root, self.env, self.procs, self.folders = root, env, [], {}

    def start(self, name: str, *args: str) -> Path:
        folder = self.root / name
        (folder / "tmp").mkdir(parents=True)
        env = {**self.env, "HOME": str(folder), "TMPDIR": str(folder / "tmp")}
        with open(folder / "process.log", "wb") as log:
            self.procs.append(subprocess.Popen([sys.executable, "-m", "dask", *args], cwd=folder, env=env,
                                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        self.folders[name] = folder
        return folder

    def stop(self) -> None:
        stop_processes(self.procs)



@pytest.mark.slow
def test_a_run_and_its_resume_with_every_store_on_s3_need_no_shared_folder(s3, tmp_path):
    from distributed import Client

    from dora_tasks.plugins import WORKER_ENV
    from pipelines.cache import cache_root

    driver = tmp_path / "driver"
    driver.mkdir()
    forbidden = [str(driver), cache_root()]  # the driver's folder and its warm-start cache
    env = {**os.environ, **WORKER_ENV, "DORA_FORBIDDEN_ROOTS": os.pathsep.join(forbidden)}
    cluster = Cluster(tmp_path / "cluster", env)
    try:
        folder = cluster.start("scheduler", "scheduler", "--host", "127.0.0.1", "--port", "0",
                               "--dashboard-address", "127.0.0.1:0", "--scheduler-file", "scheduler.json")
        address = read_scheduler_file(folder / "scheduler.json")
        for name, (nthreads, resources) in WORKERS.items():
            here = cluster.root / name
            cluster.start(name, "worker", address, "--nthreads", nthreads, "--resources", resources,
                          "--host", "127.0.0.1", "--dashboard-address", "127.0.0.1:0", "--memory-limit", "3GiB",
                          "--local-directory", str(here / "local"), "--preload", str(GUARD))
        canary = driver / "canary.txt"
        canary.write_text("the driver's")
        with Client(address, timeout=30) as client:
            client.wait_for_workers(len(WORKERS), timeout=120)
            assert set(client.run(Path.read_text, canary).values()) == {"the driver's"}  # pathlib: no pickling by value
        for name in WORKERS:  # the guard works: each worker's canary read was recorded
            log = cluster.folders[name] / "forbidden-access.log"
            assert str(canary) in log.read_text(), name
            log.unlink()
        canary.unlink()

        root = f"{s3()}/runs/demo"
        overrides = SMALL_RUN + [
            "storage.run_dir=run", f"storage.store_root={root}", "storage.checkpoint_interval=2",
            f"tracking.mlflow_uri=sqlite:///{driver}/ml.db", f"cluster.scheduler_address={address}",
            "dora.max_staleness=1", "dora.num_updates=4", "task.eval_interval=2"]
        with open(driver / "run.log", "w") as log:
            proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", "--config",
                                   str(REPO / "configs" / "cpu_demo.yaml"), *overrides], cwd=driver, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S, check=False)
        output = (driver / "run.log").read_text()
        assert proc.returncode == 0, output[-5000:]
        assert "audit: PASS" in output, output[-3000:]
        fs = objectstore.filesystem(root)
        assert fs.cat_file(f"{root}/weights/v000004/model.safetensors") != fs.cat_file(
            f"{root}/weights/initial/model.safetensors")  # the workers trained and published through S3

        # resume from the S3 checkpoint (after update 1): store truncated on S3, trainer state fetched from S3
        with open(driver / "resume.log", "w") as log:
            proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "resume", "run", "dora.num_updates=6"],
                                  cwd=driver, stdout=log, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S,
                                  check=False)
        output = (driver / "resume.log").read_text()
        assert proc.returncode == 0, output[-5000:]
        assert "audit: PASS" in output, output[-3000:]

        accesses = {name: (cluster.folders[name] / "forbidden-access.log") for name in WORKERS}
        touched = {name: p.read_text().splitlines()[:5] for name, p in accesses.items() if p.exists()}
        assert touched == {}, f"workers touched the driver's folders: {touched}"
        for name in WORKERS:  # each worker read what it needed from S3, into a cache in its local directory
            cached = glob.glob(str(cluster.folders[name] / "local" / "**" / objectstore.CACHE_DIR / "*" / MARKER),
                               recursive=True)
            assert cached, f"{name} downloaded nothing into its local directory"
            assert not glob.glob(str(cluster.folders[name] / "tmp" / f"{objectstore.CACHE_DIR}*")), name
    finally:
        cluster.stop()

    report = audit_store(f"{root}/trajectories.zarr", 1)
    assert report.ok, report.to_text()
    assert TrajectoryStore.open(f"{root}/trajectories.zarr").read_table("updates")["update"].tolist() == list(range(6))
    assert WeightStore(f"{root}/weights").latest() == 6
    checkpoint = CheckpointStore(f"{root}/checkpoints").latest()
    assert checkpoint is not None and checkpoint.update == 3 and checkpoint.files == ["trainer"]
    assert objectstore.filesystem(root).find(checkpoint.file("trainer"))  # written by the trainer, through S3
    assert sorted(os.listdir(driver / "run")) and not {"trajectories.zarr", "weights", "checkpoints"} & set(
        os.listdir(driver / "run"))  # the driver's run folder holds no store
