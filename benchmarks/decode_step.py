"""The two decode sessions of the transformers engine side by side: transformers' forward against the written-out step.

Prints one table: for each number of rows, the CPU time of one decode step (every row one token) with
`DecodeSession` (transformers' forward and dynamic cache) and with `FastDecodeSession` (`rollout.fast_decode`), and
their ratio. Each row starts from a countdown-like prompt of 12-19 tokens and decodes `--tokens` tokens in chunks of
16 (the benchmark's `rollout.chunk_tokens`); no row ends early (no eos id is given), so both sessions do exactly the
same work. The policy is a freshly initialised one of the benchmark's shape (64 wide, 2 layers, 4 heads): timing
does not depend on the weights.

Simplified, and why: one process, one torch thread (as the rollout workers run); the sessions alternate, each
measured `--repeats` times, the table gives the median.

    python benchmarks/decode_step.py [--rows 1,8,32,128] [--tokens 96] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dora_tasks.core.config import ModelConfig  # noqa: E402
from dora_tasks.engines.fast_session import FastDecodeSession  # noqa: E402
from dora_tasks.engines.hf_session import DecodeSession  # noqa: E402
from dora_tasks.model import CharTokenizer, build_model  # noqa: E402

CHUNK = 16


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32,128", help="comma-separated row counts")
    parser.add_argument("--tokens", type=int, default=96, help="tokens decoded per row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=64)
    return parser.parse_args(argv)


def step_seconds(kind, model, rows: int, tokens: int) -> float:
    """CPU seconds per decode step of a session of `kind` serving `rows` rows for `tokens` tokens each."""
    session = kind(model, eos_ids=[], pad_id=0, version=0)
    for r in range(rows):
        session.add(r, [1] + [5 + (r * 7 + j) % 40 for j in range(11 + r % 8)])
    session.decode({r: 1 for r in range(rows)}, seed=0)  # the prefill, not timed
    chunks = (tokens - 1 + CHUNK - 1) // CHUNK
    start = time.process_time()
    for chunk in range(chunks):
        session.decode({r: CHUNK for r in range(rows)}, seed=chunk + 1)
    return (time.process_time() - start) / (chunks * CHUNK)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    model = build_model(ModelConfig(hidden_size=args.hidden_size, num_layers=2, num_heads=4),
                        CharTokenizer().vocab_size)
    kinds = {"transformers": DecodeSession, "fast": FastDecodeSession}
    print(f"| rows | transformers ms/step | fast ms/step | fast us/token | speed-up |\n|---|---|---|---|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for _ in range(args.repeats):
            for name, kind in kinds.items():
                times[name].append(step_seconds(kind, model, rows, args.tokens))
        slow, fast = (statistics.median(times[name]) for name in kinds)
        print(f"| {rows} | {slow * 1e3:.2f} | {fast * 1e3:.2f} | {fast * 1e6 / rows:.0f} | {slow / fast:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
