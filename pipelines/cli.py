"""`dora`: the command line of the project (console script `dora = pipelines.cli:main`, or `python -m pipelines.cli`).

    dora run       --config FILE [key=value ...]          train with DORA multi-version streaming rollout
    dora warmstart --config FILE [key=value ...] [--out]  build and warm-start the initial policy only
    dora resume    RUN_DIR [key=value ...]                continue a killed or finished run from its checkpoint
    dora audit     STORE [--max-staleness K] [--json]     check C1-C3 on a trajectory store
    dora plots     RUN_DIR [--store S] [--out DIR]        redraw the PNGs of a run from its trajectory store
    dora config    --config FILE [key=value ...]          print the resolved configuration as YAML
    dora simulate  [FILE] [key=value ...] [--gpus N --mode M --max-staleness K ...]  discrete-event simulation

Bad input (unknown key, wrong type, out-of-range value, missing file, malformed override) prints one line
`dora: error: <message>` on stderr and exits with 2, without a traceback. Input errors are: `ConfigError`, the
command line's own `UsageError`, any exception class defined in this project (pipelines, dora_tasks, storage)
whose name ends in "Error" and which subclasses ValueError (e.g. `DatasetError`, `RunFolderError`), and the few
listed in `EXTRA_INPUT_ERRORS` (`ClusterError`: the scheduler address is the user's). A run that stopped for a reason
its message explains (`RUN_STOPPED_ERRORS`: a trainer that cannot be brought back, a reward function that always
fails) prints one line too and exits with 1; its folder can be resumed. Ctrl-C stops a run cleanly with one line
(`dora: stopped (Ctrl-C); continue with: dora resume RUN_DIR`) and exit 130. Everything else is a bug and keeps its
traceback. `run` and `resume` go through the Python API (`pipelines.api.Pipeline`), like a pipeline built in Python.

Simplified: the heavy modules (pipeline, warm start, store, audit, matplotlib) are imported inside the command that
needs them, so `dora --help` and `dora config` answer at once.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Sequence

PROJECT_PACKAGES = ("pipelines", "dora_tasks", "storage")
# Input errors that are not ValueErrors: an unreachable or unsuitable cluster.scheduler_address is the user's to fix.
EXTRA_INPUT_ERRORS = ("pipelines.cluster.ClusterError",)
# The run stopped for a reason its message explains (the folder can be resumed): one line, exit 1.
RUN_STOPPED_ERRORS = ("pipelines.trainer_recovery.TrainerError", "pipelines.reward_checks.RewardFailureError")
DEFAULT_CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "cpu_demo.yaml")
STORE_NAME = "trajectories.zarr"
EXIT_USAGE = 2
EXIT_STOPPED = 1
EXIT_INTERRUPTED = 130

OVERRIDES_HELP = ("config overrides as section.key=value (YAML values), applied after the file, "
                  "e.g. dora.max_staleness=0 rollout.instances=4")


class UsageError(ValueError):
    """The command line itself is wrong (bad option, missing folder); the message says what."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing usage and exiting, so every error is one line."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise UsageError(f"{message} (see '{self.prog} --help')")


# ----------------------------------------------------------------------------------------------- helpers
def error_name(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}"


def is_input_error(exc: BaseException) -> bool:
    """True for the project's own input-validation errors (see the module docstring)."""
    cls = type(exc)
    if isinstance(exc, UsageError) or f"{cls.__module__}.{cls.__qualname__}" in EXTRA_INPUT_ERRORS:
        return True
    return (isinstance(exc, ValueError) and cls is not ValueError and cls.__name__.endswith("Error")
            and cls.__module__.split(".")[0] in PROJECT_PACKAGES)


def load(args: argparse.Namespace):
    """The configuration of `--config` and the overrides, its algorithm names checked against the registry."""
    from dora_tasks.algorithms import check_config_names
    from dora_tasks.core.config import load_config

    cfg = load_config(args.config, args.overrides)
    check_config_names(cfg.train)
    return cfg


def existing_dir(path: str, what: str) -> str:
    if not os.path.isdir(path):
        raise UsageError(f"{what} {path!r} does not exist or is not a folder")
    return path


def config_yaml(cfg) -> str:
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)


def find_store(run_dir: str, store: str | None) -> str:
    """`--store`, else `<run_dir>/trajectories.zarr`, else RUN_DIR itself when it is a store."""
    if store:
        return store
    candidate = os.path.join(run_dir, STORE_NAME)
    if os.path.isdir(candidate):
        return candidate
    if os.path.isfile(os.path.join(run_dir, "zarr.json")):
        return run_dir
    raise UsageError(f"no trajectory store in {run_dir!r} (expected {candidate!r}; pass --store)")


# ----------------------------------------------------------------------------------------------- commands
def finish(pipeline, method) -> int:
    """Run `method` of the Python API's `pipeline` (`run` or `resume`) and print its summary; Ctrl-C stops it with
    one line saying how to go on (the run closed its cluster and store first)."""
    try:
        summary = method()
    except KeyboardInterrupt:
        print(f"dora: stopped (Ctrl-C); continue with: dora resume {pipeline.run_dir}", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(summary.to_text())
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from pipelines.api import Pipeline

    pipeline = Pipeline(load(args))
    return finish(pipeline, pipeline.run)


def cmd_warmstart(args: argparse.Namespace) -> int:
    cfg = load(args)
    if args.out:
        from dora_tasks.warmstart import warm_start

        path = warm_start(cfg, args.out)
    else:  # the cache folder `dora run` itself uses, so this pre-warms the next run
        from pipelines.run import initial_policy

        path = initial_policy(cfg)
    print(f"warm-started policy: {path}\nuse it with: model.path={path}")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    run_dir = existing_dir(args.run_dir, "run folder")
    from dora_tasks.core.config import apply_overrides

    apply_overrides({}, list(args.overrides))  # malformed overrides fail here, before anything starts
    from pipelines.api import Pipeline

    pipeline = Pipeline.from_run_dir(run_dir, list(args.overrides))
    return finish(pipeline, pipeline.resume)


def cmd_audit(args: argparse.Namespace) -> int:
    if "://" not in args.store and not os.path.exists(args.store):
        raise UsageError(f"trajectory store {args.store!r} does not exist")
    from storage.audit import main as audit_main

    argv = [args.store] + (["--max-staleness", str(args.max_staleness)] if args.max_staleness is not None else [])
    return int(audit_main(argv + (["--json"] if args.json else []), prog="dora audit", speaker="dora"))


def cmd_plots(args: argparse.Namespace) -> int:
    run_dir = existing_dir(args.run_dir, "run folder")
    store_path = find_store(run_dir, args.store)
    from pipelines.plots import make_plots
    from storage.schema import StoreError
    from storage.trajectory_store import TrajectoryStore

    try:
        store = TrajectoryStore.open(store_path)
        tables = {name: store.read_table(name) for name in ("trajectories", "updates", "dispatch")}
    except StoreError as exc:
        raise UsageError(f"cannot read trajectory store {store_path!r}: {exc}") from None
    K = args.max_staleness if args.max_staleness is not None else store.meta.get("max_staleness")
    beside = run_dir if store_path != run_dir else os.path.dirname(os.path.abspath(run_dir))  # never inside a store
    paths = make_plots(tables, args.out or os.path.join(beside, "plots"), K)
    print("\n".join(paths) if paths else f"nothing to plot: {store_path!r} holds no rows yet")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from dora_tasks.core.config import load_config
    from pipelines.simulator.command import run

    return run(args, load_config)


def cmd_config(args: argparse.Namespace) -> int:
    sys.stdout.write(config_yaml(load(args)))
    return 0


# ----------------------------------------------------------------------------------------------- parser
def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", default=DEFAULT_CONFIG,
                   help="YAML file overriding the defaults of dora_tasks/core/config.py "
                        "(default: configs/cpu_demo.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help=OVERRIDES_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dora", description="DORA multi-version streaming rollout for asynchronous RL "
                     "post-training of LLMs, on Dask.",
                     epilog="Run 'dora <command> --help' for the options of a command.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser, required=True)

    p = sub.add_parser("run", help="train: rollout, reward, advantage, version gate, update, publish",
                       description="Run the pipeline: on an embedded LocalCluster, or on cluster.scheduler_address. "
                       "Prints a summary (throughput, staleness, reward) and where MLflow and the plots are.")
    _add_config_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("warmstart", help="build and warm-start the initial policy, then stop",
                       description="Build the small model from scratch and fine-tune it on the task's "
                       "demonstrations (model.warmstart_* settings). Cached: a finished folder with the same "
                       "settings is reused.")
    _add_config_args(p)
    p.add_argument("--out", metavar="DIR", help="output folder (default: the settings-keyed cache that `dora run` "
                   "uses, $DORA_CACHE or ~/.cache/dora/warmstart/<digest>)")
    p.set_defaults(func=cmd_warmstart)

    p = sub.add_parser("resume", help="continue a run from its last checkpoint",
                       description="Resume the run in RUN_DIR from its last checkpoint: nothing lost, nothing "
                       "trained twice. Overrides apply on top of the run's saved configuration.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (storage.run_dir of the run)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. dora.num_updates=20 to train longer")
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("audit", help="check C1-C3 (one version per trajectory, whole groups once, staleness <= K)",
                       description="Audit a trajectory store. Exit code 0: clean, 1: violations, 2: unusable store.")
    p.add_argument("store", metavar="STORE", help="trajectory store path or fsspec URL (<run_dir>/trajectories.zarr)")
    p.add_argument("--max-staleness", type=int, metavar="K", help="the bound K (default: the store's own)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("plots", help="draw learning, staleness, timeline and throughput PNGs of a run",
                       description="Read the run's trajectory store and write learning.png, staleness.png, "
                       "timeline.png and throughput.png.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (or a trajectory store)")
    p.add_argument("--store", metavar="STORE", help="trajectory store (default: RUN_DIR/trajectories.zarr)")
    p.add_argument("--out", metavar="DIR", help="output folder (default: RUN_DIR/plots, or next to a STORE given "
                   "as RUN_DIR)")
    p.add_argument("--max-staleness", type=int, metavar="K", help="K to mark (default: the store's own)")
    p.set_defaults(func=cmd_plots)

    p = sub.add_parser("config", help="print the resolved configuration as YAML",
                       description="Load FILE, apply the overrides, validate, and print every key as YAML.")
    _add_config_args(p)
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("simulate", help="simulate a mode on an emulated cluster in virtual time",
                       description="Drive the real version gate and orchestrator with emulated engines (the "
                       "emulation section's cost model and lengths) in virtual time, and print step time, tokens/s, "
                       "bubbles, the non-overlapped rollout share and the staleness.")
    from pipelines.simulator.command import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_simulate)
    return parser


def show_warnings() -> None:
    """The pipeline's warnings (a lost trainer, failing rewards) as `dora: warning: ...` lines on stderr."""
    logger = logging.getLogger("dora")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("dora: %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING)
        logger.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    show_warnings()
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        print("dora: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - re-raised below unless it is an input error or a stopped run
        stopped = error_name(exc) in RUN_STOPPED_ERRORS
        if not (stopped or is_input_error(exc)):
            raise
        print(f"dora: error: {' '.join(str(exc).split())}", file=sys.stderr)  # one line, even for YAML errors
        return EXIT_STOPPED if stopped else EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
