"""CheckpointStore: atomic, self-describing checkpoints of a run, `<root>/ckpt-000010/`.

A checkpoint folder holds `state.json` (everything JSON-able the driver needs to resume: gate and orchestrator state,
the unconsumed groups' ids/prompts/versions, RNG state, the trajectory store's row counts for `truncate_to`), one
sub-folder per entry of `files` (trainer weights, optimizer state: each callable writes its own folder) and a
`COMPLETE` marker written last. The whole folder is built under a temp name and renamed into place, with fsync, so a
killed run leaves either a whole checkpoint or none; a folder without `COMPLETE` (damaged, copied half-way) is skipped.

On an object store (an fsspec URL such as s3://bucket/run/checkpoints) there is no atomic rename: a save first
deletes the `COMPLETE` marker of a checkpoint of the same update, then the folder, writes the sub-folders and
`state.json`, and the marker last. Each `files[name]` is then given the URL of its folder and writes there itself
(the trainer stages locally and uploads: `storage.objectstore.staged`), since the trainer is another machine.

Simplified, and why: numpy scalars and arrays in `state` are converted to JSON numbers and lists.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from storage import _fsutil, objectstore

MARKER = "COMPLETE"
STATE_FILE = "state.json"
_CKPT_DIR = re.compile(r"^ckpt-(\d{6,})$")


class CheckpointError(ValueError):
    """No usable checkpoint where one was expected (the message names the path)."""


@dataclass
class Checkpoint:
    update: int  # the checkpoint was taken after this update published version update + 1
    path: str
    state: dict
    files: list[str]
    created: float

    def file(self, name: str) -> str:
        """Folder written by `files[name]` at save time."""
        if name not in self.files:
            raise CheckpointError(f"checkpoint {self.path} has no {name!r} (it has {self.files})")
        return os.path.join(self.path, name)


class CheckpointStore:
    def __init__(self, root: str):
        self.root = str(root)
        self._local = objectstore.is_local(self.root)
        if self._local:
            self.root = objectstore.local_path(self.root)  # a file:// URL as its plain path

    def path_for(self, update: int) -> str:
        return os.path.join(self.root, f"ckpt-{update:06d}")

    def save(self, update: int, state: dict, files: dict[str, Callable[[str], None]] | None = None) -> Checkpoint:
        """Write a checkpoint atomically (replacing one of the same update); `files[name](folder)` fills
        `<checkpoint>/<name>/`."""
        files = dict(files or {})
        for name in files:
            if name in (STATE_FILE, MARKER) or not name or os.sep in name or _fsutil.is_hidden(name):
                raise ValueError(f"bad checkpoint file name {name!r}")
        state_text = json.dumps(state, default=_json_default, indent=1)  # fails before anything is written
        created = time.time()

        def fill(folder: str) -> None:
            for name, write in files.items():
                os.mkdir(os.path.join(folder, name))
                write(os.path.join(folder, name))
            _write_text(os.path.join(folder, STATE_FILE), state_text)
            marker = {"update": update, "created": created, "files": sorted(files)}
            _write_text(os.path.join(folder, MARKER), json.dumps(marker))

        if self._local:
            _fsutil.publish_dir(self.path_for(update), fill, overwrite=True, durable=True)
        else:
            self._save_remote(update, files, state_text, created)
        return self.load(update)

    def _save_remote(self, update: int, files: dict[str, Callable[[str], None]], state_text: str,
                     created: float) -> None:
        path = self.path_for(update)
        objectstore.unpublish_folder(path, MARKER)
        for name, write in files.items():
            write(objectstore.join(path, name))
        fs = objectstore.filesystem(path)
        fs.pipe_file(objectstore.join(path, STATE_FILE), state_text.encode())
        marker = {"update": update, "created": created, "files": sorted(files)}
        fs.pipe_file(objectstore.join(path, MARKER), json.dumps(marker).encode())  # last: publishes the checkpoint

    def updates(self) -> list[int]:
        """Updates that have a complete checkpoint, ascending."""
        return [u for u, complete in self._scan() if complete]

    def latest(self) -> Checkpoint | None:
        """The newest complete checkpoint, or None (no folder, or no complete checkpoint in it)."""
        updates = self.updates()
        return self.load(updates[-1]) if updates else None

    def load_latest(self) -> Checkpoint:
        """The newest complete checkpoint; CheckpointError naming the path when there is none."""
        if not (os.path.isdir(self.root) if self._local else objectstore.exists(self.root)):
            raise CheckpointError(f"cannot resume: checkpoint folder {self.root} does not exist")
        checkpoint = self.latest()
        if checkpoint is None:
            incomplete = [f"ckpt-{u:06d}" for u, complete in self._scan() if not complete]
            detail = f" (incomplete, without {MARKER}: {', '.join(incomplete)})" if incomplete else ""
            raise CheckpointError(f"cannot resume: no complete checkpoint in {self.root}{detail}")
        return checkpoint

    def load(self, update: int) -> Checkpoint:
        path = self.path_for(update)
        marker_path = os.path.join(path, MARKER)
        if not self._is_file(marker_path):
            what = "does not exist" if not self._is_dir(path) else f"is incomplete (no {MARKER})"
            raise CheckpointError(f"checkpoint {path} {what}")
        try:
            marker = json.loads(self._read(marker_path))
            state = json.loads(self._read(os.path.join(path, STATE_FILE)))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {path} is unreadable: {exc}") from exc
        return Checkpoint(update=update, path=path, state=state, files=marker["files"], created=marker["created"])

    def prune(self, keep_last: int) -> list[int]:
        """Delete all but the newest `keep_last` complete checkpoints (and incomplete ones older than those)."""
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        complete = self.updates()
        if len(complete) <= keep_last:
            return []
        oldest_kept = complete[-keep_last]
        deleted = [u for u, _ in self._scan() if u < oldest_kept]
        for update in deleted:
            if self._local:
                shutil.rmtree(self.path_for(update))
            else:
                objectstore.unpublish_folder(self.path_for(update), MARKER)
        return deleted

    def _scan(self) -> list[tuple[int, bool]]:
        if not self._is_dir(self.root):
            return []
        found = []
        for name in self._listdir(self.root):
            match = _CKPT_DIR.match(name)
            if match:
                found.append((int(match.group(1)), self._is_file(os.path.join(self.root, name, MARKER))))
        return sorted(found)

    # file operations on a local folder or an object store (os.path.join builds both: "/" on POSIX)
    def _is_file(self, path: str) -> bool:
        return os.path.isfile(path) if self._local else objectstore.filesystem(path).isfile(path)

    def _is_dir(self, path: str) -> bool:
        return os.path.isdir(path) if self._local else objectstore.exists(path)

    def _listdir(self, path: str) -> list[str]:
        if self._local:
            return os.listdir(path)
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in objectstore.filesystem(path).ls(path, detail=False)]

    def _read(self, path: str) -> str:
        if self._local:
            with open(path) as f:
                return f.read()
        return objectstore.filesystem(path).cat_file(path).decode()


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"checkpoint state must be JSON-able; got {type(value).__name__}: {value!r:.80}")
