"""LoRA policies (`train.lora`): the published version is the adapter alone with its base's identity; the engines
serve it with the trainer's log-probs; checkpoints carry it; a run with adapters keeps C1-C3."""
from __future__ import annotations

import importlib.util
import os
import shutil

import numpy as np
import pytest
import torch

from dora_tasks.algorithms.objective import batch_tensors, sequence_logprobs
from dora_tasks.core.config import ConfigError, RolloutConfig, TrainConfig, load_config
from dora_tasks.core.config_lora import LoraConfig
from dora_tasks.engines import lora
from dora_tasks.engines.hf_rollout import HFRolloutEngine
from dora_tasks.engines.torch_trainer import TorchTrainEngine
from dora_tasks.rollout_server import RolloutServer
from dora_tasks.version_policy import ConcurrentVersions
from storage.weight_store import WeightFiles, WeightStore
from tests.test_trainers import make_batch

torch.set_num_threads(1)
HF_TOLERANCE = 1e-4  # tests/test_hf_engine.py: engine log-probs against a recompute, fp32
VLLM_TOLERANCE = 1e-3  # tests/test_vllm_engine.py
ADAPTER = LoraConfig(rank=4, alpha=8.0)
PROMPTS = [[1, 5, 6, 7], [1, 9, 30, 31, 32], [1, 40]]


def tiny_qwen2(folder, seed: int, hidden: int = 128, heads: int = 4) -> str:
    """A random Qwen2 (vocab 64, head_dim 32 as vLLM on CPU needs) saved as a model folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=2, bos_token_id=1, pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).float().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return tiny_qwen2(tmp_path_factory.mktemp("base"), seed=0)


@pytest.fixture(scope="module")
def trained(base, tmp_path_factory):
    """A LoRA trainer two updates in (KL to the base on), and its published adapter folder."""
    engine = TorchTrainEngine(base, TrainConfig(lr=2e-2, kl_coef=0.1, lora=ADAPTER), base_path=base)
    batch = make_batch(base)
    steps = [engine.train_step(batch) for _ in range(2)]
    folder = str(tmp_path_factory.mktemp("adapter") / "v2")
    engine.save_weights(folder)
    return engine, folder, steps


def engine_logprob_error(reference, prompts, generations, temperature: float = 1.0) -> float:
    """Largest |behaviour - recompute under `reference`| over every sampled token."""
    errors = []
    for prompt, gens in zip(prompts, generations):
        for g in gens:
            ids = torch.tensor([list(prompt) + g.token_ids.tolist()])
            with torch.no_grad():
                logp, _ = sequence_logprobs(reference, ids, torch.ones_like(ids), temperature, with_entropy=False)
            errors.append(float(np.abs(logp[0, len(prompt):].numpy() - g.logprobs).max()))
    return max(errors)


# ---- the published version -------------------------------------------------------------------------------------------
def test_the_published_version_is_the_adapter_with_its_bases_identity(trained, base):
    engine, folder, steps = trained
    assert sorted(os.listdir(folder)) == sorted([lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS, lora.BASE_FILE])
    assert lora.read_base(folder) == lora.base_identity(base)
    adapter_bytes = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    base_bytes = os.path.getsize(os.path.join(base, "model.safetensors"))
    assert adapter_bytes < base_bytes / 4
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # a fresh adapter (B = 0) is the base: the KL reference
    assert steps[1]["kl"] > 1e-6  # ... which the adapter has left after one update


def test_peer_copies_of_a_version_move_only_the_adapter(trained, tmp_path):
    _, folder, _ = trained
    store = WeightStore(str(tmp_path / "weights"))
    store.publish(2, lambda target: shutil.copytree(folder, target, dirs_exist_ok=True))
    files = WeightFiles.read(2, store.path_for(2))
    assert set(files.files) == set(os.listdir(folder))
    assert not lora.is_adapter_folder(str(tmp_path)) and lora.is_adapter_folder(files.local_folder())


# ---- engines under an adapter: the trainer's log-probs ---------------------------------------------------------------
@pytest.mark.parametrize("fast_decode", [True, False], ids=["fast", "transformers"])
def test_hf_engine_under_adapter_v_gives_the_trainers_logprobs(trained, base, fast_decode):
    engine, folder, _ = trained
    rollout = HFRolloutEngine(base, RolloutConfig(max_new_tokens=16, fast_decode=fast_decode))
    rollout.load_version(2, folder)
    sampled = rollout.generate(PROMPTS, n=3, seed=0)
    session = rollout.open_session()
    for key, prompt in enumerate(PROMPTS):
        session.add(key, prompt)
    decoded = session.decode({key: 12 for key in range(len(PROMPTS))}, seed=1)
    engine.model.eval()
    assert engine_logprob_error(engine.model, PROMPTS, sampled) < HF_TOLERANCE
    assert engine_logprob_error(engine.model, PROMPTS, [[decoded[k]] for k in range(len(PROMPTS))]) < HF_TOLERANCE
    with engine.model.disable_adapter():  # the adapter does change the policy
        assert engine_logprob_error(engine.model, PROMPTS, sampled) > 100 * HF_TOLERANCE
    rollout.load_version(0, base)  # a full-weights folder puts the base back
    with engine.model.disable_adapter():
        assert engine_logprob_error(engine.model, PROMPTS, rollout.generate(PROMPTS, n=1, seed=2)) < HF_TOLERANCE


def test_an_adapter_folder_loads_as_a_policy_over_its_base(trained):
    """Evaluation reads a version folder as a policy: an adapter folder is served over the base it names."""
    engine, folder, _ = trained
    rollout = HFRolloutEngine(folder, RolloutConfig(max_new_tokens=8), version=2)
    engine.model.eval()
    assert engine_logprob_error(engine.model, PROMPTS, rollout.generate(PROMPTS, n=2, seed=0)) < HF_TOLERANCE


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_engine_under_adapter_v_gives_the_trainers_logprobs(trained, second, base):
    """Also with two adapters resident (M = 2): one `generate` call whose prompts name different versions, and a
    rollout server's mixed batch, give each row its own version's log-probs."""
    from dora_tasks.engines.vllm_rollout import VLLMRolloutEngine

    engine, folder, _ = trained
    cfg = RolloutConfig(engine="vllm", max_new_tokens=16, kv_cache_bytes=16 * 2**20, versions_per_instance=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        rollout = VLLMRolloutEngine(base, cfg, max_lora_rank=ADAPTER.rank)
    try:
        rollout.load_version(2, folder)
        sampled = rollout.generate(PROMPTS, n=3, seed=0)
        engine.model.eval()
        assert engine_logprob_error(engine.model, PROMPTS, sampled) < VLLM_TOLERANCE
        assert all((g.versions == 2).all() for gens in sampled for g in gens)
        rollout.load_version(3, second)
        mixed = rollout.generate(PROMPTS, n=2, seed=1, versions=[2, 3, 2])
        assert [{int(v) for g in gens for v in g.versions} for gens in mixed] == [{2}, {3}, {2}]
        assert engine_logprob_error(engine.model, PROMPTS[::2], mixed[::2]) < VLLM_TOLERANCE
        other = HFRolloutEngine(second, RolloutConfig(max_new_tokens=16), version=3).model
        assert engine_logprob_error(other, PROMPTS[1:2], mixed[1:2]) < VLLM_TOLERANCE
        assert engine_logprob_error(engine.model, PROMPTS[1:2], mixed[1:2]) > 100 * VLLM_TOLERANCE
        server = RolloutServer(lambda: rollout, ConcurrentVersions(2), chunk_tokens=4)  # a mixed batch, chunked
        answers = serve_concurrently(server, [(2, folder, PROMPTS[0], 5), (3, second, PROMPTS[1], 6)])
        server.close()
        assert engine_logprob_error(engine.model, PROMPTS[:1], answers[:1]) < VLLM_TOLERANCE
        assert engine_logprob_error(other, PROMPTS[1:2], answers[1:]) < VLLM_TOLERANCE
        rollout.load_version(0, base)
        with engine.model.disable_adapter():
            assert engine_logprob_error(engine.model, PROMPTS, rollout.generate(PROMPTS, n=1, seed=1)) < VLLM_TOLERANCE
    finally:
        rollout.close()


# ---- several versions on one instance (rollout.versions_per_instance) -----------------------------------------------
@pytest.fixture(scope="module")
def second(trained, tmp_path_factory) -> str:
    """Another adapter over the same base (the trained one with its B matrices scaled): a second policy version."""
    from safetensors.torch import load_file, save_file

    _, folder, _ = trained
    other = str(tmp_path_factory.mktemp("adapter") / "v3")
    shutil.copytree(folder, other)
    path = os.path.join(other, lora.ADAPTER_WEIGHTS)
    tensors = {k: (-1.5 * v if ".lora_B." in k else v) for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})
    return other


def serve_concurrently(server, requests) -> list:
    """Each (version, path, prompt, seed) as its own task on `server`, all in flight together; answers in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(server.generate, v, path, prompt, 2, seed) for v, path, prompt, seed in requests]
        return [f.result(timeout=120) for f in futures]


def test_a_batch_of_two_versions_gives_each_request_what_its_version_gives_alone(trained, second, base, monkeypatch):
    """Two adapters served at once by one transformers instance (M = 2): every request gets the tokens and log-probs
    it gets served alone by an instance of its own version (per-row streams), and some chunk decoded both."""
    import threading

    from dora_tasks import server_sessions

    _, v2, _ = trained
    requests = [(2, v2, PROMPTS[0], 11), (3, second, PROMPTS[1], 12), (2, v2, PROMPTS[2], 13),
                (3, second, PROMPTS[0], 14)]
    mixed_chunks, decode = [], server_sessions.TimeSlicedSession.decode

    def spying(session, steps, seed):
        mixed_chunks.append(len({session.version_of[k] for k in steps}) > 1)
        return decode(session, steps, seed)

    monkeypatch.setattr(server_sessions.TimeSlicedSession, "decode", spying)
    queued = threading.Event()  # the engine starts once every request waits: they share the first chunks
    cfg = RolloutConfig(max_new_tokens=16, versions_per_instance=2)
    server = RolloutServer(lambda: (queued.wait(30), HFRolloutEngine(base, cfg))[1], ConcurrentVersions(2),
                           chunk_tokens=4, row_streams=True)
    threading.Timer(0.5, queued.set).start()
    together = serve_concurrently(server, requests)
    server.close()
    assert any(mixed_chunks), "no chunk decoded rows of both versions"
    for (version, path, prompt, seed), answers in zip(requests, together):
        alone = RolloutServer(lambda: HFRolloutEngine(base, RolloutConfig(max_new_tokens=16)), chunk_tokens=4,
                              row_streams=True)
        reference = alone.generate(version, path, prompt, 2, seed)
        alone.close()
        for mine, theirs in zip(answers, reference):
            assert (mine.versions == version).all()
            np.testing.assert_array_equal(mine.token_ids, theirs.token_ids)
            np.testing.assert_allclose(mine.logprobs, theirs.logprobs, rtol=0, atol=1e-5)


def test_without_kv_cache_a_mixed_batch_is_one_generate_call_with_each_rows_version(trained, second, base):

    engine, v2, _ = trained
    cfg = RolloutConfig(max_new_tokens=12, versions_per_instance=2)
    server = RolloutServer(lambda: HFRolloutEngine(base, cfg), ConcurrentVersions(2), chunk_tokens=4,
                           keep_kv_cache=False)
    requests = [(2, v2, PROMPTS[0], 1), (3, second, PROMPTS[1], 2), (3, second, PROMPTS[2], 3)]
    answers = serve_concurrently(server, requests)
    server.close()
    references = {2: engine.model.eval(), 3: HFRolloutEngine(second, RolloutConfig(), version=3).model}
    for (version, _, prompt, _), gens in zip(requests, answers):
        assert all((g.versions == version).all() for g in gens)
        assert engine_logprob_error(references[version], [prompt], [gens]) < HF_TOLERANCE


def test_an_engine_keeps_m_versions_and_evicts_the_lru_idle_one(trained, second, base, monkeypatch, tmp_path):
    from dora_tasks.engines.resident import AllVersionsRunning

    _, v2, _ = trained
    engine = HFRolloutEngine(base, RolloutConfig(max_new_tokens=8, versions_per_instance=2))
    merges, merged_state = [], lora.merged_state
    monkeypatch.setattr(lora, "merged_state", lambda b, folder: merges.append(folder) or merged_state(b, folder))
    engine.load_version(2, v2)  # resident: 0 (the base it started from) and 2
    first = engine.model
    engine.load_version(0, base)
    engine.load_version(2, v2)  # resident already: no merge, the same copy
    assert engine.model is first and merges == [v2] and engine.resident.versions == (0, 2)
    engine.resident.running = frozenset({2})
    engine.load_version(3, second)  # 0 is the least recently used and not running: its copy takes version 3
    assert engine.resident.versions == (2, 3) and engine.model is not first
    sampled = engine.generate(PROMPTS, n=1, seed=0, versions=[2, 3, 2])
    assert [int(gens[0].versions[0]) for gens in sampled] == [2, 3, 2]
    reference = HFRolloutEngine(second, RolloutConfig()).model
    assert engine_logprob_error(reference, PROMPTS[1:2], sampled[1:2]) < HF_TOLERANCE
    engine.resident.running = frozenset({2, 3})
    with pytest.raises(AllVersionsRunning, match="running rows"):
        engine.load_version(4, v2)
    engine.resident.running = frozenset({3})
    with pytest.raises(ValueError, match="safetensors"):  # a failed load: version 2's copy it went into is dropped
        engine.load_version(4, str(tmp_path))
    assert engine.resident.versions == (3,) and engine.version == 3 and engine.model is engine.resident.get(3).model


# ---- the base's identity ---------------------------------------------------------------------------------------------
def test_an_adapter_over_another_base_is_refused_by_name(trained, tmp_path):
    _, folder, _ = trained
    other = tiny_qwen2(tmp_path / "other", seed=1)
    rollout = HFRolloutEngine(other, RolloutConfig(max_new_tokens=8))
    with pytest.raises(lora.BaseModelMismatch, match="trained over the base at"):
        rollout.load_version(2, folder)
    with pytest.raises(lora.BaseModelMismatch, match=str(other)):
        TorchTrainEngine(folder, TrainConfig(lora=ADAPTER), base_path=other)
    with pytest.raises(lora.AdapterError, match="train.lora.rank is 0"):
        TorchTrainEngine(folder, TrainConfig(), base_path=other)


def test_on_an_object_store_an_adapter_names_the_shared_base_and_loads_from_it(base):
    from dora_tasks.engines.factory import make_train_engine
    from storage.objectstore import local_folder

    store = WeightStore("memory://test-lora/weights")
    shared = store.share_initial(base)  # the initial model as workers read it: <weights>/initial
    cfg = TrainConfig(lr=2e-2, lora=ADAPTER)
    engine = make_train_engine(base, cfg, version=0, base_path=shared)
    engine.train_step(make_batch(base))
    store.publish(1, engine.save_weights, overwrite=True)
    assert lora.read_base(local_folder(store.path_for(1))).path == shared
    restarted = make_train_engine(store.path_for(1), cfg, version=1, base_path=shared)
    served = HFRolloutEngine(local_folder(store.path_for(1)), RolloutConfig(max_new_tokens=8), version=1)
    assert engine_logprob_error(engine.model.eval(), PROMPTS, served.generate(PROMPTS, n=1, seed=0)) < HF_TOLERANCE
    tensors = batch_tensors(make_batch(base, seed=5))
    with torch.no_grad():
        mine, _ = sequence_logprobs(engine.model, tensors["input_ids"], tensors["attention_mask"])
        theirs, _ = sequence_logprobs(restarted.model, tensors["input_ids"], tensors["attention_mask"])
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


def test_a_trainer_started_on_an_adapter_continues_it(trained, base):
    engine, folder, _ = trained
    resumed = TorchTrainEngine(folder, TrainConfig(lr=2e-2, kl_coef=0.1, lora=ADAPTER), version=2, base_path=base)
    tensors = batch_tensors(make_batch(base, seed=3))
    with torch.no_grad():
        mine, _ = sequence_logprobs(engine.model.eval(), tensors["input_ids"], tensors["attention_mask"])
        theirs, _ = sequence_logprobs(resumed.model, tensors["input_ids"], tensors["attention_mask"])
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    with pytest.raises(lora.AdapterError, match="train.lora asks for"):
        TorchTrainEngine(folder, TrainConfig(lora=LoraConfig(rank=8)), base_path=base)


def test_a_checkpoint_holds_the_adapter_and_reproduces_the_next_step(base, tmp_path):
    cfg = TrainConfig(lr=2e-2, lora=ADAPTER)
    batches = [make_batch(base, seed=s) for s in (0, 1)]
    engine = TorchTrainEngine(base, cfg, base_path=base)
    engine.train_step(batches[0])
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert all("lora_" in k for k in torch.load(tmp_path / "ckpt" / "trainer.pt", weights_only=True)["model"])
    engine.train_step(batches[1])
    restored = TorchTrainEngine(base, cfg, base_path=base)
    restored.load_checkpoint(str(tmp_path / "ckpt"))
    assert restored.version == 1
    restored.train_step(batches[1])
    for (name, a), (_, b) in zip(lora.adapter_state(engine.model).items(), lora.adapter_state(restored.model).items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_zero2_trains_the_same_adapter_as_torch(trained, base, tmp_path):
    from dora_tasks.engines.deepspeed_trainer import DeepSpeedTrainEngine, shm_buffer_paths
    from tests.test_deepspeed_trainer import RENDEZVOUS_VARS

    _, folder, _ = trained
    saved = {k: os.environ.get(k) for k in RENDEZVOUS_VARS}
    cfg = TrainConfig(engine="deepspeed", zero_stage=2, lr=2e-2, kl_coef=0.1, lora=ADAPTER)
    ds = DeepSpeedTrainEngine(base, cfg, base_path=base)
    try:
        batch = make_batch(base)
        for _ in range(2):
            ds.train_step(batch)
        ds.save_weights(str(tmp_path / "ds"))
        ds.save_checkpoint(str(tmp_path / "ckpt"))
        ds.load_checkpoint(str(tmp_path / "ckpt"))
        assert ds.version == 2
    finally:
        ds.close()
        for path in shm_buffer_paths():
            os.remove(path)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    from safetensors.torch import load_file

    ours, theirs = (load_file(os.path.join(f, lora.ADAPTER_WEIGHTS)) for f in (str(tmp_path / "ds"), folder))
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-6, msg=name)


# ---- what a version switch moves ------------------------------------------------------------------------------------
def test_a_switch_to_an_adapter_moves_fewer_bytes_than_the_full_model(tmp_path):
    """`benchmarks/lora_sync.py` on the long-tail benchmark's model: each step of a switch timed, the adapter's bytes
    a fraction of the model's; projected for Qwen2.5-32B, the adapter is well under 1% of the weights."""
    from tests.test_benchmark_tools import load

    bench = load("lora_sync")
    model_cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "longtail_bench.yaml")).model
    measured = bench.measure(model_cfg, rank=8, reps=2, work=str(tmp_path))
    assert measured["adapter"]["bytes"] < measured["full"]["bytes"] / 3
    assert all(row[key] > 0 for row in measured.values() for key in ("publish_s", "read_s", "load_s"))
    projection = bench.projected(rank=8)
    assert projection["adapter_bytes"] < projection["full_bytes"] / 100
    assert projection["adapter_peer_s"] / projection["full_peer_s"] == pytest.approx(
        projection["adapter_bytes"] / projection["full_bytes"])


# ---- configuration ---------------------------------------------------------------------------------------------------
def test_lora_config_is_checked_with_the_key_named():
    cfg = load_config(None, ["train.lora.rank=8", "train.lora.target_modules=[q_proj,v_proj]"])
    assert cfg.train.lora == LoraConfig(rank=8, target_modules=["q_proj", "v_proj"])
    assert cfg.flat()["train.lora.rank"] == 8
    for bad, key in (("train.lora.rank=-1", "train.lora.rank"), ("train.lora.dropout=1", "train.lora.dropout"),
                     ("train.lora.target_modules=q_proj", "train.lora.target_modules"),
                     ("train.lora.rnak=2", "train.lora.rank")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match="train.lora.rank"):
        load_config(None, ["train.lora.rank=4", "train.engine=emulated", "rollout.engine=emulated",
                           "task.name=emulated"])


def test_unknown_target_modules_are_named(base):
    with pytest.raises(lora.AdapterError, match="train.lora.target_modules"):
        TorchTrainEngine(base, TrainConfig(lora=LoraConfig(rank=4, target_modules=["nope_proj"])), base_path=base)


# ---- a run with adapters ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("K, M", [(0, 1), (1, 1), (3, 2)])
def test_a_lora_run_keeps_all_three_constraints_and_publishes_adapters(small_config, shared_cluster, K, M):
    """M = rollout.versions_per_instance: at M = 2 one instance generates two versions at once, each group under its
    own adapter."""
    from pipelines.inputs import RunInputs
    from pipelines.run import initial_policy
    from pipelines.streaming import run_pipeline
    from storage.audit import audit_store
    from storage.trajectory_store import TrajectoryStore

    shared = ["dora.num_updates=4"]
    if M > 1:  # one instance, 4 slots, TBS 2: each version is published while the older ones' groups still run
        shared = ["rollout.instances=1", "rollout.slots=4", "dora.train_batch_size=2", "dora.num_updates=8"]
    cfg = small_config("train.lora.rank=8", "train.lora.alpha=16", f"dora.max_staleness={K}",
                       f"rollout.versions_per_instance={M}", *shared)
    summary = run_pipeline(cfg, RunInputs(client=shared_cluster(cfg)))
    report = audit_store(summary.store, K)
    assert report.ok, report.to_text()
    assert report.max_versions_per_instance == M
    table = TrajectoryStore.open(summary.store).read_table("trajectories", ["version", "consumed_by"])
    G, TBS, N = cfg.rollout.group_size, cfg.dora.train_batch_size, cfg.dora.num_updates
    consumed = table["consumed_by"] >= 0
    assert consumed.sum() == G * TBS * N
    assert set(table["version"][consumed].tolist()) - {0}, "no trajectory was sampled under an adapter"
    weights = WeightStore(cfg.storage.resolved("weight_store"))
    assert lora.is_adapter_folder(weights.path_for(N))  # the newest version is an adapter over the initial model
    recorded = lora.read_base(weights.path_for(N))
    assert recorded.path == initial_policy(cfg) and recorded.sha256 == lora.weights_sha256(recorded.path)


@pytest.mark.slow
@pytest.mark.long  # default suite: test_a_checkpoint_holds_the_adapter_... and test_chaos's driver kill and resume
def test_a_lora_run_killed_and_resumed_continues_from_its_adapter_checkpoint(tmp_path):
    """The driver killed by its PID after a checkpoint; the resumed trainer starts from the base plus the adapter of
    the checkpoint's version and its optimizer state; every prompt is trained once."""
    import signal
    import time

    from storage.audit import audit_store
    from storage.checkpoint import CheckpointStore
    from storage.trajectory_store import TrajectoryStore
    from tests.conftest import SMALL_RUN
    from tests.processes import dora, kill_group, resume_to_end

    run_dir, K, N = tmp_path / "run", 1, 5
    proc = dora(tmp_path / "run.log", "run", "--config", "configs/cpu_demo.yaml", *SMALL_RUN,
                f"storage.run_dir={run_dir}", f"tracking.mlflow_uri=sqlite:///{tmp_path}/ml.db", "train.lora.rank=8",
                f"dora.max_staleness={K}", f"dora.num_updates={N}", "storage.checkpoint_interval=2")
    checkpoints = CheckpointStore(str(run_dir / "checkpoints"))
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None and not checkpoints.updates():
            time.sleep(0.2)
        assert proc.poll() is None, (tmp_path / "run.log").read_text()[-5000:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        kill_group(proc)
    trainer_files = os.listdir(checkpoints.latest().file("trainer"))
    assert trainer_files == ["trainer.pt"]
    resume_to_end(tmp_path / "resume.log", run_dir, "tracking.live_view=false")
    store_path = str(run_dir / "trajectories.zarr")
    assert audit_store(store_path, K).ok
    updates = TrajectoryStore.open(store_path).read_table("updates")
    assert updates["update"].tolist() == list(range(N))
    assert lora.is_adapter_folder(WeightStore(str(run_dir / "weights")).path_for(N))


@pytest.mark.long  # default suite: the vLLM engine's and DeepSpeed's adapter tests above, and the LoRA runs
@pytest.mark.vllm
@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None or importlib.util.find_spec("deepspeed") is None,
                    reason="vllm and deepspeed are needed")
def test_vllm_behaviour_logprobs_in_a_deepspeed_lora_run_are_those_of_base_plus_adapter(small_config):
    """vLLM instances serving each version as a LoRARequest, a DeepSpeed ZeRO-2 trainer publishing adapters: the
    stored behaviour log-probs of every version equal a recompute under its base + adapter (the merged weights)."""
    from pipelines.streaming import run_pipeline
    from storage.audit import audit_store
    from storage.trajectory_store import TrajectoryStore

    N = 3
    cfg = small_config("rollout.engine=vllm", "train.engine=deepspeed", "train.zero_stage=2", "model.num_heads=2",
                       "train.lora.rank=8", "dora.max_staleness=1", f"dora.num_updates={N}",
                       f"storage.keep_versions={N + 1}")
    summary = run_pipeline(cfg)
    assert audit_store(summary.store, 1).ok
    store = TrajectoryStore.open(summary.store)
    table = store.read_table("trajectories", ["version", "prompt_len", "response_len"])
    weights = WeightStore(cfg.storage.resolved("weight_store"))
    served = [v for v in sorted(set(table["version"].tolist())) if v > 0]
    assert served, "no trajectory was sampled under an adapter"
    for version in served:
        assert lora.is_adapter_folder(weights.path_for(version))
        policy = HFRolloutEngine(weights.path_for(version), RolloutConfig(), version=version).model
        rows = np.flatnonzero((table["version"] == version) & (table["response_len"] > 0))[:16]
        tokens, behaviour = store.read_ragged("tokens", rows), store.read_ragged("behaviour_logprobs", rows)
        for toks, logp, plen in zip(tokens, behaviour, table["prompt_len"][rows]):
            ids = torch.tensor([toks.tolist()])
            with torch.no_grad():
                recomputed, _ = sequence_logprobs(policy, ids, torch.ones_like(ids), with_entropy=False)
            assert np.abs(recomputed[0, plen:].numpy() - logp).max() < VLLM_TOLERANCE, version
