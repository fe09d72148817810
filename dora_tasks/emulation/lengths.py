"""Deterministic long-tailed prompt and response lengths shaped like DAPO-Math responses of a 32B reasoning model.

A response length is log-normal with a per-prompt part (hard prompts get long answers from every sample) and a
per-sample part, capped at `cap` (a capped response ends unfinished). With the defaults, p50 1,200 tokens,
log-sd 1.06 in all: p90 ~4,700, p99 ~14,000 (p99/p50 ~ 11.6) and mean ~2,100; about 0.1% of responses hit the
30,720-token cap. Every figure depends only on (seed, prompt id, sample), so the Dask emulation and the simulator
see the same workload.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthModel:
    response_p50: float = 1200.0
    prompt_sigma: float = 0.75  # log-sd shared by a prompt's samples
    sample_sigma: float = 0.75  # log-sd of each sample around its prompt
    cap: int = 30720
    prompt_p50: float = 180.0
    prompt_log_sd: float = 0.35
    prompt_cap: int = 2048
    seed: int = 0

    def prompt_factor(self, prompt_id: int) -> float:
        z = np.random.default_rng([self.seed, 1, prompt_id]).standard_normal(2)
        return float(z[0])

    def prompt_tokens(self, prompt_id: int) -> int:
        z = np.random.default_rng([self.seed, 1, prompt_id]).standard_normal(2)[1]
        return int(min(self.prompt_cap, max(16, round(self.prompt_p50 * math.exp(self.prompt_log_sd * z)))))

    def response_tokens(self, prompt_id: int, sample: int) -> int:
        """Tokens of response `sample` to prompt `prompt_id`; `cap` means it was cut unfinished."""
        z = np.random.default_rng([self.seed, 2, prompt_id, sample]).standard_normal()
        log_len = math.log(self.response_p50) + self.prompt_sigma * self.prompt_factor(prompt_id) \
            + self.sample_sigma * float(z)
        return int(min(self.cap, max(1, round(math.exp(log_len)))))

    @property
    def log_sd(self) -> float:
        return math.hypot(self.prompt_sigma, self.sample_sigma)


def length_model_from(emulation, seed: int = 0) -> LengthModel:
    """The length model an `EmulationConfig` describes, for the run's seed."""
    e = emulation
    return LengthModel(e.response_p50, e.prompt_sigma, e.sample_sigma, e.response_cap, e.prompt_p50, seed=seed)
