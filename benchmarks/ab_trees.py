"""The long-tail benchmark on two versions of the code, side by side in one invocation: tokens/s of sync K=0 and
DORA K=3 and their ratio, for a git revision (checked out in a temporary worktree) against the working tree.

    python benchmarks/ab_trees.py REV [--rounds 2] [--updates 20] [compare_modes.py options ...]

Each round runs `benchmarks/compare_modes.py --modes sync,DORA --no-colocated --repeats 1` in both trees, their
order swapped every other round (ABBA...), so drift of the machine's load falls on both alike. Each tree runs its own
code: its folder leads PYTHONPATH, which the Dask workers inherit.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("sync K=0", "DORA K=3")


def worktree(rev: str, where: str) -> str:
    path = os.path.join(where, "tree")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, rev], check=True, capture_output=True)
    return path


def one_pass(tree: str, out: str, updates: int, extra: list[str]) -> dict[str, float]:
    """tokens/s by mode of one compare_modes pass in `tree`."""
    env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "benchmarks/compare_modes.py", "--modes", "sync,DORA", "--no-colocated", "--repeats", "1",
           "--updates", str(updates), "--eval-every", "1000", "--out", out, *extra]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "compare_modes.json")) as f:
        runs = json.load(f)["runs"]
    return {r["mode"]: r["throughput_tokens_per_s"] for r in runs if r["mode"] in MODES}


def table(results: dict[str, list[dict[str, float]]]) -> str:
    lines = ["| tree | sync K=0 tokens/s | DORA K=3 tokens/s | K=3 / K=0 (each round) | median ratio |",
             "|---|---|---|---|---|"]
    for name, passes in results.items():
        ratios = [p["DORA K=3"] / p["sync K=0"] for p in passes]
        k0 = " / ".join(f"{p['sync K=0']:,.0f}" for p in passes)
        k3 = " / ".join(f"{p['DORA K=3']:,.0f}" for p in passes)
        lines.append(f"| {name} | {k0} | {k3} | {' / '.join(f'{r:.2f}' for r in ratios)} | "
                     f"{statistics.median(ratios):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the git revision to compare the working tree against")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--updates", type=int, default=20)
    args, extra = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="dora-ab-") as where:
        trees = {args.rev: worktree(args.rev, where), "working tree": ROOT}
        results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        try:
            for r in range(args.rounds):
                order = list(trees) if r % 2 == 0 else list(reversed(trees))
                for name in order:
                    out = os.path.join(where, f"out-{r}-{len(results[name])}-{name.replace(' ', '_')}")
                    results[name].append(one_pass(trees[name], out, args.updates, extra))
                    print(f"round {r}, {name}: {results[name][-1]}", flush=True)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", trees[args.rev]], capture_output=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
