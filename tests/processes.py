"""`dora` and `dask` commands as real processes for the tests that start, kill and stop them."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dora(log_path, *args: str) -> subprocess.Popen:
    """`dora ...` in its own session, output to a file (a full pipe would stall it), with Ctrl-C's signal handled as
    in a terminal even where the test itself runs in the background (which starts it with SIGINT ignored)."""
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "pipelines.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT, text=True, start_new_session=True, preexec_fn=_sigint_as_in_a_terminal)


def _sigint_as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python then installs its KeyboardInterrupt handler at start-up


def resume_to_end(log_path, run_dir, *overrides: str, timeout_s: float = 900) -> None:
    """`dora resume run_dir overrides...` run to its end; it must exit 0 (the log's tail says why not)."""
    resumed = dora(log_path, "resume", str(run_dir), *overrides)
    try:
        resumed.wait(timeout=timeout_s)
    finally:
        kill_group(resumed)
    assert resumed.returncode == 0, Path(log_path).read_text()[-5000:]


def kill_group(proc: subprocess.Popen) -> None:
    """Clean up worker processes the killed driver left behind (they are in its session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM all (the `dask` CLI closes its nanny and worker on it), then kill what is left of each session."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its own process group
        except ProcessLookupError:
            pass
        proc.wait()


def read_scheduler_file(path: Path, timeout_s: float = 60) -> str:
    """The address a `dask scheduler --scheduler-file` wrote, once it has written it."""
    deadline = time.time() + timeout_s
    while not path.exists() or not path.read_text().strip():
        assert time.time() < deadline, f"the scheduler wrote no {path} in {timeout_s:.0f} s"
        time.sleep(0.2)
    return json.loads(path.read_text())["address"]
