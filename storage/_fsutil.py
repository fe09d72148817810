"""Atomic publication of a local folder: fill a hidden temp folder beside the target, then rename it into place.

Shared by the weight store and the checkpoint store. `os.rename` of a folder is atomic on one POSIX filesystem, so a
reader sees either no folder or a complete one. Replacing an existing folder takes two renames (old -> trash,
temp -> final): a reader may briefly see no folder, never a mixed one.
"""
from __future__ import annotations

import os
import shutil
import uuid
from typing import Callable

TEMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".old-"


def publish_dir(final: str, fill: Callable[[str], None], *, overwrite: bool = False, durable: bool = False) -> None:
    """Create folder `final` atomically with the content `fill(temp_dir)` writes. With `durable`, file data and
    the folder entries are fsynced before and after the rename (survives power loss, not only a killed process)."""
    parent, name = os.path.split(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    if os.path.exists(final) and not overwrite:
        raise FileExistsError(final)
    temp = os.path.join(parent, f"{TEMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
    os.mkdir(temp)
    try:
        fill(temp)
        if durable:
            fsync_tree(temp)
        _swap_into_place(temp, final)
        if durable:
            fsync_dir(parent)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def _swap_into_place(temp: str, final: str) -> None:
    if not os.path.exists(final):
        os.rename(temp, final)
        return
    parent, name = os.path.split(final)
    trash = os.path.join(parent, f"{TRASH_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
    os.rename(final, trash)
    os.rename(temp, final)
    shutil.rmtree(trash, ignore_errors=True)


def fsync_tree(folder: str) -> None:
    for dirpath, _, filenames in os.walk(folder):
        for filename in filenames:
            fd = os.open(os.path.join(dirpath, filename), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_hidden(name: str) -> bool:
    """Temp and trash folders of an interrupted publication (ignored by listings)."""
    return name.startswith((TEMP_PREFIX, TRASH_PREFIX))
