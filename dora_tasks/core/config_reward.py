"""The `reward` config section: a reward model served on workers of its own (label REWARD), next to the rule reward.

With `reward.model` empty (the default) rewards come from `task.reward_fn` alone. With a model folder, every response
is scored twice: by the rule (`task.reward_fn`, on a CPU worker) and then by the model (on a REWARD worker), and the
two are combined by `reward.combine`, with m = `reward.weight` * model score and r = the rule reward:
  "model": m                     (the rule reward is computed but not used: its failures do not count either)
  "sum":   r + m                 (a rule reward that failed stays a failure: it counts as 0 and is counted)
  "gate":  m where r > 0, else r (the model ranks the responses the rule accepts)
Model scores lie in [0, 1] (`dora_tasks/workloads/reward_model.py` defines them for both kinds).
"""
from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

from dora_tasks.core.config_checks import ConfigError, _choice, _require

KINDS = {"classifier": "ForSequenceClassification", "judge": "ForCausalLM"}  # kind -> its architectures' suffix
TEMPLATE_FIELDS = ("prompt", "response", "answer")
DEFAULT_TEMPLATES = {"classifier": "{prompt} {response}",
                     "judge": "{prompt} {response}\nIs this answer correct? "}


@dataclass
class RewardConfig:
    model: str = ""  # a local Hugging Face folder of a reward model; empty: no reward model (rule reward only)
    kind: str = "classifier"  # "classifier": AutoModelForSequenceClassification, score = sigmoid of its one logit,
    #                           or the softmax probability of `positive_label`; "judge": a causal LM asked by
    #                           `template`, score = P(yes) / (P(yes) + P(no)) of the next token (`judge_yes/no`)
    template: str = ""  # the text scored, with {prompt}, {response} and {answer}; empty: DEFAULT_TEMPLATES[kind]
    positive_label: str = ""  # classifier: the label whose probability is the score (a name of its id2label);
    #                           empty: the last label (a one-logit head: the sigmoid of that logit)
    judge_yes: str = "yes,Yes"  # judge: words meaning yes, comma-separated; the first token of each counts
    judge_no: str = "no,No"  # judge: words meaning no, likewise
    combine: str = "sum"  # "model", "sum" or "gate" (module docstring: the rule of each)
    weight: float = 1.0  # the model score's factor in every combine rule
    batch_size: int = 32  # responses per forward pass; scoring tasks arriving together share one
    batch_window_s: float = 0.02  # how long a forward waits for more scoring tasks before it runs with what it has
    max_length: int = 512  # tokens per scored text; longer texts keep their last `max_length` tokens

    def validate(self) -> None:
        _choice(self.kind, "reward.kind", tuple(KINDS))
        _choice(self.combine, "reward.combine", ("model", "sum", "gate"))
        _require(self.weight > 0, "reward.weight", f"must be > 0, got {self.weight}")
        _require(self.batch_size >= 1, "reward.batch_size", f"must be >= 1, got {self.batch_size}")
        _require(self.batch_window_s >= 0, "reward.batch_window_s", f"must be >= 0, got {self.batch_window_s}")
        _require(self.max_length >= 8, "reward.max_length", f"must be >= 8 tokens, got {self.max_length}")
        _check_template(self.scoring_template)
        if self.kind == "judge":
            for key in ("judge_yes", "judge_no"):
                _require(bool(words(getattr(self, key))), f"reward.{key}", "needs at least one word")
        if self.model:
            _check_model_folder(self.model, self.kind, self.positive_label)

    @property
    def scoring_template(self) -> str:
        """`template`, or the default of `kind`."""
        return self.template or DEFAULT_TEMPLATES.get(self.kind, "")


def words(value: str) -> list[str]:
    """The comma-separated words of `judge_yes` / `judge_no`."""
    return [w for w in (part.strip() for part in value.split(",")) if w]


def _check_template(template: str) -> None:
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ConfigError(f"reward.template: {template!r} is not a format string ({exc})") from None
    unknown = sorted(set(names) - set(TEMPLATE_FIELDS))
    _require(not unknown, "reward.template", f"unknown field(s) {', '.join('{' + n + '}' for n in unknown)} in "
             f"{template!r}; allowed: {{prompt}}, {{response}}, {{answer}}")
    _require("response" in names, "reward.template", f"{template!r} must contain {{response}}")


def _check_model_folder(folder: str, kind: str, positive_label: str) -> None:
    """A local folder whose config.json names an architecture of `kind` and, if given, the label `positive_label`
    (read as JSON: no model is loaded here)."""
    _require("://" not in folder, "reward.model", f"must be a local folder on the reward workers, got {folder!r}")
    config = Path(folder) / "config.json"
    _require(config.is_file(), "reward.model",
             f"{folder!r} is not a Hugging Face model folder (no config.json there)")
    try:
        spec = json.loads(config.read_text())
        architectures = spec.get("architectures") or []
    except (json.JSONDecodeError, AttributeError):
        spec, architectures = {}, None
    _require(architectures is not None, "reward.model", f"{str(config)!r} is not a JSON object")
    default_labels = [f"LABEL_{i}" for i in range(int(spec.get("num_labels", 2)))]  # transformers' when unsaved
    labels = [str(name) for name in (spec.get("id2label") or {}).values()] or default_labels
    _require(not positive_label or kind != "classifier" or positive_label in labels, "reward.positive_label",
             f"{positive_label!r} is not a label of {folder!r} (labels: {', '.join(labels) or 'none'})")
    other = {k: v for k, v in KINDS.items() if k != kind}
    matches = [a for a in architectures if a.endswith(KINDS[kind])]
    hint = next((f"; it is a {k} model: set reward.kind={k}" for k, suffix in other.items()
                 if any(a.endswith(suffix) for a in architectures)), "")
    _require(bool(matches) or not architectures, "reward.kind",
             f"{kind!r} needs a *{KINDS[kind]} model, {folder!r} holds {', '.join(architectures)}{hint}")
