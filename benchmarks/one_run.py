"""Command line and config of the benchmark scripts that analyse one pipeline run (`rollout_gaps.py`,
`handover_hops.py`): a config file, K, a run folder (emptied first) and `section.key=value` overrides."""
from __future__ import annotations

import argparse
import shutil


def parser(description: str, run_dir: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", default="configs/longtail_bench.yaml")
    p.add_argument("--staleness", type=int, default=3)
    p.add_argument("--run-dir", default=run_dir)
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return p


def config(args: argparse.Namespace):
    """The run's config (live view and plots off); its run folder is removed first."""
    from dora_tasks.core.config import load_config

    shutil.rmtree(args.run_dir, ignore_errors=True)
    return load_config(args.config, [f"dora.max_staleness={args.staleness}", f"storage.run_dir={args.run_dir}",
                                     "tracking.live_view=false", "tracking.plots=false", *args.overrides])
