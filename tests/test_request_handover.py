"""Request migration below the Dask layer: one running response leaves a session (or a rollout server) and continues
in another of the same weights, with its tokens, behaviour log-probs, random stream and KV cache.

Sessions with their own per-row stream draw the same tokens wherever a row continues, so a moved response is compared
token for token with the same response grown without a move; the receiver prefills nothing (its prefill counter stays
at 0). Without a cache (`ReencodingSession`: vLLM, or `keep_kv_cache` off) the receiver re-encodes prompt and response
so far and reports what that cost. A continuation of another version is refused (C1).
"""
from __future__ import annotations

import importlib.util
import pickle
import threading
import time

import numpy as np
import pytest
import torch

from dora_tasks.core.config import ModelConfig, RolloutConfig
from dora_tasks.core.handover import Continuation, Resumed, VersionMismatch
from dora_tasks.core.records import Generation
from dora_tasks.engines.fast_session import FastDecodeSession
from dora_tasks.engines.hf_rollout import HFRolloutEngine
from dora_tasks.engines.hf_session import DecodeSession
from dora_tasks.model import CharTokenizer, build_model, save_policy
from dora_tasks.rollout_server import ReencodingSession, RolloutServer

TOK = CharTokenizer()
TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=2)
PROMPTS = [[1, *TOK.encode(text)] for text in ("count 7 step 10:", "count 123 step 10:", "9:", "count 31415 step 2:")]
BUDGET, CHUNK = 40, 5
KINDS = {"fast": True, "transformers": False}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return save_policy(build_model(TINY, TOK.vocab_size, seed=0), TOK, str(tmp_path_factory.mktemp("policy")))


def instance(policy: str, fast: bool = True) -> HFRolloutEngine:
    """One rollout instance of the policy (its own model, loaded from the same weights)."""
    return HFRolloutEngine(policy, RolloutConfig(max_new_tokens=BUDGET, fast_decode=fast), threads=None)


def recomputed(model, prompt, tokens) -> np.ndarray:
    """Teacher-forced log-prob of each response token (temperature 1: the raw policy's)."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(tokens).long()[:, None])[:, 0].numpy()


class Grown:
    """Responses grown chunk by chunk in one session: tokens and log-probs per row key, which rows ended."""

    def __init__(self, session, prompts: dict, streams: dict | None = None):
        self.session, self.prompts = session, prompts
        self.tokens = {k: [] for k in prompts}
        self.logprobs = {k: [] for k in prompts}
        self.ended: set = set()
        for k, prompt in prompts.items():
            session.add(k, prompt, stream=None if streams is None else streams[k])

    def running(self) -> list:
        return [k for k in self.tokens if k not in self.ended]

    def chunk(self, seed: int) -> None:
        steps = {k: min(CHUNK, BUDGET - len(self.tokens[k])) for k in self.running()}
        for k, g in self.session.decode(steps, seed).items():
            self.tokens[k] += g.token_ids.tolist()
            self.logprobs[k] += g.logprobs.tolist()
            if g.finished or len(self.tokens[k]) >= BUDGET:
                self.ended.add(k)
        self.session.drop(list(self.ended))

    def to_end(self, first_seed: int) -> None:
        seed = first_seed
        while self.running():
            self.chunk(seed)
            seed += 1

    def hand_over(self, key) -> Continuation:
        """The row as a continuation, taken out of the session, through pickle (as Dask would move it)."""
        row = self.session.export(key)
        c = Continuation(self.session.version, "group-0", key, 0, np.array(self.prompts[key], np.int32),
                         np.array(self.tokens[key], np.int32), np.array(self.logprobs[key], np.float32),
                         np.full(len(self.tokens[key]), self.session.version, np.int32), BUDGET, row, time.time())
        self.ended.add(key)
        return pickle.loads(pickle.dumps(c))


def continue_alone(session, c: Continuation, first_seed: int):
    """Adopt `c` into `session` and decode it to its end: (the whole response's tokens, its log-probs, the cost)."""
    grown, key = Grown(session, {}), c.sample_index
    grown.prompts[key], grown.tokens[key], grown.logprobs[key] = c.prompt_ids.tolist(), c.token_ids.tolist(), \
        c.logprobs.tolist()
    cost = session.adopt(key, c)
    grown.to_end(first_seed)
    return grown.tokens[key], grown.logprobs[key], cost


STREAMS = {k: 1000 + k for k in range(len(PROMPTS))}


@pytest.mark.parametrize("home_kind,away_kind", [("fast", "fast"), ("transformers", "transformers"),
                                                  ("fast", "transformers"), ("transformers", "fast")])
def test_a_response_moved_between_sessions_continues_exactly_without_a_prefill(policy, home_kind, away_kind):
    reference = Grown(instance(policy, KINDS[home_kind]).open_session(), dict(enumerate(PROMPTS)), STREAMS)
    reference.to_end(first_seed=0)
    home = Grown(instance(policy, KINDS[home_kind]).open_session(), dict(enumerate(PROMPTS)), STREAMS)
    home.chunk(seed=50)
    home.chunk(seed=51)  # other chunk seeds than the reference's: rows with their own stream do not use them
    moved = home.running()[0]
    c = home.hand_over(moved)
    assert c.row.cache.length == len(PROMPTS[moved]) + len(c.token_ids) and c.row.sampler is not None

    away_engine = instance(policy, KINDS[away_kind])
    away = away_engine.open_session()
    assert isinstance(away, FastDecodeSession if KINDS[away_kind] else DecodeSession)
    tokens, logprobs, cost = continue_alone(away, c, first_seed=90)
    home.to_end(first_seed=52)

    assert away.prefill_tokens == 0 and cost.reprefill_tokens == 0 and cost.bytes_moved > c.row.cache.nbytes
    assert tokens == reference.tokens[moved] and len(tokens) > len(c.token_ids)
    np.testing.assert_allclose(logprobs, reference.logprobs[moved], atol=1e-5)
    np.testing.assert_allclose(logprobs, recomputed(away_engine.model, PROMPTS[moved], tokens), atol=1e-4)
    for k in home.tokens:  # the rows left at home are not disturbed by the one that left
        if k != moved:
            assert home.tokens[k] == reference.tokens[k]


@pytest.mark.parametrize("kind", KINDS)
def test_a_session_refuses_a_continuation_of_another_version(policy, kind):
    home = Grown(instance(policy, KINDS[kind]).open_session(), {0: PROMPTS[0]})
    home.chunk(seed=0)
    c = home.hand_over(0)
    c.version = 1
    away = instance(policy, KINDS[kind]).open_session()
    with pytest.raises(VersionMismatch, match="version 1.*serves version 0"):
        away.adopt(0, c)
    with pytest.raises(VersionMismatch):
        ReencodingSession(instance(policy)).adopt(0, c)
    assert len(away) == 0


def test_the_reencoding_session_continues_by_a_measured_reprefill(policy):
    home_engine, away_engine = instance(policy), instance(policy)
    home = Grown(ReencodingSession(home_engine), {0: PROMPTS[3]})
    home.chunk(seed=0)
    home.chunk(seed=1)
    c = home.hand_over(0)
    assert c.row.cache is None and c.row.sampler is None and len(home.session.rows) == 0

    tokens, logprobs, cost = continue_alone(ReencodingSession(away_engine), c, first_seed=2)
    assert cost.reprefill_tokens == len(PROMPTS[3]) + len(c.token_ids) and cost.seconds > 0
    assert tokens[:len(c.token_ids)] == c.token_ids.tolist() and len(tokens) > len(c.token_ids)
    np.testing.assert_allclose(logprobs, recomputed(away_engine.model, PROMPTS[3], tokens), atol=1e-4)


def test_an_emulated_session_takes_a_response_over_as_a_prefill_in_emulated_time():
    from dora_tasks.core.config import load_config
    from dora_tasks.emulation.task import emulated_prompts
    from dora_tasks.engines.rollout_factory import make_rollout_engine

    cfg = load_config(None, ["rollout.engine=emulated", "train.engine=emulated", "task.name=emulated",
                             "rollout.group_size=1", "emulation.speedup=1e6"])
    home_engine, away_engine = (make_rollout_engine("", cfg.rollout, 0, emulation=cfg.emulation, seed=0)
                                for _ in range(2))
    (prompt,), _ = emulated_prompts(1, 0, cfg.emulation, 0)
    reference = Grown(home_engine.open_session(), {0: list(prompt.token_ids)})
    reference.to_end(first_seed=0)
    home = Grown(home_engine.open_session(), {0: list(prompt.token_ids)})
    home.chunk(seed=0)
    c = home.hand_over(0)
    tokens, _, cost = continue_alone(away_engine.open_session(), c, first_seed=1)
    assert tokens == reference.tokens[0] and len(tokens) > len(c.token_ids)
    assert cost.reprefill_tokens == len(c.ids) and cost.seconds == away_engine.cost.prefill_s(len(c.ids))


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_continues_a_handed_over_response_by_a_measured_reprefill(tmp_path, monkeypatch):
    """One vLLM engine plays both instances (two in one process would only add start-up time): its prefix cache is
    emptied between hand-over and adoption, so the receiver holds none of the row's blocks."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dora_tasks.engines.vllm_rollout import VLLMRolloutEngine

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                         eos_token_id=2, bos_token_id=1, pad_token_id=0)).float().eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    engine = VLLMRolloutEngine(str(tmp_path), RolloutConfig(engine="vllm", max_new_tokens=BUDGET,
                                                            kv_cache_bytes=16 * 2**20))
    prompt = [1] + [3 + (7 * i) % 61 for i in range(399)]  # several 128-token blocks
    try:
        home = Grown(ReencodingSession(engine), {0: prompt})
        home.chunk(seed=0)
        home.chunk(seed=1)
        c = home.hand_over(0)
        assert engine.llm.reset_prefix_cache()
        tokens, logprobs, cost = continue_alone(ReencodingSession(engine), c, first_seed=2)
    finally:
        engine.close()
    assert cost.reprefill_tokens == len(prompt) + len(c.token_ids) and cost.seconds > 0
    assert tokens[:len(c.token_ids)] == c.token_ids.tolist() and len(tokens) > len(c.token_ids)
    np.testing.assert_allclose(logprobs, recomputed(model, prompt, tokens), atol=1e-3)


# ---- rollout servers ---------------------------------------------------------------------------------------------
def hand_over_one(server: RolloutServer, prompt, n: int, seed: int) -> tuple[list, list[Continuation]]:
    """Generate on `server` and hand one running response over at the first chunk boundary that has one."""
    answer: dict = {}
    worker = threading.Thread(target=lambda: answer.setdefault(
        "result", server.generate(0, "", prompt, n, seed, request_id=("group", 7))))
    worker.start()
    moved: list[Continuation] = []
    while not moved and worker.is_alive():
        moved = server.hand_over(1)
        time.sleep(0.001)
    worker.join(60)
    return answer["result"], moved


def served(policy: str, fast: bool = True, **options) -> RolloutServer:
    return RolloutServer(lambda: instance(policy, fast), chunk_tokens=4, **options)


@pytest.mark.parametrize("kind", KINDS)
def test_a_server_hands_a_response_over_and_another_continues_it_exactly(policy, kind):
    fast = KINDS[kind]
    reference_server, home, away = (served(policy, fast, row_streams=True) for _ in range(3))
    reference = reference_server.generate(0, "", PROMPTS[1], 3, 11)
    result, moved = hand_over_one(home, PROMPTS[1], 3, 11)
    assert len(moved) == 1, "every response ended before a chunk boundary"
    (c,) = moved
    assert c.request_id == ("group", 7) and result[c.sample_index] is c and c.row.cache is not None
    assert all(isinstance(g, Generation) for i, g in enumerate(result) if i != c.sample_index)

    resumed = away.resume(pickle.loads(pickle.dumps(c)), "")
    for server in (reference_server, home, away):
        server.close()
    assert isinstance(resumed, Resumed) and isinstance(resumed.outcome, Generation)
    assert resumed.cost.reprefill_tokens == 0 and resumed.cost.delay >= 0
    expected = reference[c.sample_index]
    assert resumed.outcome.token_ids.tolist() == expected.token_ids.tolist()
    np.testing.assert_allclose(resumed.outcome.logprobs, expected.logprobs, atol=1e-5)
    assert resumed.outcome.finished == expected.finished and set(resumed.outcome.versions.tolist()) == {0}
    for i, g in enumerate(result):
        if i != c.sample_index:
            assert g.token_ids.tolist() == reference[i].token_ids.tolist()


def test_a_server_reports_each_response_that_ended_once_and_none_it_handed_over(policy):
    at_home, away_ended = [], []
    home = served(policy, on_report=lambda report: at_home.extend(report.ended))
    away = served(policy, on_report=lambda report: away_ended.extend(report.ended))
    result, moved = hand_over_one(home, PROMPTS[1], 3, 11)
    assert len(moved) == 1, "every response ended before a chunk boundary"
    away.resume(moved[0], "")
    home.generate(0, "", PROMPTS[0], 2, 5)  # no request id: nothing to report
    for server in (home, away):
        server.close()
    sample = moved[0].sample_index
    assert sorted(at_home) == [(("group", 7), s) for s in range(3) if s != sample]
    assert away_ended == [(("group", 7), sample)]  # by the server it ended on


def test_a_chunk_report_names_each_end_once_and_the_kv_tokens_a_request_still_holds_here():
    from dora_tasks.rollout_rows import PartialResponse
    from dora_tasks.server_requests import Request, chunk_report

    rows = [PartialResponse([1, 2, 3], 0, tokens=[4] * 5),  # running: 3 + 5 tokens
            PartialResponse([1, 2, 3], 1, tokens=[4] * 8),  # at the budget: ended
            PartialResponse([1, 2, 3], 2, tokens=[4] * 2, finished=True),  # ended at eos
            PartialResponse([1, 2, 3], 3, tokens=[4] * 6)]  # given away
    rows[3].handed_over = object()
    request = Request(0, "", [1, 2, 3], 4, 0, request_id=(5, 1), rows=rows)
    unnamed = Request(0, "", [9], 1, 0, rows=[PartialResponse([9], 0)])
    all_ended = Request(0, "", [7], 1, 0, request_id=(6, 0), rows=[PartialResponse([7], 0, finished=True)])
    active = [(request, rows), (unnamed, unnamed.rows), (all_ended, all_ended.rows)]
    first = chunk_report(active, budget=8)
    assert sorted(first.ended) == [((5, 1), 1), ((5, 1), 2), ((6, 0), 0)]
    assert first.held == [((5, 1), 8)]
    rows[0].tokens += [4] * 3  # the last running row reaches the budget
    second = chunk_report(active, budget=8)
    assert second.ended == [((5, 1), 0)] and second.held == []


def test_a_server_without_the_cache_resumes_by_a_measured_reprefill(policy):
    home, away = served(policy, keep_kv_cache=False), served(policy, keep_kv_cache=False)
    _, (c,) = hand_over_one(home, PROMPTS[3], 2, 5)
    resumed = away.resume(c, policy)
    home.close()
    away.close()
    assert c.row.cache is None
    assert resumed.cost.reprefill_tokens == len(PROMPTS[3]) + len(c.token_ids) and resumed.cost.seconds > 0
    g = resumed.outcome
    assert g.token_ids[:len(c.token_ids)].tolist() == c.token_ids.tolist() and len(g.token_ids) <= BUDGET
    model = build_model(TINY, TOK.vocab_size, seed=0)
    np.testing.assert_allclose(g.logprobs, recomputed(model, PROMPTS[3], g.token_ids.tolist()), atol=1e-4)


def test_a_server_refuses_a_continuation_of_an_older_version_and_moves_up_to_a_newer_ones(policy):
    home, newer, older = served(policy), served(policy), served(policy)
    newer.generate(1, policy, PROMPTS[2], 1, 0)  # started: holds version 1
    older.generate(0, "", PROMPTS[2], 1, 0)  # holds version 0
    _, (c,) = hand_over_one(home, PROMPTS[0], 1, 3)  # of version 0
    home.close()
    with pytest.raises(VersionMismatch, match="C1"):
        newer.resume(c, "")
    c.version = 1  # as if version 1 had produced it: the server still on version 0 loads 1, then takes it in
    resumed = older.resume(c, policy)
    assert older.version == 1 and len(resumed.outcome.token_ids) >= len(c.token_ids)
    for server in (newer, older):
        server.close()


def test_hand_over_on_an_idle_server_returns_nothing(policy):
    server = served(policy)
    assert server.hand_over(2) == [] and server.hand_over(requests=["x"]) == []
    with pytest.raises(ValueError, match="either"):
        server.hand_over(2, requests=["x"])
    server.close()
