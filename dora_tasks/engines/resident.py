"""The versions a rollout engine holds at once (``rollout.versions_per_instance`` = M), least recently used first out.

An engine serving several policy versions keeps up to M of them resident (the transformers engine: one merged model
per version; vLLM: one `LoRARequest` per version). Asking for a resident version costs nothing and makes it the most
recently used; a new version takes a free place or the least recently used version's, never that of a version whose
rows are still running (`running`: the rollout server sets it before asking the engine to load a version).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

T = TypeVar("T")


class AllVersionsRunning(RuntimeError):
    """Every resident version has running rows: a further version has no place (the server admits at most M)."""


class ResidentVersions(Generic[T]):
    """version -> what the engine holds for it (a model, an adapter request), in least recently used order."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"an engine holds at least one version, got capacity {capacity}")
        self.capacity = capacity
        self._held: OrderedDict[int, T] = OrderedDict()
        self.running: frozenset[int] = frozenset()  # versions with rows in the server's batch: never evicted

    def __contains__(self, version: int) -> bool:
        return version in self._held

    def __len__(self) -> int:
        return len(self._held)

    def values(self) -> list[T]:
        return list(self._held.values())

    @property
    def versions(self) -> tuple[int, ...]:
        """Resident versions, least recently used first."""
        return tuple(self._held)

    def get(self, version: int) -> T:
        """What is held for a resident version (KeyError naming it otherwise); marks it most recently used."""
        if version not in self._held:
            raise KeyError(f"version {version} is not resident on this engine (resident: {list(self._held)})")
        self._held.move_to_end(version)
        return self._held[version]

    def victim(self) -> int | None:
        """The version to evict before a new one is added: None while there is a free place, else the least recently
        used version not `running` (`AllVersionsRunning` when every one is)."""
        if len(self._held) < self.capacity:
            return None
        for version in self._held:
            if version not in self.running:
                return version
        raise AllVersionsRunning(f"all {self.capacity} resident versions {list(self._held)} have running rows; "
                                 "a rollout server admits at most rollout.versions_per_instance versions at once")

    def pop(self, version: int) -> T:
        return self._held.pop(version)

    def put(self, version: int, held: T) -> None:
        """Add (or replace) a version as the most recently used; the caller made room (`victim`)."""
        self._held[version] = held
        self._held.move_to_end(version)
        if len(self._held) > self.capacity:
            raise RuntimeError(f"{len(self._held)} versions resident, capacity {self.capacity}: evict first")
