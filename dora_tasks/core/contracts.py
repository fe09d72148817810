"""Engine contracts: the only things the pipeline knows about rollout and training backends.

Implementations (`dora_tasks.engines.*`) import these; these never import implementations.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Hashable, Mapping, Protocol, Sequence

from dora_tasks.core.handover import Continuation, MigrationCost, RowState
from dora_tasks.core.records import Generation, TrainBatch


class DecodeSession(Protocol):
    """Rows decoded together chunk by chunk on one loaded version, each keeping its state between chunks."""

    version: int

    def add(self, key: Hashable, token_ids: Sequence[int], stream: int | bytes | None = None) -> None:
        """Start a row from its prompt (plus the tokens it already has); `stream`: its own random stream (a seed or a
        saved state), where the session samples per row; None: it draws from each `decode` call's stream."""

    def decode(self, steps: Mapping[Hashable, int], seed: int) -> dict[Hashable, Generation]:
        """Up to `steps[key]` more tokens of each row (fewer when it ends with eos)."""

    def drop(self, keys: Sequence[Hashable]) -> None:
        """Forget rows that ended."""

    def sampler_state(self, key: Hashable) -> bytes | None:
        """The saved state of the row's own random stream (None: it has none)."""

    def export(self, key: Hashable) -> RowState:
        """Take a row out with what another session of this version needs to continue it (its cache, if kept)."""

    def adopt(self, key: Hashable, continuation: Continuation) -> MigrationCost:
        """Take in a row handed over by a session of this version (raises `VersionMismatch` otherwise); returns
        what it cost (tokens re-encoded, seconds)."""


class RolloutEngine(ABC):
    """Serves one policy version at a time (DORA's rollout instance)."""

    version: int = -1

    def open_session(self) -> DecodeSession | None:
        """A session that keeps each row's KV cache between chunks, or None when the engine keeps none (its rows are
        then re-encoded at every chunk through `generate`)."""
        return None

    @abstractmethod
    def load_version(self, version: int, weights_path: str) -> None:
        """Load the weights of `version` from the weight store in place; afterwards `self.version == version`."""

    @property
    @abstractmethod
    def max_new_tokens(self) -> int:
        """The response budget of one generation (`rollout.max_new_tokens`)."""

    @abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], n: int, seed: int, *,
                 max_new_tokens: int | None = None) -> list[list[Generation]]:
        """Sample `n` responses per prompt with the current version; one list of `n` generations per prompt.
        `max_new_tokens` caps this call (a chunk of a longer response); default: the engine's budget."""


class TrainEngine(ABC):
    """Holds the trainable policy and its optimizer on the trainer worker."""

    version: int = 0

    def skip_step(self) -> None:
        """An update whose every group was filtered out: the version advances, the weights stay as they are."""
        self.version += 1

    @abstractmethod
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One policy update on `batch` (advantages already set); returns scalar metrics. Advances `version` by one."""

    def accumulate(self, batch: TrainBatch, stragglers: bool) -> None:
        """A streamed update (`dora.stream_updates`): compute one part of the update's batch, the optimizer step
        waiting for `finish_update`; `stragglers`: a part that completed after the rest."""
        raise NotImplementedError(f"{type(self).__name__} does not stream updates (dora.stream_updates)")

    def finish_update(self) -> dict[str, float]:
        """The optimizer step over every part `accumulate` computed since the last update; advances `version`."""
        raise NotImplementedError(f"{type(self).__name__} does not stream updates (dora.stream_updates)")

    @abstractmethod
    def save_weights(self, path: str) -> None:
        """Write the current policy weights as a Hugging Face model folder (config.json + model.safetensors)."""

    @abstractmethod
    def save_checkpoint(self, directory: str) -> None:
        """Write the whole trainer state (weights, optimizer, version) into `directory`."""

    @abstractmethod
    def load_checkpoint(self, directory: str) -> None:
        """Restore what `save_checkpoint` wrote, version included."""

    @abstractmethod
    def load_optimizer_state(self, directory: str) -> bool:
        """Take only the optimizer state of a checkpoint, keeping this engine's weights and version (a trainer that
        restarts from a version published after the checkpoint). False when the backend cannot split them."""
