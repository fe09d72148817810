"""A quiet terminal: what engines and libraries print goes to the run's log file, `<run_dir>/run.log`.

While a run is open, `RunLog` points this process's standard output and error *file descriptors* at the log file, so
everything written to them lands there: C and C++ output (vLLM, torch, DeepSpeed's op build), Python loggers and
progress bars bound to the old streams, `warnings`, and every worker process the embedded cluster starts meanwhile
(a child inherits the descriptors; `dora_tasks.worker_preload` keeps Ctrl-C away from those workers). What the user
must see goes to `terminal`, a stream on a copy of the original stderr: the line naming the log file, the live
view, and the `dora` logger's warnings (also written to the file, with its info lines). The summary is printed
after the run closes, when the descriptors are back.

Simplified: where stderr is not a file descriptor (a notebook, pytest's capsys) the terminal is that stream as it
is; the descriptors are still redirected, and they are where child processes and C code write anyway.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import TextIO

LOG_NAME = "run.log"
STD_FDS = (1, 2)
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
TERMINAL_FORMAT = "dora: %(levelname)s: %(message)s"


def log_path(run_dir: str) -> str:
    return os.path.join(run_dir, LOG_NAME)


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass


def _terminal_stream() -> tuple[TextIO, bool]:
    """A stream on a copy of stderr's descriptor (it stays on the terminal when fd 2 moves), and whether it is
    ours to close; stderr itself where it has no descriptor of its own."""
    try:
        if sys.stderr.fileno() == 2:
            return os.fdopen(os.dup(2), "w", buffering=1, errors="replace"), True
    except (AttributeError, OSError, ValueError):
        pass
    return sys.stderr, False


class InterruptedSync(logging.Filter):
    """Ctrl-C just as a Dask client call starts: distributed's `sync` then cancels a future it has not made yet, and
    tornado logs the NameError of that callback with a traceback. The stop is the user's: the line stays, the
    traceback goes."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, NameError) and "sync.<locals>.cancel" in record.getMessage():
            record.exc_info, record.exc_text = None, None
        return True


INTERRUPTED_SYNC_LOGGER = "tornado.application"


class RunLog:
    """Context manager: the log file takes fds 1 and 2 (and the `dora` logger) while the run is open; `terminal`
    is where the user's lines go. Disabled (`enabled=False`), nothing moves and `terminal` is stderr."""

    def __init__(self, run_dir: str, enabled: bool = True) -> None:
        self.path = log_path(run_dir)
        self.enabled = enabled
        self.terminal: TextIO = sys.stderr
        self._own_terminal = False
        self._saved_fds: dict[int, int] = {}
        self._saved_logger: tuple | None = None
        self._made_folder = False
        self._interrupted_sync: logging.Filter | None = None

    def __enter__(self) -> RunLog:
        if not self.enabled:
            return self
        folder = os.path.dirname(os.path.abspath(self.path))
        self._made_folder = not os.path.isdir(folder)
        os.makedirs(folder, exist_ok=True)
        self.terminal, self._own_terminal = _terminal_stream()
        _flush_std()
        log_fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            for fd in STD_FDS:
                self._saved_fds[fd] = os.dup(fd)
                os.dup2(log_fd, fd)
        finally:
            os.close(log_fd)
        self._route_dora_logger()
        self._interrupted_sync = InterruptedSync()
        logging.getLogger(INTERRUPTED_SYNC_LOGGER).addFilter(self._interrupted_sync)
        self.say(f"engine and library logs: {self.path}")
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def say(self, message: str) -> None:
        """One line for the user on the terminal (never fatal: a closed terminal loses the line)."""
        try:
            self.terminal.write(f"[dora] {message}\n")
            self.terminal.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        if not self._saved_fds and self._saved_logger is None:
            return
        _flush_std()
        for fd, saved in self._saved_fds.items():
            os.dup2(saved, fd)
            os.close(saved)
        self._saved_fds.clear()
        self._restore_dora_logger()
        logging.getLogger(INTERRUPTED_SYNC_LOGGER).removeFilter(self._interrupted_sync)
        if self._own_terminal:
            self.terminal.close()
        self.terminal, self._own_terminal = sys.stderr, False

    def discard(self) -> None:
        """Close, and remove the log file and the folder it made: a run that failed before it wrote anything (the
        cluster cannot be reached) leaves the folder as it found it."""
        self.close()
        if self._made_folder:
            with contextlib.suppress(OSError):
                os.remove(self.path)
                os.rmdir(os.path.dirname(os.path.abspath(self.path)))

    def _route_dora_logger(self) -> None:
        """The `dora` logger: info and up to the file, warnings and up to the terminal too (its own handlers, such
        as the command line's, are set aside meanwhile: they write to the redirected stderr). Records still
        propagate to the caller's own handlers."""
        logger = logging.getLogger("dora")
        self._saved_logger = (list(logger.handlers), logger.level)
        to_file = logging.FileHandler(self.path)
        to_file.setFormatter(logging.Formatter(FILE_FORMAT))
        to_terminal = logging.StreamHandler(self.terminal)
        to_terminal.setLevel(logging.WARNING)
        to_terminal.setFormatter(logging.Formatter(TERMINAL_FORMAT))
        logger.handlers = [to_file, to_terminal]
        logger.setLevel(logging.INFO)

    def _restore_dora_logger(self) -> None:
        if self._saved_logger is None:
            return
        logger = logging.getLogger("dora")
        for handler in logger.handlers:
            handler.close()
        logger.handlers, level = self._saved_logger
        logger.setLevel(level)
        self._saved_logger = None
