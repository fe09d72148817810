"""The real backends in the pipeline: vLLM rollout instances and a DeepSpeed ZeRO-2 trainer inside the Dask worker
processes of the embedded cluster, and the engine preflight that refuses what cannot run before any cluster starts.

One small run (K=1, 4 updates) serves the two slow tests: whichever runs first starts it, the other reads its results.
The model is the small test model with 2 heads instead of 4 (head_dim 32): vLLM's CPU attention has no kernel for
head_dim 16. `storage.keep_versions` keeps every published version, so the agreement test can recompute each
trajectory's log-probs from the weights of the version that sampled it.
"""
from __future__ import annotations

import importlib.util
import time

import numpy as np
import pytest
import torch

from dora_tasks.core.config import ConfigError
from dora_tasks.engines.preflight import VLLM_CPU_HEAD_SIZES, check_engines
from dora_tasks.engines.rollout_factory import EngineConfigError

HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def engines_test(test):
    """Marks of the slow tests on the real backends."""
    for mark in (pytest.mark.vllm, pytest.mark.deepspeed, pytest.mark.slow,
                 pytest.mark.skipif(not (HAS_VLLM and HAS_DEEPSPEED), reason="vllm and deepspeed are needed")):
        test = mark(test)
    return test


K, UPDATES = 1, 4
ENGINES = ["rollout.engine=vllm", "train.engine=deepspeed", "train.zero_stage=2", "model.num_heads=2",
           f"dora.max_staleness={K}", f"dora.num_updates={UPDATES}", f"storage.keep_versions={UPDATES + 1}"]
AGREEMENT_TOLERANCE = 1e-3  # fp32 on both sides; measured <= 1.2e-5 (see the test's printout)
SAMPLE_PER_VERSION = 16  # consumed trajectories checked per version


# ---- the run ---------------------------------------------------------------------------------------------------------
def _worker_report(dask_worker):
    """What each worker ran: its engine classes, the trainer's ZeRO stage, the rollout server's weight loads."""
    import psutil

    report = {"name": dask_worker.name, "rss": psutil.Process().memory_info().rss}
    rollout = dask_worker.plugins.get("dora-rollout")
    server = getattr(rollout, "server", None)
    if server is not None and server._engine is not None:
        report["rollout_engine"] = type(server._engine).__name__
        report["loads"] = list(server.loads)
    trainer = dask_worker.plugins.get("dora-trainer")
    engine = getattr(trainer, "engine", None)
    if engine is not None:
        report["train_engine"] = type(engine).__name__
        report["zero_stage"] = engine.engine.zero_optimization_stage()
    return report


@pytest.fixture(scope="module")
def run_cache():
    return {}


def engines_run(small_config, run_cache):
    """Run the vLLM + DeepSpeed pipeline once per module; returns (cfg, summary, worker reports). A failed run is
    not repeated by the next test."""
    if "error" in run_cache:
        pytest.fail(f"the shared vLLM + DeepSpeed run failed: {run_cache['error']!r}")
    if "summary" not in run_cache:
        from pipelines.run import open_run
        from pipelines.streaming import stream

        cfg = small_config(*ENGINES)
        start = time.perf_counter()
        try:
            with open_run(cfg) as run:
                stream(run.driver)
                summary = run.finish()
                reports = list(run.driver.client.run(_worker_report).values())
        except BaseException as exc:
            run_cache["error"] = exc
            raise
        run_cache.update(cfg=cfg, summary=summary, reports=reports)
        print(f"\nvLLM + DeepSpeed run: {time.perf_counter() - start:.1f} s (open_run to close), "
              f"streaming {summary.metrics['wall_s']:.1f} s")
    return run_cache["cfg"], run_cache["summary"], run_cache["reports"]


# ---- (a) the pipeline on the real backends ---------------------------------------------------------------------------
@engines_test
def test_vllm_deepspeed_pipeline_audits_clean_and_syncs_weights(small_config, run_cache):
    from storage.audit import audit_store
    from storage.trajectory_store import TrajectoryStore

    cfg, summary, reports = engines_run(small_config, run_cache)
    report = audit_store(summary.store, K)
    assert report.ok, report.to_text()
    assert summary.audit_ok

    # the real backends ran, in the worker processes
    rollout = [r for r in reports if "rollout_engine" in r]
    trainer = [r for r in reports if "train_engine" in r]
    assert len(rollout) == cfg.rollout.instances and {r["rollout_engine"] for r in rollout} == {"VLLMRolloutEngine"}
    assert [(r["train_engine"], r["zero_stage"]) for r in trainer] == [("DeepSpeedTrainEngine", 2)]

    store = TrajectoryStore.open(summary.store)
    t = store.read_table("trajectories")
    G, TBS = cfg.rollout.group_size, cfg.dora.train_batch_size
    assert len(t["group_id"]) == G * TBS * UPDATES

    # weight sync: the trainer published every version, rollout instances loaded them in place
    updates = store.read_table("updates")
    sync = updates["metrics/weight_sync_s"]
    assert len(sync) == UPDATES and np.all(np.isfinite(sync)) and np.all(sync > 0), sync
    loads = {}  # version -> load seconds on each instance that loaded it
    for r in rollout:
        for version, start, end in r["loads"]:
            assert end >= start
            loads.setdefault(version, []).append(end - start)
    assert set(loads) - {0}, "no rollout instance loaded a published version"
    assert max(loads) <= UPDATES
    from mlflow.tracking import MlflowClient

    history = MlflowClient(summary.tracking_uri).get_metric_history(summary.mlflow_run_id, "weight_sync_s")
    assert len(history) >= UPDATES

    assert set(summary.accuracy) >= {0, UPDATES}
    assert all(0.0 <= a <= 1.0 for a in summary.accuracy.values()), summary.accuracy
    print("publish s per version:", {u + 1: round(float(s), 3) for u, s in enumerate(sync)})
    print("load s per version (per instance):", {v: [round(s, 3) for s in ss] for v, ss in sorted(loads.items())})
    print("rollout worker RSS MiB:", [round(r["rss"] / 2**20) for r in rollout])
    print("held-out accuracy:", summary.accuracy)


# ---- (b) training-inference agreement inside the pipeline ------------------------------------------------------------
def recompute_logprobs(model, prompt: np.ndarray, response: np.ndarray, temperature: float) -> np.ndarray:
    """Teacher-forced log-prob of each response token, as the trainer computes it (fp32)."""
    ids = torch.as_tensor(np.concatenate([prompt, response]).astype(np.int64))[None]
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, len(prompt):, None])[:, 0].numpy()


@engines_test
def test_behaviour_logprobs_match_the_published_weights_of_their_version(small_config, run_cache):
    """Every sampled trajectory's stored behaviour log-probs (vLLM, after in-place weight reloads) equal a
    transformers fp32 recompute under the weights DeepSpeed published for that version."""
    from transformers import AutoModelForCausalLM

    from storage.trajectory_store import TrajectoryStore
    from storage.weight_store import WeightStore

    cfg, summary, _ = engines_run(small_config, run_cache)
    store = TrajectoryStore.open(summary.store)
    table = store.read_table("trajectories", ["version", "prompt_len", "response_len"])
    weights = WeightStore(cfg.storage.resolved("weight_store"))
    rng = np.random.default_rng(0)
    errors: dict[int, float] = {}
    checked = 0
    for version in sorted(set(table["version"].tolist())):
        rows = np.flatnonzero((table["version"] == version) & (table["response_len"] > 0))
        rows = np.sort(rng.choice(rows, size=min(SAMPLE_PER_VERSION, len(rows)), replace=False))
        assert version in weights.versions(), f"version {version} was not kept: raise storage.keep_versions"
        model = AutoModelForCausalLM.from_pretrained(weights.path_for(version), dtype=torch.float32).eval()
        tokens = store.read_ragged("tokens", rows)
        behaviour = store.read_ragged("behaviour_logprobs", rows)
        token_versions = store.read_ragged("token_versions", rows)
        for toks, logp, tv, plen in zip(tokens, behaviour, token_versions, table["prompt_len"][rows]):
            assert (tv == version).all()
            recomputed = recompute_logprobs(model, toks[:plen], toks[plen:], cfg.rollout.temperature)
            errors[version] = max(errors.get(version, 0.0), float(np.abs(recomputed - logp).max()))
            checked += 1
    print(f"\nmax |vLLM behaviour - transformers recompute| log-prob over {checked} trajectories, by version: "
          + ", ".join(f"v{v}: {e:.2e}" for v, e in sorted(errors.items())))
    assert len(errors) >= 2, "trajectories of at least two versions are needed"
    assert max(errors.values()) < AGREEMENT_TOLERANCE, errors


# ---- (c) preflight: refused before any cluster starts ----------------------------------------------------------------
@pytest.fixture
def no_cluster(monkeypatch):
    """Fail the test if open_run gets as far as starting (or attaching to) a cluster or warm-starting a model."""

    def refuse(*args, **kwargs):
        raise AssertionError("open_run started work although the preflight should have refused the config")

    monkeypatch.setattr("pipelines.run.connect", refuse)
    monkeypatch.setattr("pipelines.run.initial_policy", refuse)


def run_until_refused(cfg, error, match: str) -> None:
    from pipelines.streaming import run_pipeline

    with pytest.raises(error, match=match):
        run_pipeline(cfg)


def test_preflight_refuses_a_model_path_that_does_not_exist(small_config, tmp_path, no_cluster):
    from dora_tasks.model import TokenizerError

    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ConfigError, match=r"model\.path: .*no-such-model.* does not exist"):
        small_config(f"model.path={missing}")
    cfg = small_config()
    cfg.model.path = missing  # changed after loading: check_engines validates again
    with pytest.raises(ConfigError, match=r"model\.path: .*no-such-model.* does not exist"):
        check_engines(cfg, cfg.model.path)
    empty = tmp_path / "empty-model"
    empty.mkdir()
    with pytest.raises(ConfigError, match="initial policy folder: .*has no config.json"):
        check_engines(small_config(), str(empty))
    run_until_refused(cfg, (ConfigError, TokenizerError), "no-such-model")  # the tokenizer is read first


def test_preflight_refuses_zero_stage_5(small_config, no_cluster):
    with pytest.raises(ConfigError, match=r"train\.zero_stage: must be 0, 1, 2 or 3, got 5"):
        small_config("train.engine=deepspeed", "train.zero_stage=5")
    cfg = small_config("train.engine=deepspeed", "train.zero_stage=2")
    cfg.train.zero_stage = 5
    with pytest.raises(ConfigError, match=r"train\.zero_stage: must be 0, 1, 2 or 3, got 5"):
        check_engines(cfg, None)
    run_until_refused(cfg, ConfigError, r"train\.zero_stage")


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_preflight_refuses_a_1kib_kv_cache(small_config, tmp_path, no_cluster):
    from transformers import Qwen2Config

    from dora_tasks.engines.preflight import warm_start_shape
    from dora_tasks.engines.vllm_rollout import min_kv_cache_bytes
    from dora_tasks.model import MAX_POSITIONS

    cfg = small_config("rollout.engine=vllm", "model.num_heads=2", "rollout.kv_cache_bytes=1024")
    needed = min_kv_cache_bytes(warm_start_shape(cfg), 1024)
    assert needed == (1024 // 128 + 1) * 128 * (2 * 2 * 2 * 32 * 4)  # blocks x tokens x (K+V, layers, heads, dim, fp32)
    message = rf"rollout\.kv_cache_bytes=1024 is too small: .* at least {needed} bytes"
    with pytest.raises(EngineConfigError, match=message):  # warm start ahead: the shape comes from cfg.model
        check_engines(cfg, None)
    folder = str(tmp_path / "model")  # a model folder: the shape comes from its config.json
    Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                max_position_embeddings=MAX_POSITIONS).save_pretrained(folder)
    with pytest.raises(EngineConfigError, match=message):
        check_engines(cfg, folder)
    run_until_refused(cfg, EngineConfigError, message)


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_preflight_refuses_what_vllm_cannot_run(small_config, monkeypatch):
    with pytest.raises(EngineConfigError, match=r"head_dim=16 \(model\.hidden_size / model\.num_heads\)"):
        check_engines(small_config("rollout.engine=vllm", "model.num_heads=4"), None)  # hidden 64 / 4 heads
    with pytest.raises(EngineConfigError, match=r"cluster\.worker_memory=1GiB is too small"):
        check_engines(small_config("rollout.engine=vllm", "model.num_heads=2", "cluster.worker_memory=1GiB"), None)
    with pytest.raises(EngineConfigError, match=r"rollout\.max_new_tokens=1024 leaves no room"):
        check_engines(small_config("rollout.engine=vllm", "model.num_heads=2", "rollout.max_new_tokens=1024"), None)
    check_engines(small_config(*ENGINES), None)  # the run above passes
    # an attached cluster's workers are not this machine: no package, head-size or memory check here
    check_engines(small_config("rollout.engine=vllm", "cluster.scheduler_address=tcp://10.0.0.1:8786"), None)


def test_preflight_checks_a_gpu_model_against_its_context_length(tmp_path):
    """configs/gpu_qwen_math.yaml's model shape (Qwen2.5-Math-1.5B: 28 layers, 2 kv heads of 128, 4096 positions),
    read from its config.json alone; on an attached cluster only the model-shape checks apply."""
    from transformers import Qwen2Config

    from dora_tasks.core.config import load_config
    from dora_tasks.core.records import Prompt

    Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096,
                tie_word_embeddings=True).save_pretrained(tmp_path)
    gpu = ["configs/gpu_qwen_math.yaml", [f"model.path={tmp_path}"]]
    cfg = load_config(gpu[0], gpu[1] + ["rollout.max_new_tokens=3072"])
    check_engines(cfg, str(tmp_path), prompts=[Prompt(0, "q", "a", tuple(range(1024)))])
    with pytest.raises(EngineConfigError, match=r"rollout\.max_new_tokens=3072 \+ the longest prompt \(1100 tokens"):
        check_engines(cfg, str(tmp_path), prompts=[Prompt(0, "q", "a", tuple(range(1100)))])
    with pytest.raises(EngineConfigError, match=r"rollout\.max_new_tokens=8192 leaves no room for a prompt: .*=4096"):
        check_engines(load_config(gpu[0], gpu[1] + ["rollout.max_new_tokens=8192"]), str(tmp_path))
    with pytest.raises(EngineConfigError, match=r"rollout\.kv_cache_bytes=1024 is too small: .* at least 242221056"):
        check_engines(load_config(gpu[0], gpu[1] + ["rollout.kv_cache_bytes=1024", "rollout.max_new_tokens=3072"]),
                      str(tmp_path))


def test_preflight_names_a_missing_package(small_config, monkeypatch):
    from dora_tasks.engines import preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("vllm", "deepspeed") else real(name, *a))
    with pytest.raises(EngineConfigError, match=r"rollout\.engine=vllm: the 'vllm' package is not installed"):
        check_engines(small_config("rollout.engine=vllm", "model.num_heads=2"), None)
    with pytest.raises(EngineConfigError, match=r"train\.engine=deepspeed: the 'deepspeed' package is not installed"):
        check_engines(small_config("train.engine=deepspeed"), None)
    check_engines(small_config(), None)  # hf + torch need neither


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_preflight_head_sizes_are_vllms():
    """The preflight lists vLLM's CPU head sizes instead of importing vLLM in the driver: keep them equal."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert list(VLLM_CPU_HEAD_SIZES) == list(CPUAttentionBackend.get_supported_head_sizes())
