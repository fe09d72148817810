"""WeightStore: one folder per published policy version, `<root>/v000012`, written atomically.

`publish(version, write_fn)` lets the trainer write a Hugging Face model folder (`TrainEngine.save_weights`) into a
temp folder, then renames it into place, so a rollout instance told to load `path_for(v)` never sees half a model.
`retain(keep)` deletes every other version: the driver passes the versions unconsumed groups still need, the newest
and the version of the latest checkpoint (resume restarts from it), and never deletes a version newer than the newest
it has seen (`newer_than`: the trainer may already have published it).

Simplified, and why
- Local folders (or file:// URLs) are the main path: a shared filesystem is what the rollout engines load from.
- Other fsspec URLs (s3://, memory://, ...) have no atomic folder rename: the folder is written locally, uploaded into
  place file by file, and a `_PUBLISHED` marker is written last; `versions()` lists only folders with the marker.
- A version that already exists is refused unless `overwrite=True` (a resumed run re-publishing versions newer than
  its checkpoint should `retain` them away first, or overwrite).
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from typing import Callable

from dora_tasks.core.records import PublishedWeights
from storage import _fsutil
from storage._zarr_io import local_path

MARKER = "_PUBLISHED"
_VERSION_DIR = re.compile(r"^v(\d{6,})$")


class WeightStoreError(Exception):
    """A publish or listing failed (version exists, bad version number, unreadable root)."""


class WeightStore:
    def __init__(self, root: str, storage_options: dict | None = None):
        self.root = str(root)
        self._local = local_path(self.root)
        self._storage_options = storage_options or {}
        self._fs = None

    def path_for(self, version: int) -> str:
        """Folder of `version` (it exists only once published)."""
        if version < 0:
            raise WeightStoreError(f"versions are >= 0, got {version}")
        return f"{self.root.rstrip('/')}/v{version:06d}"

    def publish(self, version: int, write_fn: Callable[[str], None], *, overwrite: bool = False) -> PublishedWeights:
        """Run `write_fn(folder)` on a temp folder and publish it as `version`; returns path and seconds taken."""
        started = time.perf_counter()
        final = self.path_for(version)
        if version in self.versions() and not overwrite:
            raise WeightStoreError(f"version {version} is already published at {final}; pass overwrite=True "
                                   "or retain() it away first")
        if self._local is not None:
            _fsutil.publish_dir(local_path(final), write_fn, overwrite=overwrite)
        else:
            self._publish_remote(final, write_fn)
        return PublishedWeights(version=version, path=final, seconds=time.perf_counter() - started)

    def versions(self) -> list[int]:
        """Published versions, ascending."""
        if self._local is not None:
            if not os.path.isdir(self._local):
                return []
            return sorted(int(m.group(1)) for m in map(_VERSION_DIR.match, os.listdir(self._local)) if m)
        fs = self._filesystem()
        if not fs.exists(self.root):
            return []
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(self.root, detail=False)]
        return sorted(int(m.group(1)) for m in map(_VERSION_DIR.match, names)
                      if m and fs.exists(f"{self.path_for(int(m.group(1)))}/{MARKER}"))

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
                fs = self._filesystem()
                fs.rm(f"{path}/{MARKER}")  # unpublish first, then remove the files
                fs.rm(path, recursive=True)
        return deleted

    def _filesystem(self):
        if self._fs is None:
            import fsspec

            self._fs, _ = fsspec.core.url_to_fs(self.root, **self._storage_options)
        return self._fs

    def _publish_remote(self, final: str, write_fn: Callable[[str], None]) -> None:
        fs = self._filesystem()
        with tempfile.TemporaryDirectory(prefix="dora-weights-") as temp:
            write_fn(temp)
            if fs.exists(final):
                fs.rm(final, recursive=True)
            for dirpath, _, filenames in os.walk(temp):
                for filename in filenames:
                    rel = os.path.relpath(os.path.join(dirpath, filename), temp).replace(os.sep, "/")
                    fs.put_file(os.path.join(dirpath, filename), f"{final}/{rel}")
        fs.pipe_file(f"{final}/{MARKER}", b"")
