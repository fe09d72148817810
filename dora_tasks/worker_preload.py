"""Preloaded into every worker process of the embedded cluster (`Nanny(preload=[...])`, run at each start and restart).

Ctrl-C in a terminal sends SIGINT to every process of its foreground process group, the embedded workers included.
The driver stops the run and closes the cluster itself, so a worker ignores SIGINT instead of dying mid-task with a
KeyboardInterrupt traceback (and a Nanny restarting it while the cluster closes).
"""
from __future__ import annotations

import signal
import threading


def dask_setup(worker) -> None:
    if threading.current_thread() is threading.main_thread():  # only the main thread may set a signal handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)
