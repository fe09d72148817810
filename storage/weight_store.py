"""WeightStore: one folder per published policy version, `<root>/v000012`, written atomically.

`publish(version, write_fn)` lets the trainer write a Hugging Face model folder (`TrainEngine.save_weights`) into a
temp folder, then renames it into place, so a rollout instance told to load `path_for(v)` never sees half a model.
`retain(keep)` deletes every other version: the driver passes the versions unconsumed groups still need, the newest
and the version of the latest checkpoint (resume restarts from it), and never deletes a version newer than the newest
it has seen (`newer_than`: the trainer may already have published it).

Simplified, and why
- Local folders (or file:// URLs): a filesystem every worker can read; publish is an atomic rename.
- Other fsspec URLs (s3://, gs://, memory:// in tests) have no atomic folder rename: the folder is written locally,
  uploaded, and a `_PUBLISHED` marker is written last (`storage.objectstore.publish_folder`); `versions()` lists only
  folders with the marker. Readers get a local copy from `storage.objectstore.local_folder` (engines, evaluation).
  The initial model goes to `<root>/initial` (`share_initial`), so that workers need no folder of the driver's.
- A version that already exists is refused unless `overwrite=True` (a resumed run re-publishing versions newer than
  its checkpoint should `retain` them away first, or overwrite).
- The store does not look inside a version's folder: under `train.lora` it holds an adapter folder (adapter and the
  base's identity, `dora_tasks/engines/lora.py`), and `WeightFiles` then moves the adapter's bytes only.
"""
from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from dora_tasks.core.records import PublishedWeights
from storage import _fsutil, objectstore
from storage._zarr_io import local_path

MARKER = "_PUBLISHED"
INITIAL = "initial"  # the initial model folder on an object store (`share_initial`); not a version, never retained
_VERSION_DIR = re.compile(r"^v(\d{6,})$")


class WeightStoreError(Exception):
    """A publish or listing failed (version exists, bad version number, unreadable root)."""


class WeightStore:
    def __init__(self, root: str):
        self.root = str(root)
        self._local = local_path(self.root)

    def path_for(self, version: int) -> str:
        """Folder of `version` (it exists only once published)."""
        if version < 0:
            raise WeightStoreError(f"versions are >= 0, got {version}")
        return f"{self.root.rstrip('/')}/v{version:06d}"

    def publish(self, version: int, write_fn: Callable[[str], None], *, overwrite: bool = False) -> PublishedWeights:
        """Run `write_fn(folder)` on a temp folder and publish it as `version`; returns path and seconds taken."""
        started = time.perf_counter()
        final = self.path_for(version)
        if not overwrite and version in self.versions():  # the trainer overwrites: no listing per publish
            raise WeightStoreError(f"version {version} is already published at {final}; pass overwrite=True "
                                   "or retain() it away first")
        if self._local is not None:
            _fsutil.publish_dir(local_path(final), write_fn, overwrite=overwrite)
        else:
            objectstore.publish_folder(final, write_fn, MARKER)
        return PublishedWeights(version=version, path=final, seconds=time.perf_counter() - started)

    def versions(self) -> list[int]:
        """Published versions, ascending."""
        if self._local is not None:
            if not os.path.isdir(self._local):
                return []
            return sorted(int(m.group(1)) for m in map(_VERSION_DIR.match, os.listdir(self._local)) if m)
        fs = objectstore.filesystem(self.root)
        if not fs.exists(self.root):
            return []
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(self.root, detail=False)]
        return sorted(int(m.group(1)) for m in map(_VERSION_DIR.match, names)
                      if m and objectstore.is_published(self.path_for(int(m.group(1))), MARKER))

    def latest(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def retain(self, keep: set[int], *, newer_than: int | None = None) -> list[int]:
        """Delete every published version not in `keep`; returns the deleted versions. With `newer_than`, versions
        above it are kept too: a trainer running ahead (update lookahead) may publish a version before the caller
        has seen it, and a rollout of that version can already be on its way."""
        deleted = [v for v in self.versions() if v not in keep and (newer_than is None or v <= newer_than)]
        for version in deleted:
            path = self.path_for(version)
            if self._local is not None:
                shutil.rmtree(local_path(path))
            else:
                objectstore.unpublish_folder(path, MARKER)
        return deleted

    def share_initial(self, model_path: str, *, overwrite: bool = True) -> str:
        """Where workers read the initial model (`model_path`, a folder of the driver's) from: `model_path` itself
        beside a local store (the workers share its filesystem), else a copy uploaded to `<root>/initial` (kept when
        already there and not `overwrite`: a resumed run)."""
        if self._local is not None:
            return model_path
        url = objectstore.join(self.root, INITIAL)
        if overwrite or not objectstore.is_published(url, MARKER):
            objectstore.publish_folder(url, lambda folder: shutil.copytree(model_path, folder, dirs_exist_ok=True),
                                       MARKER)
        return url


@dataclass
class WeightFiles:
    """A published version's folder as bytes, to move between workers as Dask data (peer-to-peer weight transfer):
    read once from the store, then copied by Dask from whichever worker holds it to the instances that need it."""

    version: int
    files: dict[str, bytes]  # relative path -> content
    token: str  # unique to this read: a worker's cached copy is never confused with another publication's

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.files.values())

    @classmethod
    def read(cls, version: int, path: str) -> "WeightFiles":
        folder = objectstore.local_folder(path, MARKER)
        if not os.path.isdir(folder):  # os.walk would read nothing and say nothing
            raise WeightStoreError(f"version {version} is not in the weight store at {path}: never published, "
                                   "or deleted by retention")
        files = {}
        for name in objectstore.files_under(folder):
            with open(os.path.join(folder, name), "rb") as f:
                files[name] = f.read()
        return cls(version, files, uuid.uuid4().hex[:12])

    def local_folder(self) -> str:
        """These files as a folder of this worker's cache (written once per worker), for the engines to load."""
        return objectstore.cached_folder(f"v{self.version:06d}-{self.token}", self._write)

    def _write(self, folder: str) -> None:
        for name, content in self.files.items():
            target = os.path.join(folder, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                f.write(content)
