"""Typed configuration. Defaults live here, once; YAML files in `configs/` and `key=value` overrides only change them.

`load_config(path, overrides)` reads YAML, applies dotted overrides (`dora.max_staleness=3`), builds the dataclasses
and validates them. Every problem raises `ConfigError` with the offending key and what is allowed.

Simplified: this module is on the ground floor (`dora_tasks.core`) and cannot see the algorithm registry above it, so
`train.advantage` and `train.loss` are checked against the registered names by the registry itself
(`dora_tasks.algorithms.check_config_names`), which `dora config`, `dora run` and the engine preflight call right
after loading.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dora_tasks.core.clock import Clock
from dora_tasks.core.config_checks import ConfigError, _choice, _is_host, _require
from dora_tasks.core.config_emulation import EmulationConfig
from dora_tasks.core.config_episodes import check_episodes
from dora_tasks.core.config_lora import LoraConfig
from dora_tasks.core.config_reward import RewardConfig

EMULATED_REWARD = "dora_tasks.emulation.task.synthetic_reward"  # task.reward_fn of task.name=emulated when unset


@dataclass
class ModelConfig:
    path: str = ""  # Hugging Face model folder; empty means "warm-start one from scratch into the run folder"
    hidden_size: int = 128  # used only when building a model from scratch
    num_layers: int = 2
    num_heads: int = 4
    warmstart_steps: int = 120  # supervised steps on the task's demonstrations before RL: partly right, not solved
    warmstart_lr: float = 3e-3
    warmstart_batch: int = 32  # demonstrations per warm-start step; small, so the warm start leaves RL room to improve
    dtype: str = "float32"

    def validate(self) -> None:
        _require(self.hidden_size > 0 and self.hidden_size % self.num_heads == 0, "model.hidden_size",
                 f"must be positive and divisible by model.num_heads={self.num_heads}, got {self.hidden_size}")
        _require(self.num_layers >= 1, "model.num_layers", f"must be >= 1, got {self.num_layers}")
        _require(self.warmstart_steps >= 0, "model.warmstart_steps", f"must be >= 0, got {self.warmstart_steps}")
        _choice(self.dtype, "model.dtype", ("float32", "bfloat16", "float16"))
        if self.path:
            _require(Path(self.path).is_dir() or "://" in self.path, "model.path",
                     f"{self.path!r} does not exist (a Hugging Face model folder is expected)")


@dataclass
class TaskConfig:
    name: str = "countdown"  # built-in procedural task; or "dataset" to read prompts from `dataset`
    dataset: str = ""  # path to .jsonl / .parquet, or "hf:<name>[:split]" for Hugging Face datasets
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    reward_fn: str = ""  # dotted path "package.module.function"; empty means the task's own reward
    reward_timeout_s: float = 10.0  # per call; a timed-out call is recorded as a reward failure
    reward_isolation: str = "thread"  # "process": calls run in reward processes, killed past the timeout or memory
    reward_memory_bytes: int = 2**30  # address-space limit (RLIMIT_AS) of each reward process (process isolation)
    reward_failure_warn_share: float = 0.1  # warn when more than this share of an update's rewards failed
    reward_failure_stop_updates: int = 3  # stop once every reward of this many updates in a row failed (0: never)
    num_prompts: int = 4096  # size of the generated prompt pool for procedural tasks
    eval_prompts: int = 64  # held-out prompts for accuracy
    eval_interval: int = 0  # updates between held-out evaluations; 0 evaluates the initial and final policy only
    max_count: int = 400  # long-tail cap of the countdown task
    environment: str = ""  # multi-turn episodes: dotted path of an environment factory (dora_tasks/workloads/
    #                        environments.py, e.g. dora_tasks.workloads.calculator.CalculatorEnvironment); "" = none
    max_turns: int = 4  # model turns of an episode at most
    max_turn_tokens: int = 0  # tokens of one model turn at most; 0 = the rest of rollout.max_new_tokens, which
    #                           bounds the whole response (model and environment tokens)
    environment_timeout_s: float = 10.0  # per environment call (reset, step); one that raises or times out ends
    #                                      its episode, recorded on the trajectory (env_error)

    def validate(self) -> None:
        _choice(self.name, "task.name", ("countdown", "arithmetic", "dataset", "emulated"))
        _require(self.max_turns >= 1, "task.max_turns", f"must be >= 1, got {self.max_turns}")
        _require(self.max_turn_tokens >= 0, "task.max_turn_tokens", f"must be >= 0, got {self.max_turn_tokens}")
        _require(self.environment_timeout_s > 0, "task.environment_timeout_s",
                 f"must be > 0, got {self.environment_timeout_s}")
        if self.name == "dataset":
            _require(bool(self.dataset), "task.dataset", "required when task.name=dataset")
        _require(self.reward_timeout_s > 0, "task.reward_timeout_s", f"must be > 0, got {self.reward_timeout_s}")
        _require(0 <= self.reward_failure_warn_share <= 1, "task.reward_failure_warn_share",
                 f"must be in [0, 1], got {self.reward_failure_warn_share}")
        _require(self.reward_failure_stop_updates >= 0, "task.reward_failure_stop_updates",
                 f"must be >= 0 (0 = never stop), got {self.reward_failure_stop_updates}")
        _choice(self.reward_isolation, "task.reward_isolation", ("thread", "process"))
        _require(self.reward_memory_bytes > 0, "task.reward_memory_bytes",
                 f"must be > 0, got {self.reward_memory_bytes}")
        _require(self.num_prompts > 0, "task.num_prompts", f"must be > 0, got {self.num_prompts}")


@dataclass
class RolloutConfig:
    engine: str = "hf"  # "hf" (transformers, light fallback) or "vllm"
    instances: int = 2  # rollout instances (GPU-labelled rollout workers) in the embedded cluster
    group_size: int = 8  # G trajectories per prompt
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    slots: int = 4  # groups one instance generates at once (its engine batches them)
    kv_cache_bytes: int = 64 * 2**20  # vLLM KV-cache memory; must be set on CPU
    chunk_tokens: int = 16  # continuous batching: finished groups leave and waiting ones (same version) join every
    #                         this many tokens; 0 = static batches (a batch runs until its longest response ends)
    keep_kv_cache: bool = True  # continuous batching on the transformers engine keeps running rows' KV cache between
    #                             chunks (false: prompt + tokens so far are re-encoded at every chunk)
    fast_decode: bool = True  # with the kept cache, decode steps written out in plain torch over the loaded version's
    #                           fused weights (dora_tasks/engines/fast_session.py; Qwen2/Llama layouts); false:
    #                           transformers' forward
    switching: str = "auto"  # how an instance leaves an older version (pipelines/switching.py): "drain" = once its
    #                          last group ends; "queue" = new groups of the newest version queue behind those groups;
    #                          "migrate" = its running responses move to instances staying on that version (DORA's
    #                          request migration; with the KV cache on the transformers engine, by a re-prefill on
    #                          vLLM, with keep_kv_cache off, and (in emulated time) on the emulated engine); "auto" =
    #                          migrate, or drain where a response cannot move (`resolved_switching`)
    row_streams: bool | None = None  # each response samples from its own random stream (seeded by its group's seed
    #                                  and sample index), so a migrated response draws the tokens it would have drawn
    #                                  at home; null = on with switching=migrate, off otherwise (one draw per decode
    #                                  step for the whole batch is cheaper)
    partial_rollout: bool = False  # baseline only: swap weights mid-generation (breaks C1 on purpose); chunked
    versions_per_instance: int = 1  # M: policy versions one instance serves at once (one adapter each; rows
    #                                 shared between them); > 1 needs adapters: train.lora (emulated engines:
    #                                 emulation.lora_rank), and rollout.switching=drain (pipelines/switching.py)

    @property
    def per_row_streams(self) -> bool:
        """`row_streams`, its default resolved: on with switching=migrate."""
        return self.switching == "migrate" if self.row_streams is None else self.row_streams

    def resolved_switching(self, episodes: bool) -> str:
        """`switching`, "auto" resolved: migrate, or drain where a response cannot leave its instance (the
        partial-rollout baseline, several versions per instance, static batches, or multi-turn `episodes`)."""
        if self.switching != "auto":
            return self.switching
        movable = self.chunk_tokens >= 1 and not self.partial_rollout and self.versions_per_instance == 1
        return "migrate" if movable and not episodes else "drain"

    def validate(self) -> None:
        _choice(self.engine, "rollout.engine", ("hf", "vllm", "emulated"))
        _choice(self.switching, "rollout.switching", ("auto", "drain", "queue", "migrate"))
        _require(self.row_streams in (None, True, False), "rollout.row_streams",
                 f"expected true, false or null (on with switching=migrate), got {self.row_streams!r}")
        if self.switching == "migrate":
            _require(self.chunk_tokens >= 1, "rollout.chunk_tokens",
                     "must be >= 1 with rollout.switching=migrate (a response is handed over at a chunk boundary)")
            _require(not self.partial_rollout, "rollout.switching",
                     "'migrate' moves a response between instances of its own version; the partial-rollout baseline "
                     "(rollout.partial_rollout=true) changes versions under it: use 'drain' or 'queue'")
        _require(self.instances >= 1, "rollout.instances", f"must be >= 1, got {self.instances}")
        _require(self.group_size >= 1, "rollout.group_size", f"must be >= 1, got {self.group_size}")
        _require(self.slots >= 1, "rollout.slots", f"must be >= 1, got {self.slots}")
        _require(self.max_new_tokens >= 1, "rollout.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        _require(self.temperature > 0, "rollout.temperature", f"must be > 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.chunk_tokens >= 0, "rollout.chunk_tokens",
                 f"must be >= 0 (0 = static batches), got {self.chunk_tokens}")
        _require(self.chunk_tokens >= 1 or not self.partial_rollout, "rollout.chunk_tokens",
                 "must be >= 1 with rollout.partial_rollout=true (the newest version is loaded between chunks)")
        _require(self.kv_cache_bytes > 0, "rollout.kv_cache_bytes", f"must be > 0, got {self.kv_cache_bytes}")
        self._validate_versions_per_instance()

    def _validate_versions_per_instance(self) -> None:
        m = self.versions_per_instance
        _require(m >= 1, "rollout.versions_per_instance", f"must be >= 1, got {m}")
        if m == 1:
            return
        _require(not self.partial_rollout, "rollout.versions_per_instance",
                 f"{m} serves each request with its own version's adapter from start to end; the partial-rollout "
                 "baseline (rollout.partial_rollout=true) swaps versions under running requests: set one of them off")
        _require(self.switching in ("auto", "drain"), "rollout.versions_per_instance",
                 f"{m} lets an instance take the newest version beside its older ones, which replaces "
                 f"rollout.switching={self.switching!r} (an instance leaving its version); keep "
                 "rollout.switching=drain or auto")


@dataclass
class TrainConfig:
    engine: str = "torch"  # "torch" (plain, fallback) or "deepspeed"
    zero_stage: int = 0
    advantage: str = "grpo"  # estimator name in the dora_tasks.algorithms registry (checked after load by
    #                          `check_config_names`; custom ones must be registered, i.e. their module imported, first)
    loss: str = "ppo_clip"  # policy-loss name in the dora_tasks.algorithms registry (checked likewise)
    lr: float = 3e-4  # Adam step size, for the tiny CPU policies: larger steps collapse them, smaller ones leave
    #                   them unchanged (docs/benchmark.md, "Learning rate"); a pretrained LLM wants ~1e-6
    #                   (gpu_qwen_math.yaml)
    clip_low: float = 0.2
    clip_high: float = 0.2  # > clip_low gives DAPO's clip-higher
    kl_coef: float = 0.0  # KL to the initial policy; 0 disables the reference model
    micro_batch: int = 32  # at most this many trajectories per forward/backward
    micro_batch_call_tokens: int = 256  # what one more forward/backward costs, in padded tokens: rows sorted by length
    #   are cut into micro-batches where padding would cost more (the default suits the small CPU policies; measure
    #   it on a GPU, where a call is cheap against padded tokens of a large model); 0 cuts wherever it saves any padding
    max_grad_norm: float = 1.0  # 0 disables clipping (the norm is still reported)
    loss_agg: str = "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm (Dr. GRPO)
    loss_norm_len: int = 0  # divisor of seq_mean_token_sum_norm; 0 = longest response of the batch
    filter_degenerate: bool = False  # DAPO dynamic sampling: zero-variance groups are recorded as filtered, not trained
    importance_cap: float = 2.0  # C of tis's min(ratio, C) and cap of decoupled_ppo's behaviour weight
    lora: LoraConfig = field(default_factory=LoraConfig)  # adapters instead of full weights (rank 0 = off)

    def validate(self) -> None:
        _choice(self.engine, "train.engine", ("torch", "deepspeed", "emulated"))
        _choice(self.loss_agg, "train.loss_agg", ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"))
        _require(self.loss_norm_len >= 0, "train.loss_norm_len", f"must be >= 0, got {self.loss_norm_len}")
        _require(self.importance_cap >= 1, "train.importance_cap", f"must be >= 1, got {self.importance_cap}")
        _require(self.max_grad_norm >= 0, "train.max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")
        _require(self.zero_stage in (0, 1, 2, 3), "train.zero_stage", f"must be 0, 1, 2 or 3, got {self.zero_stage}")
        _require(self.lr > 0, "train.lr", f"must be > 0, got {self.lr}")
        _require(self.clip_low > 0 and self.clip_high > 0, "train.clip_low/clip_high", "must be > 0")
        _require(self.micro_batch >= 1, "train.micro_batch", f"must be >= 1, got {self.micro_batch}")
        _require(self.micro_batch_call_tokens >= 0, "train.micro_batch_call_tokens",
                 f"must be >= 0, got {self.micro_batch_call_tokens}")
        _require(self.kl_coef >= 0, "train.kl_coef", f"must be >= 0, got {self.kl_coef}")
        self.lora.validate()
        _require(not (self.lora.enabled and self.engine == "emulated"), "train.lora.rank",
                 "LoRA needs a real trainer (train.engine=torch or deepspeed), not the emulated one")


@dataclass
class DoraConfig:
    max_staleness: int = 1  # K: 0 = synchronous on-policy, 1 = one-step off-policy, >= 2 = DORA multi-version
    train_batch_size: int = 8  # TBS, in groups (prompts) per update
    rollout_batch_size: int = 16  # RBS, groups kept in flight; must be >= TBS
    num_updates: int = 10
    seed: int = 0
    update_lookahead: int = 1  # batches the gate may hand over while an update still trains, so the trainer goes
    #                            on without a driver round trip (0 = decide each update after the previous publish;
    #                            no effect at K=0, where update u+1's groups cannot exist before version u+1)

    batch_order: str = "completion"  # which groups fill a batch: "completion" = the first complete ones (streaming),
    #                                  "dispatch" = in dispatch order, waiting for them (unbiased by response length)
    stream_updates: bool = False  # hand an update its batch before its stragglers (version u - K) complete: the
    #                               trainer computes the rest meanwhile (pipelines/streamed_updates.py)

    def validate(self) -> None:
        _choice(self.batch_order, "dora.batch_order", ("completion", "dispatch"))
        _require(self.update_lookahead >= 0, "dora.update_lookahead", f"must be >= 0, got {self.update_lookahead}")
        _require(self.max_staleness >= 0, "dora.max_staleness", f"K must be >= 0, got {self.max_staleness}")
        _require(self.train_batch_size >= 1, "dora.train_batch_size",
                 f"TBS must be >= 1, got {self.train_batch_size}")
        _require(self.rollout_batch_size >= self.train_batch_size, "dora.rollout_batch_size",
                 f"RBS={self.rollout_batch_size} must be >= TBS=dora.train_batch_size={self.train_batch_size}")
        _require(self.num_updates >= 1, "dora.num_updates", f"must be >= 1, got {self.num_updates}")


@dataclass
class ClusterConfig:
    scheduler_address: str = ""  # empty: start an embedded LocalCluster; else attach, e.g. tcp://10.0.0.1:8786
    cpu_workers: int = 1  # embedded cluster: reward/advantage workers (label CPU)
    cpu_threads: int = 2
    worker_memory: str = "4GiB"
    direct_to_workers: bool = True  # the driver fetches groups straight from the workers; false if the driver
    #                                 cannot reach them (behind NAT): the scheduler then relays every result
    host: str = "127.0.0.1"  # embedded cluster: where its scheduler, nannies and workers (and their HTTP servers)
    #                          listen; loopback because a Dask scheduler runs any pickled code sent to it
    dashboard_address: str = "127.0.0.1:0"  # embedded scheduler's dashboard (":0" would listen on every interface)
    tls_ca_file: str = ""  # TLS: CA, certificate and key PEM files, all three or none; the driver's client uses
    tls_cert: str = ""  # them (cluster.scheduler_address must then be tls://), and the embedded cluster runs on TLS
    tls_key: str = ""  # with them for every role
    connect_timeout_s: float = 10.0
    paused_timeout_s: float = 60.0  # a worker paused by Dask's memory monitor this long stops the run with an error

    def validate(self) -> None:
        _require(self.cpu_workers >= 1, "cluster.cpu_workers", f"must be >= 1, got {self.cpu_workers}")
        _require(self.cpu_threads >= 1, "cluster.cpu_threads", f"must be >= 1, got {self.cpu_threads}")
        _require(self.paused_timeout_s > 0, "cluster.paused_timeout_s", f"must be > 0, got {self.paused_timeout_s}")
        if self.scheduler_address:
            _require("://" in self.scheduler_address, "cluster.scheduler_address",
                     f"expected a URL such as tcp://host:8786, got {self.scheduler_address!r}")
        _require(_is_host(self.host), "cluster.host",
                 f"expected an IP address or host name (0.0.0.0: every interface), got {self.host!r}")
        self._validate_tls()

    def _validate_tls(self) -> None:
        files = {"cluster.tls_ca_file": self.tls_ca_file, "cluster.tls_cert": self.tls_cert,
                 "cluster.tls_key": self.tls_key}
        if not any(files.values()):
            return
        for key, path in files.items():
            _require(bool(path), key, "set all three of cluster.tls_ca_file, cluster.tls_cert, cluster.tls_key or none")
            _require(Path(path).is_file(), key, f"{path!r} does not exist (a PEM file is expected)")
        if self.scheduler_address:
            _require(self.scheduler_address.startswith("tls://"), "cluster.scheduler_address",
                     f"must be tls://HOST:PORT when cluster.tls_* are set, got {self.scheduler_address!r}")


_STORE_NAMES = {"trajectory_store": "trajectories.zarr", "weight_store": "weights", "checkpoint_store": "checkpoints"}


def _check_location(value: str, key: str) -> None:
    """A local folder, or an fsspec URL whose filesystem is installed and writable from every process. Credentials
    and endpoint are never configured here: the filesystem's library reads its own environment variables."""
    if "://" not in value or value.startswith("file://"):
        return
    import fsspec

    scheme, rest = value.split("://", 1)
    _require(scheme in fsspec.available_protocols(), key,
             f"unsupported URL scheme {scheme!r} in {value!r}: use a local folder or an fsspec URL such as "
             "s3://bucket/prefix (schemes: fsspec.available_protocols())")
    _require(scheme not in ("http", "https"), key, f"{value!r}: {scheme}:// URLs are read-only; use s3://, gs://, ...")
    _require(scheme != "memory", key, f"{value!r}: memory:// lives inside one process, so workers (and a later "
             "`dora resume`) cannot read it; use an object store (s3://bucket/prefix) or a folder")
    _require(bool(rest.strip("/")), key, f"{value!r} names no bucket or path")
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as exc:
        raise ConfigError(f"{key}: {value!r} needs a package that is not installed ({exc}); for s3:// run "
                          "`pip install s3fs`") from None


@dataclass
class StorageConfig:
    run_dir: str = "runs/demo"  # the driver's folder of the run: config.yaml, MLflow db, plots (and the stores when
    #                             store_root is empty)
    store_root: str = ""  # folder or object-store URL (s3://bucket/prefix; endpoint and keys from AWS_* environment
    #                       variables) holding the stores below; empty: run_dir. A URL needs no folder shared with
    #                       the workers
    trajectory_store: str = ""  # zarr folder or URL; empty: <store_root>/trajectories.zarr
    weight_store: str = ""  # folder or URL; empty: <store_root>/weights
    checkpoint_store: str = ""  # folder or URL; empty: <store_root>/checkpoints
    checkpoint_interval: int = 5  # updates between checkpoints; 0 disables
    keep_versions: int = 0  # published versions kept beyond the live window; 0 keeps only what resume needs

    def validate(self) -> None:
        _require(bool(self.run_dir), "storage.run_dir", "must not be empty")
        _require("://" not in self.run_dir, "storage.run_dir",
                 f"must be a local folder of the driver (config, MLflow db, plots), got {self.run_dir!r}; to keep "
                 "the stores on an object store, set storage.store_root=s3://bucket/prefix")
        for key in ("store_root", *_STORE_NAMES):
            _check_location(getattr(self, key), f"storage.{key}")
        _require(self.checkpoint_interval >= 0, "storage.checkpoint_interval",
                 f"must be >= 0, got {self.checkpoint_interval}")

    def resolved(self, name: str) -> str:
        """Where store `name` (trajectory_store, weight_store, checkpoint_store) is: set, or under store_root."""
        explicit = getattr(self, name)
        root = self.store_root or self.run_dir
        if explicit or "://" not in root:
            return explicit or os.path.join(root, _STORE_NAMES[name])
        return f"{root.rstrip('/')}/{_STORE_NAMES[name]}"


@dataclass
class TrackingConfig:
    mlflow_uri: str = ""  # empty: sqlite:///<run_dir>/mlflow.db
    experiment: str = "dora"
    run_name: str = ""
    live_view: bool = True
    plots: bool = True
    log_file: bool = True  # engine and library output (the driver's and the embedded workers') goes to
    #                        <run_dir>/run.log instead of the terminal; false: everything prints to the terminal
    metrics_flush_s: float = 5.0  # per-update metrics go to MLflow in one batch at most this often (and at the
    #                               end), since a sqlite write per update costs the driver CPU; 0 = every update

    def validate(self) -> None:
        _require(self.metrics_flush_s >= 0, "tracking.metrics_flush_s", f"must be >= 0, got {self.metrics_flush_s}")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dora: DoraConfig = field(default_factory=DoraConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    emulation: EmulationConfig = field(default_factory=EmulationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)  # a reward model on REWARD workers (config_reward.py)

    def validate(self) -> "Config":
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        emulated = {"rollout.engine": self.rollout.engine == "emulated", "train.engine": self.train.engine == "emulated",
                    "task.name": self.task.name == "emulated"}
        _require(len(set(emulated.values())) == 1, "emulation",
                 "rollout.engine, train.engine and task.name are all 'emulated' or none is; got "
                 + ", ".join(f"{k}={'emulated' if v else 'real'}" for k, v in emulated.items()))
        if self.emulated and not self.task.reward_fn:
            self.task.reward_fn = EMULATED_REWARD
        check_episodes(self)
        adapters = self.emulation.lora_rank > 0 if self.emulated else self.train.lora.enabled
        _require(self.rollout.versions_per_instance == 1 or adapters, "rollout.versions_per_instance",
                 f"{self.rollout.versions_per_instance} needs one adapter per version on an instance: set "
                 "train.lora.rank > 0 (emulated engines: emulation.lora_rank > 0); full-weight versions are one "
                 "per instance")
        if self.rollout.partial_rollout:
            _require(self.rollout.engine in ("hf", "emulated"), "rollout.partial_rollout",
                     "the partial-rollout baseline is implemented for rollout.engine=hf and emulated only")
        return self

    @property
    def switching(self) -> str:
        """The switching the run uses: `rollout.switching`, "auto" resolved (`RolloutConfig.resolved_switching`)."""
        return self.rollout.resolved_switching(episodes=bool(self.task.environment))

    @property
    def emulated(self) -> bool:
        """Emulated engines and task (`validate` checks that the three settings agree)."""
        return self.rollout.engine == "emulated"

    def clock(self, origin: float) -> Clock:
        """The run's clock: emulated seconds at `emulation.speedup` under emulated engines, else wall seconds."""
        return Clock(self.emulation.speedup, origin) if self.emulated else Clock()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """`section.key -> value` (`section.sub.key` inside a sub-section such as train.lora), for MLflow params."""
        return _flattened(self.to_dict(), "")


def _flattened(data: dict[str, Any], prefix: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flattened(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _coerce(value: Any, typ: type, key: str) -> Any:
    if isinstance(typ, types.UnionType) and type(None) in typ.__args__:  # `X | None`: null, or an X
        (inner,) = [t for t in typ.__args__ if t is not type(None)]
        return None if value is None or value == "" else _coerce(value, inner, key)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if typ in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected {typ.__name__}, got {value!r}")
        try:
            if typ is int and isinstance(value, float) and not value.is_integer():
                raise ValueError
            return typ(value) if not isinstance(value, str) else typ(float(value) if typ is float else int(value))
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected {typ.__name__}, got {value!r}") from None
    if typ is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return "" if value is None else str(value)
    return value


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {prefix + close[0]!r}? " if close else ""
            raise ConfigError(f"unknown config key {full!r}; {hint}allowed under {prefix.rstrip('.') or 'top level'}: "
                              f"{', '.join(names)}")
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            kwargs[key] = _build(typ, value, f"{full}.")
        else:
            kwargs[key] = _coerce(value, typ, full)
    return cls(**kwargs)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings onto a nested dict (values parsed as YAML scalars)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        dotted, raw = item.split("=", 1)
        parts = dotted.strip().split(".")
        if len(parts) < 2 or not all(parts):  # section.sub.key reaches a sub-section (train.lora.rank)
            raise ConfigError(f"override {item!r}: expected section.key=value, e.g. dora.max_staleness=3")
        node = data
        for depth, name in enumerate(parts[:-1]):
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[:depth + 1])!r} is not a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return data


def config_from_dict(data: dict[str, Any]) -> Config:
    return _build(Config, data or {}, "").validate()


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
    return config_from_dict(apply_overrides(data, list(overrides or [])))
