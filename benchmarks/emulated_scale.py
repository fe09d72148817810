"""How the driver and the Dask scheduler scale with rollout instances, on EMULATED engines and a real Dask cluster.

    python benchmarks/emulated_scale.py                               # 8 16 32 64 128 instances, dask CLI cluster
    python benchmarks/emulated_scale.py --instances 64 128 --cluster embedded
    python benchmarks/emulated_scale.py --speedup 10 emulation.response_p50=600   # any config override at the end

For each size: start a cluster of that many emulated rollout workers (one process each) plus a trainer and a CPU
worker, either from the `dask` CLI (`dask scheduler`, `dask worker --nworkers N --resources GPU=1,ROLLOUT=<slots>`,
the scheduler its own process) or embedded (the run's own SpecCluster, the scheduler in the driver's process); record
its start-up time and the workers' memory (RSS and PSS per worker process); then run `configs/emulated_h800.yaml`
through the real driver (`open_run` + `stream`) attached to it, and measure with psutil:

* driver CPU and scheduler CPU (process CPU seconds over the streaming loop), per consumed group and per update;
* their share of one core over the loop's wall time, and the whole machine's CPU use;
* latency from a group's end (its rollout task's end) to the update that consumed it, from the trajectory store,
  in emulated seconds;
* groups in flight (the most, over the driver's turns), emulated throughput and rollout bubble (the run's summary).

* the emulated engines' pace: the seconds they emulated over the wall seconds their servers had requests to serve,
  times the speed-up, summed over the instances (`dora_tasks.plugins.engine_pace`); below 1, this machine's CPU
  passed as emulated time in which instances produced nothing.

A row is marked CPU-PACED when this machine rather than the emulated hardware may have set the pace: driver plus
scheduler above 80% of a core, the machine above 90% busy, the driver's reaction to the trainer's updates and parts
(from one ending to the driver's next decisions, `pipelines.metrics`) above 2% of the steady window in emulated
seconds, or the engines' pace under 95%. The markdown table is printed and written to
benchmarks/results/emulated_scale.md (with `--out` elsewhere).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.tables import formatted, markdown_table  # noqa: E402 - after the path
from pipelines.cluster import EMBEDDED_DASK_CONFIG  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_PACED_CORE_SHARE = 0.8
CPU_PACED_MACHINE_SHARE = 0.9
# The trainer's next update or part waits on the driver's reaction to the one before: this share of the steady window
# costs up to as much throughput where the trainer sets the pace.
CPU_PACED_TRAINER_LAG = 0.02
CPU_PACED_ENGINE_PACE = 0.95  # the instances emulated less than this share of the time they had work
# The trainer's worker holds the batches handed to it (update lookahead + 1; at TBS 512 x G 16 a batch is hundreds
# of MB of token arrays) and the CPU worker scores whole groups: `cluster.worker_memory` sizes the rollout workers.
TRAINER_AND_CPU_MEMORY = "6GiB"
# The embedded cluster's settings, for CLI workers: as Dask reads them from the environment (`DASK_` + key, `__`
# between levels).
QUIET_WORKERS = {"DASK_" + key.upper().replace(".", "__").replace("-", "_"): str(value)
                 for key, value in EMBEDDED_DASK_CONFIG.items()}


@dataclass
class CliCluster:
    """`python -m dask scheduler` and labelled `python -m dask worker` processes, each in its own session."""

    folder: str
    procs: list

    @classmethod
    def start(cls, cfg, instances: int) -> tuple["CliCluster", str, float]:
        """Start it; returns it, the scheduler's address and the seconds until every worker had joined."""
        from dora_tasks.plugins import WORKER_ENV

        folder = tempfile.mkdtemp(prefix="dora-cli-cluster-")
        env = {**os.environ, **WORKER_ENV, **QUIET_WORKERS}
        cluster = cls(folder, [])
        started = time.time()
        file = os.path.join(folder, "scheduler.json")
        cluster._run("scheduler", env, "scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address",
                     "127.0.0.1:0", "--scheduler-file", file)
        address = _read_address(file)
        common = ["--host", "127.0.0.1", "--dashboard-address", "127.0.0.1:0"]
        big = [*common, "--memory-limit", TRAINER_AND_CPU_MEMORY]
        slots = cfg.rollout.slots
        cluster._run("rollout", env, "worker", address, "--nworkers", str(instances), "--nthreads", str(slots),
                     "--resources", f"GPU=1,ROLLOUT={slots}", *common, "--memory-limit", cfg.cluster.worker_memory)
        cluster._run("trainer", env, "worker", address, "--nthreads", "2", "--resources", "GPU=1,TRAINER=1", *big)
        threads = str(cfg.cluster.cpu_threads)
        cluster._run("cpu", env, "worker", address, "--nthreads", threads, "--resources", f"CPU={threads}", *big)
        _wait_for(address, instances + 2)
        return cluster, address, time.time() - started

    def _run(self, name: str, env: dict, *args: str) -> None:
        with open(os.path.join(self.folder, f"{name}.log"), "wb") as log:
            self.procs.append(subprocess.Popen([sys.executable, "-m", "dask", *args], cwd=REPO, env=env, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True))

    @property
    def scheduler_pid(self) -> int:
        return self.procs[0].pid

    def worker_processes(self):
        import psutil

        return worker_children([psutil.Process(p.pid) for p in self.procs[1:]])

    def stop(self) -> None:
        import signal

        for proc in reversed(self.procs):
            proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _read_address(path: str, timeout_s: float = 60.0) -> str:
    deadline = time.time() + timeout_s
    while not (os.path.exists(path) and open(path).read().strip()):
        if time.time() > deadline:
            raise RuntimeError(f"the dask scheduler wrote no {path}")
        time.sleep(0.2)
    return json.load(open(path))["address"]


def _wait_for(address: str, workers: int, timeout_s: float = 900.0) -> None:
    from distributed import Client

    with Client(address, timeout=60) as client:
        client.wait_for_workers(workers, timeout=timeout_s)


def worker_children(parents) -> list:
    """The Dask worker processes Nannies spawned under `parents` (not multiprocessing's resource trackers)."""
    return [c for p in parents for c in p.children(recursive=True) if " ".join(c.cmdline()).startswith("dask worker [")]


def memory_per_worker(processes) -> tuple[float, float]:
    """Mean RSS and PSS (MiB) of these processes (PSS shares the pages they have in common)."""
    import numpy as np

    infos = [p.memory_full_info() for p in processes]
    return (float(np.mean([i.rss for i in infos])) / 2**20, float(np.mean([i.pss for i in infos])) / 2**20)


# ---- one size --------------------------------------------------------------------------------------------------
def measure(instances: int, args, overrides: list[str]) -> dict:
    import psutil

    from dora_tasks.core.config import load_config

    run_dir = tempfile.mkdtemp(prefix=f"dora-emulated-{instances}-")
    cfg = load_config(args.config, [f"rollout.instances={instances}", f"emulation.speedup={args.speedup}",
                                    f"dora.num_updates={args.updates}", "tracking.plots=false",
                                    "tracking.live_view=false", "storage.checkpoint_interval=0",
                                    f"storage.run_dir={run_dir}", f"tracking.mlflow_uri=sqlite:///{run_dir}/ml.db"]
                      + overrides)
    cluster, scheduler, row = None, None, {"instances": instances, "cluster": args.cluster}
    try:
        if args.cluster == "cli":
            cluster, address, row["startup_s"] = CliCluster.start(cfg, instances)
            cfg.cluster.scheduler_address = address
            scheduler = psutil.Process(cluster.scheduler_pid)
            workers = cluster.worker_processes()
        row.update(run_and_measure(cfg, scheduler, workers if cluster else None))
    finally:
        if cluster is not None:
            cluster.stop()
    return row


def run_and_measure(cfg, scheduler, workers) -> dict:
    import psutil

    from distributed import get_task_stream

    from dora_tasks.plugins import engine_pace
    from pipelines.events import Turn
    from pipelines.run import open_run
    from pipelines.streaming import stream

    me, row, in_flight = psutil.Process(), {}, [0]
    opened = time.time()
    with open_run(cfg) as run:
        if workers is None:  # embedded: the Nannies' worker processes are this process's children
            row["startup_s"] = time.time() - opened
            workers = worker_children([me])
        row["worker_rss_mib"], row["worker_pss_mib"] = memory_per_worker(workers)
        row["workers"] = len(workers)
        run.driver.subscribe(lambda e: isinstance(e, Turn) and in_flight.append(e.in_flight))
        orchestration = time_orchestration(run.driver)
        cpu0, sched0, machine0, wall0 = _cpu(me), _cpu(scheduler), psutil.cpu_times(), time.time()
        with get_task_stream(run.driver.client) as tasks:
            stream(run.driver)
        wall = time.time() - wall0
        driver_cpu, sched_cpu = _cpu(me) - cpu0, _cpu(scheduler) - sched0
        machine = _busy_share(machine0, psutil.cpu_times())
        row["engine_pace"] = pace([p for p in run.driver.client.run(engine_pace).values() if p is not None],
                                  cfg.emulation.speedup)
        summary = run.finish()
    groups = cfg.dora.num_updates * cfg.dora.train_batch_size
    row.update({
        "updates": cfg.dora.num_updates, "groups": groups, "wall_s": wall,
        "driver_ms_per_group": 1e3 * driver_cpu / groups, "sched_ms_per_group": 1e3 * sched_cpu / groups,
        "driver_s_per_update": driver_cpu / cfg.dora.num_updates,
        "sched_s_per_update": sched_cpu / cfg.dora.num_updates,
        "core_share": (driver_cpu + sched_cpu) / wall, "machine_share": machine,
        "in_flight_max": max(in_flight), "audit_ok": summary.audit_ok,
        "throughput": summary.metrics["throughput_tokens_per_s"], "step_s": summary.metrics["step_time_s"],
        "rollout_bubble": summary.metrics["rollout_bubble"], "open_bubble": summary.metrics["open_rollout_bubble"],
        "open_bubble_held": summary.metrics["open_rollout_bubble_held"],
        "non_overlapped": summary.metrics["non_overlapped_rollout_share"],
        "gate_closed_share": summary.metrics["gate_closed_share"], "open_window_s": summary.metrics["open_window_s"],
        "orchestration_cpu_s": orchestration[0], "emulated_run_s": summary.metrics["wall_s"],
        "migrations": summary.metrics.get("migrations", 0.0),
        "migration_s": summary.metrics.get("migrations", 0.0) * summary.metrics.get("migration_s_mean", 0.0),
        "reaction_lag_s": summary.metrics["driver_reaction_lag_mean_s"],
        "reaction_lag_share": summary.metrics["driver_reaction_lag_step_share"],
        "trainer_lag_share": summary.metrics["driver_trainer_lag_share"],
        "trainer_parts": summary.metrics["trainer_parts_per_update"],
        "first_part_share": summary.metrics["first_part_group_share"],
    })
    row.update(consume_latency(cfg))
    row["task_seconds"] = task_seconds(tasks.data, cfg.emulation.speedup, cfg.dora.num_updates)
    row["cpu_paced"] = (row["core_share"] > CPU_PACED_CORE_SHARE or machine > CPU_PACED_MACHINE_SHARE
                        or row["trainer_lag_share"] > CPU_PACED_TRAINER_LAG
                        or row["engine_pace"] < CPU_PACED_ENGINE_PACE)
    return row


def pace(engines: list[tuple[float, float]], speedup: float) -> float:
    """Seconds emulated over wall seconds serving times the speed-up, over every instance (nan: none served)."""
    serving = sum(wall for _, wall in engines) * speedup
    return sum(emulated for emulated, _ in engines) / serving if serving else float("nan")


def time_orchestration(driver) -> list[float]:
    """The driver's CPU seconds in the orchestrator's decisions and in submitting the migrations they order (the
    driver's thread CPU, so that other processes' load does not count), summed into the returned one-item list."""
    spent = [0.0]

    def timed(call):
        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                spent[0] += time.thread_time() - start
        return wrapper

    driver.orchestrator.decide = timed(driver.orchestrator.decide)
    driver.migrate = timed(driver.migrate)
    return spent


def _cpu(process) -> float:
    if process is None:
        return 0.0
    t = process.cpu_times()
    return t.user + t.system


def _busy_share(before, after) -> float:
    total = sum(after) - sum(before)
    idle = (after.idle + after.iowait) - (before.idle + before.iowait)
    return 1.0 - idle / max(1e-9, total)


def task_seconds(records, speedup: float, updates: int) -> dict[str, dict[str, float]]:
    """Per task name (a key's first part), emulated seconds per update that its tasks computed and that their inputs
    took to reach the worker, from the scheduler's task stream: what tasks that run real code (gate checks, rewards,
    advantages) add to the emulated time, this machine's seconds x the speed-up."""
    import ast

    seconds: dict[str, dict[str, float]] = {}
    for record in records:
        key = record["key"]
        if isinstance(key, str) and key.startswith("("):
            try:
                key = ast.literal_eval(key)
            except (ValueError, SyntaxError):
                pass
        name = str(key[0] if isinstance(key, tuple) else key)
        spent = seconds.setdefault(name, {"compute": 0.0, "transfer": 0.0, "tasks": 0})
        spent["tasks"] += 1
        for s in record["startstops"]:
            if s["action"] in ("compute", "transfer"):
                spent[s["action"]] += (s["stop"] - s["start"]) * speedup / updates
    return seconds


def consume_latency(cfg) -> dict:
    """From a group's end to the record of the update that consumed it (emulated seconds): p50, p90, max."""
    import numpy as np

    from storage.trajectory_store import TrajectoryStore

    traj = TrajectoryStore.open(cfg.storage.resolved("trajectory_store")).read_table("trajectories")
    first = traj["sample_idx"] == 0
    latency = traj["consumed_time"][first] - traj["end_time"][first]
    return {"latency_p50_s": float(np.percentile(latency, 50)), "latency_p90_s": float(np.percentile(latency, 90)),
            "latency_max_s": float(latency.max())}


# ---- the table -------------------------------------------------------------------------------------------------
COLUMNS = [
    ("instances", "instances", "{}"), ("startup_s", "start-up (s)", "{:.1f}"),
    ("worker_rss_mib", "worker RSS (MiB)", "{:.0f}"), ("worker_pss_mib", "worker PSS (MiB)", "{:.0f}"),
    ("driver_ms_per_group", "driver CPU / group (ms)", "{:.1f}"),
    ("sched_ms_per_group", "scheduler CPU / group (ms)", "{:.1f}"),
    ("driver_s_per_update", "driver CPU / update (s)", "{:.2f}"),
    ("sched_s_per_update", "scheduler CPU / update (s)", "{:.2f}"),
    ("core_share", "driver+sched (core share)", "{:.0%}"), ("machine_share", "machine busy", "{:.0%}"),
    ("latency_p50_s", "group end -> update p50 (emu s)", "{:.0f}"),
    ("latency_p90_s", "p90 (emu s)", "{:.0f}"), ("trainer_lag_share", "driver lag on the trainer", "{:.2%}"),
    ("engine_pace", "engines' pace", "{:.1%}"), ("in_flight_max", "groups in flight (max)", "{}"),
    ("throughput", "throughput (emu tok/s)", "{:,.0f}"), ("step_s", "step (emu s)", "{:.1f}"),
    ("rollout_bubble", "rollout bubble", "{:.1%}"), ("wall_s", "loop wall (s)", "{:.0f}"),
    ("audit_ok", "audit", "{}"), ("cpu_paced", "paced by", "{}"),
]


def table(rows: list[dict]) -> str:
    return markdown_table([title for _, title, _ in COLUMNS],
                          [[formatted(key, row.get(key), fmt) for key, _, fmt in COLUMNS] for row in rows])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--cluster", choices=("cli", "embedded"), default="cli")
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "emulated_h800.yaml"))
    parser.add_argument("--speedup", type=float, default=20.0)
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "emulated_scale.md"))
    parser.add_argument("overrides", nargs="*", help="config overrides, section.key=value")
    args = parser.parse_args(argv)
    rows = []
    for instances in args.instances:
        rows.append(measure(instances, args, args.overrides))
        print(json.dumps(rows[-1]), flush=True)
        text = table(rows)
        print(text, flush=True)
    header = (f"# Emulated scale ({args.cluster} cluster, emulation.speedup={args.speedup:g}, "
              f"{args.updates} updates a size, {' '.join(args.overrides) or 'configs/emulated_h800.yaml'})\n\n")
    with open(args.out, "w") as f:
        f.write(header + text + "\n")


if __name__ == "__main__":
    main()
