"""Safe by default: the embedded cluster listens on loopback only, and a TLS cluster started from the CLI runs a job
for a driver holding its certificate and refuses clients without one.

Real processes throughout: the embedded cluster exactly as a run starts it (`connect(cfg)`), and a `dask scheduler`
with three labelled `dask worker` processes started with the README's flags, on throw-away certificates.
"""
from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from distributed import Client, Security
from processes import read_scheduler_file, stop_processes

from dora_tasks.core.config import ConfigError, load_config
from dora_tasks.plugins import WORKER_ENV
from pipelines.cluster import ClusterError, connect, security, wait_for_workers
from pipelines.streaming import run_pipeline
from storage.audit import audit_store

REPO = Path(__file__).resolve().parents[1]


def listening_sockets(*roots: psutil.Process) -> list[tuple[int, str, int]]:
    """(pid, ip, port) of every listening inet socket of the given processes and their descendants."""
    pids = {p.pid for root in roots for p in (root, *root.children(recursive=True))}
    return [(c.pid, c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
            if c.pid in pids and c.status == psutil.CONN_LISTEN]


def not_loopback(sockets: list[tuple[int, str, int]]) -> list[tuple[int, str, int]]:
    return [s for s in sockets if not ipaddress.ip_address(s[1]).is_loopback]


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def advertised_ports(client: Client) -> set[int]:
    """Every port the scheduler knows of: its own, its dashboard's, and each worker's, nanny's and HTTP server's."""
    ident = client.sync(client.scheduler.identity, n_workers=-1)
    ports = {port_of(ident["address"]), *ident["services"].values()}
    for address, info in ident["workers"].items():
        ports |= {port_of(address), port_of(info["nanny"]), *info["services"].values()}
    return ports


def write_certificates(folder: Path) -> dict[str, str]:
    """A throw-away self-signed certificate (its own CA) and its key, as PEM files."""
    folder.mkdir(parents=True, exist_ok=True)
    sec = Security.temporary()
    files = {"ca": folder / "ca.pem", "cert": folder / "cert.pem", "key": folder / "key.pem"}
    for name, text in (("ca", sec.tls_ca_file), ("cert", sec.tls_client_cert), ("key", sec.tls_client_key)):
        files[name].write_text(text)
    return {name: str(path) for name, path in files.items()}


def tls_keys(certs: dict[str, str]) -> list[str]:
    return [f"cluster.tls_{key}={certs[name]}" for key, name in (("ca_file", "ca"), ("cert", "cert"), ("key", "key"))]


def tls_flags(certs: dict[str, str]) -> list[str]:
    return ["--tls-ca-file", certs["ca"], "--tls-cert", certs["cert"], "--tls-key", certs["key"]]


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> dict[str, str]:
    return write_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def foreign_certificates(tmp_path_factory) -> dict[str, str]:
    return write_certificates(tmp_path_factory.mktemp("foreign-certs"))


# --- configuration ---------------------------------------------------------------------------------------------------

def test_the_default_binding_is_loopback():
    cfg = load_config(None, [])
    assert cfg.cluster.host == "127.0.0.1" and cfg.cluster.dashboard_address.startswith("127.0.0.1:")
    assert security(cfg.cluster) is None


@pytest.mark.parametrize("override, named", [
    ("cluster.host=tcp://0.0.0.0", "cluster.host"),
    ("cluster.host=", "cluster.host"),
    ("cluster.host=127.0.0.1:8786", "cluster.host"),
    ("cluster.tls_cert={cert}", "cluster.tls_ca_file"),
    ("cluster.tls_ca_file={ca} cluster.tls_cert={cert} cluster.tls_key=/nonexistent/key.pem", "cluster.tls_key"),
    ("{tls} cluster.scheduler_address=tcp://127.0.0.1:8786", "cluster.scheduler_address"),
])
def test_binding_and_tls_errors_name_the_key(certificates, override, named):
    text = override.format(tls=" ".join(tls_keys(certificates)), **certificates)
    with pytest.raises(ConfigError) as err:
        load_config(None, text.split(" "))
    assert str(err.value).startswith(named)


def test_the_tls_keys_make_a_security_that_requires_encryption(certificates):
    cfg = load_config(None, tls_keys(certificates) + ["cluster.scheduler_address=tls://127.0.0.1:8786"])
    sec = security(cfg.cluster)
    assert sec.require_encryption and sec.tls_client_cert == certificates["cert"]
    assert sec.tls_scheduler_key == sec.tls_worker_key == certificates["key"]


# --- the embedded cluster ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_the_embedded_cluster_listens_on_loopback_only(small_config, certificates, tls):
    """Every listening socket of this process and its children (scheduler, dashboard, nannies, workers' RPC and HTTP
    servers) is loopback, and every port the scheduler advertises was among them (the check is not vacuous)."""
    cfg = small_config(*(tls_keys(certificates) if tls else []))
    cluster, client = connect(cfg)
    try:
        wait_for_workers(client, 60)
        sockets = listening_sockets(psutil.Process())
        assert not not_loopback(sockets), not_loopback(sockets)
        ports = advertised_ports(client)
        n_workers = cfg.rollout.instances + 1 + cfg.cluster.cpu_workers
        assert len(ports) == 2 + 3 * n_workers and ports <= {port for _, _, port in sockets}
        assert client.dashboard_link.startswith("http://127.0.0.1:")  # what the run prints
        assert client.scheduler.address.startswith(("tls" if tls else "tcp") + "://127.0.0.1:")
        assert client.submit(sum, [1, 2], pure=False).result() == 3
    finally:
        client.close()
        cluster.close()


def _worker_start() -> tuple[str | None, object, bool]:
    """In a worker: the test's mark from the environment, its event-loop tick, and whether a forkserver started it."""
    import dask

    parent = " ".join(psutil.Process().parent().cmdline())
    return os.environ.get("DORA_TEST_MARK"), dask.config.get("distributed.admin.tick.interval"), "forkserver" in parent


def test_embedded_workers_fork_from_a_server_yet_see_this_process_environment(small_config, monkeypatch):
    """A forked worker inherits its server's environment, which an earlier cluster of this process may have started:
    the Nanny passes the environment of the moment on. The quiet tick (`EMBEDDED_DASK_CONFIG`) reaches every worker,
    and the benchmarks' CLI workers get the same settings from their environment."""
    from multiprocessing import forkserver

    import dask
    from distributed.utils import get_mp_context

    from benchmarks.emulated_scale import QUIET_WORKERS
    from pipelines.cluster import EMBEDDED_DASK_CONFIG, WORKER_START_METHOD

    with dask.config.set(WORKER_START_METHOD):
        get_mp_context()  # distributed's preloads, as its Nannies set them
    forkserver.ensure_running()  # the server predates the mark
    mark = f"mark-{time.time_ns()}"
    monkeypatch.setenv("DORA_TEST_MARK", mark)
    cluster, client = connect(small_config())
    try:
        wait_for_workers(client, 60)
        seen = set(client.run(_worker_start).values())
    finally:
        client.close()
        cluster.close()
    assert seen == {(mark, EMBEDDED_DASK_CONFIG["distributed.admin.tick.interval"], True)}
    from_env = dask.config.collect_env(QUIET_WORKERS)
    assert {key: dask.config.get(key, config=from_env) for key in EMBEDDED_DASK_CONFIG} == EMBEDDED_DASK_CONFIG


# --- a TLS cluster started from the CLI -------------------------------------------------------------------------------

class Processes:
    """`python -m dask ...` subprocesses, each in its own process group, logging to files, stopped together."""

    def __init__(self, folder: Path):
        self.folder, self.started = folder, []

    def start(self, name: str, *args: str) -> None:
        env = {**os.environ, **WORKER_ENV}
        with open(self.folder / f"{name}.log", "wb") as log:
            self.started.append(subprocess.Popen([sys.executable, "-m", "dask", *args], cwd=REPO, env=env,
                                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def roots(self) -> list[psutil.Process]:
        return [psutil.Process(p.pid) for p in self.started]

    def stop(self) -> None:
        stop_processes(self.started)



@pytest.fixture(scope="module")
def tls_cluster(certificates, tmp_path_factory):
    """A TLS `dask scheduler` on loopback (yields its address and the processes); workers join via `tls_workers`."""
    folder = tmp_path_factory.mktemp("tls-cluster")
    procs = Processes(folder)
    try:
        procs.start("scheduler", "scheduler", "--protocol", "tls", "--host", "127.0.0.1", "--port", "0",
                    "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(folder / "scheduler.json"),
                    *tls_flags(certificates))
        yield read_scheduler_file(folder / "scheduler.json"), procs
    finally:
        procs.stop()


WORKER_LABELS = {"rollout": ("1", "GPU=1,ROLLOUT=1"), "trainer": ("2", "GPU=1,TRAINER=1"), "cpu": ("1", "CPU=1")}


@pytest.fixture(scope="module")
def tls_workers(tls_cluster, certificates):
    """The three labelled workers of the README, with TLS and loopback flags, connected."""
    address, procs = tls_cluster
    for name, (nthreads, resources) in WORKER_LABELS.items():
        procs.start(name, "worker", address, "--nthreads", nthreads, "--resources", resources, "--host", "127.0.0.1",
                    "--dashboard-address", "127.0.0.1:0", *tls_flags(certificates))
    cfg = load_config(None, tls_keys(certificates) + [f"cluster.scheduler_address={address}"])
    with Client(address, security=security(cfg.cluster), timeout=30) as client:
        client.wait_for_workers(len(WORKER_LABELS), timeout=120)
    return tls_cluster


def test_a_job_runs_end_to_end_on_a_tls_cluster_started_from_the_cli(small_config, certificates, tls_workers):
    address, procs = tls_workers
    sockets = listening_sockets(*procs.roots())
    assert not not_loopback(sockets), not_loopback(sockets)  # the README's flags keep the CLI cluster on loopback
    assert port_of(address) in {port for _, _, port in sockets}
    cfg = small_config(f"cluster.scheduler_address={address}", *tls_keys(certificates), "dora.num_updates=3")
    summary = run_pipeline(cfg)
    report = audit_store(summary.store, cfg.dora.max_staleness)
    assert summary.audit_ok and report.ok, report.to_text()
    assert report.counts["updates"] == 3


def test_a_client_without_the_certificate_is_refused(tls_cluster, foreign_certificates):
    address, _ = tls_cluster
    with pytest.raises(OSError):  # plain TCP: the scheduler's TLS handshake fails and it hangs up
        Client(address.replace("tls://", "tcp://"), timeout=5)
    foreign = load_config(None, tls_keys(foreign_certificates) + [f"cluster.scheduler_address={address}"])
    with pytest.raises(OSError, match="TLS certificate does not match"):  # a certificate of another CA
        Client(address, security=security(foreign.cluster), timeout=5)
    with pytest.raises(TypeError, match="TLS"):  # no certificate at all: distributed cannot open a TLS connection
        Client(address, timeout=5)


@pytest.mark.parametrize("how, named, mentions", [
    ("tcp", "cluster.scheduler_address", "cluster.tls_cert"),
    ("tls-without-keys", "cluster.tls_cert", "no certificate"),
    ("foreign-keys", "cluster.tls_cert", "TLS handshake"),
])
def test_connect_without_the_certificate_is_a_one_line_cluster_error(small_config, tls_cluster, foreign_certificates,
                                                                     how, named, mentions):
    address, _ = tls_cluster
    overrides = {"tcp": [f"cluster.scheduler_address={address.replace('tls://', 'tcp://')}"],
                 "tls-without-keys": [f"cluster.scheduler_address={address}"],
                 "foreign-keys": [f"cluster.scheduler_address={address}", *tls_keys(foreign_certificates)]}[how]
    start = time.time()
    with pytest.raises(ClusterError) as err:
        connect(small_config(*overrides, "cluster.connect_timeout_s=5"))
    message = str(err.value)
    assert message.startswith(named) and mentions in message and "\n" not in message, message
    assert time.time() - start < 15
