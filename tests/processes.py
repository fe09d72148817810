"""`dora` commands as real processes for the tests that kill them by PID."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dora(log_path, *args: str) -> subprocess.Popen:
    """`dora ...` in its own session, output to a file (a full pipe would stall it)."""
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "pipelines.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT, text=True, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    """Clean up worker processes the killed driver left behind (they are in its session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
