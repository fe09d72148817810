"""A small reward model the project trains itself (no pretrained reward model is reachable here), for tests and the
demo: a tiny Qwen2 classifier, or a tiny causal-LM judge, that learns to tell right countdown answers from wrong ones.

`train_reward_model(out, kind=...)` writes a Hugging Face folder that `reward.model` can point at:
- the data: countdown prompts, each with its right answer and wrong ones made from it the ways a policy slips (it
  stops early, runs on, gets one number wrong or starts from another count); every response is labelled by the
  task's rule reward (`countdown.reward`), half of them right;
- the model: `Qwen2ForSequenceClassification` with two labels (score: the probability of "right"), or a
  `Qwen2ForCausalLM` judge trained on the next token after `reward.template` (score: P(yes) / (P(yes) + P(no)));
  both read the text of `reward.template` with the project's character tokenizer;
- the loss: binary cross-entropy on the model's logit margin (right - wrong, or log P(yes) - log P(no)),
  AdamW, constant learning rate.

Simplified: the wrong answers are made by rule, not sampled from a policy, so a few hundred steps of a 2-layer model
learn what separates them (the end of the count, a broken step) within seconds on a CPU; its scores correlate with
correctness without matching the rule (`agreement` measures it on held-out prompts).

    python -m dora_tasks.workloads.reward_model_training runs/reward-model [--kind judge] [--steps 300]
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np
import torch
import transformers

from dora_tasks.core.config import ModelConfig
from dora_tasks.core.config_reward import RewardConfig, words
from dora_tasks.model import MAX_POSITIONS, PAD_ID, CharTokenizer, build_model, save_policy
from dora_tasks.workloads import countdown
from dora_tasks.workloads.reward_model import encode_texts, judge_margin, load_reward_model

MAX_LENGTH = 256  # characters of a training text: every countdown answer up to max_count=400 fits


@dataclass
class Example:
    text: str  # `reward.template` filled in
    label: float  # the rule reward: 1.0 right, 0.0 wrong


def corrupt(answer: str, rng: np.random.Generator) -> str:
    """A wrong answer made from the right one, the ways a policy slips."""
    numbers = answer.split()
    how = rng.integers(4)
    if how == 0 and len(numbers) > 1:  # stops early
        return " ".join(numbers[:rng.integers(1, len(numbers))])
    if how == 1:  # runs on past the end
        return " ".join(numbers + [str(int(numbers[-1]) + int(rng.integers(1, 9)))])
    if how == 2:  # one number wrong
        i = int(rng.integers(len(numbers)))
        numbers[i] = str(int(numbers[i]) + int(rng.integers(1, 10)))
        return " ".join(numbers)
    return " ".join(str(int(n) + 10) for n in numbers)  # starts from another count


def examples(n_prompts: int, seed: int, max_count: int, template: str) -> list[Example]:
    """One right and one wrong response per countdown prompt, labelled by the rule reward."""
    rng = np.random.default_rng(seed)
    out = []
    for prompt in countdown.make_prompts(n_prompts, seed, CharTokenizer(), max_count):
        for response in (prompt.answer, corrupt(prompt.answer, rng)):
            label = countdown.reward(prompt.text, response, prompt.answer)
            out.append(Example(template.format(prompt=prompt.text, response=response, answer=prompt.answer), label))
    return out


def build_reward_model(kind: str, tokenizer: CharTokenizer, hidden: int, layers: int, seed: int):
    """A freshly initialised tiny Qwen2 classifier (two labels) or causal LM (the judge)."""
    if kind == "judge":
        return build_model(ModelConfig(hidden_size=hidden, num_layers=layers, num_heads=4), tokenizer.vocab_size, seed)
    config = transformers.Qwen2Config(
        vocab_size=tokenizer.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=MAX_POSITIONS,
        id2label={0: "wrong", 1: "right"}, label2id={"wrong": 0, "right": 1}, pad_token_id=PAD_ID,
        use_sliding_window=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.Qwen2ForSequenceClassification(config).float()


def margin_fn(kind: str, cfg: RewardConfig, tokenizer: CharTokenizer):
    """(model, ids, lengths) -> the logit margin [B] that the score is the sigmoid of."""
    if kind == "classifier":
        def classifier(model, ids, lengths):
            logits = model(input_ids=ids, attention_mask=_mask(ids, lengths)).logits
            return logits[:, 1] - logits[:, 0]

        return classifier
    yes, no = (list(dict.fromkeys(tokenizer.encode(w)[0] for w in words(v))) for v in (cfg.judge_yes, cfg.judge_no))
    return lambda model, ids, lengths: judge_margin(
        model(input_ids=ids, attention_mask=_mask(ids, lengths)).logits, lengths, yes, no)


def _mask(ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()


def train_reward_model(out: str, kind: str = "classifier", steps: int = 300, batch: int = 32, lr: float = 3e-3,
                       hidden: int = 64, layers: int = 2, max_count: int = 200, seed: int = 0) -> dict:
    """Train a reward model of `kind` on countdown responses labelled by the rule reward and save it to `out` (a
    Hugging Face folder with the character tokenizer); returns its training record (seconds, final loss)."""
    cfg = RewardConfig(kind=kind)
    tokenizer = CharTokenizer()
    data = examples(max(64, steps * batch // 8), seed, max_count, cfg.scoring_template)
    model = build_reward_model(kind, tokenizer, hidden, layers, seed).train()
    margin = margin_fn(kind, cfg, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng, losses, start = np.random.default_rng(seed), [], time.perf_counter()
    for _ in range(steps):
        chosen = [data[i] for i in rng.choice(len(data), size=batch, replace=False)]
        ids, lengths = encode_texts(tokenizer, [e.text for e in chosen], MAX_LENGTH, PAD_ID)
        labels = torch.tensor([e.label for e in chosen])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(margin(model, ids, lengths), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    save_policy(model.eval(), tokenizer, out)
    return {"kind": kind, "seconds": time.perf_counter() - start, "final_loss": float(np.mean(losses[-20:]))}


def agreement(folder: str, kind: str = "classifier", n_prompts: int = 128, seed: int = 1,
              max_count: int = 200) -> dict:
    """How the saved model's scores separate right from wrong responses on prompts drawn with another seed: the
    mean score of each, and the AUC (the chance a right response outscores a wrong one)."""
    cfg = RewardConfig(model=folder, kind=kind)
    data = examples(n_prompts, seed, max_count, cfg.scoring_template)
    scores = load_reward_model(cfg).score([e.text for e in data])
    labels = np.array([e.label for e in data])
    right, wrong = scores[labels == 1.0], scores[labels == 0.0]
    auc = float((right[:, None] > wrong[None, :]).mean() + 0.5 * (right[:, None] == wrong[None, :]).mean())
    return {"right_mean": float(right.mean()), "wrong_mean": float(wrong.mean()), "auc": auc}


def main() -> None:
    parser = argparse.ArgumentParser(description="Train the project's small countdown reward model.")
    parser.add_argument("out", help="folder to write (a Hugging Face model folder for reward.model)")
    parser.add_argument("--kind", choices=("classifier", "judge"), default="classifier")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    record = train_reward_model(args.out, args.kind, steps=args.steps, seed=args.seed)
    print(record, agreement(args.out, args.kind), sep="\n")
    print(f"use it with: reward.model={args.out} reward.kind={args.kind}")


if __name__ == "__main__":
    main()
