"""Rollout engines side by side: a vLLM instance against the transformers fallback, on the same long-tailed batch.

Prints one table: engine start, generate time and tokens/s of each engine and their ratio, then the weight publish
(`save_pretrained` to /dev/shm) and load (`load_version`: vLLM `reload_weights`, transformers `load_state_dict`)
seconds, and that time as a share of a step (generate the batch + publish + load).

The batch (P prompts x n samples), the same for both engines:
- `--model DIR` (a policy folder with its `tokenizer.json`, e.g. a warm-started countdown policy) or
  `--warmstart-steps N` (warm-start one, cached under --cache): countdown prompts through both engines' public
  `generate(prompts, n, seed)`; the long tail comes from the task (log-uniform counts).
- otherwise, a random tiny policy (`dora_tasks.model.build_model` with the default ModelConfig): it cannot produce
  task-like lengths, so every response gets a fixed length drawn from a Pareto distribution (median ~15 tokens,
  capped at max_new_tokens). vLLM gets one request per response with `max_tokens=length, ignore_eos=True`;
  transformers runs `HFRolloutEngine`'s model and generation config over the padded batch with eos forbidden before
  and forced at each row's length, so a batch decodes until its longest row ends, as `HFRolloutEngine.generate` does.
  Both generate exactly the same number of tokens.

Simplified, and why: one process and one torch thread for both engines (2-core machine shared with other work);
each engine gets one small warm-up call before the timed one, and each number is one measurement, not a median.

    python benchmarks/engines.py [--prompts 16] [--n 4] [--max-new-tokens 256] [--model DIR | --warmstart-steps 300]
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

from dora_tasks.core.config import ModelConfig, RolloutConfig, load_config  # noqa: E402

PARETO_SHAPE, PARETO_SCALE = 1.1, 8  # classical Pareto: median 8 * 2 ** (1 / 1.1) ~ 15 tokens


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (group size)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="", help="policy folder (with tokenizer.json): task workload")
    parser.add_argument("--warmstart-steps", type=int, default=0, help="warm-start a countdown policy first")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "dora-bench-warmstart"))
    parser.add_argument("--publish-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    return parser.parse_args(argv)


# ---------------------------------------------------------------- the batch


def random_policy(folder: str, seed: int) -> str:
    from dora_tasks.model import CharTokenizer, build_model, save_policy

    tokenizer = CharTokenizer()
    return save_policy(build_model(ModelConfig(), tokenizer.vocab_size, seed=seed), tokenizer, folder)


def warm_started_policy(steps: int, cache: str) -> str:
    from dora_tasks.warmstart import warm_start

    cfg = load_config(None, [f"model.warmstart_steps={steps}", "model.hidden_size=128", "model.num_heads=4"])
    return warm_start(cfg, os.path.join(cache, f"countdown-h128-s{steps}"))


def task_prompts(model_dir: str, count: int, seed: int) -> list[list[int]]:
    from dora_tasks.model import load_tokenizer
    from dora_tasks.workloads.countdown import make_prompts

    return [list(p.token_ids) for p in make_prompts(count, seed + 1, load_tokenizer(model_dir), max_count=400)]


def random_prompts(count: int, vocab: int, rng: np.random.Generator) -> list[list[int]]:
    from dora_tasks.model import BOS_ID

    return [[BOS_ID] + rng.integers(3, vocab, size=int(rng.integers(8, 24))).tolist() for _ in range(count)]


def heavy_tailed_lengths(count: int, cap: int, rng: np.random.Generator) -> np.ndarray:
    return np.minimum(np.ceil(PARETO_SCALE * (1 + rng.pareto(PARETO_SHAPE, size=count))), cap).astype(int)


# ---------------------------------------------------------------- generation, one function per engine and workload


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def generate_tokens(engine, prompts, n: int, seed: int) -> int:
    """Public API path: tokens generated by `engine.generate` (eos included)."""
    return sum(len(g.token_ids) for gens in engine.generate(prompts, n, seed) for g in gens)


def vllm_fixed_lengths(engine, prompts, n: int, lengths: np.ndarray, seed: int) -> int:
    """One vLLM request per response, each exactly its length (ignore_eos), in one continuous batch."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = engine.rollout_cfg
    rows = [p for p in prompts for _ in range(n)]
    params = [SamplingParams(n=1, temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=int(length),
                             ignore_eos=True, logprobs=0, seed=seed + i) for i, length in enumerate(lengths)]
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs)


class ForceLengths:
    """Logits processor: row r may not emit eos before its length and must emit it at its length."""

    def __init__(self, lengths: np.ndarray, prompt_width: int, eos: int) -> None:
        self.lengths = torch.as_tensor(lengths)
        self.prompt_width = prompt_width
        self.eos = eos

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width  # tokens generated so far
        at_end = self.lengths == step + 1
        scores[~at_end, self.eos] = -float("inf")
        scores[at_end] = torch.where(torch.arange(scores.shape[1]) == self.eos, 0.0, -float("inf"))
        return scores


def hf_fixed_lengths(engine, prompts, n: int, lengths: np.ndarray, seed: int) -> int:
    """HFRolloutEngine's model and generation config over padded batches, each row exactly its length."""
    from transformers import LogitsProcessorList

    from dora_tasks.engines.decoding import left_pad
    from dora_tasks.model import EOS_ID

    rows = [p for p in prompts for _ in range(n)]
    generated = 0
    for start in range(0, len(rows), engine.max_batch):
        batch_lengths = lengths[start:start + engine.max_batch]
        input_ids, mask = left_pad(rows[start:start + engine.max_batch])
        force = ForceLengths(batch_lengths, input_ids.shape[1], EOS_ID)
        generation_config = copy.deepcopy(engine.generation_config)
        generation_config.max_new_tokens = int(batch_lengths.max())
        torch.manual_seed(seed + start)
        with torch.no_grad():
            out = engine.model.generate(input_ids=input_ids, attention_mask=mask, generation_config=generation_config,
                                        logits_processor=LogitsProcessorList([force]))
        new_tokens = out.sequences[:, input_ids.shape[1]:]
        generated += int(((new_tokens == EOS_ID).int().argmax(dim=1) + 1).sum())  # up to and including eos
    return generated


# ---------------------------------------------------------------- one engine end to end


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def next_version_model(model_dir: str, seed: int):
    """The trainer's next policy version: the same model plus small noise, in memory (publishing writes it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1e-3 * torch.randn(param.shape, generator=generator))
    return model


def make_engine(name: str, model_dir: str, cfg: RolloutConfig):
    if name == "vllm":
        from dora_tasks.engines.vllm_rollout import VLLMRolloutEngine

        return VLLMRolloutEngine(model_dir, dataclasses.replace(cfg, engine="vllm"))
    from dora_tasks.engines.hf_rollout import HFRolloutEngine

    return HFRolloutEngine(model_dir, dataclasses.replace(cfg, engine="hf"))


def run_batch(name: str, engine, prompts, n: int, lengths: np.ndarray | None, seed: int) -> int:
    """Tokens generated for the batch: the public API on the task workload, forced lengths otherwise."""
    if lengths is None:
        return generate_tokens(engine, prompts, n, seed)
    fixed = vllm_fixed_lengths if name == "vllm" else hf_fixed_lengths
    tokens = fixed(engine, prompts, n, lengths, seed)
    assert tokens == int(lengths.sum()), f"{name} generated {tokens} tokens, expected {int(lengths.sum())}"
    return tokens


def measure_engine(name: str, model_dir: str, cfg: RolloutConfig, batch: dict, next_model, publish_dir: str) -> dict:
    """Start, warm up, generate the batch, publish the next version and load it; seconds, tokens and memory."""
    rss = rss_mib()
    engine, start_s = timed(make_engine, name, model_dir, cfg)
    memory = rss_mib() - rss
    warm_lengths = None if batch["lengths"] is None else batch["lengths"][:2]
    run_batch(name, engine, batch["prompts"][:2], 1, warm_lengths, batch["seed"] + 1)
    tokens, generate_s = timed(run_batch, name, engine, batch["prompts"], batch["n"], batch["lengths"], batch["seed"])
    folder = tempfile.mkdtemp(prefix=f"dora-bench-{name}-", dir=publish_dir)
    try:
        _, publish_s = timed(next_model.save_pretrained, folder, safe_serialization=True)
        _, load_s = timed(engine.load_version, 1, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if hasattr(engine, "close"):
        engine.close()
    return {"start_s": start_s, "rss_mib": memory, "tokens": tokens, "generate_s": generate_s,
            "tok_per_s": tokens / generate_s, "publish_s": publish_s, "load_s": load_s,
            "share": (publish_s + load_s) / (generate_s + publish_s + load_s)}


# ---------------------------------------------------------------- report


ROWS = [("engine start (s)", "start_s", "{:.2f}"), ("RSS added by start (MiB)", "rss_mib", "{:.0f}"),
        ("tokens generated", "tokens", "{:d}"), ("generate batch (s)", "generate_s", "{:.2f}"),
        ("tokens/s", "tok_per_s", "{:.0f}"), ("publish: save_pretrained (s)", "publish_s", "{:.3f}"),
        ("load_version (s)", "load_s", "{:.3f}"), ("publish+load share of step", "share", "{:.1%}")]


def print_table(title: str, vllm: dict, hf: dict) -> None:
    print(f"\n{title}")
    print(f"| {'':30} | {'vLLM':>10} | {'transformers':>12} | {'vLLM / hf':>9} |")
    print(f"|{'-' * 32}|{'-' * 11}:|{'-' * 13}:|{'-' * 10}:|")
    for label, key, fmt in ROWS:
        ratio = vllm[key] / hf[key] if hf[key] else float("nan")
        print(f"| {label:30} | {fmt.format(vllm[key]):>10} | {fmt.format(hf[key]):>12} | {ratio:>9.2f} |")


def build_batch(args, workdir: str) -> tuple[str, dict, str]:
    """(model folder, batch, title): the task workload with a policy, forced Pareto lengths with a random one."""
    rng = np.random.default_rng(args.seed)
    batch = {"n": args.n, "seed": args.seed, "lengths": None}
    if args.model or args.warmstart_steps:
        model_dir = args.model or warm_started_policy(args.warmstart_steps, args.cache)
        batch["prompts"] = task_prompts(model_dir, args.prompts, args.seed)
        title = f"countdown policy {model_dir}, {args.prompts} prompts x {args.n} samples, " \
                f"max_new_tokens={args.max_new_tokens}"
        return model_dir, batch, title
    from dora_tasks.model import CharTokenizer

    model_dir = random_policy(os.path.join(workdir, "policy"), args.seed)
    batch["prompts"] = random_prompts(args.prompts, CharTokenizer().vocab_size, rng)
    lengths = batch["lengths"] = heavy_tailed_lengths(args.prompts * args.n, args.max_new_tokens, rng)
    title = (f"random policy, {args.prompts} prompts x {args.n} samples, fixed Pareto lengths: "
             f"median {np.median(lengths):.0f}, p90 {np.percentile(lengths, 90):.0f}, max {lengths.max()}, "
             f"total {lengths.sum()} tokens")
    return model_dir, batch, title


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    workdir = tempfile.mkdtemp(prefix="dora-bench-")
    try:
        model_dir, batch, title = build_batch(args, workdir)
        cfg = RolloutConfig(max_new_tokens=args.max_new_tokens)
        next_model = next_version_model(model_dir, args.seed + 1)
        rss_before_import = rss_mib()
        _, import_s = timed(__import__, "vllm")  # not counted as engine start
        results = {name: measure_engine(name, model_dir, cfg, batch, next_model, args.publish_dir)
                   for name in ("hf", "vllm")}
        print_table(title, results["vllm"], results["hf"])
        print(f"import vllm: {import_s:.1f} s and {rss_mib() - rss_before_import:.0f} MiB RSS (not in engine start); "
              f"KV cache {cfg.kv_cache_bytes / 2**20:.0f} MiB (RSS grows into it as it is used); "
              f"torch threads: {torch.get_num_threads()}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
