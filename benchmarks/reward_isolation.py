"""What process isolation of rewards costs per call, against thread isolation, and what a hanging reward costs a
held-out evaluation in each.

Table 1 scores the countdown reward (microseconds of work) in batches of 1, 8 (a group) and 64 calls with
`rewards.score_isolated`, in this process and inside a Dask worker (where reward tasks run: its event loop thread is
busy, so every hand-over between threads is dearer), and gives the wall time per call of each isolation and their
ratio. Processes are started before the clock (a Dask worker keeps its reward processes); the start of one, paid once
per worker and after every kill, is printed below the table. Table 2 scores `--eval-prompts` held-out responses with
a reward that hangs in C on every call (`rewards.score_parallel`, as `warmstart.rewards_of` does) against the serial
cost of one timeout per prompt.

    python benchmarks/reward_isolation.py [--repeats 200] [--eval-prompts 64] [--timeout 1.0]

Not a timed test: it measures this machine.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dora_tasks.workloads import countdown
from dora_tasks.workloads.reward_pool import shared_pool
from dora_tasks.workloads.rewards import score_isolated, score_parallel

ISOLATIONS = ("thread", "process")
BATCHES = (1, 8, 64)
MEMORY = 2**30
LANES = min(4, os.cpu_count() or 1)  # as warmstart.EVAL_REWARD_LANES on this machine


def calls(n: int) -> list[tuple[str, str, str]]:
    return [("count 74 step 10:", "74 64 54 44 34 24 14 4", "74 64 54 44 34 24 14 4")] * n


def per_call_us(isolation: str, batch: int, repeats: int) -> float:
    """Median wall microseconds per call of `repeats` batches (after one unmeasured batch)."""
    score_isolated(countdown.reward, calls(batch), 10.0, isolation, MEMORY)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        score_isolated(countdown.reward, calls(batch), 10.0, isolation, MEMORY)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] / batch * 1e6


def process_start_ms() -> float:
    """A fresh reward process: interpreter start, the reward module's import, first call."""
    pool = shared_pool(MEMORY)
    pool.close()
    start = time.perf_counter()
    score_isolated(countdown.reward, calls(1), 10.0, "process", MEMORY)
    return (time.perf_counter() - start) * 1e3


def measure(repeats: int) -> dict:
    return {"per_call": {(iso, b): per_call_us(iso, b, repeats) for b in BATCHES for iso in ISOLATIONS},
            "start_ms": min(process_start_ms() for _ in range(5))}


def measure_in_dask_worker(repeats: int) -> dict:
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        return client.submit(measure, repeats, pure=False).result()


def hang_in_c(prompt: str, response: str, answer: str) -> float:
    ctypes.CDLL(None).sleep(600)
    return 1.0


def evaluation_seconds(isolation: str, prompts: int, timeout_s: float) -> float:
    start = time.perf_counter()
    score_parallel(hang_in_c, calls(prompts), timeout_s, isolation, MEMORY, LANES)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=1.0)
    args = parser.parse_args()
    where = {"this process": measure(args.repeats), "Dask worker": measure_in_dask_worker(args.repeats)}
    print("| where | calls per batch | thread us/call | process us/call | process / thread |")
    print("|---|---|---|---|---|")
    for name, m in where.items():
        for b in BATCHES:
            thread, process = m["per_call"][("thread", b)], m["per_call"][("process", b)]
            print(f"| {name} | {b} | {thread:.1f} | {process:.1f} | {process / thread:.2f} |")
    print("\n" + "; ".join(f"start of a reward process ({name}): {m['start_ms']:.0f} ms" for name, m in where.items()))
    print(f"\n| held-out scoring, {args.eval_prompts} prompts, a reward that always hangs, timeout "
          f"{args.timeout:g} s, {LANES} lanes | seconds |")
    print("|---|---|")
    print(f"| one timeout per prompt, serially (before) | {args.eval_prompts * args.timeout:.1f} |")
    for isolation in ISOLATIONS:
        print(f"| {isolation} | {evaluation_seconds(isolation, args.eval_prompts, args.timeout):.2f} |")


if __name__ == "__main__":
    main()
