"""Reward models: a classifier or a causal-LM judge scoring responses, and the rule that combines their score with
the rule reward (`reward.*`, `dora_tasks/core/config_reward.py`).

Scores lie in [0, 1]:
- classifier (`AutoModelForSequenceClassification`): with one logit, its sigmoid; with several labels, the softmax
  probability of `reward.positive_label` (empty: the last label, e.g. LABEL_1 of a two-label head). The text is
  `reward.template` filled in; the head reads its last token (transformers pools the last non-pad token);
- judge (a causal LM): the text is the template filled in, ending where the judge answers; the score is
  P(yes) / (P(yes) + P(no)) of the next token, where P(yes) sums the probabilities of the first token of every word
  of `reward.judge_yes` (likewise `judge_no`): the two log-probabilities' difference through a sigmoid.

Texts are tokenized by the reward model's own tokenizer (the project's character tokenizer or the folder's Hugging
Face one), right-padded, and cut to their last `reward.max_length` tokens. The model runs in fp32 without gradients.
Simplified: one forward per batch, no bucketing by length (a batch pads to its longest text).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from dora_tasks.core.config_reward import RewardConfig, words
from dora_tasks.core.records import Group, RewardModelScoring
from dora_tasks.workloads.reward_batcher import Scored

COMBINE_RULES = ("model", "sum", "gate")
_LOADING = threading.Lock()  # transformers' loading is not thread-safe (dora_tasks.model.load_causal_lm)


class RewardModelError(ValueError):
    """The reward model folder cannot serve as the configured kind; the message names the key to change."""


class RewardModel:
    """A loaded reward model: `score(texts)` -> one score in [0, 1] per text."""

    def __init__(self, cfg: RewardConfig, model: torch.nn.Module, tokenizer, pad_id: int) -> None:
        self.cfg, self.model, self.tokenizer, self.pad_id = cfg, model.eval(), tokenizer, pad_id
        self.read_scores = classifier_reader(cfg, model) if cfg.kind == "classifier" else judge_reader(cfg, tokenizer)

    @torch.no_grad()
    def score(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros(0, dtype=np.float32)
        ids, lengths = self.encode(texts)
        mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
        logits = self.model(input_ids=ids, attention_mask=mask).logits
        return self.read_scores(logits, lengths).float().numpy()

    def encode(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        return encode_texts(self.tokenizer, texts, self.cfg.max_length, self.pad_id)


def encode_texts(tokenizer, texts: Sequence[str], max_length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids [B, T] and each row's length [B]; a text keeps its last `max_length` tokens."""
    rows = [list(tokenizer.prompt_ids(t))[-max_length:] for t in texts]
    lengths = torch.tensor([max(1, len(r)) for r in rows])
    ids = torch.full((len(rows), int(lengths.max())), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return ids, lengths


def classifier_reader(cfg: RewardConfig, model) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """logits [B, labels] -> the score of each row (module docstring)."""
    labels = int(model.config.num_labels)
    if labels == 1:
        return lambda logits, _: torch.sigmoid(logits[:, 0])
    names = {str(name): int(i) for i, name in model.config.id2label.items()}
    if cfg.positive_label and cfg.positive_label not in names:
        raise RewardModelError(f"reward.positive_label: {cfg.positive_label!r} is not a label of {cfg.model!r} "
                               f"(labels: {', '.join(names)})")
    positive = names[cfg.positive_label] if cfg.positive_label else labels - 1
    return lambda logits, _: torch.softmax(logits, dim=-1)[:, positive]


def judge_reader(cfg: RewardConfig, tokenizer) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """logits [B, T, vocab] -> P(yes) / (P(yes) + P(no)) of the token after each row's last one."""
    yes, no = answer_tokens(tokenizer, cfg.judge_yes, "judge_yes"), answer_tokens(tokenizer, cfg.judge_no, "judge_no")
    if set(yes) & set(no):
        raise RewardModelError(f"reward.judge_yes and reward.judge_no share the token(s) {sorted(set(yes) & set(no))} "
                               "(their words' first tokens must differ)")

    def read(logits: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(judge_margin(logits, lengths, yes, no))

    return read


def judge_margin(logits: torch.Tensor, lengths: torch.Tensor, yes: list[int], no: list[int]) -> torch.Tensor:
    """log P(yes) - log P(no) of the token after each row's last one (logits [B, T, vocab] -> [B])."""
    last = torch.log_softmax(logits[torch.arange(len(lengths)), lengths - 1].float(), dim=-1)
    return torch.logsumexp(last[:, yes], -1) - torch.logsumexp(last[:, no], -1)


def answer_tokens(tokenizer, value: str, key: str) -> list[int]:
    """The distinct first tokens of the comma-separated words of `reward.<key>`."""
    first = [tokenizer.encode(w)[:1] for w in words(value)]
    tokens = list(dict.fromkeys(t[0] for t in first if t))
    if not tokens:
        raise RewardModelError(f"reward.{key}: {value!r} gives no token with the reward model's tokenizer")
    return tokens


def load_reward_model(cfg: RewardConfig) -> RewardModel:
    """The model of `reward.model` as `reward.kind`, fp32, in eval mode (one load at a time per process)."""
    import transformers

    from dora_tasks.model import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    auto = (transformers.AutoModelForSequenceClassification if cfg.kind == "classifier"
            else transformers.AutoModelForCausalLM)
    with _LOADING:
        model = auto.from_pretrained(cfg.model, dtype=torch.float32)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    if model.config.pad_token_id is None:  # transformers pools a classifier's last non-pad token by this id
        model.config.pad_token_id = pad_id
    return RewardModel(cfg, model, tokenizer, int(model.config.pad_token_id))


# ---- combining with the rule reward ------------------------------------------------------------------------------
def combine(rule: np.ndarray, model: np.ndarray, how: str, weight: float) -> np.ndarray:
    """The trained reward from the rule reward `rule` and the model score `model` (both [n]; a failed rule reward
    is NaN and stays NaN except under "model"), with m = weight * model:
    "model": m; "sum": rule + m; "gate": m where rule > 0, else rule."""
    rule, m = np.asarray(rule, dtype=np.float64), weight * np.asarray(model, dtype=np.float64)
    if how == "model":
        return m
    if how == "sum":
        return rule + m
    if how == "gate":
        return np.where(rule > 0, m, rule)
    raise ValueError(f"reward.combine: got {how!r}, allowed: {', '.join(COMBINE_RULES)}")


def scoring_texts(cfg: RewardConfig, groups: Sequence[Group], decode: Callable) -> list[str]:
    """`reward.template` filled in for every response of `groups`, group after group, by sample index."""
    template = cfg.scoring_template
    return [template.format(prompt=g.prompt.text, response=decode(t.response_ids), answer=g.prompt.answer)
            for g in groups for t in g.trajectories]


def apply_scores(cfg: RewardConfig, groups: list[Group], scored: Scored, worker: str, role: str) -> list[Group]:
    """Combine each trajectory's rule reward with its model score and record the scoring on its group (its share
    of the forward time by its number of responses)."""
    offset, total = 0, max(1, len(scored.scores))
    for g in groups:
        n = len(g.trajectories)
        scores = scored.scores[offset:offset + n]
        offset += n
        rule = np.array([t.reward for t in g.trajectories], dtype=np.float64)
        for t, value in zip(g.trajectories, combine(rule, scores, cfg.combine, cfg.weight)):
            t.reward = float(value)
            if cfg.combine == "model":
                t.reward_error = ""  # the rule reward is not trained on: its failure is no failure of this reward
        g.reward_model = RewardModelScoring(
            worker, role, tuple(float(s) for s in scores), scored.seconds * n / total,
            tuple(b.size for b in scored.batches), max((b.calls for b in scored.batches), default=0))
    return groups
