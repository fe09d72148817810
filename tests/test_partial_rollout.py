"""Chunked rollout: continuous batching (one version per instance, C1 kept) and the partial-rollout baseline
(comparison only: responses continue across weight updates, chunk by chunk).

Fast tests drive `RolloutServer` directly: with a scripted engine (eos, budget, early hand-back, joining, a request of
another version waiting for the batch to drain, never loading an older version in the baseline) and with the real
transformers engine on tiny random policies (every token's log-prob is the one of the version that produced it).
The scripted engine holds each chunk until the test lets it run, so who joins which chunk and when a version is
published are decided by the test, not by thread timing; a publish forced between two chunks of a response gives the
audit an exact count of C1 violations.
The slow test runs the pipeline twice at the same chunked settings on one cluster: the partial run finishes
although its audit reports C1 violations, the continuously batched run has none.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from dora_tasks.core.config import ModelConfig, RolloutConfig
from dora_tasks.core.contracts import RolloutEngine
from dora_tasks.core.records import Generation, Group, Prompt, Trajectory
from dora_tasks.model import EOS_ID, CharTokenizer, build_model, save_policy
from dora_tasks.rollout_server import RolloutServer
from dora_tasks.version_policy import DispatchVersion, PartialRollout
from storage.audit import audit_store
from storage.trajectory_store import TrajectoryStore
from tests.waiting import wait_until

FILLER = 5


class ScriptedEngine(RolloutEngine):
    """Prompt `[1, L]` asks for a response of L tokens ending in eos; log-prob of every token: -(version + 1).

    `held=True`: every chunk (generate call) waits until the test lets it run (`allow`), so the test knows which chunk
    is running while it adds requests or publishes a version."""

    def __init__(self, budget: int, held: bool = False) -> None:
        self.version = 0
        self.budget = budget
        self.calls: list[int] = []  # rows per generate call
        self._gate = threading.Condition()
        self._allowed: int | None = 0 if held else None  # how many calls may run; None: all

    @property
    def max_new_tokens(self) -> int:
        return self.budget

    def load_version(self, version: int, weights_path: str) -> None:
        self.version = version

    def allow(self, calls: int | None) -> None:
        """Let the first `calls` generate calls run (None: all of them, from now on)."""
        with self._gate:
            self._allowed = calls
            self._gate.notify_all()

    def generate(self, prompts, n, seed, *, max_new_tokens=None):
        assert n == 1
        max_new_tokens = self.budget if max_new_tokens is None else max_new_tokens
        with self._gate:
            self.calls.append(len(prompts))
            call = len(self.calls)
            if not self._gate.wait_for(lambda: self._allowed is None or call <= self._allowed, timeout=30):
                raise TimeoutError(f"the test never let chunk {call} run")
        out = []
        for p in prompts:
            length, done = p[1], len(p) - 2
            tokens = [FILLER] * min(max_new_tokens, max(0, length - 1 - done))
            if len(tokens) < max_new_tokens:
                tokens.append(EOS_ID)
            k = len(tokens)
            out.append([Generation(np.array(tokens, np.int32), np.full(k, -(self.version + 1.0), np.float32),
                                   np.full(k, self.version, np.int32), tokens[-1] == EOS_ID)])
        return out


def _ask(server: RolloutServer, version: int, length: int, n: int, results: dict, key) -> threading.Thread:
    def go():
        results[key] = server.generate(version, f"/w/{version}", [1, length], n, seed=0)

    thread = threading.Thread(target=go)
    thread.start()
    return thread


def queued(server: RolloutServer) -> int:
    """Requests waiting to join a batch (the server's queue, read under its lock)."""
    with server._cond:
        return len(server._waiting)


def chunk_running(engine: ScriptedEngine, call: int) -> None:
    wait_until(lambda: len(engine.calls) >= call, 10, f"chunk {call} was started")


def answered(thread: threading.Thread, what: str) -> None:
    thread.join(10)
    assert not thread.is_alive(), f"{what} was not answered within 10 s"


def test_partial_rollout_eos_budget_versions_and_early_hand_back():
    engine = ScriptedEngine(budget=10, held=True)
    published = {"v": 0}

    def newest():  # a new version is published before every chunk but the first
        version = published["v"]
        published["v"] += 1
        return version, f"/w/{version}"

    server = RolloutServer(lambda: engine, PartialRollout(newest), chunk_tokens=4)
    results: dict = {}
    middle = _ask(server, 0, 7, 1, results, "middle")
    chunk_running(engine, 1)  # the middle response alone, on version 0
    short, long_ = _ask(server, 0, 3, 2, results, "short"), _ask(server, 0, 50, 1, results, "long")
    wait_until(lambda: queued(server) == 2, 10, "the short and long requests were queued")
    engine.allow(2)  # chunk 2 (version 1): all three; the short one ends at its eos, the middle one at its own
    answered(short, "the short request")
    answered(middle, "the middle request")
    chunk_running(engine, 3)  # the long response's third chunk waits: it is still running
    assert "long" not in results
    engine.allow(None)
    answered(long_, "the long request")
    server.close()

    for g in results["short"]:  # ends at its eos inside its first chunk, one version
        assert g.token_ids.tolist() == [FILLER, FILLER, EOS_ID] and g.finished
        assert g.versions.tolist() == [1, 1, 1]
    (g,) = results["middle"]  # continues across a weight update: 4 tokens of version 0, then 3 of version 1
    assert g.token_ids.tolist() == [FILLER] * 6 + [EOS_ID] and g.finished
    assert g.versions.tolist() == [0] * 4 + [1] * 3
    np.testing.assert_array_equal(g.logprobs, -(g.versions + 1.0))  # each token's log-prob from its own version
    (g,) = results["long"]  # no eos: cut at the total budget, unfinished, three versions
    assert len(g.token_ids) == 10 and not g.finished and EOS_ID not in g.token_ids.tolist()
    assert g.versions.tolist() == [1] * 4 + [2] * 4 + [3] * 2
    assert [v for v, _, _ in server.loads] == [1, 2, 3]  # only ever newer (the engine starts on version 0)
    assert engine.calls == [1, 4, 1, 1]


def test_partial_rollout_joins_late_requests_on_the_newest_version():
    engine = ScriptedEngine(budget=12, held=True)
    server = RolloutServer(lambda: engine, PartialRollout(lambda: (3, "/w/3")), chunk_tokens=2)
    results: dict = {}
    first = _ask(server, 2, 12, 1, results, "first")
    chunk_running(engine, 1)
    late = _ask(server, 1, 2, 1, results, "late")  # dispatched on an older version: served by the newest
    wait_until(lambda: queued(server) == 1, 10, "the late request was queued")
    engine.allow(2)
    answered(late, "the late request")  # joined the running batch and was answered before it ended
    chunk_running(engine, 3)
    assert "first" not in results
    engine.allow(None)
    answered(first, "the first request")
    server.close()
    (g,) = results["late"]
    assert g.versions.tolist() == [3, 3] and g.finished
    assert [v for v, _, _ in server.loads] == [3]
    assert engine.calls == [1, 2, 1, 1, 1, 1]  # the late request shared the second chunk with the running one


class _Req:
    def __init__(self, version: int) -> None:
        self.version, self.weights_path = version, f"/w/{version}"


def test_version_policies_choose_joiners_and_weights():
    waiting = [_Req(1), _Req(2), _Req(1)]
    join, stay = DispatchVersion().joiners(waiting, 1)
    assert join == [waiting[0], waiting[2]] and stay == [waiting[1]]
    assert DispatchVersion().weights_for([_Req(2)], loaded=5) == (2, "/w/2")  # the batch's own version
    listing = {"newest": (None, "")}
    partial = PartialRollout(lambda: listing["newest"])
    assert partial.joiners(waiting, 1) == (waiting, [])  # every waiting request joins
    assert partial.weights_for([_Req(1)], loaded=-1) == (1, "/w/1")  # nothing listed: the request's version
    listing["newest"] = (4, "/w/4")
    assert partial.weights_for([_Req(1), _Req(2)], loaded=3) == (4, "/w/4")  # the newest published
    assert partial.weights_for([_Req(1)], loaded=6) == (6, "")  # never back to an older version
    assert partial.weights_for([_Req(7)], loaded=6) == (7, "/w/7")  # a dispatch version newer than the listing


def test_concurrent_versions_admit_up_to_m_versions_in_arrival_order():
    from dora_tasks.version_policy import ConcurrentVersions

    waiting = [_Req(v) for v in (1, 3, 2, 1, 4, 3)]
    join, stay = ConcurrentVersions(2).admit(waiting, [1])
    assert [r.version for r in join] == [1, 3, 1, 3] and [r.version for r in stay] == [2, 4]
    join, stay = ConcurrentVersions(3).admit(waiting, [5, 6])
    assert [r.version for r in join] == [1, 1] and [r.version for r in stay] == [3, 2, 4, 3]


class RetainingEngine(ScriptedEngine):
    """Loading a version no longer in `store` fails as loading a deleted folder does."""

    def __init__(self, budget: int, store: list[int]) -> None:
        super().__init__(budget)
        self.store = store

    def load_version(self, version: int, weights_path: str) -> None:
        if version not in self.store:
            raise FileNotFoundError(weights_path)
        super().load_version(version, weights_path)


def test_partial_rollout_falls_back_to_the_newer_version_when_the_listed_one_is_retained_away():
    store = [0, 1]

    def newest():  # the listed version is retained away before the load, and a newer one published
        version = store[-1]
        if version == 1:
            store[:] = [0, 2]
        return version, f"/w/{version}"

    engine = RetainingEngine(budget=3, store=store)
    server = RolloutServer(lambda: engine, PartialRollout(newest), chunk_tokens=2)
    (g,) = server.generate(0, "/w/0", [1, 3], 1, seed=0)
    assert g.versions.tolist() == [2, 2, 2] and [v for v, _, _ in server.loads] == [2]

    store[:] = [0, 3]  # a load failing on a version still listed is a real error: raised, not retried
    engine.store = [0, 2]
    with pytest.raises(FileNotFoundError):
        server.generate(0, "/w/0", [1, 3], 1, seed=0)
    server.close()


def as_group(group_id: int, version: int, prompt: list[int], gens: list[Generation]) -> Group:
    prompt_ids = np.array(prompt, np.int32)
    return Group(group_id=group_id, prompt=Prompt(group_id, "", "", tuple(prompt)), version=version, trajectories=[
        Trajectory(group_id=group_id, sample_idx=i, prompt_ids=prompt_ids, response_ids=g.token_ids,
                   versions=g.versions, behaviour_logprobs=g.logprobs, finished=g.finished, reward=float(i % 2),
                   advantage=0.0) for i, g in enumerate(gens)])


def test_a_publish_forced_between_two_chunks_gives_the_audit_an_exact_c1_count(tmp_path):
    """Group A (dispatched on version 0) is mid-response when version 1 is published: each of its 3 responses carries
    tokens of versions 0 and 1, so the audit counts exactly 3 C1 violations. Group C ended before the publish and
    group B was dispatched on version 1 after it: both are clean."""
    published = {"v": 0}
    engine = ScriptedEngine(budget=8, held=True)
    server = RolloutServer(lambda: engine, PartialRollout(lambda: (published["v"], f"/w/{published['v']}")),
                           chunk_tokens=4)
    results: dict = {}
    c = _ask(server, 0, 3, 3, results, "C")
    chunk_running(engine, 1)
    a = _ask(server, 0, 8, 3, results, "A")
    wait_until(lambda: queued(server) == 1, 10, "group A was queued")
    engine.allow(1)
    answered(c, "group C")
    chunk_running(engine, 2)  # group A's first chunk runs on version 0 ...
    published["v"] = 1  # ... when version 1 is published
    b = _ask(server, 1, 3, 3, results, "B")
    wait_until(lambda: queued(server) == 1, 10, "group B was queued")
    engine.allow(None)
    answered(a, "group A")
    answered(b, "group B")
    server.close()
    assert [g.versions.tolist() for g in results["A"]] == [[0] * 4 + [1] * 4] * 3
    assert engine.calls == [3, 3, 6]

    path = tmp_path / "store.zarr"
    groups = [as_group(0, 0, [1, 3], results["C"]), as_group(1, 0, [1, 8], results["A"]),
              as_group(2, 1, [1, 3], results["B"])]
    with TrajectoryStore.create(path, {"group_size": 3, "max_staleness": 1}) as store:
        for g in groups:
            store.append_dispatch(g.group_id, g.prompt.prompt_id, g.version, 0, float(g.group_id))
        store.append_consumed(groups[:2], update=0, time=1.0)
        store.append_update(0, 0.5, 1.0, 1, 0.01, {"loss": 0.0})
        store.append_consumed(groups[2:], update=1, time=2.0)
        store.append_update(1, 1.5, 2.0, 2, 0.01, {"loss": 0.0})
    report = audit_store(path)
    assert report.count("token_version_mismatch") == 3 and report.count("mixed_version_trajectories") == 3
    assert report.count("group_version_mismatch") == 0
    assert not [v for v in report.violations if v.clause != "C1"], report.to_text()


def test_partial_rollout_logprobs_are_those_of_the_producing_version(tmp_path):
    tokenizer = CharTokenizer()
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2)
    paths = [save_policy(build_model(cfg, tokenizer.vocab_size, seed=s), tokenizer, str(tmp_path / f"v{s}"))
             for s in (0, 1)]
    models = [build_model(cfg, tokenizer.vocab_size, seed=s) for s in (0, 1)]
    rollout_cfg = RolloutConfig(max_new_tokens=20, temperature=1.0, top_p=1.0)
    from dora_tasks.engines.hf_rollout import HFRolloutEngine

    calls = {"n": 0}

    def newest():  # version 1 is published after the first chunk
        calls["n"] += 1
        return (0, paths[0]) if calls["n"] == 1 else (1, paths[1])

    server = RolloutServer(lambda: HFRolloutEngine(paths[0], rollout_cfg, version=0, threads=None),
                           PartialRollout(newest), chunk_tokens=6)
    prompt = [1] + tokenizer.encode("count 42 step 10:")
    gens = server.generate(0, paths[0], prompt, 3, seed=7)
    server.close()
    mixed = 0
    for g in gens:
        assert len(g.token_ids) <= 20 and (g.finished == (g.token_ids[-1] == EOS_ID))
        assert EOS_ID not in g.token_ids[:-1].tolist()
        assert g.versions[: min(6, len(g.versions))].tolist() == [0] * min(6, len(g.versions))
        assert set(g.versions[6:].tolist()) <= {1}
        mixed += len(set(g.versions.tolist())) > 1
        ids = torch.tensor([prompt + g.token_ids.tolist()])
        for version in (0, 1):
            with torch.no_grad():
                logp = torch.log_softmax(models[version](ids).logits[0, len(prompt) - 1:-1], -1)
            expected = logp.gather(-1, torch.as_tensor(g.token_ids, dtype=torch.long)[:, None])[:, 0].numpy()
            rows = g.versions == version
            np.testing.assert_allclose(g.logprobs[rows], expected[rows], atol=1e-4)
    assert mixed > 0  # a random policy rarely says eos within 6 tokens


def test_continuous_batching_joins_same_version_requests_and_keeps_one_version():
    engine = ScriptedEngine(budget=40, held=True)
    server = RolloutServer(lambda: engine, chunk_tokens=4)
    results: dict = {}
    long_ = _ask(server, 0, 30, 2, results, "long")
    chunk_running(engine, 1)
    late = _ask(server, 0, 3, 1, results, "late")  # same version: joins the running batch
    other = _ask(server, 1, 3, 1, results, "other")  # another version: waits until version 0 has drained
    wait_until(lambda: queued(server) == 2, 10, "the late and other requests were queued")
    engine.allow(2)
    answered(late, "the late request")
    engine.allow(8)  # 30 tokens are 8 chunks of 4
    answered(long_, "the long request")
    chunk_running(engine, 9)
    assert "other" not in results
    engine.allow(None)
    answered(other, "the other request")
    server.close()
    for g in results["long"]:  # 30 tokens over 8 chunks, all of version 0, ending at eos
        assert len(g.token_ids) == 30 and g.finished and set(g.versions.tolist()) == {0}
    assert results["late"][0].versions.tolist() == [0, 0, 0]
    assert results["other"][0].versions.tolist() == [1, 1, 1]
    np.testing.assert_array_equal(results["other"][0].logprobs, -2.0)
    assert [v for v, _, _ in server.loads] == [1]  # loaded only after the version-0 batch had drained
    assert engine.calls == [2, 3, 2, 2, 2, 2, 2, 2, 1]  # the late request shared a chunk with the two long responses


def test_static_batches_make_a_late_request_wait_for_the_longest_response():
    engine = ScriptedEngine(budget=40, held=True)
    server = RolloutServer(lambda: engine)
    results: dict = {}
    long_ = _ask(server, 0, 30, 1, results, "long")
    chunk_running(engine, 1)
    late = _ask(server, 0, 3, 1, results, "late")
    wait_until(lambda: queued(server) == 1, 10, "the late request was queued")
    engine.allow(1)
    answered(long_, "the long request")
    chunk_running(engine, 2)  # one call per batch: the late request waited for the whole long response
    assert "late" not in results
    engine.allow(None)
    answered(late, "the late request")
    server.close()
    assert len(results["long"][0].token_ids) == 30 and results["late"][0].token_ids.tolist() == [FILLER, FILLER, EOS_ID]
    assert engine.calls == [1, 1]


def test_continuous_batching_logprobs_match_a_recompute_of_the_one_version(tmp_path):
    tokenizer = CharTokenizer()
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2)
    path = save_policy(build_model(cfg, tokenizer.vocab_size, seed=3), tokenizer, str(tmp_path / "v0"))
    model = build_model(cfg, tokenizer.vocab_size, seed=3)
    from dora_tasks.engines.hf_rollout import HFRolloutEngine

    engine = HFRolloutEngine(path, RolloutConfig(max_new_tokens=20), version=0, threads=None)
    server = RolloutServer(lambda: engine, chunk_tokens=5)
    prompt = [1] + tokenizer.encode("count 42 step 10:")
    gens = server.generate(0, path, prompt, 4, seed=11)
    server.close()
    assert any(len(g.token_ids) > 5 for g in gens)  # a random policy rambles past the first chunk
    for g in gens:
        assert set(g.versions.tolist()) == {0} and EOS_ID not in g.token_ids[:-1].tolist()
        ids = torch.tensor([prompt + g.token_ids.tolist()])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1], -1)
        expected = logp.gather(-1, torch.as_tensor(g.token_ids, dtype=torch.long)[:, None])[:, 0].numpy()
        np.testing.assert_allclose(g.logprobs, expected, atol=1e-4)


@pytest.mark.slow
def test_partial_rollout_run_finishes_with_c1_violations_and_normal_run_has_none(small_config, shared_cluster,
                                                                                 tmp_path):
    from pipelines.inputs import RunInputs
    from pipelines.streaming import run_pipeline
    from storage.audit import audit_store

    # K=1: the groups of version u+1 roll out while update u runs. Temperature 2 makes the policy ramble to its
    # rollout.max_new_tokens budget (12 chunks of 8), so publishes land in the middle of running responses; one
    # run of 3 updates once had none that did, 6 updates give 5 publishes during rollout. Where they land is up to
    # the cluster's timing (the engines run in worker processes, out of the test's reach), so only "some" is
    # asserted here; the exact count for a publish forced mid-response is checked by
    # test_a_publish_forced_between_two_chunks_gives_the_audit_an_exact_c1_count.
    N = 6
    settings = ["dora.max_staleness=1", f"dora.num_updates={N}", "rollout.chunk_tokens=8",
                "rollout.temperature=2.0"]
    on_shared = RunInputs(client=shared_cluster(small_config(*settings)))
    c1 = {}
    for name, partial in (("partial", "true"), ("normal", "false")):
        cfg = small_config(*settings, f"rollout.partial_rollout={partial}", f"storage.run_dir={tmp_path / name}",
                           f"tracking.mlflow_uri=sqlite:///{tmp_path}/{name}.db")
        summary = run_pipeline(cfg, on_shared)
        report = audit_store(summary.store, cfg.dora.max_staleness)
        assert report.counts["updates"] == N and report.counts["consumed_groups"] == 4 * N
        assert not [v for v in report.violations if v.clause != "C1"], report.to_text()
        c1[name] = report.count("token_version_mismatch")
        assert summary.audit_ok == (c1[name] == 0)
    assert c1["partial"] > 0 and c1["normal"] == 0, c1
