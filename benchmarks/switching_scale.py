"""The three switchings side by side at scale: EMULATED engines on a real Dask cluster, and the simulator on the
same config, in one run and one table.

    python benchmarks/switching_scale.py --instances 8 16
    python benchmarks/switching_scale.py --instances 64 128 --out benchmarks/results/switching_scale_64_128.md
    python benchmarks/switching_scale.py --instances 64 --variant m2=rollout.switching=migrate,rollout.versions_per_instance=2
    python benchmarks/switching_scale.py --instances 16 emulation.response_p50=600     # config overrides at the end

For each instance count N and each switching (`rollout.switching` drain, queue, migrate, plus any `--variant NAME=
key=value,...`): a `dask` CLI cluster of N emulated rollout workers (one process each), a trainer and a CPU worker
(`emulated_scale.CliCluster`), the real driver, gate, orchestrator, store and audit (`emulated_scale.run_and_measure`),
and the discrete-event simulator with the same settings (`sim_vs_emulation.run_sim`, its rollout bubble mapped to the
Dask side's definition). The config is `sim_vs_emulation.make_config`: RBS = N x slots, TBS = RBS / (K + 1), so the
in-flight cap (K + 1) x TBS groups gives every instance `slots` groups (16 by default: 256 rows, a full engine batch)
and none idles for want of work; the trainer gets as many accelerators as the instances hold, so that it does not set
the pace.

Columns (emulated seconds throughout; wall figures are this machine's):
* tokens/s, step time, rollout bubble: the run's summary (steady window, after two warm-up updates);
* open bubble: the rollout bubble until the run's last group is dispatched (the run trains every group it dispatches,
  so its last K updates drain the instances; this window leaves that out, as a longer run would), and that window's
  length (from the publish that closes the warm-up);
* orch + transfer: the driver's CPU seconds in the orchestrator's decisions and migration submissions, as emulated
  seconds (x speed-up) over the emulated run, plus the receivers' emulated seconds taking moved responses in (the
  emulated engine re-prefills them), over N x the emulated run: each a share of an instance's step time;
* gain: tokens/s over the drain and the queue rows of the same N;
* machine busy, driver lag on the trainer, engines' pace and "paced by": as `emulated_scale` decides CPU-PACED
  (driver + scheduler above 80% of a core, the machine above 90% busy, the driver's reaction to the trainer's updates
  and parts above 2% of the steady window, or the emulated engines' pace under 95%): such a row measured this
  machine, not the emulated hardware;
* sim: the simulator's tokens/s and rollout bubble, and their difference from the Dask row (relative, absolute);
* responses moved: over the whole run, one per running response a migration carried (the store's `migrations`
  rows), and the simulator's count of the same;
* parts and first part's groups (streamed updates): the spans the trainer computed a streamed update in, and the
  share of its groups its first part held, on Dask and in the simulator.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.emulated_scale import CliCluster, run_and_measure
from benchmarks.sim_vs_emulation import make_config, run_sim
from benchmarks.tables import formatted, markdown_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWITCHINGS = ("drain", "queue", "migrate")


def variants(extra: list[str], switchings=SWITCHINGS) -> list[tuple[str, list[str]]]:
    """(name, overrides) of the switchings and of each `NAME=key=value,key=value` given."""
    named = [(s, [f"rollout.switching={s}"]) for s in switchings]
    for spec in extra:
        name, _, overrides = spec.partition("=")
        if not name or not overrides:
            raise SystemExit(f"--variant {spec!r}: expected NAME=section.key=value[,section.key=value...]")
        named.append((name, overrides.split(",")))
    return named


def settings(args, instances: int) -> SimpleNamespace:
    """`make_config`'s settings for N instances; the trainer as many accelerators as the instances (the simulator's
    searched split at 64 GPUs is 28 rollout / 36 trainer: with fewer, the trainer sets the pace and instances idle)."""
    trainer = args.trainer_gpus or instances * args.tp
    return SimpleNamespace(instances=instances, slots=args.slots, group_size=args.group_size,
                           max_staleness=args.max_staleness, updates=args.updates, trainer_gpus=trainer,
                           response_p50=args.response_p50, response_cap=args.response_cap,
                           chunk_tokens=args.chunk_tokens, speedup=args.speedup)


def measure(instances: int, name: str, overrides: list[str], args) -> dict:
    """One switching at N instances: the Dask emulation on a fresh CLI cluster, then the simulator."""
    import psutil

    with tempfile.TemporaryDirectory(prefix=f"dora-switching-{instances}-{name}-") as folder:
        cfg = make_config(settings(args, instances), folder,
                          [f"emulation.tp={args.tp}", *args.overrides, *overrides])
        sim = simulated(cfg)  # first: a config the simulator cannot take fails in seconds, not after the Dask run
        cluster, address, startup = CliCluster.start(cfg, instances)
        try:
            cfg.cluster.scheduler_address = address
            row = run_and_measure(cfg, psutil.Process(cluster.scheduler_pid), cluster.worker_processes())
        finally:
            cluster.stop()
    row.update(instances=instances, switching=name, startup_s=startup, tbs=cfg.dora.train_batch_size,
               rbs=cfg.dora.rollout_batch_size, **overheads(row, cfg), **sim)
    return row


def overheads(row: dict, cfg) -> dict:
    """Orchestration and request transfer, each a share of an instance's emulated time."""
    emulated = max(1e-9, row["emulated_run_s"])
    orchestration = row["orchestration_cpu_s"] * cfg.emulation.speedup / emulated
    transfer = row["migration_s"] / (cfg.rollout.instances * emulated)
    return {"orchestration_share": orchestration, "transfer_share": transfer,
            "overhead_share": orchestration + transfer}


def simulated(cfg) -> dict:
    """The simulator's figures for the same config (none where it does not model a setting)."""
    start = time.perf_counter()
    try:
        figures, result = run_sim(cfg)
    except ValueError as unmodelled:
        return {"sim_note": str(unmodelled)}
    return {"sim_tokens_per_s": figures.tokens_per_s, "sim_rollout_bubble": figures.rollout_bubble,
            "sim_open_bubble": result.open_rollout_bubble, "sim_open_bubble_held": result.open_rollout_bubble_held,
            "sim_non_overlapped": result.non_overlapped_share,
            "sim_migrations": result.migrations, "sim_moved_responses": result.moved_responses,
            "sim_trainer_parts": result.trainer_parts_per_update,
            "sim_first_part_share": result.first_part_group_share, "sim_c_ok": result.c2_ok and result.c3_ok
            and result.c1_mixed_trajectories == 0, "sim_wall_s": time.perf_counter() - start}


def add_gains(rows: list[dict]) -> None:
    """Each row's tokens/s over the drain and queue rows of its instance count."""
    for row in rows:
        for base in ("drain", "queue"):
            ref = next((r for r in rows if r["instances"] == row["instances"] and r["switching"] == base), None)
            if ref is not None and row is not ref:
                row[f"gain_{base}"] = row["throughput"] / ref["throughput"] - 1


COLUMNS = [
    ("instances", "N", "{}"), ("switching", "switching", "{}"), ("tbs", "TBS / RBS", "{}"),
    ("throughput", "tokens/s (emu)", "{:,.0f}"), ("step_s", "step (emu s)", "{:.1f}"),
    ("rollout_bubble", "rollout bubble", "{:.1%}"), ("open_bubble", "open bubble", "{:.1%}"),
    ("open_bubble_held", "open bubble: gate held / free", "{}"), ("gate_closed_share", "gate closed", "{:.0%}"),
    ("non_overlapped", "non-overlapped", "{:.1%}"),
    ("open_window_s", "open window (emu s)", "{:,.0f}"), ("overhead_share", "orch + transfer (of step)", "{}"),
    ("migrations", "responses moved (sim)", "{:.0f}"), ("gain_drain", "gain vs drain", "{:+.1%}"),
    ("gain_queue", "gain vs queue", "{:+.1%}"), ("machine_share", "machine busy", "{:.0%}"),
    ("trainer_lag_share", "driver lag on the trainer", "{:.2%}"), ("engine_pace", "engines' pace", "{:.1%}"),
    ("cpu_paced", "paced by", "{}"),
    ("audit_ok", "audit C1-C3", "{}"),
    ("sim_tokens_per_s", "sim tokens/s (diff)", "{}"), ("sim_rollout_bubble", "sim bubble (diff)", "{}"),
    ("sim_open_bubble", "sim open bubble (diff)", "{}"), ("sim_open_bubble_held", "sim gate held / free", "{}"),
    ("sim_non_overlapped", "sim non-overlapped (diff)", "{}"),
    ("trainer_parts", "parts / streamed update (sim)", "{}"), ("first_part_share", "first part's groups (sim)", "{}"),
    ("wall_s", "loop wall (s)", "{:.0f}"),
]

SIM_BUBBLES = {"sim_rollout_bubble": "rollout_bubble", "sim_open_bubble": "open_bubble",  # sim: its Dask column
               "sim_non_overlapped": "non_overlapped"}


def cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    if key == "tbs":
        return f"{row['tbs']} / {row['rbs']}"
    if key == "overhead_share":
        return f"{value:.2%} ({row['orchestration_share']:.2%} + {row['transfer_share']:.2%})"
    if key == "sim_tokens_per_s" and value is not None:
        return f"{value:,.0f} ({value / row['throughput'] - 1:+.1%})"
    if key in ("open_bubble_held", "sim_open_bubble_held") and value is not None:
        whole = row["open_bubble" if key == "open_bubble_held" else "sim_open_bubble"]
        return f"{value:.1%} / {whole - value:.1%}"
    if key == "migrations" and row.get("sim_moved_responses") is not None:
        return f"{value:.0f} ({row['sim_moved_responses']})"
    if key in ("trainer_parts", "first_part_share") and value is not None and value == value:
        fmt = "{:.2f}" if key == "trainer_parts" else "{:.0%}"
        return f"{fmt.format(value)} ({fmt.format(row.get('sim_' + key, float('nan')))})"
    if key in SIM_BUBBLES and value is not None and row.get(SIM_BUBBLES[key]) is not None:
        return f"{value:.1%} ({value - row[SIM_BUBBLES[key]]:+.1%})"
    return formatted(key, value, fmt)


def table(rows: list[dict]) -> str:
    return markdown_table([title for _, title, _ in COLUMNS],
                          [[cell(row, key, fmt) for key, _, fmt in COLUMNS] for row in rows])


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--instances", type=int, nargs="+", default=[8, 16])
    p.add_argument("--switchings", nargs="*", choices=SWITCHINGS, default=list(SWITCHINGS),
                   help="none given: only the --variant rows")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=key=value,...",
                   help="a further switching setting, run beside the three")
    p.add_argument("--slots", type=int, default=16, help="groups per instance; RBS = N x slots, TBS = RBS / (K + 1); "
                   "16 groups of 16 fill an engine's batch (emulation.max_rows 256)")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--max-staleness", type=int, default=3)
    p.add_argument("--updates", type=int, default=8)
    p.add_argument("--tp", type=int, default=2, help="accelerators per rollout instance")
    p.add_argument("--trainer-gpus", type=int, default=0, help="0: N x tp (half of the accelerators)")
    p.add_argument("--response-p50", type=float, default=1200.0)
    p.add_argument("--response-cap", type=int, default=30720)
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--speedup", type=float, default=20.0)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "switching_scale.md"))
    p.add_argument("overrides", nargs="*", help="config overrides for every run, section.key=value")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    rows: list[dict] = []
    for instances in args.instances:
        for name, overrides in variants(args.variant, args.switchings):
            rows.append(measure(instances, name, overrides, args))
            print(json.dumps(rows[-1], default=str), flush=True)
            write(args, rows)  # after every run: a long sweep cut short keeps what it measured
    print(table(rows))
    return 0


def write(args, rows: list[dict]) -> None:
    add_gains(rows)
    text = table(rows)
    notes = [r for r in rows if r.get("sim_note")]
    header = (f"# Switchings at scale (cli cluster, emulation.speedup={args.speedup:g}, {args.updates} updates a run, "
              f"slots {args.slots}, G {args.group_size}, K {args.max_staleness}, responses p50 "
              f"{args.response_p50:g} / cap {args.response_cap}, chunk {args.chunk_tokens}"
              f"{', ' + ' '.join(args.overrides) if args.overrides else ''})\n\n")
    with open(args.out, "w") as f:
        f.write(header + text + "\n" + "".join(f"\n{r['switching']} at {r['instances']}: simulator not run "
                                               f"({r['sim_note']})\n" for r in notes))


if __name__ == "__main__":
    sys.exit(main())
