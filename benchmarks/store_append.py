"""Benchmark the trajectory store: append N trajectories the way a run does, then read them back and audit them.

A "run" here: updates of `--batch-groups` groups of `--group-size` trajectories (~256 tokens each: a 32..96-token
prompt and a long-tailed response); per update, one dispatch row per group, one `append_consumed`, one
`append_update`, and a `flush()` every `--flush-every` updates (0: only the automatic chunk-size flushes).
Only the store's calls are timed; building the records is not.

Simplified, and why: token ids and log-probs are uniform random numbers, which compress worse than real text and
real log-probs, so the on-disk size is an upper bound.

    python benchmarks/store_append.py [--n 100000] [--flush-every 1] [--dir /tmp/x]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dora_tasks.core.records import Group  # noqa: E402
from storage.audit import audit_store  # noqa: E402
from storage.synthetic import make_group  # noqa: E402
from storage.trajectory_store import TrajectoryStore  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=100_000, help="trajectories to append")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--batch-groups", type=int, default=64, help="groups per update (TBS)")
    p.add_argument("--flush-every", type=int, default=1, help="flush every k updates; 0 = chunk-size flushes only")
    p.add_argument("--dir", default=None, help="where to write the store (default: a temp folder, deleted after)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_batch(rng: np.random.Generator, first_id: int, version: int, args: argparse.Namespace) -> list[Group]:
    groups = []
    for gid in range(first_id, first_id + args.batch_groups):
        lens = np.minimum(rng.lognormal(np.log(150), 0.6, args.group_size), 2048).astype(int) + 1
        groups.append(make_group(gid, version, rng, group_size=args.group_size, prompt_len=int(rng.integers(32, 97)),
                                 response_lens=lens.tolist(), instance=f"tcp://10.0.0.{gid % 8}:4000",
                                 start_time=float(version), end_time=version + 0.5))
    return groups


def raw_bytes(groups: list[Group]) -> int:
    """Bytes of the data as the store keeps it before compression (row columns + ragged arrays)."""
    row_bytes = 8 + 8 + 4 + 2 + 2 + 8 + 8 + 2 + 4 + 8 + 2 + 4 + 2 + 4 + 1 + 4 + 4 + 8 + 8
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for g in groups for t in g.trajectories)
    responses = sum(len(t.response_ids) for g in groups for t in g.trajectories)
    return sum(len(g.trajectories) for g in groups) * row_bytes + 4 * tokens + 8 * responses


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def write(path: str, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    store = TrajectoryStore.create(path, {"group_size": args.group_size, "max_staleness": 0}, overwrite=True)
    written = raw = tokens = 0
    seconds = 0.0
    update = 0
    while written < args.n:
        batch = make_batch(rng, update * args.batch_groups, update, args)
        raw += raw_bytes(batch)
        tokens += sum(g.num_tokens for g in batch)
        started = time.perf_counter()
        for g in batch:
            store.append_dispatch(g.group_id, g.prompt.prompt_id, g.version, 0, float(update))
        store.append_consumed(batch, update, update + 0.9)
        store.append_update(update, update + 0.5, update + 1.0, update + 1, 0.01, {"loss": 0.0, "kl": 0.0})
        if args.flush_every and (update + 1) % args.flush_every == 0:
            store.flush()
        seconds += time.perf_counter() - started
        written += sum(len(g.trajectories) for g in batch)
        update += 1
    started = time.perf_counter()
    store.close()
    seconds += time.perf_counter() - started
    return {"trajectories": written, "updates": update, "tokens": tokens, "raw": raw, "seconds": seconds}


def read_back(path: str) -> dict:
    started = time.perf_counter()
    reader = TrajectoryStore.open(path)
    table = reader.read_table("trajectories")
    rows = np.arange(len(table["group_id"]))
    tables = time.perf_counter() - started
    tokens = reader.read_ragged("tokens", rows)
    versions = reader.read_ragged("token_versions", rows)
    logprobs = reader.read_ragged("behaviour_logprobs", rows)
    ragged = time.perf_counter() - started - tables
    assert len(tokens) == len(versions) == len(logprobs) == len(rows)
    started = time.perf_counter()
    report = audit_store(path)
    return {"tables": tables, "ragged": ragged, "audit": time.perf_counter() - started, "audit_ok": report.ok}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="store-bench-")
    path = os.path.join(root, "trajectories.zarr")
    try:
        w = write(path, args)
        disk = disk_bytes(path)
        r = read_back(path)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    mb = 1e6
    print(f"appended {w['trajectories']} trajectories ({w['tokens']} tokens, {w['updates']} updates of "
          f"{args.batch_groups}x{args.group_size}, flush every {args.flush_every or 'chunk'}) in {w['seconds']:.2f} s")
    print(f"  rows/s          {w['trajectories'] / w['seconds']:,.0f} trajectories/s "
          f"({w['tokens'] / w['seconds']:,.0f} tokens/s)")
    print(f"  MB/s            {w['raw'] / mb / w['seconds']:.1f} (uncompressed data appended)")
    print(f"  on disk         {disk / mb:.1f} MB, {disk / w['trajectories']:.0f} bytes/trajectory "
          f"(raw {w['raw'] / w['trajectories']:.0f}; compression ratio {w['raw'] / disk:.2f})")
    print(f"  read back       tables {r['tables']:.2f} s, ragged (3 arrays, all rows) {r['ragged']:.2f} s")
    print(f"  audit           {r['audit']:.2f} s (ok={r['audit_ok']})")


if __name__ == "__main__":
    main()
