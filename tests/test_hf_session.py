"""Continuous batching with the KV cache kept across chunks (`DecodeSession` on transformers' forward and
`FastDecodeSession` with the step written out): rows join, leave and continue between chunks, and every token's
log-prob and every greedy token are those of a from-scratch computation."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from transformers.generation.logits_process import TopPLogitsWarper

from dora_tasks.core.config import ModelConfig, RolloutConfig
from dora_tasks.engines.decoding import _top_p, sample_next
from dora_tasks.engines.fast_session import FastDecodeSession, supports
from dora_tasks.engines.hf_rollout import HFRolloutEngine
from dora_tasks.engines.hf_session import DecodeSession
from dora_tasks.model import CharTokenizer, build_model, save_policy

TOK = CharTokenizer()
TINY = ModelConfig(hidden_size=32, num_layers=2, num_heads=2)
PROMPTS = [[1, *TOK.encode(text)] for text in ("count 7 step 10:", "count 123 step 10:", "9:", "count 31415 step 2:")]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return save_policy(build_model(TINY, TOK.vocab_size, seed=0), TOK, str(tmp_path_factory.mktemp("policy")))


def recomputed(model, prompt, tokens, temperature: float) -> np.ndarray:
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(tokens).long()[:, None])[:, 0].numpy()


def transformers_greedy(policy, budget: int):
    """Greedy responses of `PROMPTS` by transformers' own `generate` (the reference for both sessions)."""
    engine = HFRolloutEngine(policy, RolloutConfig(max_new_tokens=budget, fast_decode=False), do_sample=False)
    return engine.generate(PROMPTS, n=1, seed=0)


def run_session(session, chunk: int, budget: int) -> dict:
    """Rows 0 and 1 start, rows 2 and 3 join after the first chunk; chunks of `chunk` tokens until every row ends."""
    grown = {k: ([], []) for k in range(len(PROMPTS))}
    finished = {}
    for k in (0, 1):
        session.add(k, PROMPTS[k])
    for c in range(100):
        if c == 1:
            for k in (2, 3):
                session.add(k, PROMPTS[k])
        steps = {k: min(chunk, budget - len(grown[k][0])) for k in grown if k not in finished}
        for k, g in session.decode(steps, seed=c).items():
            grown[k][0].extend(g.token_ids.tolist())
            grown[k][1].extend(g.logprobs.tolist())
            if g.finished or len(grown[k][0]) >= budget:
                finished[k] = g.finished
        session.drop([k for k in finished])
        if not len(session):
            return {k: (toks, np.array(lps), finished[k]) for k, (toks, lps) in grown.items()}
    raise AssertionError("the session never emptied")


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "transformers"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_session_logprobs_equal_a_recompute_across_joins_and_chunks(policy, temperature, fast):
    engine = HFRolloutEngine(policy, RolloutConfig(max_new_tokens=40, temperature=temperature, fast_decode=fast))
    session = engine.open_session()
    assert isinstance(session, FastDecodeSession) == fast
    out = run_session(session, chunk=5, budget=40)
    assert max(len(toks) for toks, _, _ in out.values()) > 10  # responses continue over several chunks
    for k, (toks, lps, finished) in out.items():
        np.testing.assert_allclose(lps, recomputed(engine.model, PROMPTS[k], toks, temperature), atol=1e-4)
        assert finished == (toks[-1] in engine.eos_ids) and all(t not in engine.eos_ids for t in toks[:-1])


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "transformers"])
def test_greedy_session_decodes_what_generate_decodes(policy, fast):
    """Joins (rows of other lengths), leaving rows and chunk boundaries change nothing."""
    engine = HFRolloutEngine(policy, RolloutConfig(max_new_tokens=30, fast_decode=fast), do_sample=False)
    out = run_session(engine.open_session(), chunk=4, budget=30)
    reference = transformers_greedy(policy, 30)
    for k, (toks, _, _) in out.items():
        assert toks == reference[k][0].token_ids.tolist()


def test_top_p_keeps_what_transformers_keeps_with_the_renormalised_probabilities():
    scores = torch.randn(16, 50, generator=torch.Generator().manual_seed(0)) * 3
    full = scores.softmax(-1)
    for top_p in (0.3, 0.8, 0.95):
        expected = TopPLogitsWarper(top_p)(None, scores.clone())
        got = _top_p(scores.clone(), top_p)
        kept = ~torch.isinf(got)
        assert torch.equal(kept, ~torch.isinf(expected))
        assert ((full * kept).sum(-1) >= top_p - 1e-6).all()  # the nucleus holds at least top_p ...
        smallest_kept = torch.where(kept, full, 1.0).min(-1).values  # ... and is the smallest that does
        assert ((full * kept).sum(-1) - smallest_kept < top_p + 1e-6).all()
        renormalised = torch.where(kept, full / (full * kept).sum(-1, keepdim=True), 0.0)
        torch.testing.assert_close(got.softmax(-1), renormalised, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got.softmax(-1), expected.softmax(-1), rtol=1e-5, atol=1e-7)


# ---- the sampled distribution ---------------------------------------------------------------------------------------
# Pearson's chi-square goodness of fit of the drawn tokens to the model's softmax at the temperature, after top-p.
# ALPHA is the false-failure rate of one check: a correct sampler fails it with probability 1e-4. The seeds are fixed,
# so a given code base passes or fails every time; ALPHA says how unlucky a fixed seed would have to be to fail a
# correct sampler. Each check is paired with a power check: the same draws reject a nearby wrong distribution.
ALPHA = 1e-4


def chi_square_p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of `tokens` (draws) under `probs` [V]; tokens of probability 0 must never be drawn (asserted), and the
    least likely ones are pooled into one bin until it expects at least 5 draws."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    possible = probs > 0
    assert counts[~possible].sum() == 0, f"drew tokens of probability 0: {(~possible & (counts > 0)).nonzero()}"
    counts, expected = counts[possible], probs[possible].double() * len(tokens)
    order = torch.argsort(expected)
    counts, expected = counts[order], expected[order]
    pooled = int((torch.cumsum(expected, 0) < 5).sum()) + 1
    counts = torch.cat([counts[:pooled].sum()[None], counts[pooled:]])
    expected = torch.cat([expected[:pooled].sum()[None], expected[pooled:]])
    assert len(counts) >= 2, "too few draws for a chi-square test"
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(counts) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2))  # the chi-square survival function


def truncated_softmax(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The reference: transformers' own top-p warper on the logits at `temperature`, then softmax."""
    scores = (logits.double() / temperature)[None]
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)[0]


SAMPLING = [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)]


@pytest.mark.parametrize("own_streams", [False, True], ids=["shared-stream", "row-streams"])
@pytest.mark.parametrize("temperature, top_p", SAMPLING)
def test_sample_next_draws_the_softmax_at_its_temperature_and_top_p(temperature, top_p, own_streams):
    """20000 draws (5000 with a random stream per row) of one row's logits pass a chi-square test at ALPHA = 1e-4
    against softmax(logits / T) truncated to the top-p nucleus; each draw's log-prob is that distribution's."""
    logits = torch.randn(40, generator=torch.Generator().manual_seed(1)) * 2
    draws = 5000 if own_streams else 20000
    streams = [torch.Generator().manual_seed(1000 + i) for i in range(draws)] if own_streams else None
    tokens, logprobs = sample_next(logits.expand(draws, -1), torch.Generator().manual_seed(2), temperature, top_p,
                                   True, streams)
    expected = truncated_softmax(logits, temperature, top_p)
    torch.testing.assert_close(logprobs.double(), expected.log()[tokens], rtol=0, atol=1e-5)
    assert chi_square_p_value(tokens, expected) >= ALPHA
    assert chi_square_p_value(tokens, truncated_softmax(logits, temperature * 1.2, top_p)) < ALPHA  # power


@pytest.fixture(scope="module")
def peaked_policy():
    """A tiny policy whose next-token distribution is far from uniform (its lm_head untied and scaled by 8; the
    random model's logits are nearly flat), so that a wrong temperature or top-p shows in a few thousand draws."""
    model = build_model(TINY, TOK.vocab_size, seed=0)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 8)
    return model.eval()


@pytest.mark.parametrize("temperature, top_p", SAMPLING)
def test_fast_session_draws_the_models_softmax_at_its_temperature_and_top_p(peaked_policy, temperature, top_p):
    """3000 rows of one prompt decode one token each in a `FastDecodeSession`: the tokens pass a chi-square test at
    ALPHA = 1e-4 against transformers' forward at temperature T, truncated to the top-p nucleus, and each token's
    log-prob is that distribution's."""
    prompt, rows = [1, *TOK.encode("9:")], 3000
    with torch.no_grad():
        logits = peaked_policy(input_ids=torch.tensor([prompt])).logits[0, -1]
    expected = truncated_softmax(logits, temperature, top_p)
    session = FastDecodeSession(peaked_policy, [2], 0, version=0, temperature=temperature, top_p=top_p)
    for row in range(rows):
        session.add(row, prompt)
    out = session.decode(dict.fromkeys(range(rows), 1), seed=3)
    tokens = torch.tensor([int(out[row].token_ids[0]) for row in range(rows)])
    logprobs = torch.tensor([float(out[row].logprobs[0]) for row in range(rows)], dtype=torch.float64)
    torch.testing.assert_close(logprobs, expected.log()[tokens], rtol=0, atol=1e-4)
    assert chi_square_p_value(tokens, expected) >= ALPHA
    assert chi_square_p_value(tokens, truncated_softmax(logits, temperature * 1.2, top_p)) < ALPHA  # power


@pytest.mark.parametrize("chunk", [0, 3, 16])
def test_rollout_server_answers_the_same_with_and_without_the_kept_cache(policy, chunk):
    """Greedy decoding through the server, in chunks or static batches (0): requests that join while others run get
    the same tokens whether running rows keep their KV cache or are re-encoded at every chunk."""
    import threading

    from dora_tasks.rollout_server import RolloutServer

    def ask(server, k, got):
        got[k] = [g.token_ids.tolist() for g in server.generate(0, "", PROMPTS[k], 2, seed=k)]

    answers = {}
    for keep in (True, False):
        engine = HFRolloutEngine(policy, RolloutConfig(max_new_tokens=24), do_sample=False, threads=None)
        server = RolloutServer(lambda e=engine: e, chunk_tokens=chunk, keep_kv_cache=keep)
        answers[keep] = {}
        threads = [threading.Thread(target=ask, args=(server, k, answers[keep])) for k in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        server.close()
    assert answers[True] == answers[False] and len(answers[True]) == len(PROMPTS)
    reference = transformers_greedy(policy, 24)
    assert all(answers[True][k][0] == reference[k][0].token_ids.tolist() for k in range(len(PROMPTS)))


def llama_gqa() -> transformers.LlamaForCausalLM:
    """A Llama layout with grouped-query attention (4 query heads, 1 key/value head) and no projection biases."""
    config = transformers.LlamaConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_fast_session_on_llama_with_grouped_query_attention_and_grown_buffers():
    """Past the first 64 columns (the buffers double) and with rows joining in two rounds (they grow on the batch
    axis), every log-prob is the from-scratch one, and the next-token logits match transformers' forward."""
    model = llama_gqa()
    assert supports(model)
    session = FastDecodeSession(model, [2], 0, version=0)
    out = run_session(session, chunk=7, budget=90)
    assert max(len(toks) for toks, _, _ in out.values()) > 64
    for k, (toks, lps, _) in out.items():
        np.testing.assert_allclose(lps, recomputed(model, PROMPTS[k], toks, 1.0), atol=1e-4)
    session = FastDecodeSession(model, [2], 0, version=0, do_sample=False)
    for k, ids in enumerate(PROMPTS):
        session.add(k, ids)
    grown = {k: g.token_ids.tolist() for k, g in session.decode({k: 3 for k in range(len(PROMPTS))}, seed=1).items()}
    session.drop([1])
    assert set(session.keys) == {k for k, toks in grown.items() if k != 1 and toks[-1] != 2}
    for row, k in enumerate(session.keys):
        ids = torch.tensor([PROMPTS[k] + grown[k]])
        assert int(session.lengths[row]) == ids.shape[1]
        with torch.no_grad():
            expected = model(input_ids=ids).logits[0, -1]
        torch.testing.assert_close(session.next_logits[row], expected, atol=1e-5, rtol=1e-5)


def test_fast_session_refuses_what_it_was_not_written_for(policy):
    sliding = transformers.Qwen2Config(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                       use_sliding_window=True, sliding_window=8, max_window_layers=0)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(sliding).eval()
    assert not supports(model)
    with pytest.raises(ValueError, match="does not support"):
        FastDecodeSession(model, [2], 0, version=0)
    engine = HFRolloutEngine.from_model(model, RolloutConfig(max_new_tokens=8))
    assert isinstance(engine.open_session(), DecodeSession)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "transformers"])
def test_a_row_dropped_before_its_prefill_never_decodes_and_an_empty_row_is_refused(policy, fast):
    engine = HFRolloutEngine(policy, RolloutConfig(max_new_tokens=8, fast_decode=fast), do_sample=False)
    session = engine.open_session()
    session.add("kept", PROMPTS[0])
    session.add("dropped", PROMPTS[1])
    session.drop(["dropped"])
    assert len(session) == 1 and set(session.decode({"kept": 4, "dropped": 4}, seed=0)) == {"kept"}
    with pytest.raises(ValueError, match="no tokens"):
        session.add("empty", [])


@pytest.mark.parametrize("budget", [1, 5, 30])
def test_greedy_generate_on_the_fast_session_is_transformers_generate(policy, budget):
    """Evaluation's greedy `generate` runs through the fast session in chunks: the same tokens, log-probs and ends
    as transformers' `generate`, for n > 1 and for budgets that cut responses short."""
    fast = HFRolloutEngine(policy, RolloutConfig(max_new_tokens=budget), do_sample=False)
    slow = HFRolloutEngine(policy, RolloutConfig(max_new_tokens=budget, fast_decode=False), do_sample=False)
    ours, theirs = fast.generate(PROMPTS, n=2, seed=3), slow.generate(PROMPTS, n=2, seed=3)
    for row_ours, row_theirs in zip(ours, theirs):
        assert len(row_ours) == 2
        for a, b in zip(row_ours, row_theirs):
            assert a.token_ids.tolist() == b.token_ids.tolist() and a.finished == b.finished
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
