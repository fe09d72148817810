"""`dora simulate`: one simulated configuration, printed as a table (or JSON).

Without a config file the workload is the paper's step (512 prompts x 16 samples) and the cost model the
`emulation` section's defaults; with one, its `emulation` section sets the cost model and lengths, and its
`dora.max_staleness`, `dora.train_batch_size` (one step), `dora.rollout_batch_size`, `rollout.group_size` and
`emulation.trainer_gpus` set the workload, each flag overriding its key.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from pipelines.simulator import SimConfig, SimResult, simulate
from pipelines.simulator.modes import MODES

FLAGS = {  # flag -> SimConfig field
    "gpus": "gpus", "mode": "mode", "max_staleness": "max_staleness", "tbs": "train_batch_size",
    "rbs": "rollout_batch_size", "prompts_per_step": "prompts_per_step", "group_size": "group_size",
    "trainer_gpus": "trainer_gpus", "steps": "steps", "warmup_steps": "warmup_steps", "switching": "switching",
    "max_rows": "max_rows", "decision_interval": "decision_interval_s",
    "versions_per_instance": "versions_per_instance", "handover_s": "handover_s", "stream_updates": "stream_updates",
}


def add_arguments(p) -> None:
    p.add_argument("inputs", nargs="*", metavar="[config.yaml] key=value",
                   help="an optional config file, then section.key=value overrides")
    p.add_argument("--gpus", type=int, help="accelerators in all (default 64)")
    p.add_argument("--mode", choices=MODES, help="default dora")
    p.add_argument("--max-staleness", type=int, metavar="K", help="K of dora and partial (default 3)")
    p.add_argument("--tbs", type=int, help="groups per version (default: one step's prompts)")
    p.add_argument("--rbs", type=int, help="groups kept in flight by dora and partial (default 2 x TBS)")
    p.add_argument("--prompts-per-step", type=int, help="prompts of a step (default 512)")
    p.add_argument("--group-size", type=int, help="samples per prompt (default 16)")
    p.add_argument("--trainer-gpus", type=trainer_gpus, metavar="N|rule|search",
                   help="disaggregated modes: trainer accelerators, or how they are chosen: rule (default), the best "
                   "predicted step time; search, the best tokens/s of short simulations around the rule's split")
    p.add_argument("--steps", type=int, help="steps to simulate (default 8)")
    p.add_argument("--warmup-steps", type=int, help="steps left out of the figures (default 2)")
    p.add_argument("--switching", choices=("drain", "queue", "migrate"), help="how instances leave old versions")
    p.add_argument("--max-rows", type=int, help="rows one engine decodes at once (default 256)")
    p.add_argument("--decision-interval", type=float, help="seconds between orchestrator turns (default 1)")
    p.add_argument("--handover-s", type=float, metavar="S",
                   help="migrate: seconds a moved group's requests spend between instances (default 0)")
    p.add_argument("--versions-per-instance", type=int, metavar="M",
                   help="versions one instance serves at once, one LoRA adapter each (default 1; needs "
                   "emulation.lora_rank > 0; implies --switching drain)")
    p.add_argument("--stream-updates", action="store_const", const=True,
                   help="dora: hand a batch to the trainer before its stragglers complete; it computes the rest "
                   "meanwhile (dora.stream_updates on Dask)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def trainer_gpus(text: str) -> int | str:
    """--trainer-gpus: a count, or the name of a split (`SimConfig.split`)."""
    names = {"rule": "rule", "search": "searched"}
    if text in names:
        return names[text]
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, rule or search; got {text!r}") from None


def settings(args, load_config):
    """(SimConfig, cost model, length model) from the config file, its overrides and the flags."""
    from dora_tasks.emulation.cost_model import cost_model_from
    from dora_tasks.emulation.lengths import length_model_from

    path = args.inputs[0] if args.inputs and "=" not in args.inputs[0] else None
    cfg = load_config(path, args.inputs[1:] if path else args.inputs)
    values = {}
    if path:
        values = {"max_staleness": cfg.dora.max_staleness, "train_batch_size": cfg.dora.train_batch_size,
                  "prompts_per_step": cfg.dora.train_batch_size, "rollout_batch_size": cfg.dora.rollout_batch_size,
                  "group_size": cfg.rollout.group_size, "trainer_gpus": cfg.emulation.trainer_gpus,
                  "versions_per_instance": cfg.rollout.versions_per_instance}
    flags = {field: getattr(args, flag) for flag, field in FLAGS.items() if getattr(args, flag) is not None}
    values.update(flags)
    if values.get("versions_per_instance", 1) > 1 and args.switching is None:
        values["switching"] = "drain"  # the only switching that several versions per instance replaces
    if isinstance(values.get("trainer_gpus"), str):  # a named split: the simulator chooses the count
        values["split"], values["trainer_gpus"] = values["trainer_gpus"], 0
    if "train_batch_size" not in values and "prompts_per_step" in values:
        values["train_batch_size"] = values["prompts_per_step"]
    if "rollout_batch_size" not in values:
        values["rollout_batch_size"] = 2 * values.get("train_batch_size", SimConfig.train_batch_size)
    sim = SimConfig(**values).validate()
    return sim, cost_model_from(cfg.emulation), length_model_from(cfg.emulation, cfg.dora.seed)


def table(r: SimResult) -> str:
    rows = [
        ("mode", f"{r.mode} (K={r.max_staleness}, TBS={r.train_batch_size}, RBS={r.rollout_batch_size})"),
        ("accelerators", f"{r.gpus}: rollout {r.rollout_gpus} ({r.instances} instances), trainer {r.trainer_gpus}"),
        ("step time", f"{r.step_s / 60:.2f} min"),
        ("tokens/s", f"{r.tokens_per_s:,.0f}"),
        ("non-overlapped rollout share", f"{r.non_overlapped_share:.1%} ({r.rollout_phase_s / 60:.2f} min a step)"),
        ("rollout bubble", f"{r.rollout_bubble:.1%} (prefill {r.prefill_share:.1%}, weight loads {r.load_share:.1%}, "
                           f"KV transfers {r.transfer_share:.1%})"),
        ("migrations", f"{r.migrations} (steady state)"),
        ("trainer bubble", f"{r.trainer_bubble:.1%}"),
        ("staleness max / histogram", f"{r.staleness_max} / {dict(sorted(r.staleness_hist.items()))}"),
        ("C1 mixed-version trajectories", str(r.c1_mixed_trajectories)),
        ("C2 every group whole, once", "ok" if r.c2_ok else "BROKEN"),
        ("C3 staleness <= K", "ok" if r.c3_ok else "BROKEN"),
    ]
    if r.predicted_step_s:
        rows.append(("split rule's predicted step", f"{r.predicted_step_s / 60:.2f} min"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows) + "\n(virtual seconds of the emulated cluster)"


def run(args, load_config) -> int:
    sim, cost, lengths = settings(args, load_config)
    result = simulate(sim, cost, lengths)
    print(json.dumps(dataclasses.asdict(result), indent=1) if args.json else table(result))
    return 0
