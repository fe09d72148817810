"""TRL's GRPOTrainer on the same workload as `benchmarks/compare_modes.py`: the peer row of the comparison table.

Same warm-started model folder (Hugging Face Qwen2 + the project's character tokenizer, wrapped below as a
`PreTrainedTokenizer` so TRL can tokenize and decode), same countdown train prompts in the same order, same group
size G, learning rate (constant, AdamW without weight decay, gradient clipping at `train.max_grad_norm`), clip range,
sampling temperature and response budget, and the same number of trained prompts (`updates * TBS`, one optimizer
step per TBS prompts x G completions, micro-batches of `train.micro_batch`). GRPO's advantage is the same
(group-normalised: TRL `scale_rewards="group"`) and TRL's `dapo` loss is a token mean over the batch like the
project's `token_mean`. TRL runs synchronously: generate, score, then one update per step; under
`accelerate launch --multi_gpu --num_processes N` as N data-parallel ranks on gloo (`use_cpu=True`; accelerate's
`--cpu` flag would start one process), each generating its share of the step's completions.

Measured: tokens/s over steady-state steps (steps 0 and 1 left out, as `pipelines.metrics` does), step time,
generation share of wall time (TRL's non-overlapped rollout share: nothing overlaps), and held-out accuracy with the
same `dora_tasks.warmstart.evaluate` (greedy, same eval prompts, same seed) every `--eval-every` steps. Evaluation
and TRL's set-up are left off the clock, as the pipeline leaves its warm-up and its evaluations (which run on a CPU
worker beside it) off the critical path; `--warm` also takes TRL's first generate and backward off it, as the
pipeline's engines are warmed before its clock. What TRL trained on is counted, not assumed (`Ledger`): completions
generated and trained, the policy version each was generated at, staleness and C1.

Options tried to give TRL its best (`PeerOptions`): two torch threads, N processes, TRL's
`use_transformers_continuous_batching`, warming, and TRL's colocated vLLM (`--use-vllm`; see
benchmarks/results/race.md for what each gave). Simplified, and why: `report_to=[]`, no gradient checkpointing (a
2-layer model). TRL is a benchmark-only dependency (`.[bench]`); it is installed with
`pip install --no-deps trl accelerate` so that it cannot move torch or transformers.

    python benchmarks/trl_peer.py --model DIR [--config configs/longtail_bench.yaml] [--updates 10] [--target 0.5]
                                  [--threads 2] [--warm] [--continuous-batching] [--use-vllm] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
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


@dataclass
class PeerOptions:
    """How TRL runs. `threads`: torch threads of each process (default `OMP_NUM_THREADS`, 1). `sampling_seed`: TRL's
    seed (its sampling; default `dora.seed`). `data_seed`: which train prompts, in which order (default `dora.seed`);
    evaluation always uses the held-out prompts of `dora.seed`. `continuous_batching`: TRL's
    `use_transformers_continuous_batching` instead of a static `generate` batch. `warm`: one generate and one
    backward before the clock starts. `use_vllm`: TRL's colocated vLLM generation. `stop_eval_at_target`: evaluate
    only the last step once the target is reached (the time to target is then known)."""

    threads: int | None = None
    sampling_seed: int | None = None
    data_seed: int | None = None
    continuous_batching: bool = False
    warm: bool = False
    use_vllm: bool = False
    stop_eval_at_target: bool = False


def grpo_args(cfg, out_dir: str, updates: int, seed: int, options: PeerOptions, world: int):
    """GRPOConfig matching the project's run: one optimizer step per TBS x G completions over all processes."""
    from trl import GRPOConfig

    g, rows = cfg.rollout.group_size, cfg.dora.train_batch_size * cfg.rollout.group_size
    local = rows // world
    fits = [d for d in range(1, min(local, cfg.train.micro_batch) + 1) if local % d == 0 and (d * world) % g == 0]
    micro = max(fits) if fits else local
    extra = {"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False} if options.use_vllm else {}
    return GRPOConfig(
        output_dir=out_dir, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=seed,
        learning_rate=cfg.train.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else 1e9,
        per_device_train_batch_size=micro, gradient_accumulation_steps=local // micro, num_generations=g,
        max_completion_length=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p, top_k=0, max_steps=updates, num_iterations=1, beta=cfg.train.kl_coef,
        epsilon=cfg.train.clip_low, epsilon_high=cfg.train.clip_high, loss_type="dapo", scale_rewards="group",
        shuffle_dataset=False, gradient_checkpointing=False, bf16=False, disable_dropout=True,
        dataloader_num_workers=0, disable_tqdm=True,
        use_transformers_continuous_batching=options.continuous_batching, **extra)


class Ledger:
    """What TRL generated and trained on, per process: each completion is tagged with the optimizer step (policy
    version) it was generated at, and read back when a loss is computed on it. Staleness = training step minus
    generation step; a C1 violation = a generation call during which the step counter moved."""

    def __init__(self) -> None:
        self.generated = self.trained = self.c1_violations = self.max_staleness = 0
        self.staleness: dict[int, int] = {}

    def instrument(self, trainer) -> None:
        import torch

        score, loss = trainer._generate_and_score_completions, trainer.compute_loss

        def tagged(batch):
            before = trainer.state.global_step
            out = score(batch)
            n = out["completion_ids"].shape[0]
            self.generated += n
            self.c1_violations += n if trainer.state.global_step != before else 0
            out["policy_version"] = torch.full((n,), before, dtype=torch.long)
            return out

        def counted(model, inputs, *args, **kwargs):
            versions = inputs.pop("policy_version")
            for lag in (trainer.state.global_step - versions).tolist():
                self.staleness[lag] = self.staleness.get(lag, 0) + 1
            self.trained += len(versions)
            return loss(model, inputs, *args, **kwargs)

        trainer._generate_and_score_completions, trainer.compute_loss = tagged, counted

    def totals(self, accelerator) -> dict:
        """Counts summed over processes (the staleness histogram too), from every process's ledger."""
        import torch

        lags = range(max(self.staleness, default=0) + 1)
        local = torch.tensor([[self.generated, self.trained, self.c1_violations] +
                              [self.staleness.get(lag, 0) for lag in lags]], dtype=torch.long)
        if accelerator.num_processes > 1:
            local = accelerator.gather(local)
        total = local.sum(0).tolist()
        histogram = {lag: n for lag, n in enumerate(total[3:]) if n}
        return {"generated_completions": total[0], "trained_trajectories": total[1], "c1_violations": total[2],
                "staleness_histogram": histogram, "max_staleness": max(histogram, default=0)}


def train_dataset(cfg, char, data_seed: int, n_prompts: int):
    from datasets import Dataset

    from dora_tasks.workloads.datasets import load_prompts

    train_prompts, _ = load_prompts(cfg.task, char, data_seed)
    return Dataset.from_list([{"prompt": p.text, "answer": p.answer}
                              for p in (train_prompts[i % len(train_prompts)] for i in range(n_prompts))])


def run_trl(model_path: str, cfg, *, updates: int, eval_every: int, out_dir: str, target: float | None = None,
            log=print, threads: int | None = None, sampling_seed: int | None = None,
            options: PeerOptions | None = None) -> dict:
    """Train with TRL GRPO; returns the comparison row (see compare_modes.ROW_KEYS) plus the accuracy curve and the
    ledger's counts. TRL's run is deterministic given its seeds, so repeats need their own seeds to show a spread.
    Under `accelerate launch --num_processes N` every process calls this; process 0 evaluates and keeps the clock."""
    import torch
    import transformers
    from trl import GRPOTrainer

    from dora_tasks.workloads.datasets import load_prompts
    from dora_tasks.workloads.rewards import resolve_reward_fn, score_all

    options = options or PeerOptions(threads=threads, sampling_seed=sampling_seed)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(options.threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
    char = load_tokenizer(model_path)
    _, eval_prompts = load_prompts(cfg.task, char, cfg.dora.seed)
    data_seed = cfg.dora.seed if options.data_seed is None else options.data_seed
    dataset = train_dataset(cfg, char, data_seed, updates * cfg.dora.train_batch_size)
    reward_fn = resolve_reward_fn(cfg.task.reward_fn)

    def countdown_reward(prompts, completions, answer, **kwargs):
        calls = list(zip(prompts, completions, answer))
        return [value for value, _ in score_all(reward_fn, calls, cfg.task.reward_timeout_s)]

    world = int(os.environ.get("WORLD_SIZE", "1"))
    seed = cfg.dora.seed if options.sampling_seed is None else options.sampling_seed
    args = grpo_args(cfg, out_dir, updates, seed, options, world)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    measure = Measure(cfg, eval_prompts, reward_fn, char, updates, eval_every, target, options, log)
    trainer = GRPOTrainer(model=model, reward_funcs=countdown_reward, args=args, train_dataset=dataset,
                          processing_class=HFCharTokenizer(char.charset), callbacks=[measure])
    ledger = Ledger()
    ledger.instrument(trainer)
    time_generation(trainer, measure.gen)
    if options.warm:
        warm_up(trainer, [row["prompt"] for row in dataset.select(range(2))], cfg.rollout.group_size)
    try:
        trainer.train()
    finally:
        torch.set_num_threads(previous_threads)
    row = trl_row(measure.steps, measure.curve, measure.gen, target, options.threads or 1)
    row.update(ledger.totals(trainer.accelerator), processes=world, is_main=trainer.accelerator.is_main_process,
               config=peer_name(options, world))
    return row


def peer_name(options: PeerOptions, world: int) -> str:
    parts = [f"{world} processes" if world > 1 else f"{options.threads or 1} thread(s)"]
    parts += [name for name, on in (("continuous batching", options.continuous_batching), ("warmed", options.warm),
                                    ("vLLM", options.use_vllm)) if on]
    return "TRL GRPO (" + ", ".join(parts) + ")"


def time_generation(trainer, gen: dict) -> None:
    """Generation time and tokens (prompt + completion, as the pipeline counts), summed over processes."""
    import torch

    generate = trainer._generate

    def timed_generate(prompts):
        t = time.time()
        out = generate(prompts)
        gen["seconds"] += time.time() - t
        tokens = sum(len(p) + len(c) for p, c in zip(out[0], out[1]))
        if trainer.accelerator.num_processes > 1:
            tokens = int(trainer.accelerator.gather(torch.tensor([tokens])).sum())
        gen["tokens"] += tokens
        gen["step_tokens"] = gen.get("step_tokens", 0) + tokens
        return out

    trainer._generate = timed_generate


def warm_up(trainer, prompts: list[str], group_size: int) -> None:
    """One generate through TRL's own path and one forward/backward, before the clock starts (as the pipeline's
    engines are warmed before its run); gradients are dropped and no optimizer step is taken."""
    import torch

    model = trainer.model
    model.eval()
    trainer._generate([p for p in prompts for _ in range(group_size)])
    model.train()
    ids = torch.tensor([trainer.processing_class(p)["input_ids"] for p in prompts[:1]])
    model(input_ids=ids).logits.float().mean().backward()
    model.zero_grad(set_to_none=True)


class Measure(TrainerCallback):
    """The clock (from the first step, evaluations left off it), steps' token counts and the accuracy curve;
    evaluation runs on process 0 only."""

    def __init__(self, cfg, eval_prompts, reward_fn, char, updates, eval_every, target, options, log) -> None:
        self.eval_prompts, self.reward_fn, self.updates, self.eval_every = eval_prompts, reward_fn, updates, eval_every
        self.target, self.options, self.log = target, options, log
        self.eval_kwargs = {"greedy": True, "seed": cfg.dora.seed, "max_new_tokens": cfg.rollout.max_new_tokens,
                            "tokenizer": char}
        self.clock = _Clock()
        self.steps: list[tuple[float, int, float]] = []  # (train-clock seconds, tokens, CPU seconds) at each step end
        self.curve: list[tuple[int, float, float]] = []  # (step, train-clock seconds, held-out accuracy)
        self.gen = {"seconds": 0.0, "tokens": 0}

    def _evaluate(self, model) -> float:
        from dora_tasks.warmstart import evaluate

        acc = evaluate(model, self.eval_prompts, self.reward_fn, **self.eval_kwargs)
        model.train()
        return acc

    def _main(self, state) -> bool:
        return state.is_world_process_zero

    def on_train_begin(self, args_, state, control, model=None, **kwargs):
        if self._main(state):
            acc = self._evaluate(model)
            self.curve.append((0, 0.0, acc))
            self.log(f"trl: step 0 held-out accuracy {acc:.3f}")
        self.clock.begin()

    def _wanted(self, step: int) -> bool:
        reached = self.target is not None and any(a >= self.target - 1e-9 for s, _, a in self.curve if s > 0)
        if step == self.updates:
            return True
        if reached and self.options.stop_eval_at_target:
            return False
        return bool(self.eval_every) and step % self.eval_every == 0

    def on_step_end(self, args_, state, control, model=None, **kwargs):
        self.steps.append((self.clock.now(), self.gen.pop("step_tokens", 0), self.clock.cpu()))
        step = state.global_step
        if self._main(state) and self._wanted(step):
            self.clock.pause()
            acc = self._evaluate(model)
            self.clock.resume()
            self.curve.append((step, self.steps[-1][0], acc))
            self.log(f"trl: step {step} ({self.steps[-1][0]:.1f} s) held-out accuracy {acc:.3f}")


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
        "initial_accuracy": curve[0][2] if curve else float("nan"),
        "final_accuracy": curve[-1][2] if curve else float("nan"),
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
    parser.add_argument("--threads", type=int, default=None, help="torch threads of each process (default 1)")
    parser.add_argument("--sampling-seed", type=int, default=None, help="TRL's seed (default dora.seed)")
    parser.add_argument("--data-seed", type=int, default=None, help="train prompts and order (default dora.seed)")
    parser.add_argument("--continuous-batching", action="store_true", help="use_transformers_continuous_batching")
    parser.add_argument("--warm", action="store_true", help="one generate and backward before the clock starts")
    parser.add_argument("--use-vllm", action="store_true", help="TRL's colocated vLLM generation")
    parser.add_argument("--stop-eval-at-target", action="store_true", help="once reached, evaluate the last step only")
    parser.add_argument("--json-out", default=None, help="also write the row (process 0) to this file")
    parser.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    args = parser.parse_args(argv)
    from dora_tasks.core.config import load_config

    cfg = load_config(args.config, list(args.overrides) + [f"model.path={args.model}"])
    options = PeerOptions(threads=args.threads, sampling_seed=args.sampling_seed, data_seed=args.data_seed,
                          continuous_batching=args.continuous_batching, warm=args.warm, use_vllm=args.use_vllm,
                          stop_eval_at_target=args.stop_eval_at_target)
    row = run_trl(args.model, cfg, updates=args.updates, eval_every=args.eval_every, out_dir=args.out,
                  target=args.target, options=options)
    if not row["is_main"]:
        return 0
    row["trained_prompts"] = args.updates * cfg.dora.train_batch_size
    text = json.dumps(row, indent=1, default=float)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
