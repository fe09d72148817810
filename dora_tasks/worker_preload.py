"""Preloaded into every worker process of the embedded cluster (`Nanny(preload=[...])`, run at each start and restart).

Ctrl-C in a terminal sends SIGINT to every process of its foreground process group, the embedded workers included.
The driver stops the run and closes the cluster itself, so a worker ignores SIGINT instead of dying mid-task with a
KeyboardInterrupt traceback (and a Nanny restarting it while the cluster closes). A driver that stops while it
fetches a result from a worker leaves that worker's send half done, and a worker whose heartbeat falls while the
scheduler closes finds the connection gone: the worker logs each in one line, without the traceback of its closed
connection.
"""
from __future__ import annotations

import logging
import signal
import threading

CLIENT_LEFT_MID_FETCH = "failed during get data with %s -> %s"  # distributed.worker's message; `who` None: a client
HEARTBEAT_LOST = "Failed to communicate with scheduler during heartbeat."  # distributed.worker's, on an OSError only


class PeerClosedConnection(logging.Filter):
    """Keeps the line of a fetch its client abandoned, or of a heartbeat whose connection to the scheduler closed,
    and drops the traceback (a client's exit or a closing scheduler is not a worker fault)."""

    def filter(self, record: logging.LogRecord) -> bool:
        abandoned = record.msg == CLIENT_LEFT_MID_FETCH and record.args and record.args[-1] is None
        if abandoned or record.msg == HEARTBEAT_LOST:
            record.exc_info, record.exc_text = None, None
        return True


def dask_setup(worker) -> None:
    logger = logging.getLogger("distributed.worker")
    if not any(isinstance(f, PeerClosedConnection) for f in logger.filters):
        logger.addFilter(PeerClosedConnection())
    if threading.current_thread() is threading.main_thread():  # only the main thread may set a signal handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)
