"""The discrete-event simulator against the Dask emulation, on one small configuration with the same settings.

    python benchmarks/sim_vs_emulation.py                       # 8 instances, G=8, TBS 4, RBS 16, K=3
    python benchmarks/sim_vs_emulation.py --chunk-tokens 256    # any flag below; config overrides at the end

Both sides run the same workload: the emulated engines' cost model (`dora_tasks.emulation.cost_model`) and length
model (`dora_tasks.emulation.lengths`, prompt id = group id on both sides), the real `VersionGate` and
`Orchestrator`, switching "drain" (what the Dask driver runs), the same instances (rollout.instances x emulation.tp
accelerators), trainer (emulation.trainer_gpus), G, TBS, RBS, K, seed and updates. The Dask side is
`pipelines.streaming.run_pipeline` on an embedded LocalCluster (one worker process per instance); the simulator is
`pipelines.simulator.simulate` with one step = one update (prompts_per_step = TBS), so both leave out the same first
two updates (`pipelines.metrics.WARMUP_UPDATES`) and measure from the publish that closes them to the last publish.

Settings chosen so the two can agree, and why:
* `rollout.slots` = RBS / instances: the simulator gives each instance ceil(RBS / instances) groups of rows;
* `emulation.store_bandwidth` = the accelerators' network bandwidth: the simulator's first instance to load a version
  reads it from the store (16 s at the default 2 GB/s), the Dask engines all take it from a peer (0.65 s);
* `decision_interval_s` = 0: the Dask driver reacts to each finished future, not on a tick;
* the orchestrator's group budget = updates x TBS, the Dask run's (`pipelines.run`): the simulator's own budget,
  (updates + K + 2) x TBS, keeps dispatching to the end, where the Dask run stops creating groups once the last
  update's are out, so its last K updates run with fewer groups in flight (`DaskBudget`; `--own-budget` to compare).

Metric definitions compared (each side's own code, mapped where they differ):
* tokens/s and step time: the same on both sides (prompt + response tokens of the steady updates over the window;
  mean time between publishes);
* rollout bubble: the Dask side counts a decode call's prefill as busy (`RolloutServer.busy`), the simulator counts
  prefill as bubble, so its figure is shown as `rollout_bubble - prefill_share` (weight loads are bubble on both);
* trainer bubble: the Dask side counts an update's publish as busy (emulated seconds of writing the weights), the
  simulator publishes instantly; the non-overlapped rollout share is the trainer's wait for data on both sides (the
  Dask side from a publish to the gate's next hand-over, which with `update_lookahead` 1 may precede the publish);
* staleness max: over every update on both sides.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EMULATED = ["rollout.engine=emulated", "train.engine=emulated", "task.name=emulated"]
METRICS = (  # (label, key, relative difference or absolute)
    ("tokens/s (emulated)", "tokens_per_s", "rel"),
    ("step time s (between publishes)", "step_s", "rel"),
    ("rollout bubble (prefill busy)", "rollout_bubble", "abs"),
    ("trainer bubble", "trainer_bubble", "abs"),
    ("non-overlapped rollout share", "non_overlapped", "abs"),
    ("staleness max", "staleness_max", "abs"),
)


@dataclass
class Figures:
    tokens_per_s: float
    step_s: float
    rollout_bubble: float
    trainer_bubble: float
    non_overlapped: float
    staleness_max: float


def make_config(args, run_dir: str, overrides: list[str] = ()):
    """The Dask run's config: every setting the simulator is then given comes from it."""
    from dora_tasks.core.config import load_config
    from dora_tasks.emulation.hardware import ACCELERATORS

    rbs = args.instances * args.slots
    tbs = rbs // (args.max_staleness + 1)
    base = load_config(None, EMULATED + list(overrides))
    network = ACCELERATORS[base.emulation.accelerator].network_bandwidth
    return load_config(None, EMULATED + [
        f"rollout.instances={args.instances}", f"rollout.slots={args.slots}", f"rollout.group_size={args.group_size}",
        f"rollout.chunk_tokens={args.chunk_tokens}", f"rollout.max_new_tokens={args.response_cap}",
        "rollout.switching=drain", f"dora.train_batch_size={tbs}", f"dora.rollout_batch_size={rbs}",
        f"dora.max_staleness={args.max_staleness}", f"dora.num_updates={args.updates}",
        f"emulation.response_p50={args.response_p50}", f"emulation.response_cap={args.response_cap}",
        f"emulation.speedup={args.speedup}", f"emulation.trainer_gpus={args.trainer_gpus}",
        f"emulation.store_bandwidth={network}", "emulation.weight_source=peer",
        f"task.num_prompts={max(1024, (args.updates + args.max_staleness + 2) * tbs)}", "task.eval_prompts=4",
        "task.eval_interval=0", "cluster.cpu_workers=1", "cluster.cpu_threads=2", "cluster.worker_memory=1GiB",
        "storage.checkpoint_interval=0", "tracking.plots=false", "tracking.live_view=false",
        f"storage.run_dir={run_dir}/run", f"tracking.mlflow_uri=sqlite:///{run_dir}/ml.db"] + list(overrides))


def sim_settings(cfg, decision_interval_s: float = 0.0):
    """(SimConfig, cost model, length model) with the Dask run's settings."""
    from dora_tasks.emulation.cost_model import cost_model_from
    from dora_tasks.emulation.lengths import length_model_from
    from pipelines.simulator import SimConfig

    e, d, r = cfg.emulation, cfg.dora, cfg.rollout
    if r.partial_rollout:
        raise ValueError("the simulator's partial rollout is colocated (pipelines/simulator/modes.py), this run's "
                         "is disaggregated: not the same mode")
    if r.slots * r.instances != d.rollout_batch_size:
        raise ValueError("the simulator gives each instance RBS / instances groups: set rollout.slots to that")
    sim = SimConfig(gpus=r.instances * e.tp + e.trainer_gpus, mode="dora", max_staleness=d.max_staleness,
                    prompts_per_step=d.train_batch_size, group_size=r.group_size, train_batch_size=d.train_batch_size,
                    rollout_batch_size=d.rollout_batch_size, switching=cfg.switching, max_rows=e.max_rows,
                    trainer_gpus=e.trainer_gpus, steps=d.num_updates, warmup_steps=2,
                    decision_interval_s=decision_interval_s, versions_per_instance=r.versions_per_instance,
                    stream_updates=d.stream_updates)
    return sim, cost_model_from(e), length_model_from(e, d.seed)


def run_dask(cfg) -> tuple[Figures, dict]:
    """The emulated run through `run_pipeline`; its summary's figures and the staleness from the store."""
    import numpy as np
    import psutil

    from pipelines.streaming import run_pipeline
    from storage.trajectory_store import TrajectoryStore

    cpu0, wall0 = psutil.cpu_times(), time.time()
    summary = run_pipeline(cfg)
    wall, cpu1 = time.time() - wall0, psutil.cpu_times()
    busy = 1 - (cpu1.idle - cpu0.idle) / max(1e-9, sum(cpu1) - sum(cpu0))
    updates = TrajectoryStore.open(summary.store).read_table("updates")
    m = summary.metrics
    figures = Figures(m["throughput_tokens_per_s"], m["step_time_s"], m["rollout_bubble"], m["trainer_bubble"],
                      m["non_overlapped_rollout_share"], float(np.max(updates["metrics/staleness_max"])))
    return figures, {"wall_s": wall, "machine_busy": busy, "audit_ok": summary.audit_ok,
                     "publish_s": float(np.mean(updates["publish_seconds"][2:]))}


def dask_budget(simulation_class):
    """The simulation with the Dask run's group budget: exactly the groups its updates consume."""

    class DaskBudget(simulation_class):
        def __init__(self, *args):
            super().__init__(*args)
            self.orchestrator.group_budget = self.updates * self.tbs

    return DaskBudget


def run_sim(cfg, decision_interval_s: float = 0.0, own_budget: bool = False) -> tuple[Figures, object]:
    from pipelines.simulator.core import Simulation

    sim, cost, lengths = sim_settings(cfg, decision_interval_s)
    r = (Simulation if own_budget else dask_budget(Simulation))(sim, cost, lengths).run().result()
    figures = Figures(r.tokens_per_s, r.step_s, r.rollout_bubble - r.prefill_share - r.transfer_share,
                      r.trainer_bubble, r.non_overlapped_share, r.staleness_max)
    return figures, r


def table(dask: Figures, sim: Figures) -> str:
    lines = ["| metric | Dask emulation | simulator | difference |", "|---|---|---|---|"]
    for label, key, kind in METRICS:
        a, b = getattr(dask, key), getattr(sim, key)
        diff = f"{(b - a) / a:+.1%}" if kind == "rel" else f"{b - a:+.3f}"
        fmt = (lambda x: f"{x:,.0f}") if key == "tokens_per_s" else (lambda x: f"{x:.3f}")
        lines.append(f"| {label} | {fmt(a)} | {fmt(b)} | {diff} |")
    return "\n".join(lines)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--slots", type=int, default=2, help="groups per instance; RBS = instances x slots")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-staleness", type=int, default=3, help="K; TBS = RBS / (K + 1)")
    p.add_argument("--updates", type=int, default=14)
    p.add_argument("--trainer-gpus", type=int, default=8)
    p.add_argument("--response-p50", type=float, default=300.0)
    p.add_argument("--response-cap", type=int, default=4096)
    p.add_argument("--chunk-tokens", type=int, default=64)
    p.add_argument("--speedup", type=float, default=10.0)
    p.add_argument("--sim-only", action="store_true", help="skip the Dask run (the simulator's figures alone)")
    p.add_argument("--own-budget", action="store_true", help="the simulator keeps its own group budget")
    p.add_argument("overrides", nargs="*", help="section.key=value, for both sides")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="dora-sim-vs-emu-") as folder:
        cfg = make_config(args, folder, args.overrides)
        sim, r = run_sim(cfg, own_budget=args.own_budget)
        print(f"simulator: {r.instances} instances ({r.rollout_gpus} GPUs), trainer {r.trainer_gpus} GPUs, "
              f"TBS {r.train_batch_size}, RBS {r.rollout_batch_size}, K {r.max_staleness}; rollout bubble as "
              f"defined there {r.rollout_bubble:.3f} (prefill {r.prefill_share:.3f}, loads {r.load_share:.3f})")
        if args.sim_only:
            print(sim)
            return 0
        dask, info = run_dask(cfg)
    print(f"Dask: {info['wall_s']:.0f} s wall at x{args.speedup:g}, machine {info['machine_busy']:.0%} busy, "
          f"audit {'ok' if info['audit_ok'] else 'FAILED'}, publish {info['publish_s']:.2f} emulated s an update")
    print(table(dask, sim))
    return 0


if __name__ == "__main__":
    sys.exit(main())
