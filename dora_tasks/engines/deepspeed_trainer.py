"""DeepSpeed training backend: ZeRO stage 0-3, same interface and same objective as `torch_trainer`.

Simplifications, and why:
- One data-parallel rank (world size 1: the design has one trainer worker). The trainer still goes through
  `deepspeed.init_distributed` (gloo on CPU, NCCL with CUDA), with MASTER_ADDR/MASTER_PORT (a free port)/RANK/
  WORLD_SIZE/LOCAL_RANK set when absent, so the ZeRO code paths are the real ones. Splitting a TrainBatch across
  ranks is not implemented: WORLD_SIZE > 1 is refused with a clear error, unless `replicated_batch=True` says that
  every rank is handed the same whole batch (ZeRO then shards gradients, optimizer state and, at stage 3, weights
  across the ranks; the tests use it to check the sharded paths against the torch engine).
- A torch AdamW is passed in (`zero_allow_untested_optimizer`): DeepSpeed's CPU Adam takes ~85 s to compile.
- Gradient accumulation is manual because a TrainBatch has a varying number of micro-batches: the accumulation
  boundary is set off before the first micro-batch and on for the last backward, then `engine.step()` runs once.
  DeepSpeed's config therefore says gradient_accumulation_steps=1; the objective normalises each micro-batch by the
  whole batch, so no DeepSpeed loss scaling is involved (fp32, no fp16 loss scaler).
- A streamed update (`accumulate` / `finish_update`, see `streamed_parts`) keeps the boundary off through every
  part; `finish_update` crosses it with a zero loss on one token (no part knows it is the last), then divides the
  gradient by the whole batch's normaliser with `deepspeed.utils.safe_update_full_grad_vectorized` (DeepSpeed's API
  for partitioned gradients between backward and step).
- The model is loaded whole and partitioned by `deepspeed.initialize` (no `zero.Init` at load): fine for the models
  that fit one host, which is what this project trains. The reference model (kl_coef > 0) is a plain frozen copy.
- ZeRO-3 weights are gathered with `deepspeed.zero.GatheredParameters` to write the Hugging Face folder.
- With `train.lora` the module is the base with a `peft` adapter, as in `torch_trainer`: the optimizer holds the
  adapter's parameters, checkpoints leave the frozen base out, the published folder is the adapter alone.
- DeepSpeed's CPU shared-memory all-reduce op is not built: with one rank there is nothing to all-reduce across
  processes, and building it compiles C++ with g++ the first time on a machine (measured 259 s on a busy 2-core
  machine, 0.25 s once cached in ~/.cache/torch_extensions). `single_rank_comm()` makes DeepSpeed's backend skip it
  (gloo does the, trivial, collectives); init_distributed then takes ~0.01 s on a fresh machine.
- That op creates /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank> only when LOCAL_SIZE is set (the
  DeepSpeed launcher sets it; we do not); `shm_buffer_paths()` lists this process's, for clean-up by whoever owns
  the process (a process group made outside this module may have built the op).
"""
from __future__ import annotations

import contextlib
import glob
import importlib
import os
import socket

import torch

from dora_tasks.algorithms.losses import UNIT_NORM, LossNorm
from dora_tasks.algorithms.objective import policy_objective
from dora_tasks.core.contracts import TrainEngine
from dora_tasks.core.records import TrainBatch
from dora_tasks.engines.hf_io import (
    check_train_config,
    default_device,
    read_tokenizer_files,
    timed_train_step,
    write_hf_folder,
)
from dora_tasks.engines.lora import adapter_dropout, load_trainable_policy, reference_policy, write_adapter_folder
from dora_tasks.engines.streamed_parts import StreamsUpdates

CHECKPOINT_TAG_PREFIX = "version_"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_distributed_env(replicated_batch: bool = False) -> None:
    """Single-process defaults for torch.distributed's env:// rendezvous, leaving any value already set alone.
    WORLD_SIZE > 1 only with `replicated_batch` (every rank trains on the same whole batch)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    if os.environ["WORLD_SIZE"] != "1" and not replicated_batch:
        raise NotImplementedError(f"DeepSpeedTrainEngine trains on one rank; WORLD_SIZE={os.environ['WORLD_SIZE']} "
                                  "(splitting a TrainBatch across data-parallel ranks is not implemented)")


@contextlib.contextmanager
def single_rank_comm():
    """While DeepSpeed sets up its comm backend, skip building its shared-memory all-reduce op (world size 1 never
    uses it; building it compiles C++ for minutes the first time). Does nothing if DeepSpeed's internals moved."""
    try:
        ds_comm = importlib.import_module("deepspeed.comm.torch")  # `from deepspeed.comm import torch` is torch itself
    except ImportError:
        ds_comm = None
    original = getattr(ds_comm, "build_shm_op", None)
    if original is None:
        yield
        return
    ds_comm.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_comm.build_shm_op = original


def shm_buffer_paths() -> list[str]:
    """DeepSpeed's shared-memory all-reduce files of this process's rendezvous (MASTER_ADDR/MASTER_PORT)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return []
    return glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_*")


def deepspeed_config(train_cfg) -> dict:
    return {
        "train_micro_batch_size_per_gpu": train_cfg.micro_batch,
        "gradient_accumulation_steps": 1,  # accumulation is driven by set_gradient_accumulation_boundary
        "gradient_clipping": float(train_cfg.max_grad_norm),
        "zero_optimization": {"stage": train_cfg.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class DeepSpeedTrainEngine(StreamsUpdates, TrainEngine):
    def __init__(self, model_path: str, train_cfg, version: int = 0, temperature: float = 1.0, *,
                 replicated_batch: bool = False, base_path: str = ""):
        """`replicated_batch`: allow WORLD_SIZE > 1, each rank being handed the same whole TrainBatch; `base_path`:
        where workers read the base model (train.lora: recorded with each adapter)."""
        check_train_config(train_cfg)  # a ZeRO stage out of range fails here, before DeepSpeed is touched
        import deepspeed

        self._deepspeed = deepspeed
        self.cfg = train_cfg
        self.tokenizer_files = read_tokenizer_files(model_path)
        self.version = version
        self.temperature = temperature  # the rollout's sampling temperature (see objective.py)
        ensure_distributed_env(replicated_batch)
        device = default_device()
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        model, self.base = load_trainable_policy(model_path, train_cfg.lora, device, base_path)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=train_cfg.lr, weight_decay=0.0)
        with single_rank_comm():  # deepspeed.initialize sets the backend up too when the process group exists
            if not torch.distributed.is_initialized():
                deepspeed.utils.groups._WORLD_GROUP = None  # its clone of a destroyed process group is stale
                deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
            self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                        config=deepspeed_config(train_cfg))
        self.ref_model = reference_policy(self.engine.module, model_path, self.engine.device, train_cfg, self.base)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step over the whole batch (micro-batches accumulate gradients); advances `version`."""
        metrics = timed_train_step(batch, self.cfg.advantage, self._update)
        self.version += 1
        return metrics

    def start_parts(self) -> None:
        pass  # DeepSpeed zeroes the gradient after each step

    def part_backward(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        return self._backward(tensors, boundary_at_end=False, norm=UNIT_NORM)

    def divided_step(self, divisor: float) -> float:
        """A zero loss at the accumulation boundary (ZeRO reduces and partitions the gradient there), the gradient
        divided with DeepSpeed's partitioned-gradient API, then `engine.step()`."""
        self._boundary_backward()
        trainable = [p for p in self.engine.module.parameters() if p.requires_grad]
        self._deepspeed.utils.safe_update_full_grad_vectorized(trainable, lambda grad, _: grad / divisor)
        return self._step()

    def _update(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        metrics = self._backward(tensors, boundary_at_end=True)
        metrics["grad_norm"] = self._step()
        return metrics

    def _backward(self, tensors: dict[str, torch.Tensor], boundary_at_end: bool,
                  norm: LossNorm | None = None) -> dict[str, float]:
        engine = self.engine
        engine.set_gradient_accumulation_boundary(False)

        def backward(loss: torch.Tensor, last: bool) -> None:
            if last and boundary_at_end:
                engine.set_gradient_accumulation_boundary(True)
            engine.backward(loss)

        with adapter_dropout(engine.module, self.cfg.lora.dropout > 0):
            _, metrics = policy_objective(engine, tensors, self.cfg, self.ref_model, backward=backward,
                                          device=engine.device, temperature=self.temperature, norm=norm)
        return metrics

    def _boundary_backward(self) -> None:
        """A one-token forward whose loss is zero, backward with the boundary on: the accumulated gradient stays as
        it is and goes through DeepSpeed's boundary (which a part cannot know it is the last to reach)."""
        engine = self.engine
        engine.set_gradient_accumulation_boundary(True)
        token = torch.zeros((1, 1), dtype=torch.long, device=engine.device)
        engine.backward(engine(input_ids=token).logits.sum() * 0.0)

    def _step(self) -> float:
        """`engine.step()`; returns the gradient norm (DeepSpeed's, or computed before the step at stage 0)."""
        pre_step_norm = self._unreduced_grad_norm() if self.cfg.zero_stage == 0 else 0.0
        self.engine.step()
        reported = self.engine.get_global_grad_norm()  # None at stage 0
        return float(reported) if reported is not None else pre_step_norm

    def _unreduced_grad_norm(self) -> float:
        """Stage 0 keeps plain .grad tensors and DeepSpeed does not record their norm: compute it before the step."""
        grads = [p.grad.detach().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0

    def save_weights(self, path: str) -> None:
        state = self._gathered_state_dict() if self.cfg.zero_stage == 3 else None  # every rank must gather
        if self.engine.global_rank != 0:
            return
        if self.base is not None:
            write_adapter_folder(self.engine.module, path, self.base, state_dict=state)
        else:
            write_hf_folder(self.engine.module, path, self.tokenizer_files, state_dict=state)

    def _gathered_state_dict(self) -> dict[str, torch.Tensor]:
        """Full copies of the weights (ZeRO-3 keeps only a shard of each parameter on a rank: gather them)."""
        module = self.engine.module
        with self._deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}

    def save_checkpoint(self, directory: str) -> None:
        """DeepSpeed checkpoint (model, optimizer, ZeRO partitions) plus the policy version."""
        self.engine.save_checkpoint(directory, tag=f"{CHECKPOINT_TAG_PREFIX}{self.version}",
                                    client_state={"version": self.version},
                                    exclude_frozen_parameters=self.base is not None)  # LoRA: the base is published

    def load_checkpoint(self, directory: str) -> None:
        """Load the latest checkpoint of `directory` (DeepSpeed's `latest` file names it)."""
        path, client_state = self.engine.load_checkpoint(directory, load_module_strict=self.base is None)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {directory!r}")
        self.version = int(client_state["version"])

    def load_optimizer_state(self, directory: str) -> bool:
        """The checkpoint's optimizer state (and ZeRO partitions) under this engine's current weights and version."""
        weights, version = self._gathered_state_dict(), self.version
        self.load_checkpoint(directory)  # loads the checkpoint's weights too: put ours back
        module = self.engine.module
        with self._deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):  # no-op below ZeRO-3
            module.load_state_dict(weights)
        if self.cfg.zero_stage > 0:  # the optimizer steps ZeRO's fp32 partitions (master weights): refill them
            self.engine.optimizer._restore_from_bit16_weights()
        self.version = version
        return True

    def close(self) -> None:
        """Release the engine's hooks and buffers; the process group stays up for the next engine."""
        self.engine.destroy()
