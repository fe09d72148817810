"""Which version a rollout server's chunk runs on, and which waiting requests may join it.

The rollout server (`dora_tasks.rollout_server`) asks its `VersionPolicy` two things and nothing else about versions:

* `joiners(waiting, version)`: of the waiting requests, those that join a batch serving `version`, and those that stay;
* `weights_for(requests, loaded)`: the version (and its weights path) to load before the next chunk of `requests`,
  with `loaded` the version the engine holds now.

Two policies:

* `DispatchVersion` (DORA, the default): a batch runs on its requests' own dispatch version and only requests of that
  version join, so every token of a group comes from the version it was dispatched with (C1).
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
    @abstractmethod
    def joiners(self, waiting: Sequence[R], version: int) -> tuple[list[R], list[R]]:
        """(join, stay): the waiting requests that join a batch serving `version`, and the others, in order."""

    @abstractmethod
    def weights_for(self, requests: Sequence[VersionedRequest], loaded: int) -> tuple[int, str]:
        """(version, weights path) to hold for the next chunk of `requests` (non-empty); `loaded` is the version the
        engine holds (-1: none). A path may be "" when the version is `loaded` (nothing to load)."""


class DispatchVersion(VersionPolicy):
    """DORA: a batch serves one dispatch version, which it keeps until its last response ends."""

    def joiners(self, waiting, version):
        return [r for r in waiting if r.version == version], [r for r in waiting if r.version != version]

    def weights_for(self, requests, loaded):
        return requests[0].version, requests[0].weights_path  # the server batches one version (`joiners`)


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
