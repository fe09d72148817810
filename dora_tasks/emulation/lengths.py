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
        return float(self._prompt_draw(prompt_id)[0])

    def prompt_tokens(self, prompt_id: int) -> int:
        return self._prompt_length(self._prompt_draw(prompt_id)[1])

    def response_tokens(self, prompt_id: int, sample: int) -> int:
        """Tokens of response `sample` to prompt `prompt_id`; `cap` means it was cut unfinished."""
        return self._response_length(self.prompt_factor(prompt_id), prompt_id, sample)

    def group(self, prompt_id: int, samples: int) -> tuple[int, tuple[int, ...]]:
        """(prompt_tokens, response_tokens of samples 0..samples-1) of one prompt, drawing its prompt part once."""
        z = self._prompt_draw(prompt_id)
        factor = float(z[0])
        return self._prompt_length(z[1]), tuple(self._response_length(factor, prompt_id, s) for s in range(samples))

    def _prompt_draw(self, prompt_id: int):
        return np.random.Generator(np.random.PCG64([self.seed, 1, prompt_id])).standard_normal(2)

    def _prompt_length(self, z) -> int:
        return int(min(self.prompt_cap, max(16, round(self.prompt_p50 * math.exp(self.prompt_log_sd * z)))))

    def _response_length(self, factor: float, prompt_id: int, sample: int) -> int:
        z = np.random.Generator(np.random.PCG64([self.seed, 2, prompt_id, sample])).standard_normal()
        log_len = math.log(self.response_p50) + self.prompt_sigma * factor + self.sample_sigma * float(z)
        return int(min(self.cap, max(1, round(math.exp(log_len)))))

    @property
    def log_sd(self) -> float:
        return math.hypot(self.prompt_sigma, self.sample_sigma)


def length_model_from(emulation, seed: int = 0) -> LengthModel:
    """The length model an `EmulationConfig` describes, for the run's seed."""
    e = emulation
    return LengthModel(e.response_p50, e.prompt_sigma, e.sample_sigma, e.response_cap, e.prompt_p50, seed=seed)
