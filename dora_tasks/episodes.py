"""Multi-turn episodes on a rollout instance: model turn, environment step, model turn, ..., as one trajectory.

With `task.environment` set, a rollout task runs its group's G episodes here (`run_episodes`) instead of one
generation per response. The environment contract is `dora_tasks.workloads.environments`. Each round decodes the
next model turn of every live episode of the group together on the instance's rollout server
(`RolloutServer.generate_turns`: one request per episode, its history re-encoded, a turn ending at eos, at a stop
string of the environment or at its token limit), then steps every environment on its turn's text.

C1 across turns: the whole group runs inside `RolloutServer.hold(version)`, so the server serves no other version
between two turns of an episode (a group of a newer version waits until it ends), and every model token carries the
group's version. Environment tokens carry `ENVIRONMENT_VERSION` (-1), behaviour log-prob 0 and loss mask 0: they
are stored with the response, the trainer conditions on them, and the loss leaves them out.

Limits: at most `task.max_turns` model turns, each at most `task.max_turn_tokens` tokens (0: no limit of its own),
and `rollout.max_new_tokens` for the whole response, model and environment tokens together (an observation that
does not fit is cut, and the episode ends). An environment call (factory, `reset`, `step`) that raises or outlives
`task.environment_timeout_s` ends its episode with `env_error` set; the run goes on.

Simplified, and why: every turn re-encodes its episode's history (one prefill per turn) instead of extending the
row's KV cache: a turn is a new request of the server, so its continuous batching, version hold and engines are
used unchanged. Environments run one after the other in one helper thread per round (a fresh one after a timeout),
not in parallel: steps are meant to be cheap next to a decode round.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dora_tasks.core.records import ENVIRONMENT_VERSION, Generation, Prompt, Trajectory
from dora_tasks.workloads.environments import Environment, EnvironmentFactory, Step, load_environment
from dora_tasks.workloads.reward_worker import describe

TIMEOUT = "timeout"
STOP_WINDOW_SLACK = 2  # tokens beyond a stop string's characters looked at (a token may hold parts of two words)


@dataclass(frozen=True)
class EpisodeSpec:
    """How a run's rollout tasks run episodes (from the `task` section; None when `task.environment` is empty)."""

    environment: str | EnvironmentFactory  # dotted path of a factory, or the factory itself
    max_turns: int
    max_turn_tokens: int  # 0: a turn may use the rest of the budget
    timeout_s: float

    @classmethod
    def of(cls, task) -> EpisodeSpec | None:
        if not task.environment:
            return None
        return cls(task.environment, task.max_turns, task.max_turn_tokens, task.environment_timeout_s)


class StopStrings:
    """Where a model turn ends before eos: at the first token whose text completes one of `stops` (`TurnEnd`)."""

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.window = max((len(s) for s in self.stops), default=0) + STOP_WINDOW_SLACK

    def cut(self, tokens: Sequence[int], checked: int) -> int | None:
        for end in range(max(1, checked + 1), len(tokens) + 1):
            tail = self.tokenizer.decode(tokens[max(0, end - self.window):end])
            if any(stop in tail for stop in self.stops):
                return end
        return None


@dataclass
class Episode:
    """One episode as it grows: the response so far, which tokens are the model's, what the environment said."""

    env: Environment | None
    prompt_ids: list[int]
    budget: int  # response tokens of the whole episode (`rollout.max_new_tokens`)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    reward: float = float("nan")  # the sum of the rewards its steps gave; NaN: none
    error: str = ""
    ended: bool = False
    finished: bool = False  # ended by eos or by the environment (not cut by a limit or an error)

    def history(self) -> list[int]:
        return self.prompt_ids + self.tokens

    def turn_limit(self, max_turn_tokens: int) -> int:
        room = self.budget - len(self.tokens)
        return min(room, max_turn_tokens) if max_turn_tokens else room

    def add_turn(self, g: Generation) -> None:
        """The model's turn: its tokens, log-probs and versions (mask 1); eos ends the episode."""
        self._append(g.token_ids.tolist(), g.logprobs.tolist(), g.versions.tolist(), 1)
        self.turns += 1
        if g.finished:
            self.end(finished=True)

    def take(self, step: Step, observation_ids: list[int], max_turns: int) -> None:
        """The environment's answer to the last turn: its reward counts, and its observation is appended (cut to the
        budget, mask 0) unless the episode ends here."""
        if step.reward is not None:
            self.reward = float(step.reward) + (0.0 if np.isnan(self.reward) else self.reward)
        self.tool_calls += int(bool(step.tool_call))
        if step.done:
            self.end(finished=True)
        if self.ended:
            return
        if self.turns >= max_turns or len(self.tokens) >= self.budget:
            self.end(finished=False)
            return
        ids = observation_ids[:self.budget - len(self.tokens)]
        self._append(ids, [0.0] * len(ids), [ENVIRONMENT_VERSION] * len(ids), 0)
        if len(self.tokens) >= self.budget:
            self.end(finished=False)

    def fail(self, error: str) -> None:
        self.error = error or "error"
        self.end(finished=False)

    def end(self, finished: bool) -> None:
        if not self.ended:
            self.ended, self.finished = True, finished

    def _append(self, ids: list[int], logprobs: list[float], versions: list[int], mask: int) -> None:
        self.tokens += ids
        self.logprobs += logprobs
        self.versions += versions
        self.mask += [mask] * len(ids)

    def trajectory(self, group_id: int, sample_idx: int) -> Trajectory:
        return Trajectory(group_id, sample_idx, np.array(self.prompt_ids, np.int32), np.array(self.tokens, np.int32),
                          np.array(self.versions, np.int32), np.array(self.logprobs, np.float32), self.finished,
                          loss_mask=np.array(self.mask, np.int8), turns=self.turns, tool_calls=self.tool_calls,
                          env_error=self.error, env_reward=self.reward)


def run_episodes(server, spec: EpisodeSpec, tokenizer, prompt: Prompt, version: int, weights_path: str,
                 group_size: int, seed: int, budget: int, group_id: int) -> list[Trajectory]:
    """The G episodes of one group on `server`, every model token from `version` (see the module docstring)."""
    episodes = start_episodes(load_environment(spec.environment), tokenizer, prompt, group_size, budget,
                              spec.timeout_s)
    stops = next((e.env.stop for e in episodes if e.env is not None), ())
    stop = StopStrings(tokenizer, stops) if stops else None
    with server.hold(version):
        for turn in range(spec.max_turns):
            live = [e for e in episodes if not e.ended]
            if not live:
                break
            seeds = [turn_seed(seed, turn, i) for i, e in enumerate(episodes) if not e.ended]
            limits = [e.turn_limit(spec.max_turn_tokens) for e in live]
            gens = server.generate_turns(version, weights_path, [e.history() for e in live], seeds, limits, stop)
            for episode, g in zip(live, gens):
                episode.add_turn(g)
            step_all(live, [tokenizer.decode(g.token_ids) for g in gens], tokenizer, spec)
    for e in episodes:
        e.end(finished=False)  # max_turns rounds ran
    return [e.trajectory(group_id, i) for i, e in enumerate(episodes)]


def start_episodes(factory: EnvironmentFactory, tokenizer, prompt: Prompt, group_size: int, budget: int,
                   timeout_s: float) -> list[Episode]:
    """G episodes, each with its own environment, reset on the prompt; one that fails to start ends at once."""
    episodes = []
    for outcome, error in call_all([lambda: _reset(factory, prompt) for _ in range(group_size)], timeout_s):
        env, text = outcome if outcome is not None else (None, "")
        episode = Episode(env, list(prompt.token_ids) + (tokenizer.encode(text) if text else []), budget)
        if error:
            episode.fail(error)
        episodes.append(episode)
    return episodes


def _reset(factory: EnvironmentFactory, prompt: Prompt) -> tuple[Environment, str]:
    env = factory()
    return env, str(env.reset(prompt) or "")


def step_all(live: list[Episode], turns: list[str], tokenizer, spec: EpisodeSpec) -> None:
    """Step each live episode's environment on its turn's text (an error or a timeout ends that episode)."""
    outcomes = call_all([lambda e=e, t=t: e.env.step(t) for e, t in zip(live, turns)], spec.timeout_s)
    for episode, (step, error) in zip(live, outcomes):
        if not error and not isinstance(step, Step):
            error = f"step returned a {type(step).__name__}, not a Step"
        if error:
            episode.fail(error)
        else:
            episode.take(step, tokenizer.encode(step.observation) if step.observation else [], spec.max_turns)


def turn_seed(seed: int, turn: int, sample: int) -> int:
    """The seed of one model turn of one episode: distinct for every turn and sample of a group."""
    return int(np.random.SeedSequence([seed % 2**63, turn, sample]).generate_state(1)[0])


def call_all(calls: Sequence[Callable[[], Any]], timeout_s: float) -> list[tuple[Any, str]]:
    """`(result, "")` or `(None, error)` of each call, in order, each with its own timeout. The calls run one after
    the other in a helper thread; one that hangs is left behind in its thread, and the rest get a fresh one."""
    results: list[tuple[Any, str]] = []
    while len(results) < len(calls):
        pending = calls[len(results):]
        done: queue.SimpleQueue = queue.SimpleQueue()
        abandoned = threading.Event()
        threading.Thread(target=_call_each, args=(pending, done, abandoned), name="dora-environment",
                         daemon=True).start()
        for _ in pending:
            try:
                results.append(done.get(timeout=timeout_s))
            except queue.Empty:
                abandoned.set()
                results.append((None, TIMEOUT))
                break
    return results


def _call_each(calls: Sequence[Callable[[], Any]], done: queue.SimpleQueue, abandoned: threading.Event) -> None:
    for call in calls:
        if abandoned.is_set():
            return
        try:
            done.put((call(), ""))
        except BaseException as exc:  # noqa: BLE001 - anything the user's environment raises is recorded
            done.put((None, describe(exc)))
