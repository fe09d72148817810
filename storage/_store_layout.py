"""The trajectory store's layout on disk: creating it, opening it, and checking that what is there is whole.

`storage.trajectory_store` reads and writes the store; these functions hold no state.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any, Sequence

import numpy as np
import zarr
import zarr.api.asynchronous
from zarr.codecs import BloscCodec
from zarr.core.sync import sync

from dora_tasks.core.records import Group
from storage import _zarr_io as zio
from storage.schema import (COLUMNS, FORMAT_NAME, METRICS_ARRAY, RAGGED, RAGGED_COUNTERS, READABLE_SCHEMA_VERSIONS,
                            SCHEMA_VERSION, TABLES, VOCAB_COLUMNS, ChunkSizes, StoreCorruptError, StoreNotFoundError,
                            StoreSchemaError, holds_array, ragged_fill, tables_of)

COMPRESSOR = BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")
COUNTERS = tuple(TABLES) + tuple(sorted(set(RAGGED_COUNTERS.values())))


def counters_of(tables: tuple[str, ...]) -> tuple[str, ...]:
    """The commit counters of a store holding `tables`."""
    return tuple(tables) + tuple(sorted(set(RAGGED_COUNTERS.values())))


def _table_len(cols: dict[str, np.ndarray]) -> int:
    return len(next(iter(cols.values()))) if cols else 0


def _array_paths(schema_version: int = SCHEMA_VERSION) -> list[str]:
    """The arrays a store of `schema_version` holds."""
    paths = [f"{table}/{c.name}" for table in tables_of(schema_version) for c in COLUMNS[table]]
    paths += [f"updates/{METRICS_ARRAY}"] + [f"ragged/{name}" for name in RAGGED]
    return [path for path in paths if holds_array(path, schema_version)]


def _counter(path: str) -> str:
    """The commit counter that bounds the array at `path` (its table, or the ragged element counter)."""
    group, name = path.split("/")
    return RAGGED_COUNTERS[name] if group == "ragged" else group


def _open_group(url: Any, mode: str, storage_options: dict | None) -> Any:
    try:
        return zarr.open_group(url, mode=mode, use_consolidated=False, zarr_format=3, storage_options=storage_options)
    except FileNotFoundError:  # zarr's GroupNotFoundError is a FileNotFoundError too
        path = zio.local_path(url)
        if path is not None and os.path.isdir(path) and os.listdir(path):
            raise StoreCorruptError(f"{url} exists but has no root zarr.json (truncated store?)") from None
        raise StoreNotFoundError(f"no trajectory store at {url}") from None


def _exists(url: Any, storage_options: dict | None) -> bool:
    path = zio.local_path(url)
    if path is not None:
        return os.path.isfile(path) or (os.path.isdir(path) and bool(os.listdir(path)))
    try:
        zarr.open_group(url, mode="r", use_consolidated=False, storage_options=storage_options)
        return True
    except FileNotFoundError:
        return False


def _check_table(name: str) -> None:
    if name not in TABLES:
        raise KeyError(f"unknown table {name!r}; tables: {list(TABLES)}")


def _initial_attrs(meta: dict) -> dict:
    return {
        "format": FORMAT_NAME,
        "schema_version": SCHEMA_VERSION,
        "meta": meta,
        "committed": dict.fromkeys(COUNTERS, 0),
        "vocab": {column: [""] for column in VOCAB_COLUMNS},
        "metric_names": [],
    }


async def _create_layout(url: Any, chunks: ChunkSizes, attrs: dict, storage_options: dict | None) -> None:
    """Create the groups and empty arrays (concurrently: ~30 metadata writes), then the root attributes. The
    schema_version comes last, so a reader opening mid-creation gets a clear error, never half a schema."""
    root = await zarr.api.asynchronous.open_group(url, mode="w", zarr_format=3, storage_options=storage_options)
    names = (*TABLES, "ragged")
    groups = dict(zip(names, await asyncio.gather(*(root.create_group(name) for name in names))))
    specs = [(groups[t], c.name, (chunks.rows(t),), c.dtype, c.fill) for t in TABLES for c in COLUMNS[t]]
    specs.append((groups["updates"], METRICS_ARRAY, (chunks.updates, chunks.metric_columns), "float64", np.nan))
    specs += [(groups["ragged"], r.name, (chunks.ragged,), r.dtype, ragged_fill(r)) for r in RAGGED.values()]
    await asyncio.gather(*(group.create_array(name, shape=(0,) * len(chunk), chunks=chunk, dtype=dtype,
                                              fill_value=fill, compressors=COMPRESSOR)
                           for group, name, chunk, dtype, fill in specs))
    await root.update_attributes(attrs)


async def _add_tables(root_url: Any, tables: tuple[str, ...], chunks: ChunkSizes,
                      storage_options: dict | None) -> None:
    root = await zarr.api.asynchronous.open_group(root_url, mode="r+", zarr_format=3, storage_options=storage_options)
    groups = await asyncio.gather(*(root.create_group(t, overwrite=True) for t in tables))
    await asyncio.gather(*(group.create_array(c.name, shape=(0,), chunks=(chunks.rows(t),), dtype=c.dtype,
                                              fill_value=c.fill, compressors=COMPRESSOR)
                           for t, group in zip(tables, groups) for c in COLUMNS[t]))


def upgrade(root: Any, url: Any, storage_options: dict | None) -> None:
    """Give a store of an older readable schema version the tables added since (empty) and the arrays added to its
    tables since (as long as their committed rows, reading their fill value there), then record the current
    version: the commit counters, vocabularies and the version last, in one metadata write, so a crash before
    leaves the store as it was (with unused arrays)."""
    attrs = dict(root.attrs)
    found = attrs["schema_version"]
    missing = tuple(t for t in TABLES if t not in tables_of(found))
    committed = {**attrs["committed"], **dict.fromkeys(missing, 0)}
    if missing:
        sync(_add_tables(url, missing, ChunkSizes(), storage_options))
    added = [path for path in _array_paths() if not holds_array(path, found) and path.split("/")[0] not in missing]
    sync(_add_arrays(url, added, committed, ChunkSizes(), storage_options))
    vocab = {column: attrs["vocab"].get(column, [""]) for column in VOCAB_COLUMNS}
    root.attrs.update({"committed": committed, "vocab": vocab, "schema_version": SCHEMA_VERSION})


async def _add_arrays(root_url: Any, paths: list[str], committed: dict, chunks: ChunkSizes,
                      storage_options: dict | None) -> None:
    """Arrays added to existing tables (or to ragged), as long as their committed rows: every row written before
    they existed reads their fill value (`ARRAYS_SINCE`)."""
    root = await zarr.api.asynchronous.open_group(root_url, mode="r+", zarr_format=3, storage_options=storage_options)
    jobs = []
    for path in paths:
        group_name, name = path.split("/")
        group = await root.getitem(group_name)
        if group_name == "ragged":
            dtype, fill, chunk = RAGGED[name].dtype, ragged_fill(RAGGED[name]), chunks.ragged
        else:
            column = next(c for c in COLUMNS[group_name] if c.name == name)
            dtype, fill, chunk = column.dtype, column.fill, chunks.rows(group_name)
        jobs.append(group.create_array(name, shape=(committed[_counter(path)],), chunks=(chunk,), dtype=dtype,
                                       fill_value=fill, compressors=COMPRESSOR, overwrite=True))
    await asyncio.gather(*jobs)


def check_store(root: Any, url: Any) -> None:
    """Raise StoreSchemaError / StoreCorruptError unless `root` is a complete store of a schema version this code
    reads. Reads metadata only (plus the last trajectory row); writes nothing."""
    attrs = dict(root.attrs)
    found = attrs.get("schema_version")
    if found is None or attrs.get("format") != FORMAT_NAME:
        raise StoreSchemaError(f"{url} is not a trajectory store (no format/schema_version attributes; "
                               f"this code reads schema_version {SCHEMA_VERSION})")
    if found not in READABLE_SCHEMA_VERSIONS:
        raise StoreSchemaError(f"{url} has schema_version {found}; this code reads schema_version {SCHEMA_VERSION} "
                               f"(and {', '.join(str(v) for v in READABLE_SCHEMA_VERSIONS if v != SCHEMA_VERSION)})")
    tables = tables_of(found)
    missing_attrs = [k for k in ("meta", "committed", "vocab", "metric_names") if k not in attrs]
    if missing_attrs or any(k not in attrs["committed"] for k in counters_of(tables)):
        raise StoreCorruptError(f"{url}: root attributes incomplete (missing {missing_attrs or 'commit counters'})")
    arrays = _open_arrays(root, url, found)
    problems = _length_problems(arrays, attrs)
    if not problems:
        problems = _ragged_span_problems(arrays, attrs["committed"])
    if problems:
        raise StoreCorruptError(f"{url}: " + "; ".join(problems))


def _open_arrays(root: Any, url: Any, schema_version: int) -> dict[str, Any]:
    arrays, missing = {}, []
    for path in _array_paths(schema_version):
        try:
            arrays[path] = root[path]
        except (KeyError, FileNotFoundError, ValueError, OSError):
            missing.append(path)
    if missing:
        raise StoreCorruptError(f"{url}: missing arrays: {', '.join(missing)}")
    return arrays


def _length_problems(arrays: dict[str, Any], attrs: dict) -> list[str]:
    committed = attrs["committed"]
    problems = []
    for path, array in arrays.items():
        counter = _counter(path)
        if array.shape[0] < committed[counter]:
            problems.append(f"{path} has {array.shape[0]} rows, fewer than the {committed[counter]} committed "
                            f"{counter} (truncated store)")
    metrics = arrays[f"updates/{METRICS_ARRAY}"]
    if metrics.shape[1] < len(attrs["metric_names"]):
        problems.append(f"updates/{METRICS_ARRAY} has {metrics.shape[1]} columns for "
                        f"{len(attrs['metric_names'])} metric names")
    return problems


def _ragged_span_problems(arrays: dict[str, Any], committed: dict[str, int]) -> list[str]:
    n = committed["trajectories"]
    if n == 0:
        return []
    problems = []
    for name, spec in RAGGED.items():
        if f"ragged/{name}" not in arrays:  # added after the store's schema version
            continue
        cols = [spec.start_column, *spec.length_columns]
        try:
            end = sum(int(arrays[f"trajectories/{c}"][n - 1]) for c in cols)
        except Exception as exc:
            return [f"cannot read the last trajectory row: {exc}"]
        if end > committed[RAGGED_COUNTERS[name]]:
            problems.append(f"the last trajectory ends at {end} in ragged/{name}, beyond its "
                            f"{committed[RAGGED_COUNTERS[name]]} committed elements")
    return problems


# -------------------------------------------------------------------- encoding records
def _encode_groups(groups: Sequence[Group], update: int, time: float, code: Any) -> tuple[dict, dict]:
    """Column arrays for the trajectories of `groups` (offsets relative to this batch) and their flat token data."""
    trajs = [t for g in groups for t in g.trajectories]
    for g in groups:
        for t in g.trajectories:
            _check_trajectory(g, t)
    per_group = [len(g.trajectories) for g in groups]

    def repeat(values: list, dtype: str) -> np.ndarray:
        return np.repeat(np.asarray(values, dtype=dtype), per_group)

    p_len = np.fromiter((len(t.prompt_ids) for t in trajs), dtype=np.int64, count=len(trajs))
    r_len = np.fromiter((len(t.response_ids) for t in trajs), dtype=np.int64, count=len(trajs))
    values = {
        "group_id": repeat([g.group_id for g in groups], "int64"),
        "prompt_id": repeat([g.prompt.prompt_id for g in groups], "int64"),
        "version": repeat([g.version for g in groups], "int32"),
        "instance": repeat([code("instance", g.instance) for g in groups], "int16"),
        "attempt": repeat([g.attempt for g in groups], "int16"),
        "start_time": repeat([g.start_time for g in groups], "float64"),
        "end_time": repeat([g.end_time for g in groups], "float64"),
        "filtered": repeat([code("filtered", g.filtered) for g in groups], "int16"),
        "consumed_by": np.full(len(trajs), update),
        "consumed_time": np.full(len(trajs), time),
        "sample_idx": [t.sample_idx for t in trajs],
        "reward": [t.reward for t in trajs],
        "reward_error": [code("reward_error", t.reward_error) if t.reward_error else 0 for t in trajs],
        "advantage": [t.advantage for t in trajs],
        "finished": [t.finished for t in trajs],
        "prompt_len": p_len,
        "response_len": r_len,
        "tokens_start": np.cumsum(p_len + r_len) - (p_len + r_len),
        "response_start": np.cumsum(r_len) - r_len,
        "turns": [t.turns for t in trajs],
        "tool_calls": [t.tool_calls for t in trajs],
        "env_error": [code("env_error", t.env_error) if t.env_error else 0 for t in trajs],
    }
    cols = {c.name: np.asarray(values[c.name], dtype=c.dtype) for c in COLUMNS["trajectories"]}
    pieces = {"tokens": [a for t in trajs for a in (t.prompt_ids, t.response_ids)],
              "token_versions": [t.versions for t in trajs],
              "behaviour_logprobs": [t.behaviour_logprobs for t in trajs], "loss_mask": [t.loss_mask for t in trajs]}
    ragged = {name: np.concatenate(pieces[name]).astype(spec.dtype, copy=False) if pieces[name]
              else np.zeros(0, dtype=spec.dtype) for name, spec in RAGGED.items()}
    return cols, ragged


def _check_trajectory(g: Group, t: Any) -> None:
    r = len(t.response_ids)
    if t.group_id != g.group_id:
        raise ValueError(f"trajectory of group {t.group_id} inside group {g.group_id}")
    if len(t.versions) != r or len(t.behaviour_logprobs) != r or len(t.loss_mask) != r:
        raise ValueError(f"group {g.group_id} sample {t.sample_idx}: {r} response tokens but {len(t.versions)} "
                         f"versions, {len(t.behaviour_logprobs)} behaviour log-probs and {len(t.loss_mask)} "
                         "loss-mask entries")
