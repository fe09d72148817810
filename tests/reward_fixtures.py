"""Reward functions of tests/test_reward_isolation.py, in a module of their own so that reward processes and Dask
workers import them by their dotted path (`reward_fixtures.<name>`)."""
from __future__ import annotations

import ctypes
import os
import subprocess

HANG_S = 60  # far past every timeout of the tests: only a kill ends it in time
BRIEF_HANG_S = 3  # for thread isolation, whose hung threads are left to finish on their own


def exact(prompt: str, response: str, answer: str) -> float:
    return float(response == answer)


def process_id(prompt: str, response: str, answer: str) -> float:
    return float(os.getpid())


def sleep_in_c(prompt: str, response: str, answer: str) -> float:
    ctypes.CDLL(None).sleep(HANG_S)  # blocks in libc: no Python code runs that could notice a timeout
    return 1.0


def sleep_briefly_in_c(prompt: str, response: str, answer: str) -> float:
    ctypes.CDLL(None).sleep(BRIEF_HANG_S)
    return 1.0


def spin(prompt: str, response: str, answer: str) -> float:
    while True:
        pass


def allocate_forever(prompt: str, response: str, answer: str) -> float:
    blocks = []
    while True:
        blocks.append(bytearray(16 * 2**20))


def die(prompt: str, response: str, answer: str) -> float:
    os._exit(3)


BEHAVIOURS = {"hang": sleep_in_c, "spin": spin, "grow": allocate_forever, "die": die, "pid": process_id}


def by_response(prompt: str, response: str, answer: str) -> float:
    """What the response names ("hang", "spin", "grow", "die", "pid"), else exact match."""
    return BEHAVIOURS.get(response, exact)(prompt, response, answer)


def start_a_child_and_hang(prompt: str, response: str, answer: str) -> float:
    """Starts `sleep`, writes its pid to the file named by `answer`, then hangs."""
    child = subprocess.Popen(["sleep", str(HANG_S)])
    with open(answer, "w") as f:
        f.write(str(child.pid))
    return sleep_in_c(prompt, response, answer)
