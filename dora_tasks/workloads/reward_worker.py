"""The child side of process-isolated rewards: `python -m dora_tasks.workloads.reward_worker MEMORY_BYTES`.

The process limits its own address space (RLIMIT_AS) to MEMORY_BYTES, then serves requests from its parent
(`reward_pool.Lane`) over its stdin/stdout pipes until the parent closes them. A request is a pickled
`(pickled_fn, units, timeout_s)`: a `reward_forms.RewardFunction` and its calls split into units (one call each, or
a whole batch); the function is unpickled once and cached, which imports it by its dotted path (module and qualified
name) in this process. The reply is one frame saying the function is loaded, then one frame per unit:
`(outcomes, alive)`, where each outcome is what `rewards.score` returns and `alive=False` says this process exits
after the frame (a call ran out of memory: its heap is not trusted any more).

Frames are an 8-byte little-endian length and a payload (a pickle, or LOADED). The protocol pipes are private copies of fds 0 and 1; fd 1
is pointed at stderr so that a reward function's prints cannot corrupt a frame. Only the standard library is
imported here, so that a new process starts fast and small.
"""
from __future__ import annotations

import math
import numbers
import os
import pickle
import resource
import select
import struct
import sys
import threading
import time

_LENGTH = struct.Struct("<Q")
LOADED = b"loaded"
TIMEOUT = "timeout"
READ_BYTES = 1 << 20  # the most one read of a pipe asks for
ORPHAN_POLL_S = 1.0  # how often a worker checks that its parent is alive


def as_reward(value: object) -> tuple[float, str]:
    """A finite real number (bools included) becomes a float reward; anything else is an error."""
    if isinstance(value, numbers.Real):
        reward = float(value)
        if math.isfinite(reward):
            return reward, ""
    return float("nan"), f"non-number: {value!r}"[:200]


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def write_frame(fd: int, payload: bytes) -> None:
    view = memoryview(_LENGTH.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view):]


def read_frame(fd: int, deadline: float | None = None) -> bytes:
    """One frame's payload; TimeoutError past `deadline` (time.monotonic(); None waits), EOFError if the pipe closed."""
    return read_exactly(fd, _LENGTH.unpack(read_exactly(fd, _LENGTH.size, deadline))[0], deadline)


def read_exactly(fd: int, n: int, deadline: float | None = None) -> bytes:
    chunks, left = [], n
    while left:
        if deadline is not None and not _readable(fd, deadline):
            raise TimeoutError
        chunk = os.read(fd, min(left, READ_BYTES))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _readable(fd: int, deadline: float) -> bool:
    poller = select.poll()  # poll, not select: a Dask worker may hold more than FD_SETSIZE descriptors
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(math.ceil(max(0.0, deadline - time.monotonic()) * 1000)))


def serve(memory_bytes: int) -> None:
    requests, replies = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    functions: dict[bytes, object] = {}
    while True:
        try:
            pickled_fn, units, timeout_s = pickle.loads(read_frame(requests))
        except EOFError:
            return
        if pickled_fn not in functions:
            functions[pickled_fn] = _load(pickled_fn)
        write_frame(replies, LOADED)
        for unit in units:
            outcomes, alive = _run(functions[pickled_fn], unit, timeout_s, memory_bytes)
            write_frame(replies, pickle.dumps((outcomes, alive)))
            if not alive:
                os._exit(0)


def _run(fn, unit: list, timeout_s: float, memory_bytes: int) -> tuple[list[tuple[float, str]], bool]:
    """`(outcomes, alive)` of one unit; a MemoryError ends this process (its heap is not trusted any more)."""
    try:
        return fn.run(unit, timeout_s), True
    except MemoryError as exc:
        why = f"memory limit: past task.reward_memory_bytes={memory_bytes} ({type(exc).__name__})"
        return [(float("nan"), why)] * len(unit), False
    except BaseException as exc:  # noqa: BLE001 - e.g. a function that could not be loaded
        return [(float("nan"), describe(exc))] * len(unit), True


def _load(pickled_fn: bytes):
    """The reward function, or one that raises why it cannot be loaded (each call then records that)."""
    try:
        return pickle.loads(pickled_fn)
    except BaseException as exc:  # noqa: BLE001 - reported on every call, never kills the process
        return _Unloadable(f"cannot load the reward function in the reward process ({type(exc).__name__}: {exc})")


class _Unloadable:
    """Stands for a function that could not be unpickled: every call records why."""

    def __init__(self, message: str):
        self.message = message

    def run(self, unit: list, timeout_s: float) -> list[tuple[float, str]]:
        return [(float("nan"), f"RuntimeError: {self.message}")] * len(unit)


def _exit_when_orphaned(parent: int) -> None:
    # a call that hangs would otherwise outlive a parent that died without closing the pipes in time
    while os.getppid() == parent:
        time.sleep(ORPHAN_POLL_S)
    os._exit(1)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
