"""TRL's GRPOTrainer on the same workload as `benchmarks/compare_modes.py`: the peer row of the comparison table.

Same warm-started model folder (Hugging Face Qwen2 + the project's character tokenizer, wrapped below as a
`PreTrainedTokenizer` so TRL can tokenize and decode), same countdown train prompts in the same order, same group
size G, learning rate (constant, AdamW without weight decay, gradient clipping at `train.max_grad_norm`), clip range,
sampling temperature and response budget, and the same number of trained prompts (`updates * TBS`, one optimizer
step per TBS prompts x G completions, micro-batches of `train.micro_batch`). GRPO's advantage is the same
(group-normalised: TRL `scale_rewards="group"`) and TRL's `dapo` loss is a token mean over the batch like the
project's `token_mean`. TRL runs synchronously in one process: generate, score, then one update per step.

Measured: tokens/s over steady-state steps (steps 0 and 1 left out, as `pipelines.metrics` does), step time,
generation share of wall time (TRL's non-overlapped rollout share: nothing overlaps), and held-out accuracy with the
same `dora_tasks.warmstart.evaluate` (greedy, same eval prompts, same seed) every `--eval-every` steps. Evaluation
and TRL's set-up are left off the clock, as the pipeline leaves its warm-up and its evaluations (which run on a CPU
worker beside it) off the critical path.

Simplified, and why: `use_cpu=True`, no vLLM, `report_to=[]`, no gradient checkpointing (a 2-layer model), one
process with one torch thread by default (the 2-core machine is shared; `threads=2`, `compare_modes.py
--trl-threads 1,2`, gives it both cores). TRL is a benchmark-only dependency (`.[bench]`); it is installed with
`pip install --no-deps trl accelerate` so that it cannot move torch or transformers.

    python benchmarks/trl_peer.py --model DIR [--config configs/longtail_bench.yaml] [--updates 10] [--target 0.5]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import ClassVar

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
from transformers import PreTrainedTokenizer, TrainerCallback

from dora_tasks.model import BOS_ID, CHARSET, EOS_ID, PAD_ID, CharTokenizer, load_tokenizer

SPECIALS = {"<pad>": PAD_ID, "<bos>": BOS_ID, "<eos>": EOS_ID}
WARMUP_STEPS = 2  # as pipelines.metrics.WARMUP_UPDATES


class HFCharTokenizer(PreTrainedTokenizer):
    """The project's `CharTokenizer` behind the Hugging Face tokenizer API (what TRL's trainers need).

    `tok(text)` gives bos + one id per character, exactly `Prompt.token_ids`; decoding skips pad/bos/eos."""

    model_input_names: ClassVar[list[str]] = ["input_ids", "attention_mask"]

    def __init__(self, charset: str = CHARSET, **kwargs) -> None:
        self.char = CharTokenizer(charset)
        self._vocab = dict(SPECIALS) | dict(zip(charset, self.char.encode(charset)))
        self._inverse = {i: token for token, i in self._vocab.items()}
        kwargs.setdefault("padding_side", "left")
        super().__init__(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.char.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return list(text)

    def _convert_token_to_id(self, token: str) -> int:
        return self._vocab.get(token, self._vocab["?"])

    def _convert_id_to_token(self, index: int) -> str:
        return self._inverse.get(int(index), "?")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)

    def build_inputs_with_special_tokens(self, ids_0: list[int], ids_1: list[int] | None = None) -> list[int]:
        return [BOS_ID] + ids_0 + (ids_1 or [])

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple:
        return ()


class _Clock:
    """Training wall time and this process's CPU time, with pauses (evaluation is left off both)."""

    def __init__(self) -> None:
        self.start = self.paused_at = self.cpu_start = self.cpu_paused_at = None
        self.paused = self.cpu_paused = 0.0

    def begin(self) -> None:
        self.start, self.cpu_start = time.time(), time.process_time()

    def now(self) -> float:
        ref = self.paused_at if self.paused_at is not None else time.time()
        return ref - self.start - self.paused

    def cpu(self) -> float:
        ref = self.cpu_paused_at if self.cpu_paused_at is not None else time.process_time()
        return ref - self.cpu_start - self.cpu_paused

    def pause(self) -> None:
        self.paused_at, self.cpu_paused_at = time.time(), time.process_time()

    def resume(self) -> None:
        self.paused += time.time() - self.paused_at
        self.cpu_paused += time.process_time() - self.cpu_paused_at
        self.paused_at = self.cpu_paused_at = None


def run_trl(model_path: str, cfg, *, updates: int, eval_every: int, out_dir: str, target: float | None = None,
            log=print, threads: int | None = None, sampling_seed: int | None = None) -> dict:
    """Train with TRL GRPO; returns the comparison row (see compare_modes.ROW_KEYS) plus the accuracy curve.
    `threads`: torch threads of the process (default `OMP_NUM_THREADS`, 1); 2 gives TRL both cores of the machine.
    `sampling_seed`: TRL's seed (its sampling; default `dora.seed`). TRL's run is deterministic given it, so repeats
    with one seed are copies of one run; the prompts, their order and the evaluation keep `dora.seed` whatever it is."""
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from dora_tasks.warmstart import evaluate
    from dora_tasks.workloads.datasets import load_prompts
    from dora_tasks.workloads.rewards import resolve_reward_fn, score_all

    threads = threads or int(os.environ.get("OMP_NUM_THREADS", "1"))
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    char = load_tokenizer(model_path)
    train_prompts, eval_prompts = load_prompts(cfg.task, char, cfg.dora.seed)
    g, tbs = cfg.rollout.group_size, cfg.dora.train_batch_size
    n_prompts = updates * tbs
    dataset = Dataset.from_list([{"prompt": p.text, "answer": p.answer}
                                 for p in (train_prompts[i % len(train_prompts)] for i in range(n_prompts))])
    reward_fn = resolve_reward_fn(cfg.task.reward_fn)

    def countdown_reward(prompts, completions, answer, **kwargs):
        calls = list(zip(prompts, completions, answer))
        return [value for value, _ in score_all(reward_fn, calls, cfg.task.reward_timeout_s)]

    rows = tbs * g
    micro = max(d for d in range(1, min(rows, cfg.train.micro_batch) + 1) if rows % d == 0 and d % g == 0) \
        if any(rows % d == 0 and d % g == 0 for d in range(1, min(rows, cfg.train.micro_batch) + 1)) else rows
    args = GRPOConfig(
        output_dir=out_dir, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
        seed=cfg.dora.seed if sampling_seed is None else sampling_seed,
        learning_rate=cfg.train.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else 1e9,
        per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro, num_generations=g,
        max_completion_length=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p, top_k=0, max_steps=updates, num_iterations=1, beta=cfg.train.kl_coef,
        epsilon=cfg.train.clip_low, epsilon_high=cfg.train.clip_high, loss_type="dapo", scale_rewards="group",
        shuffle_dataset=False, gradient_checkpointing=False, bf16=False, disable_dropout=True,
        dataloader_num_workers=0, disable_tqdm=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tokenizer = HFCharTokenizer(char.charset)
    eval_kwargs = {"greedy": True, "seed": cfg.dora.seed, "max_new_tokens": cfg.rollout.max_new_tokens,
                   "tokenizer": char}
    clock = _Clock()
    steps: list[tuple[float, int, float]] = []  # (train-clock seconds, tokens, CPU seconds) at each step end
    curve: list[tuple[int, float, float]] = []  # (step, train-clock seconds, held-out accuracy)
    gen = {"seconds": 0.0, "tokens": 0}

    class Measure(TrainerCallback):
        def on_train_begin(self, args_, state, control, model=None, **kwargs):
            acc = evaluate(model, eval_prompts, reward_fn, **eval_kwargs)
            model.train()
            curve.append((0, 0.0, acc))
            log(f"trl: step 0 held-out accuracy {acc:.3f}")
            clock.begin()

        def on_step_end(self, args_, state, control, model=None, **kwargs):
            steps.append((clock.now(), gen.pop("step_tokens", 0), clock.cpu()))
            step = state.global_step
            if step == updates or (eval_every and step % eval_every == 0):
                clock.pause()
                acc = evaluate(model, eval_prompts, reward_fn, **eval_kwargs)
                model.train()
                clock.resume()
                curve.append((step, steps[-1][0], acc))
                log(f"trl: step {step} ({steps[-1][0]:.1f} s) held-out accuracy {acc:.3f}")

    trainer = GRPOTrainer(model=model, reward_funcs=countdown_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Measure()])
    generate = trainer._generate

    def timed_generate(prompts):  # generation time and tokens (prompt + completion, as the pipeline counts)
        t = time.time()
        out = generate(prompts)
        gen["seconds"] += time.time() - t
        tokens = sum(len(p) + len(c) for p, c in zip(out[0], out[1]))
        gen["tokens"] += tokens
        gen["step_tokens"] = gen.get("step_tokens", 0) + tokens
        return out

    trainer._generate = timed_generate
    try:
        trainer.train()
    finally:
        torch.set_num_threads(previous_threads)
    return trl_row(steps, curve, gen, target, threads)


def trl_row(steps: list[tuple[float, int, float]], curve: list[tuple[int, float, float]], gen: dict,
            target: float | None, threads: int = 1) -> dict:
    ends = [0.0] + [t for t, _, _ in steps]
    steady = steps[WARMUP_STEPS:] if len(steps) > WARMUP_STEPS else steps
    start = ends[WARMUP_STEPS] if len(steps) > WARMUP_STEPS else 0.0
    cpu_start = steps[WARMUP_STEPS - 1][2] if len(steps) > WARMUP_STEPS else 0.0
    wall = max(1e-9, steps[-1][0] - start)
    tokens = sum(n for _, n, _ in steady)
    reached = [t for _, t, acc in curve if target is not None and acc >= target - 1e-9]
    return {
        "mode": "TRL GRPO (sync)" if threads == 1 else f"TRL GRPO (sync, {threads} threads)",
        "throughput_tokens_per_s": tokens / wall,
        # this process's CPU over the steady steps: cores used, and CPU seconds per 1000 consumed tokens
        "cpu_cores_used": (steps[-1][2] - cpu_start) / wall,
        "cpu_s_per_1k_tokens": 1000 * (steps[-1][2] - cpu_start) / max(1, tokens),
        "step_time_s": float(np.mean(np.diff(ends)[WARMUP_STEPS:] if len(steps) > WARMUP_STEPS else np.diff(ends))),
        "rollout_bubble": float("nan"), "trainer_bubble": float("nan"),
        "non_overlapped_rollout_share": gen["seconds"] / max(1e-9, steps[-1][0]),
        "max_staleness": 0, "c1_violations": 0, "initial_accuracy": curve[0][2], "final_accuracy": curve[-1][2],
        "wall_s": steps[-1][0], "time_to_target_s": reached[0] if reached else None,
        "accuracy_curve": [{"update": s, "wall_s": t, "accuracy": a} for s, t, a in curve],
        "trained_prompts": None, "consumed_tokens": sum(n for _, n, _ in steps),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="warm-started policy folder (config.json, tokenizer.json)")
    parser.add_argument("--config", default="configs/longtail_bench.yaml")
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--target", type=float, default=None, help="held-out accuracy to time")
    parser.add_argument("--out", default="benchmarks/results/trl_run")
    parser.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    args = parser.parse_args(argv)
    from dora_tasks.core.config import load_config

    cfg = load_config(args.config, list(args.overrides) + [f"model.path={args.model}"])
    row = run_trl(args.model, cfg, updates=args.updates, eval_every=args.eval_every, out_dir=args.out,
                  target=args.target)
    row["trained_prompts"] = args.updates * cfg.dora.train_batch_size
    print(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
