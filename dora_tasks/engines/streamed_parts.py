"""A streamed update on the torch and DeepSpeed trainers (`dora.stream_updates`): the batch arrives in parts.

A batch's loss is normalised by the whole batch (`LossNorm`), which is known only once its last part (the stragglers)
arrived. Each part's loss is therefore taken with `UNIT_NORM` and its gradient accumulated; before the optimizer step
the summed gradient is divided by the whole batch's `LossNorm.divisor`. Aggregation is linear in the normaliser, so
this is the gradient of one `train_step` over the union of the parts, clipped and stepped the same way.
"""
from __future__ import annotations

from typing import Callable

import torch

from dora_tasks.algorithms.losses import LossNorm
from dora_tasks.algorithms.objective import batch_tensors, merge_metrics
from dora_tasks.core.records import TrainBatch
from dora_tasks.engines.hf_io import Stopwatch, batch_summary, empty_update_metrics

PartBackward = Callable[[dict[str, torch.Tensor]], dict[str, float]]  # tensors -> the objective's metrics


class StreamedParts:
    """The parts of one update computed so far: their groups, response lengths, summed loss and metrics."""

    def __init__(self, first: TrainBatch) -> None:
        self.update, self.max_staleness = first.update, first.max_staleness
        self.groups: list = []
        self.lengths: list[float] = []
        self.unit_loss = 0.0
        self.collected: list[tuple[float, dict[str, float]]] = []
        self.seconds = 0.0

    def add(self, batch: TrainBatch, advantage: str, backward: PartBackward) -> None:
        """One part: its tensors, then `backward(tensors)` (the objective with `UNIT_NORM`, gradients accumulated)
        when it has response tokens."""
        if batch.update != self.update:
            raise ValueError(f"a part of update {batch.update} joined the parts of update {self.update}")
        clock = Stopwatch()
        self.groups += [g for g in batch.groups if not g.filtered]
        tensors = batch_tensors(batch, advantage=advantage)
        mask = tensors["response_mask"]
        self.lengths += mask.sum(-1).tolist()
        if float(mask.sum()) > 0:
            metrics = backward(tensors)
            self.unit_loss += metrics.pop("loss")
            self.collected.append((float(mask.sum()), metrics))
        self.seconds += clock.seconds()

    @property
    def has_tokens(self) -> bool:
        return bool(self.collected)

    def divisor(self, cfg) -> float:
        """The whole batch's normaliser of `cfg.loss_agg`: what the summed gradient is divided by."""
        return LossNorm.of_lengths(self.lengths, cfg).divisor(cfg.loss_agg)

    def metrics(self, cfg) -> dict[str, float]:
        """The update's metrics, as `train_step` reports them for the union of the parts (`grad_norm` is the
        trainer's to add)."""
        summary = batch_summary(TrainBatch(self.update, self.groups, self.max_staleness))
        merged = merge_metrics(self.collected)
        loss = self.unit_loss / self.divisor(cfg) if self.has_tokens else 0.0
        return {**summary, **empty_update_metrics(), **merged, "loss": loss, "seconds": self.seconds}


class StreamsUpdates:
    """`TrainEngine.accumulate` / `finish_update` of the torch and DeepSpeed engines, which supply `start_parts`
    (before an update's first part), `part_backward` (a part's objective with `UNIT_NORM`, gradients accumulated)
    and `divided_step` (the step after dividing the gradient; returns its norm)."""

    streamed: StreamedParts | None = None  # the parts of the update so far

    def accumulate(self, batch: TrainBatch, stragglers: bool) -> None:
        if not batch.groups:
            return
        if self.streamed is None:
            self.start_parts()
            self.streamed = StreamedParts(batch)
        self.streamed.add(batch, self.cfg.advantage, self.part_backward)

    def finish_update(self) -> dict[str, float]:
        parts, self.streamed = self.streamed, None
        if parts is None:
            raise RuntimeError(f"update {self.version}: finish_update without a part to step on")
        metrics = parts.metrics(self.cfg)
        if parts.has_tokens:
            metrics["grad_norm"] = self.divided_step(parts.divisor(self.cfg))
        self.version += 1
        return metrics
