"""Process-isolated rewards (`task.reward_isolation=process`): each call has a hard timeout and a memory limit.

A `Lane` is one reward process (`python -m dora_tasks.workloads.reward_worker`) and its two pipes; `Lane.score_all`
sends it all the calls of a batch at once, split into units (`reward_forms`: one call each, or all of them for a
batch or async reward), and reads the outcomes unit by unit, each within the unit's timeout. A unit that outlives it
is killed with its process and whatever that started (the process leads its own session): `(nan, "timeout")` for
each of its calls. One that allocates past the address-space limit ends its process after reporting
(`(nan, "memory limit: ...")`); one whose process dies is `(nan, "process died (...)")`. The remaining calls go on in
a fresh process. The pool of a Python process (`shared_pool`) lends lanes to one caller at a time and keeps them, so
a Dask worker's reward tasks reuse its processes: a process and the import of the reward module are paid once, not
per call.

Simplified, and why: processes are started with `subprocess`, not `multiprocessing` or `ProcessPoolExecutor`, since a
Dask worker is a daemonic process and those refuse to start children there. The reward function travels pickled
(cloudpickle: a module-level function by its dotted path, which the process imports itself; anything else by value),
and the child's import path is the parent's `sys.path`. The limit is on address space (RLIMIT_AS), not resident
memory: it is exact and needs no watcher, but a library that reserves large virtual ranges needs a higher limit. A
process waits for its parent's calls without a deadline; the time to start it and to import the reward module is
bounded separately (STARTUP_TIMEOUT_S) so that it does not eat the first call's timeout.
"""
from __future__ import annotations

import contextlib
import functools
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import cloudpickle

from dora_tasks.workloads.reward_forms import RewardCall, as_reward_function
from dora_tasks.workloads.reward_worker import LOADED, TIMEOUT, read_frame, write_frame

STARTUP_TIMEOUT_S = 60.0  # start of a process plus the import of a reward module, on a loaded machine
REAP_TIMEOUT_S = 5.0  # a process that closed its pipe has this long to exit before it is killed

Call = RewardCall | tuple  # (prompt, response, answer[, row JSON])
Outcome = tuple[float, str]


class Lane:
    """One reward process, started on first use and replaced after a call ends it; one caller at a time."""

    def __init__(self, memory_bytes: int):
        self.memory_bytes = memory_bytes
        self.process: subprocess.Popen | None = None

    def score_all(self, fn: Callable, calls: Sequence[Call], timeout_s: float) -> list[Outcome]:
        """The outcome of every call, in order, each within `timeout_s`; never raises for what `fn` does."""
        fn = as_reward_function(fn)
        units = fn.units([RewardCall(*call) for call in calls])
        pickled_fn = cloudpickle.dumps(fn)
        results: list[list[Outcome]] = []
        while len(results) < len(units):
            results += self._run(pickled_fn, units[len(results):], timeout_s, fn.unit_timeout(timeout_s))
        return [outcome for unit in results for outcome in unit]

    def close(self) -> None:
        """Kill the process and whatever it started (its own session), and reap it."""
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)  # the group id stays ours until the leader is reaped
        self._reap()

    def _run(self, pickled_fn: bytes, units: list[list[RewardCall]], timeout_s: float,
             unit_timeout_s: float) -> list[list[Outcome]]:
        """Scores `units` in this process until a unit ends it; the outcomes of at least one unit."""
        try:
            self._send(pickled_fn, units, timeout_s)
            if self._read(STARTUP_TIMEOUT_S) != LOADED:
                raise EOFError
        except TimeoutError:
            self.close()
            failed = (float("nan"), f"{TIMEOUT}: the reward process did not load the function")
            return [[failed] * len(unit) for unit in units]
        except EOFError:
            return [[(float("nan"), self._died())] * len(units[0])]
        results: list[list[Outcome]] = []
        for unit in units:
            try:
                outcomes, alive = pickle.loads(self._read(unit_timeout_s))
            except TimeoutError:
                self.close()
                return results + [[(float("nan"), TIMEOUT)] * len(unit)]
            except EOFError:
                return results + [[(float("nan"), self._died())] * len(unit)]
            results.append(outcomes)
            if not alive:
                self._reap()
                return results
        return results

    def _send(self, pickled_fn: bytes, units: list[list[RewardCall]], timeout_s: float) -> None:
        if self.process is None or self.process.poll() is not None:
            self._reap()
            self.process = self._start()
        try:
            write_frame(self.process.stdin.fileno(), pickle.dumps((pickled_fn, units, timeout_s)))
        except BrokenPipeError:
            raise EOFError from None

    def _read(self, timeout_s: float) -> bytes:
        return read_frame(self.process.stdout.fileno(), time.monotonic() + timeout_s)

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(os.path.abspath(p) for p in sys.path))  # "" is the cwd
        return subprocess.Popen([sys.executable, "-m", "dora_tasks.workloads.reward_worker", str(self.memory_bytes)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True)

    def _died(self) -> str:
        """Why the process closed its pipe; it is reaped (killed if it lingers)."""
        try:
            code = self.process.wait(timeout=REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.close()
            return "process died (closed its pipe, killed)"
        self._reap()
        return f"process died ({_exit_reason(code)})"

    def _reap(self) -> None:
        if self.process is None:
            return
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                pipe.close()
        self.process = None


def _exit_reason(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


class RewardPool:
    """Lanes of one memory limit, lent out one caller at a time and kept for the next."""

    def __init__(self, memory_bytes: int):
        self.memory_bytes = memory_bytes
        self._idle: list[Lane] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def lane(self) -> Iterator[Lane]:
        with self._lock:
            lane = self._idle.pop() if self._idle else Lane(self.memory_bytes)
        try:
            yield lane
        except BaseException:
            lane.close()  # interrupted mid-request: its pipe may hold a half-read reply
            raise
        with self._lock:
            self._idle.append(lane)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for lane in idle:
            lane.close()


@functools.cache
def shared_pool(memory_bytes: int) -> RewardPool:
    """This process's pool for `memory_bytes`: a Dask worker keeps its reward processes from task to task."""
    return RewardPool(memory_bytes)
