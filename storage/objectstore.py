"""Local folder or object-store URL: the one place the run's stores tell them apart and move folders between them.

Every store (weights, trajectories, checkpoints) takes a local path, handled as before with plain file operations
and atomic renames, or an fsspec URL (`s3://bucket/prefix`, `gs://...`, `memory://` in unit tests), so that a cluster
whose workers share no folder with the driver can run. Credentials and endpoint come from the environment the
filesystem's own library reads (s3fs/botocore: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_PROFILE, AWS_DEFAULT_REGION), never from config files.

Object stores have no atomic folder rename. A folder is published by uploading its files, then a marker object last
(`publish_folder`); readers treat a folder without its marker as absent, and a rewrite deletes the marker first. The
marker holds a token unique to that publication, so `local_folder` (a per-worker download cache for the libraries
that need a local folder: transformers, vLLM, torch.load) never serves a folder that was published again since.

Simplified, and why: listings are not cached (`use_listings_cache=False`): a worker must see versions published by
another process; the cache keeps the `CACHE_KEEP` folders used last per worker and evicts by last use (a loaded
engine holds its weights in memory, so an evicted folder is only downloaded again if needed again).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import uuid
from typing import Callable, Iterator

from storage._zarr_io import local_path

CACHE_DIR = "dora-store-cache"
CACHE_KEEP = 4  # folders a worker keeps downloaded: the versions it loads now and next, the initial model


class ObjectStoreError(OSError):
    """A folder on an object store is missing or unpublished (the message names the URL)."""


def is_local(path: str) -> bool:
    """A plain path or a file:// URL."""
    return local_path(path) is not None


def filesystem(url: str):
    """The fsspec filesystem of `url` (credentials from the environment), without a listing cache."""
    import fsspec

    fs, _ = fsspec.core.url_to_fs(url, use_listings_cache=False)
    return fs


def exists(path: str) -> bool:
    return os.path.exists(local_path(path)) if is_local(path) else filesystem(path).exists(path)


def join(root: str, *names: str) -> str:
    return "/".join([root.rstrip("/"), *names])


def files_under(local_dir: str) -> list[str]:
    """Every file under `local_dir`, as paths relative to it."""
    return [os.path.relpath(os.path.join(d, f), local_dir) for d, _, files in os.walk(local_dir) for f in files]


def upload_folder(local_dir: str, url: str) -> None:
    """Copy every file under `local_dir` to the same relative key under `url` (concurrently where fsspec can)."""
    names = files_under(local_dir)
    if names:
        targets = [join(url, name.replace(os.sep, "/")) for name in names]
        filesystem(url).put([os.path.join(local_dir, name) for name in names], targets)


def download_folder(url: str, local_dir: str) -> None:
    """Copy every object under `url` into `local_dir` (same relative paths)."""
    fs = filesystem(url)
    base = fs._strip_protocol(url).rstrip("/")
    sources = fs.find(url)
    if not sources:
        raise ObjectStoreError(f"{url} holds no files")
    targets = [os.path.join(local_dir, *s[len(base) + 1:].split("/")) for s in sources]
    for target in targets:
        os.makedirs(os.path.dirname(target), exist_ok=True)
    fs.get(sources, targets)


def publish_folder(url: str, write_fn: Callable[[str], None], marker: str) -> None:
    """Publish `url` on an object store: `write_fn(temp)` fills a local temp folder, which is uploaded; the marker
    (a token unique to this publication) goes last. An existing folder is unpublished (marker first) and removed."""
    fs = filesystem(url)
    with tempfile.TemporaryDirectory(prefix="dora-publish-") as temp:
        write_fn(temp)
        unpublish_folder(url, marker)
        upload_folder(temp, url)
    fs.pipe_file(join(url, marker), uuid.uuid4().hex.encode())


def unpublish_folder(url: str, marker: str) -> None:
    """Delete the marker, then the folder: a reader sees a whole folder or none."""
    fs = filesystem(url)
    if fs.exists(join(url, marker)):
        fs.rm(join(url, marker))
    if fs.exists(url):
        fs.rm(url, recursive=True)


def is_published(url: str, marker: str) -> bool:
    return filesystem(url).exists(join(url, marker))


def local_folder(path: str, marker: str = "_PUBLISHED", cache_dir: str | None = None) -> str:
    """A local folder with the content of `path`: a local path as it is; a published folder on an object store
    downloaded into this worker's cache (its local_directory) once per publication (see `publish_folder`)."""
    if is_local(path):
        return path if "://" not in str(path) else local_path(path)
    fs = filesystem(path)
    try:
        token = fs.cat_file(join(path, marker)).decode()[:16] or "unmarked"
    except FileNotFoundError:
        raise ObjectStoreError(f"{path} is not published (no {marker} object): deleted, or still being written") \
            from None
    name = f"{hashlib.sha1(path.encode()).hexdigest()[:16]}-{token}"
    return cached_folder(name, lambda folder: download_folder(path, folder), cache_dir)


def cached_folder(name: str, fill: Callable[[str], None], cache_dir: str | None = None) -> str:
    """The folder `name` of this worker's cache, filled once by `fill(folder)`; the `CACHE_KEEP` used last stay."""
    cache = cache_dir or _cache_dir()
    entry = os.path.join(cache, name)
    if os.path.isdir(entry):
        os.utime(entry)  # last use, for eviction
        return entry
    os.makedirs(cache, exist_ok=True)
    temp = tempfile.mkdtemp(prefix=".tmp-", dir=cache)
    try:
        fill(temp)
        os.rename(temp, entry)  # atomic: another thread of this worker sees the whole folder or none
    except OSError:
        shutil.rmtree(temp, ignore_errors=True)
        if not os.path.isdir(entry):  # else another thread filled the same entry first
            raise
    _evict(cache, keep=name)
    return entry


def _cache_dir() -> str:
    """The Dask worker's local_directory (removed with the worker); outside a worker, a temp folder of this process
    (per process: another process's eviction never deletes a folder this one is reading)."""
    from distributed.worker import Worker, get_worker

    try:
        worker = get_worker()
    except ValueError:  # no task context: a thread the worker's code started (the rollout server's), or no worker
        running = list(Worker._instances)
        worker = running[0] if len(running) == 1 else None
    if worker is not None:
        return os.path.join(worker.local_directory, CACHE_DIR)
    return os.path.join(tempfile.gettempdir(), f"{CACHE_DIR}-{os.getpid()}")


def _evict(cache: str, keep: str) -> None:
    entries = []
    for entry in os.scandir(cache):
        if entry.is_dir() and not entry.name.startswith(".") and entry.name != keep:
            try:
                entries.append((entry.stat().st_mtime, entry.path))
            except FileNotFoundError:  # another task thread of this worker evicted it between the listing and here
                continue
    entries.sort(reverse=True)
    for _, path in entries[CACHE_KEEP - 1:]:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def staged(path: str) -> Iterator[str]:
    """A folder to write `path` through: `path` itself when local; else a local temp folder uploaded to `path`
    when the block ends without error (the caller's marker, written after, publishes it)."""
    if not path or is_local(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="dora-stage-") as temp:
        yield temp
        upload_folder(temp, path)


@contextlib.contextmanager
def fetched(path: str | None) -> Iterator[str | None]:
    """A local folder to read `path` from for the length of the block: `path` itself when local (or empty), else a
    temp download removed afterwards (checkpoints: read once, too large to keep)."""
    if not path or is_local(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="dora-fetch-") as temp:
        download_folder(path, temp)
        yield temp
