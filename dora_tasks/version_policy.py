"""Which version a rollout server's chunk runs on, and which waiting requests may join it.

The rollout server (`dora_tasks.rollout_server`) asks its `VersionPolicy` two things and nothing else about versions:

* `joiners(waiting, version)`: of the waiting requests, those that join a batch serving `version`, and those that stay;
* `weights_for(requests, loaded)`: the version (and its weights path) to load before the next chunk of `requests`,
  with `loaded` the version the engine holds now.

Three policies:

* `DispatchVersion` (DORA, the default): a batch runs on its requests' own dispatch version and only requests of that
  version join, so every token of a group comes from the version it was dispatched with (C1).
* `ConcurrentVersions(M)` (``rollout.versions_per_instance`` = M > 1, LoRA adapters): a batch holds requests of up
  to M dispatch versions and every row decodes under its own request's version from its first token to its last (C1
  per request); a request of a further version waits until a version of the batch has no request left. The server
  asks it `admit(waiting, versions)` and keeps each version resident on the engine (`weights_for` is not used).
* `PartialRollout` (the ``rollout.partial_rollout`` baseline, comparison only): every waiting request joins and each
  chunk runs on the newest published version, as AReaL/slime-style partial rollout does. A response continues across
  a weight update, so its per-token versions record the mix (C1 broken on purpose: the audit reports it and the gate,
  with ``allow_mixed_versions``, lets the run finish). The orchestrator, capacity rule and gate still count a group
  under its dispatch version.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar


class VersionedRequest(Protocol):
    version: int  # the version the orchestrator dispatched the group on
    weights_path: str  # where that version's weights are


R = TypeVar("R", bound=VersionedRequest)


class VersionPolicy(ABC):
    max_versions = 1  # dispatch versions one batch may hold at once

    @abstractmethod
    def joiners(self, waiting: Sequence[R], version: int) -> tuple[list[R], list[R]]:
        """(join, stay): the waiting requests that join a batch serving `version`, and the others, in order."""

    @abstractmethod
    def weights_for(self, requests: Sequence[VersionedRequest], loaded: int) -> tuple[int, str]:
        """(version, weights path) to hold for the next chunk of `requests` (non-empty); `loaded` is the version the
        engine holds (-1: none). A path may be "" when the version is `loaded` (nothing to load)."""


    def admit(self, waiting: Sequence[R], versions: Sequence[int]) -> tuple[list[R], list[R]]:
        """(join, stay) for a batch that holds requests of `versions` (non-empty); one version per batch here."""
        return self.joiners(waiting, versions[0])


class DispatchVersion(VersionPolicy):
    """DORA: a batch serves one dispatch version, which it keeps until its last response ends."""

    def joiners(self, waiting, version):
        return [r for r in waiting if r.version == version], [r for r in waiting if r.version != version]

    def weights_for(self, requests, loaded):
        return requests[0].version, requests[0].weights_path  # the server batches one version (`joiners`)


class ConcurrentVersions(VersionPolicy):
    """Up to `max_versions` dispatch versions in one batch, each request decoded under its own version (C1)."""

    def __init__(self, max_versions: int):
        if max_versions < 1:
            raise ValueError(f"rollout.versions_per_instance must be >= 1, got {max_versions}")
        self.max_versions = max_versions

    def admit(self, waiting, versions):
        """Requests of the batch's versions join; so do those of further versions, oldest waiting first, while the
        batch holds fewer than `max_versions`; the others stay, in order."""
        held, join, stay = list(versions), [], []
        for r in waiting:
            if r.version not in held and len(held) < self.max_versions:
                held.append(r.version)
            (join if r.version in held else stay).append(r)
        return join, stay

    def joiners(self, waiting, version):
        return self.admit(waiting, [version])

    def weights_for(self, requests, loaded):
        return requests[0].version, requests[0].weights_path  # unused: the server holds every version of the batch


class PartialRollout(VersionPolicy):
    """The partial-rollout baseline: every chunk on the newest published version, every waiting request joins.

    `newest()` lists the weight store: (newest published version or None, its weights path). The server never goes
    back to an older version than it holds, and loads a request's dispatch version if that is newer than the listing.
    A version retained away between the listing and the load fails to load; the server then asks again and gets the
    newer version that replaced it (retention never deletes the newest)."""

    def __init__(self, newest: Callable[[], tuple[int | None, str]]):
        self._newest = newest

    def joiners(self, waiting, version):
        return list(waiting), []  # the instance serves the newest version, whatever a request's dispatch version

    def weights_for(self, requests, loaded):
        version, path = self._newest()
        if version is None or version < loaded:
            version, path = loaded, ""
        newest_request = max(requests, key=lambda r: r.version)
        if newest_request.version > version:
            version, path = newest_request.version, newest_request.weights_path
        return version, path
