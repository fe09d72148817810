"""Request migration on Dask (`rollout.switching=migrate`): a running response leaves one rollout instance and
continues on another of its version, with its tokens, behaviour log-probs, sampler state and KV cache.

- the driver's bookkeeping of where each response is (`pipelines.migration.Moves`), against a model of the
  instances under random orders of hand-overs, response ends and answers (hypothesis);
- putting a moved group back together (`assemble_group`), the store's migrations table and its audit, and a store of
  schema version 1 still opening and auditing;
- on a real LocalCluster with two rollout instances: a group's running responses handed over between them
  continue with the tokens they would have drawn at home, their log-probs those of the weights;
- whole runs with `rollout.switching=migrate` at K=1 and K=3 (slow): migrations happen, the audit is clean, and
  every migrated trajectory's behaviour log-probs equal a teacher-forced recompute under its version's weights;
- the same with the vLLM engine (slow, vllm): responses move by a re-prefill whose tokens and time are recorded.
"""
from __future__ import annotations

import importlib.util
import random
import shutil
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st

from dora_tasks.core.handover import ResumedResponse, assemble_group, check_version
from dora_tasks.core.records import Group, Migration, Prompt, Trajectory
from dora_tasks.model import load_causal_lm
from dora_tasks.version_loads import VersionLeft, VersionLoads, VersionWaitTimeout, resume_when_loaded
from pipelines.migration import ROLLOUT_TASK, Holder, Moves, RequestMigration
from pipelines.orchestrator import Migrate
from storage.audit import audit_store
from storage.trajectory_store import SCHEMA_VERSION, TrajectoryStore


# ---- the driver's bookkeeping, against a model of the instances --------------------------------------------------
class Instances:
    """What the rollout servers do with one group's responses: where each is, which task answers for it, what the
    driver will learn (task ends and order answers, delivered in any order)."""

    def __init__(self, group_size: int, rng: random.Random):
        self.rng = rng
        self.where = {s: Holder("a") for s in range(group_size)}
        self.state = {s: rng.choice(["waiting", "running"]) for s in range(group_size)}
        self.inbox: list[tuple] = []  # events on their way to the driver
        self.orders: list[tuple[str, str]] = []  # orders that reached a server, answered at its next chunk boundary
        self.tasks: set = {ROLLOUT_TASK}
        self.finished_tasks: set = set()

    def task(self, s: int) -> tuple[int, int]:
        return Moves.task_of(s, self.where[s])

    def _finish_tasks(self) -> None:
        live = {self.task(s) for s in self.where if self.state[s] != "ended"}
        for task in self.tasks - live - self.finished_tasks:
            self.finished_tasks.add(task)
            self.inbox.append(("done", task))

    def step(self) -> None:
        """One thing happens on a server: a waiting response joins a batch, a running one ends, or an order is
        answered at a chunk boundary."""
        choices = [s for s in self.where if self.state[s] != "ended"]
        if self.orders and (not choices or self.rng.random() < 0.4):
            source, target = self.orders.pop(0)
            handed = sorted(s for s in self.where if self.where[s].instance == source and self.state[s] == "running")
            for s in handed:
                self.where[s] = Holder(target, self.where[s].hop + 1)
                self.tasks.add(self.task(s))
                self.state[s] = "waiting"
            self.inbox.append(("answer", handed))
        elif choices:
            s = self.rng.choice(choices)
            self.state[s] = "running" if self.state[s] == "waiting" else "ended"
        self._finish_tasks()

    @property
    def ended(self) -> bool:
        return all(state == "ended" for state in self.state.values())


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 10**6), group_size=st.integers(1, 6), asks=st.floats(0.0, 0.5))
def test_the_driver_knows_where_every_response_is_whatever_the_order_of_events(seed, group_size, asks):
    rng = random.Random(seed)
    servers, moves = Instances(group_size, rng), Moves.start(group_size, "a")
    seen: set[int] = set()
    while not (servers.ended and not servers.inbox and not servers.orders and moves.order is None):
        roll = rng.random()
        if roll < asks and not moves.complete:  # the orchestrator moves the group (possibly to where it is)
            order = moves.ask(rng.choice("abc"), rng.choice("abc"))
            if order is not None:
                servers.orders.append(order)
        elif servers.inbox and roll < 0.7:  # the driver learns something, in any order
            kind, what = servers.inbox.pop(rng.randrange(len(servers.inbox)))
            if kind == "done":
                moves.task_done(what)
            else:
                moved, following = moves.answer(what)
                assert [s for s, _, _ in moved] == what
                assert all(new.hop == old.hop + 1 for _, old, new in moved)
                if following is not None:
                    servers.orders.append(following)
        else:
            servers.step()
        moves.validate()
        ended = moves.ended()
        assert seen <= ended, "a response the driver counted as ended came back"
        seen = ended
        for s in ended:  # counted only where it really ended, on the task that really answers for it
            assert servers.state[s] == "ended" and moves.at[s] == servers.where[s]
        assert not moves.complete or servers.ended
    assert moves.complete and moves.at == servers.where
    assert moves.final_tasks() == [(s, h.hop) for s, h in sorted(servers.where.items()) if h.hop]
    assert moves.moved == (moves.carrier is not None)
    assert moves.touched >= {h.instance for h in servers.where.values()}


def test_a_task_end_learnt_while_an_order_is_out_counts_only_once_the_order_is_answered():
    moves = Moves.start(2, "a")
    assert moves.ask("a", "b") == ("a", "b")
    assert moves.ask("a", "c") is None  # one order out at a time
    moves.task_done(ROLLOUT_TASK)  # the rollout answered: ended, or handed over?
    assert moves.ended() == set() and not moves.complete
    moved, following = moves.answer([1])
    assert moved == [(1, Holder("a"), Holder("b", 1))] and following == ("a", "c")
    assert moves.ended() == {0}  # sample 0 ended on "a"; the order now out is to "a" but 0's task ended before it
    moves.answer([])
    moves.task_done((1, 1))
    assert moves.complete and moves.final_tasks() == [(1, 1)] and moves.carrier == 1


class RecordingPool:
    def __init__(self):
        self.sent = []

    def submit(self, fn, *args, **kwargs) -> int:
        self.sent.append((args, kwargs))
        return len(self.sent)  # a stand-in for the thread's future


class OrderRecorder(RequestMigration):
    """The driver's hand-over side alone: orders go to a recording pool, answers to a recording `_handed_over`."""

    def __init__(self):
        self.outbox, self.tracked, self.answered = {}, {}, []
        self.hand_over_pool, self.client = RecordingPool(), SimpleNamespace(run=None)

    def track(self, future, task):
        self.tracked[future] = task

    def _handed_over(self, order, source, samples, failure):
        self.answered.append((order.group_id, source, order.target, samples, failure))


def test_one_hand_over_order_per_source_names_every_group_it_gives_away_and_each_learns_its_samples():
    from concurrent.futures import Future as ThreadFuture

    d = OrderRecorder()
    for gid, source, target in [(0, "a", "b"), (1, "a", "c"), (2, "b", "c"), (3, "a", "b")]:
        d._queue_order(SimpleNamespace(group_id=gid, version=2, attempt=gid % 2), source, target)
    d.send_orders()
    assert not d.outbox
    sent = {kw["workers"][0]: args[1] for args, kw in d.hand_over_pool.sent}  # source -> request ids of its order
    assert sent == {"a": [(0, 0), (1, 1), (3, 1)], "b": [(2, 0)]}
    task_a = next(t for t in d.tracked.values() if t.source == "a")
    answer = ThreadFuture()
    answer.set_result({"a": [((0, 0), 4), ((3, 1), 0), ((0, 0), 7)]})  # group 1's responses had all ended
    d.on_handed_over(task_a, answer)
    assert d.answered == [(0, "a", "b", [4, 7], None), (1, "a", "c", [], None), (3, "a", "b", [0], None)]
    failed = ThreadFuture()
    failed.set_exception(OSError("gone"))
    d.answered.clear()
    d.on_handed_over(task_a, failed)
    assert [a[0] for a in d.answered] == [0, 1, 3] and all("gone" in a[4] for a in d.answered)


# ---- putting a moved group together ----------------------------------------------------------------------------
def trajectory(group_id: int, sample: int, n: int, version: int = 0) -> Trajectory:
    return Trajectory(group_id, sample, np.array([1, 5, 6], np.int32), np.arange(3, 3 + n, dtype=np.int32),
                      np.full(n, version, np.int32), np.full(n, -0.5, np.float32), True)


def migration(group_id: int, sample: int, source="a", target="b", version=0, target_version=0) -> Migration:
    return Migration(group_id, 0, sample, version, target_version, source, target, 1000, 0, 0.01, 10.0, 10.5)


def shell(group_id: int, samples) -> Group:
    return Group(group_id, Prompt(group_id, "p", "1", (1, 5, 6)), 0, "a", 0,
                 [trajectory(group_id, s, 2) for s in samples], 1.0, 5.0)


def test_a_moved_group_is_put_back_together_in_sample_order_with_every_move():
    pieces = [ResumedResponse(7, 0, 3, "b", 9.0, [migration(7, 3)], trajectory(7, 3, 6)),
              ResumedResponse(7, 0, 1, "c", 8.0, [migration(7, 1), migration(7, 1, "b", "c")], trajectory(7, 1, 4),
                              group=shell(7, [0, 2]))]
    group = assemble_group(pieces)
    assert [t.sample_idx for t in group.trajectories] == [0, 1, 2, 3]
    assert group.end_time == 9.0 and group.instance == "a" and len(group.migrations) == 3
    with pytest.raises(ValueError, match="carry their group"):
        assemble_group(pieces[:1])
    pieces[0].trajectory = None
    with pytest.raises(ValueError, match="handed over again"):
        assemble_group(pieces)


# ---- a handed-over response waiting for its instance to load its version ---------------------------------------
class LoadingServer:
    """A rollout server whose engine holds `version` and loads another when told (`load`), as its thread would;
    `resume` answers only a continuation of the version held (C1) and counts the questions."""

    def __init__(self, loads, version: int):
        self.engine = loads.watching(lambda: SimpleNamespace(version=version, load_version=self._set))()
        self.asked = 0

    def _set(self, version: int, weights_path: str) -> None:
        self.engine.version = version

    @property
    def version(self) -> int:
        return self.engine.version

    def load(self, version: int, after_s: float) -> threading.Thread:
        thread = threading.Thread(target=lambda: (time.sleep(after_s), self.engine.load_version(version, "w")))
        thread.start()
        return thread

    def resume(self, continuation, weights_path: str) -> str:
        self.asked += 1
        check_version(self.version, continuation)
        return f"resumed on {self.version}"


def waiting_continuation(version: int) -> SimpleNamespace:
    return SimpleNamespace(version=version, request_id=(7, 0), sample_index=2)


def test_a_resume_wakes_when_its_instance_loads_the_version_without_asking_meanwhile():
    loads = VersionLoads()
    server = LoadingServer(loads, version=0)
    start = time.monotonic()
    loading = [server.load(1, after_s=0.1), server.load(2, after_s=0.4)]  # an older version first: it looks, waits on
    answer = resume_when_loaded(server, loads, waiting_continuation(2), "/store/v2", wait_s=30.0)
    late = time.monotonic() - start - 0.4
    for thread in loading:
        thread.join()
    assert answer == "resumed on 2"
    assert late < 0.2, f"answered {late:.3f} s after the load"
    assert server.asked == 3, f"the server was asked {server.asked} times: at first and after each of two loads"


def test_a_resume_whose_version_never_loads_names_the_version_and_the_store_and_one_moved_past_it_fails_at_once():
    server = LoadingServer(VersionLoads(), version=1)
    start = time.monotonic()
    with pytest.raises(VersionWaitTimeout, match=r"(?s)version 4 waited 0.3 s.*instance tcp://b:1.*'/store/v4'.*"
                                                 r"serves version 1"):
        resume_when_loaded(server, VersionLoads(), waiting_continuation(4), "/store/v4", 0.3, "tcp://b:1")
    assert 0.3 <= time.monotonic() - start < 2.0 and server.asked == 1
    server.load(5, after_s=0.0).join()  # the instance moved past version 4: no wait at all
    start = time.monotonic()
    with pytest.raises(VersionLeft, match=r"version 4: rollout instance tcp://b:1 serves version 5 already"):
        resume_when_loaded(server, VersionLoads(), waiting_continuation(4), "/store/v4", 30.0, "tcp://b:1")
    assert time.monotonic() - start < 1.0


# ---- the store's migrations table and its audit ----------------------------------------------------------------
META = {"group_size": 4, "max_staleness": 1}


def small_store(path, target_version: int = 0):
    store = TrajectoryStore.create(path, META)
    group = shell(0, [0, 1, 2, 3])
    group.migrations = [migration(0, 2, target_version=target_version), migration(0, 3)]
    store.append_dispatch(0, 0, 0, 0, 0.0)
    store.append_migrations(group.migrations)
    store.append_consumed([group], 0, 6.0)
    store.append_update(0, 5.0, 6.0, 1, 0.1, {"migrations": 2.0})
    store.close()
    return path


def test_migrations_are_stored_and_audited_and_a_store_of_schema_version_1_still_opens(tmp_path):
    path = small_store(tmp_path / "s.zarr")
    moved = TrajectoryStore.open(path).read_table("migrations")
    assert moved["sample_idx"].tolist() == [2, 3] and moved["source"].tolist() == ["a", "a"]
    assert moved["target"].tolist() == ["b", "b"] and moved["bytes"].tolist() == [1000, 1000]
    report = audit_store(path)
    assert report.ok, report.to_text()
    assert report.counts["migrations"] == 2 and report.counts["migrated_trajectories"] == 2
    assert "migrations 2 (2000 bytes moved" in report.to_text()

    bad = audit_store(small_store(tmp_path / "bad.zarr", target_version=1))
    assert bad.count("migration_version_mismatch") == 1, bad.to_text()

    old = tmp_path / "v1.zarr"  # what this code wrote before the migrations table
    shutil.copytree(path, old)
    shutil.rmtree(old / "migrations")
    root = zarr.open_group(old, mode="r+")
    committed = dict(root.attrs["committed"])
    del committed["migrations"]
    root.attrs.update({"committed": committed, "schema_version": 1})
    reader = TrajectoryStore.open(old)
    assert reader.schema_version == 1 and reader.num_rows("migrations") == 0
    assert reader.read_table("migrations")["target"].tolist() == []
    report = audit_store(old)
    assert report.ok and report.counts["migrations"] == 0
    writer = TrajectoryStore.open(old, mode="a")  # appending gives it the table
    writer.append_migrations([migration(0, 1)])
    writer.close()
    assert TrajectoryStore.open(old).schema_version == SCHEMA_VERSION
    assert audit_store(old).counts["migrations"] == 1


# ---- two rollout instances on a real LocalCluster --------------------------------------------------------------
BUDGET = 48


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    from dora_tasks.core.config import ModelConfig
    from dora_tasks.model import CharTokenizer, build_model, save_policy

    tok = CharTokenizer()
    model = build_model(ModelConfig(hidden_size=32, num_layers=2, num_heads=2), tok.vocab_size, seed=0)
    return save_policy(model, tok, str(tmp_path_factory.mktemp("policy"))), tok


def recomputed(model, prompt, tokens) -> np.ndarray:
    """Teacher-forced log-prob of each response token (temperature 1)."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(tokens).long()[:, None])[:, 0].numpy()


def test_running_responses_move_between_two_rollout_instances_and_continue_exactly(tiny_policy):
    """A group's running responses are handed over by one instance (`client.run`, while its only thread is held by
    the blocked rollout task) and continued by `("resume", ...)` tasks on the other, their continuations copied
    worker to worker, and handed back again if still running: with per-row streams every response ends with the
    tokens it drew without the moves."""
    from distributed import Client, LocalCluster

    from dora_tasks import steps
    from dora_tasks.core.config import RolloutConfig
    from dora_tasks.plugins import RolloutPlugin, hand_over_requests
    from pipelines.cluster import ROLLOUT, ROLLOUT_ROW

    path, tok = tiny_policy
    rollout = RolloutConfig(max_new_tokens=BUDGET, chunk_tokens=2, switching="migrate", slots=1, group_size=3)
    prompt = Prompt(0, "count 7 step 10:", "", (1, *tok.encode("count 7 step 10:")))
    with LocalCluster(n_workers=2, threads_per_worker=1, resources={"ROLLOUT": 1}, processes=True,
                      dashboard_address=None, host="127.0.0.1") as cluster, Client(cluster) as client:
        client.register_plugin(RolloutPlugin(path, rollout, str(path)))
        a, b = sorted(client.scheduler_info()["workers"])
        home = client.submit(steps.rollout, 0, prompt, 0, path, 3, 11, workers=[b], resources=ROLLOUT,
                             key=("rollout", 0, 0), pure=False).result()  # without moves (and b's engine starts)
        for attempt in range(1, 6):  # the same group again (same seed), handed over once it runs
            rolled = client.submit(steps.rollout, 0, prompt, 0, path, 3, 11, attempt, workers=[a],
                                   resources=ROLLOUT, key=("rollout", 0, 0, attempt), pure=False)
            handed: list[int] = []
            while not handed and not rolled.done():
                handed = [s for _, s in client.run(hand_over_requests, [steps.request_id(0, attempt)], workers=[a])[a]]
            if handed:
                break
        assert handed, "every response ended before a chunk boundary"
        start = time.perf_counter()
        first = {s: client.submit(steps.resume, rolled, s, path, s == handed[0], workers=[b], resources=ROLLOUT_ROW,
                                  key=("resume", 0, 0, s, attempt), pure=False) for s in handed}
        again: list[int] = []  # and back to the first instance, from the answers of the first resumes
        while not again and not all(f.done() for f in first.values()):
            again = [s for _, s in client.run(hand_over_requests, [steps.request_id(0, attempt)], workers=[b])[b]]
        final = dict(first)
        final.update({s: client.submit(steps.resume, first[s], s, path, False, workers=[a], resources=ROLLOUT_ROW,
                                       key=("resume", 0, 0, s, attempt, 2), pure=False) for s in again})
        resumed = client.gather([final[s] for s in handed])
        seconds = time.perf_counter() - start
    group = assemble_group(resumed)
    assert [t.sample_idx for t in group.trajectories] == [0, 1, 2] and group.attempt == attempt
    hops = [(m.sample_idx, m.source, m.target) for m in group.migrations]
    assert hops == sorted([(s, a, b) for s in handed] + [(s, b, a) for s in again])
    model = load_causal_lm(path).eval()
    for moved, at_home in zip(group.trajectories, home.trajectories):
        assert moved.response_ids.tolist() == at_home.response_ids.tolist()
        np.testing.assert_allclose(moved.behaviour_logprobs, at_home.behaviour_logprobs, atol=1e-5)
        np.testing.assert_allclose(moved.behaviour_logprobs,
                                   recomputed(model, prompt.token_ids, moved.response_ids.tolist()), atol=1e-4)
        assert set(moved.versions.tolist()) == {0}
    assert all(m.reprefill_tokens == 0 and m.nbytes > 0 and m.version == m.target_version == 0
               for m in group.migrations)
    print(f"\n{len(handed)} responses moved ({len(again)} moved back), {group.migrations[0].nbytes} bytes the "
          f"first, all ended {seconds:.2f} s after the first hand-over")


# ---- whole runs --------------------------------------------------------------------------------------------------
MIGRATE_RUN = ["rollout.switching=migrate", "rollout.slots=2", "rollout.chunk_tokens=4", "storage.keep_versions=100"]
FORCED = 6  # moves the test asks for besides the orchestrator's own, where a group's rows fit on the other instance


def move_a_running_group(d, forced: list) -> None:
    """Once a turn, at most `FORCED` times in all: a group still rolling out moves to the other instance of its
    version if its rows fit there (the orchestrator's own `Migrate`, decided here so that every run has some)."""
    orch = d.orchestrator
    if len(forced) >= FORCED:
        return
    for gid, (version, address) in sorted(orch.running.items()):
        group = d.in_flight.get(gid)
        if group is None or group.moves is not None or group.rolled_out:
            continue
        for other in orch.ordered_instances():
            if other.address != address and other.version == version and orch.free_rows(other) >= orch.rows_of(gid):
                d.migrate(orch.migrate(gid, orch.instances[address], other))
                forced.append(gid)
                return


def run_with_moves(cfg, client=None):
    """A whole run with some running groups moved (`move_a_running_group`); returns (summary, moves asked, the
    orchestrator's `Migrate` and the servers' hand-over events)."""
    from pipelines.events import ResponsesHandedOver
    from pipelines.inputs import RunInputs
    from pipelines.run import open_run
    from pipelines.streaming import stream

    forced, answers = [], []
    with open_run(cfg, inputs=RunInputs(client=client)) as run:
        run.driver.subscribe(lambda e: answers.append(e) if isinstance(e, (ResponsesHandedOver, Migrate)) else None)
        stream(run.driver, on_turn=lambda d: move_a_running_group(d, forced))
        summary = run.finish()
    return summary, forced, answers


def check_moved_run(cfg, summary, forced, answers, tolerance: float):
    """Audit clean, every group once, some responses moved between instances of their version, and every migrated
    trajectory's behaviour log-probs those of its version's weights recomputed from scratch (within `tolerance`).
    Returns the migrations table."""
    from storage.weight_store import WeightStore

    K = cfg.dora.max_staleness
    report = audit_store(summary.store, K)
    assert report.ok, report.to_text()
    store = TrajectoryStore.open(summary.store)
    G, TBS, N = cfg.rollout.group_size, cfg.dora.train_batch_size, cfg.dora.num_updates
    t = store.read_table("trajectories")
    assert len(t["group_id"]) == G * TBS * N and t["attempt"].max() == 0  # every group once, none restarted
    moved = store.read_table("migrations")
    assert len(moved["group_id"]) > 0, f"no response moved ({len(forced)} moves asked, answers {answers})"
    assert report.counts["migrations"] == len(moved["group_id"]) == summary.metrics["migrations"]
    assert (moved["source"] != moved["target"]).all()
    assert (moved["version"] == moved["target_version"]).all() and (moved["bytes"] > 0).all()

    rows = [int(np.flatnonzero((t["group_id"] == g) & (t["sample_idx"] == s))[0])
            for g, s in sorted(set(zip(moved["group_id"].tolist(), moved["sample_idx"].tolist())))]
    weights = WeightStore(cfg.storage.resolved("weight_store"))
    models = {}
    tokens, behaviour = store.read_ragged("tokens", rows), store.read_ragged("behaviour_logprobs", rows)
    worst = 0.0
    for row, toks, logp in zip(rows, tokens, behaviour):
        version, plen = int(t["version"][row]), int(t["prompt_len"][row])
        if version not in models:
            models[version] = load_causal_lm(weights.path_for(version)).eval()
        expected = recomputed(models[version], toks[:plen].tolist(), toks[plen:].tolist())
        np.testing.assert_allclose(logp, expected, atol=tolerance)
        worst = max(worst, float(np.abs(logp - expected).max()))
    decided = sum(isinstance(e, Migrate) for e in answers) - len(forced)
    print(f"\nK={K}: {len(moved['group_id'])} responses moved ({decided} moves decided by the orchestrator, "
          f"{len(forced)} asked by the test), {int(moved['bytes'].sum())} bytes, "
          f"{int(moved['reprefill_tokens'].sum())} tokens re-prefilled, "
          f"{np.nanmean(moved['seconds']) * 1e3:.2f} ms to take one in, "
          f"hand-over to adoption {np.mean(moved['adopted_time'] - moved['handed_over_time']) * 1e3:.0f} ms; "
          f"max |behaviour - recompute| {worst:.1e} over {len(rows)} trajectories")
    return moved


@pytest.mark.slow
@pytest.mark.parametrize("K", [1, 3])
def test_a_run_with_request_migration_keeps_the_constraints_and_the_behaviour_logprobs(small_config, shared_cluster, K):
    cfg = small_config(*MIGRATE_RUN, f"dora.max_staleness={K}")
    moved = check_moved_run(cfg, *run_with_moves(cfg, shared_cluster(cfg)), tolerance=1e-4)
    assert (moved["reprefill_tokens"] == 0).all()  # the KV cache moved with each response


@pytest.mark.long  # default suite: test_request_handover's vLLM re-prefill and the migrating runs above
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is needed")
def test_a_vllm_run_moves_responses_by_a_measured_reprefill_and_keeps_the_constraints(small_config):
    """vLLM holds its KV cache to itself: a moved response is prefilled again on its new instance, prompt and
    tokens so far, and that cost is recorded with each migration."""
    cfg = small_config(*MIGRATE_RUN, "rollout.engine=vllm", "model.num_heads=2", "dora.max_staleness=1")
    moved = check_moved_run(cfg, *run_with_moves(cfg), tolerance=1e-3)
    assert (moved["reprefill_tokens"] > 0).all() and (moved["seconds"] > 0).all()


@pytest.mark.slow
def test_a_target_instance_killed_while_it_takes_responses_over_restarts_their_group(small_config):
    """SIGKILL the instance that responses were just handed over to: their group starts again from scratch on its
    version (a new attempt), and the run ends with a clean audit."""
    import os
    import signal

    from pipelines.events import ResponsesHandedOver
    from pipelines.run import open_run
    from pipelines.streaming import stream

    cfg = small_config(*MIGRATE_RUN, "dora.max_staleness=1", "dora.num_updates=4")
    killed, forced = [], []

    def kill_the_target(event) -> None:
        if isinstance(event, ResponsesHandedOver) and event.samples and not killed:
            pid = run.driver.client.run(os.getpid, workers=[event.target])[event.target]
            os.kill(pid, signal.SIGKILL)
            killed.append(event.group_id)

    with open_run(cfg) as run:
        run.driver.subscribe(kill_the_target)
        stream(run.driver, on_turn=lambda d: move_a_running_group(d, forced))
        summary = run.finish()
    assert killed, "no response moved"
    report = audit_store(summary.store, 1)
    assert report.ok, report.to_text()
    dispatch = TrajectoryStore.open(summary.store).read_table("dispatch")
    assert dispatch["attempt"][dispatch["group_id"] == killed[0]].max() >= 1
