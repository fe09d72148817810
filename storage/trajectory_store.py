"""TrajectoryStore: the run's append-only record of dispatches, consumed trajectories, updates and migrated
responses, on zarr v3.

It is the source of truth for the audit (`storage.audit`) and for resume (`truncate_to`). The schema lives in
`storage.schema` and is documented in `docs/storage-schema.md`.

Protocol
- One writer (the driver). Appends are buffered in memory and written when a buffer reaches its chunk size, and on
  `flush()`/`close()`: zarr rewrites a partial chunk on every small append and loses rows with two writers
  (stack-notes). Local stores take an exclusive `flock` on `<store>/.writer.lock` to refuse a second writer; an
  object store (s3://...) has no lock, so one driver per store is the user's to keep.
- Commit record: `flush()` first writes every array (growing it), then rewrites the root attributes with the new row
  counts (`attrs["committed"]`) and string vocabularies in one atomic metadata write. Readers read only committed rows,
  so a reader in another process sees whole flushes, never a half-written one. Arrays longer than the committed count
  are an uncommitted tail (a flush in progress, or a writer that died mid-flush): readers ignore it and the next
  writer (`open(mode="a")`) trims it. Arrays *shorter* than the committed count are corruption.
- Capacity: while a writer is open, arrays grow in whole chunks, so most flushes rewrite chunk data but no array
  metadata; `close()` trims them to their committed length. Plain-zarr readers of a live store must therefore use
  `attrs["committed"]`, not the array shapes.
- `open(path)` (mode "r") uses a read-only zarr store: reading never modifies a file, corrupt or not.

Simplified, and why
- Strings (instance address, filter name, reward and environment errors) are int16 codes into vocabularies kept in the root attributes:
  zarr v3's variable-length strings are a zarr-python extension, and codes are smaller and faster. Reward errors keep
  only their first line, cut to 80 characters, and at most 256 distinct ones (later ones read "<other>"): exception
  texts are unbounded; the full text belongs in the logs.
- Group fields are repeated on each trajectory row instead of a separate groups table: one join less for every reader,
  and the repeats compress to almost nothing.
- Update metrics are a 2-D float64 array whose columns are created on first use of a name (NaN for earlier rows),
  named by `attrs["metric_names"]`.
- No migration between schema versions: another version is refused with both versions named.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
from zarr.core.sync import sync

from dora_tasks.core.records import Group, Migration
from storage import _zarr_io as zio
from storage._store_layout import (COUNTERS, _array_paths, _check_table, _counter, _create_layout, _encode_groups,
                                   _exists, _initial_attrs, _open_group, _table_len, check_store, upgrade)
from storage.schema import (CODED_COLUMNS, COLUMNS, ERROR_COLUMNS, METRICS_ARRAY, OTHER_ERROR, RAGGED,
                            RAGGED_COUNTERS, REWARD_ERROR_MAX_VOCAB, SCHEMA_VERSION, TABLES, VOCAB_COLUMNS,
                            ChunkSizes, StoreCorruptError, StoreError, StoreExistsError, StoreLockedError,
                            StoreNotFoundError, StoreReadOnlyError, StoreSchemaError, holds_array, ragged_fill,
                            short_error, tables_of)

__all__ = ["TrajectoryStore", "Dropped", "ChunkSizes", "SCHEMA_VERSION", "StoreError", "StoreNotFoundError",
           "StoreExistsError", "StoreSchemaError", "StoreCorruptError", "StoreReadOnlyError", "StoreLockedError",
           "check_store"]



@dataclass
class Dropped:
    """What `truncate_to` removed: the dropped rows of each table (decoded, as `read_table` returns them)."""

    tables: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        return {name: _table_len(cols) for name, cols in self.tables.items()}


class TrajectoryStore:
    """Append-only trajectory store. Build with `create` or `open`; use as a context manager to flush on exit."""

    def __init__(self, root: Any, url: Any, mode: str, storage_options: dict | None, lock: Any = None):
        self._root = root
        self._url = url
        self._mode = mode
        self._storage_options = storage_options
        self._lock = lock
        self._mutex = threading.RLock()
        self._attrs = dict(root.attrs)
        self._arrays: dict[str, Any] = {}
        self._codes = {col: {s: i for i, s in enumerate(self._vocab(col))} for col in VOCAB_COLUMNS}
        self._pending: dict[str, list] = {table: [] for table in TABLES}
        self._pending_counts = dict.fromkeys(COUNTERS, 0)
        self._flush_at: dict[str, int] | None = None
        self._closed = False

    # ---------------------------------------------------------------- construction
    @classmethod
    def create(cls, path: Any, meta: dict, *, overwrite: bool = False, chunks: ChunkSizes = ChunkSizes(),
               storage_options: dict | None = None) -> "TrajectoryStore":
        """Create an empty store at `path` (local path or fsspec URL) and open it for writing.
        `meta` (JSON-able) should hold at least `group_size` and `max_staleness` for the audit."""
        try:
            json.dumps(meta)
        except TypeError as exc:
            raise ValueError(f"meta must be JSON-serialisable: {exc}") from None
        exists = _exists(path, storage_options)
        if exists and not overwrite:
            raise StoreExistsError(f"{path} already exists; pass overwrite=True to replace it")
        if exists and os.path.isdir(zio.local_path(path) or ""):
            zio.WriterLock(zio.local_path(path)).release()  # refuse to wipe a store that a live writer holds
        sync(_create_layout(path, chunks, _initial_attrs(meta), storage_options))
        return cls._writer(_open_group(path, "r+", storage_options), path, storage_options)

    @classmethod
    def open(cls, path: Any, mode: str = "r", *, storage_options: dict | None = None) -> "TrajectoryStore":
        """Open an existing store: mode "r" reads (never modifies anything), mode "a" appends (single writer)."""
        if mode not in ("r", "a"):
            raise ValueError(f"mode must be 'r' or 'a', got {mode!r}")
        root = _open_group(path, "r" if mode == "r" else "r+", storage_options)
        check_store(root, path)
        if mode == "r":
            return cls(root, path, "r", storage_options)
        store = cls._writer(root, path, storage_options)  # the writer lock first: upgrading writes
        if store._attrs["schema_version"] != SCHEMA_VERSION:
            upgrade(root, path, storage_options)  # an older store gets the tables added since, empty
            store._attrs = dict(root.attrs)
        store._trim_uncommitted()
        return store

    @classmethod
    def _writer(cls, root: Any, url: Any, storage_options: dict | None) -> "TrajectoryStore":
        local = zio.local_path(url)
        lock = zio.WriterLock(local) if local is not None else None
        return cls(root, url, "a", storage_options, lock)

    # ---------------------------------------------------------------- properties
    @property
    def path(self) -> Any:
        return self._url

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def meta(self) -> dict:
        return dict(self._attrs["meta"])

    @property
    def metric_names(self) -> list[str]:
        return list(self._attrs["metric_names"])

    @property
    def schema_version(self) -> int:
        return int(self._attrs["schema_version"])

    @property
    def _tables(self) -> tuple[str, ...]:
        """The tables this store holds (an older store lacks those added since)."""
        return tables_of(self.schema_version)

    def vocab(self, column: str) -> list[str]:
        """The strings behind the int16 codes of `column` (one of instance, filtered, reward_error, env_error)."""
        return list(self._vocab(column))

    def _vocab(self, column: str) -> list[str]:
        return self._attrs["vocab"].get(column, [""])  # a vocabulary added after the store's version: codes all 0

    # ---------------------------------------------------------------- writing
    def append_dispatch(self, group_id: int, prompt_id: int, version: int, attempt: int, time: float) -> None:
        """Record one dispatched group (a re-dispatch after a lost instance is a new row with attempt + 1)."""
        with self._mutex:
            self._require_writable()
            self._pending["dispatch"].append((group_id, prompt_id, version, attempt, time))
            self._pending_counts["dispatch"] += 1
            self._maybe_flush()

    def append_consumed(self, groups: Sequence[Group], update: int, time: float) -> None:
        """Record every trajectory of `groups` as consumed by `update` (ragged token data included)."""
        with self._mutex:
            self._require_writable()
            rows, ragged = _encode_groups(groups, update, time, self._code)
            rows["tokens_start"] += self._pending_counts["tokens"]  # offsets relative to the first pending batch
            rows["response_start"] += self._pending_counts["response_tokens"]
            self._pending["trajectories"].append((rows, ragged))
            self._pending_counts["trajectories"] += len(rows["group_id"])
            self._pending_counts["tokens"] += len(ragged["tokens"])
            self._pending_counts["response_tokens"] += len(ragged["token_versions"])
            self._maybe_flush()

    def append_migrations(self, migrations: Sequence[Migration]) -> None:
        """Record responses handed over from one rollout instance to another (`Group.migrations`)."""
        with self._mutex:
            self._require_writable()
            for m in migrations:
                self._pending["migrations"].append((
                    m.group_id, m.attempt, m.sample_idx, m.version, m.target_version, self._code("instance", m.source),
                    self._code("instance", m.target), m.nbytes, m.reprefill_tokens, m.seconds, m.handed_over_time,
                    m.adopted_time))
                self._pending_counts["migrations"] += 1
            self._maybe_flush()

    def append_update(self, update: int, start: float, end: float, published_version: int,
                      publish_seconds: float, metrics: dict[str, float]) -> None:
        """Record one update; a metric name seen for the first time becomes a new column (NaN for earlier rows)."""
        with self._mutex:
            self._require_writable()
            names = self._attrs["metric_names"]
            for name in metrics:
                if name not in names:
                    self._attrs["metric_names"] = names = names + [str(name)]
            self._pending["updates"].append(((update, start, end, published_version, publish_seconds),
                                             {k: float(v) for k, v in metrics.items()}))
            self._pending_counts["updates"] += 1
            self._maybe_flush()

    def flush(self) -> None:
        """Write all buffered rows, then commit them (readers see them from now on)."""
        with self._mutex:
            self._require_writable()
            if not any(self._pending_counts.values()):
                return
            committed = dict(self._attrs["committed"])
            jobs: list = []  # (array, first row, data)
            self._row_jobs(jobs, "dispatch", committed)
            self._row_jobs(jobs, "migrations", committed)
            self._trajectory_jobs(jobs, committed)
            self._update_jobs(jobs, committed)
            zio.append_many(jobs)
            self._commit(committed)
            # cleared only now: if a write fails (disk full), the rows stay buffered and the next flush retries
            self._pending = {table: [] for table in TABLES}
            self._pending_counts = dict.fromkeys(COUNTERS, 0)

    def close(self) -> None:
        """Flush (writer) and release the writer lock. Idempotent."""
        with self._mutex:
            if self._closed:
                return
            if self._mode == "a":
                self.flush()
                self._trim_uncommitted()  # drop the unused capacity: a closed store's arrays have exact lengths
                if self._lock is not None:
                    self._lock.release()
            self._closed = True

    def __enter__(self) -> "TrajectoryStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def row_counts(self) -> dict[str, int]:
        """Flush, then return the committed rows of each table: what a checkpoint records for `truncate_to`."""
        self.flush()
        return {table: self.num_rows(table) for table in self._tables}

    def truncate_to(self, counts: dict[str, int]) -> Dropped:
        """Drop the rows after `counts[table]` of each named table (resume: rows written after the checkpoint) and
        return them. The ragged arrays are cut at the end of the last kept trajectory."""
        with self._mutex:
            self.flush()
            committed = dict(self._attrs["committed"])
            for table, n in counts.items():
                if table not in self._tables or not 0 <= n <= committed[table]:
                    raise ValueError(f"truncate_to: {table}={n} is not a table count within 0..{committed.get(table)}")
            dropped = Dropped({t: self.read_table(t, rows=slice(n, committed[t])) for t, n in counts.items()})
            if "trajectories" in counts:
                committed.update(self._ragged_ends(counts["trajectories"]))
            committed.update(counts)
            self._commit(committed)  # commit first: a crash below leaves only an uncommitted tail
            self._trim_uncommitted()
            return dropped

    # ---------------------------------------------------------------- reading
    def num_rows(self, name: str) -> int:
        """Committed (flushed) rows of a table."""
        self._refresh()
        _check_table(name)
        return int(self._attrs["committed"].get(name, 0))  # 0: a table added after the store's schema version

    def read_table(self, name: str, columns: Iterable[str] | None = None, *, rows: slice | None = None,
                   decode: bool = True) -> dict[str, np.ndarray]:
        """Columns of a table's committed rows. With `decode`, code columns come back as strings; the updates
        table adds one `metrics/<name>` column per metric."""
        self._refresh()
        return self._read_table(name, columns, rows=rows, decode=decode)

    def _read_table(self, name: str, columns: Iterable[str] | None = None, *, rows: slice | None = None,
                    decode: bool = True) -> dict[str, np.ndarray]:
        _check_table(name)
        columns = list(columns) if columns is not None else None
        wanted = columns if columns is not None else [c.name for c in COLUMNS[name]]
        if name not in self._tables:  # added after this store's schema version: it has no rows
            dtypes = {c.name: c.dtype for c in COLUMNS[name]}
            return {col: np.zeros(0, dtype=str if decode and col in CODED_COLUMNS else dtypes[col]) for col in wanted}
        start, stop, _ = (rows or slice(None)).indices(int(self._attrs["committed"][name]))
        stop = max(start, stop)
        out = {col: self._read_column(name, col, start, stop) for col in wanted if not col.startswith("metrics/")}
        for col, vocab in CODED_COLUMNS.items() if decode else ():
            if col in out:
                out[col] = self._decode(vocab, out[col])
        if name == "updates":
            out.update(self._read_metrics(start, stop, columns))
        return out

    def read_ragged(self, name: str, rows: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """Per-row token data of trajectories `rows`: tokens (prompt + response), token_versions or
        behaviour_logprobs (response tokens)."""
        self._refresh()
        if name not in RAGGED:
            raise KeyError(f"unknown ragged array {name!r}; known: {sorted(RAGGED)}")
        spec = RAGGED[name]
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        n = int(self._attrs["committed"]["trajectories"])
        if len(rows) and (rows.min() < 0 or rows.max() >= n):
            raise IndexError(f"rows must be within 0..{n - 1}")
        table = self._read_table("trajectories", [spec.start_column, *spec.length_columns], decode=False)
        starts = table[spec.start_column][rows]
        lengths = sum(table[c][rows].astype(np.int64) for c in spec.length_columns)
        if not holds_array(f"ragged/{name}", self.schema_version):  # added since: every row reads its fill
            return [np.full(n, ragged_fill(spec), dtype=spec.dtype) for n in lengths.tolist()]
        array = self._array(f"ragged/{name}")
        try:
            return zio.read_spans(array, starts, lengths, gap=array.chunks[0])
        except Exception as exc:
            raise StoreCorruptError(f"{self._url}: cannot read ragged/{name}: {exc}") from exc

    # ---------------------------------------------------------------- internals
    def _require_writable(self) -> None:
        if self._mode != "a" or self._closed:
            state = "closed" if self._closed else "opened read-only (mode='r')"
            raise StoreReadOnlyError(f"trajectory store {self._url} is {state}")

    def _maybe_flush(self) -> None:
        if self._flush_at is None:
            self._flush_at = self._chunk_rows()
        if any(self._pending_counts[k] >= self._flush_at[k] for k in self._pending_counts):
            self.flush()

    def _chunk_rows(self) -> dict[str, int]:
        """Buffered rows (elements, for ragged counters) that fill one chunk: the automatic flush thresholds."""
        sizes = {t: self._array(f"{t}/{COLUMNS[t][0].name}").chunks[0] for t in self._tables}
        ragged = self._array("ragged/tokens").chunks[0]
        return {**sizes, "tokens": ragged, "response_tokens": ragged}

    def _code(self, column: str, value: str) -> int:
        codes = self._codes[column]
        if column in ERROR_COLUMNS:
            value = short_error(value)
            if value not in codes and len(codes) >= REWARD_ERROR_MAX_VOCAB:
                value = OTHER_ERROR
        if value not in codes:
            if len(codes) >= np.iinfo(np.int16).max:
                raise ValueError(f"too many distinct {column} values for an int16 code")
            codes[value] = len(codes)
            self._attrs["vocab"] = {**self._attrs["vocab"], column: list(codes)}
        return codes[value]

    def _decode(self, column: str, codes: np.ndarray) -> np.ndarray:
        vocab = np.asarray(self._vocab(column), dtype=str)
        if len(codes) and (codes.min() < 0 or codes.max() >= len(vocab)):
            raise StoreCorruptError(f"{self._url}: a code column holds codes outside attrs.vocab.{column}")
        return vocab[codes]

    def _array(self, path: str) -> Any:
        if path not in self._arrays:
            self._arrays[path] = self._root[path]
        return self._arrays[path]

    def _read_column(self, table: str, column: str, start: int, stop: int) -> np.ndarray:
        """A column's committed rows; one added after the store's version reads its fill value."""
        if holds_array(f"{table}/{column}", self.schema_version):
            return self._read(f"{table}/{column}", start, stop)
        spec = next((c for c in COLUMNS[table] if c.name == column), None)
        if spec is None:
            raise KeyError(f"unknown column {column!r} of table {table!r}")
        return np.full(stop - start, spec.fill, dtype=spec.dtype)

    def _read(self, path: str, start: int, stop: int) -> np.ndarray:
        try:
            return np.asarray(self._array(path)[start:stop])
        except Exception as exc:
            raise StoreCorruptError(f"{self._url}: cannot read {path}[{start}:{stop}]: {exc}") from exc

    def _read_metrics(self, start: int, stop: int, columns: Iterable[str] | None) -> dict[str, np.ndarray]:
        names = self._attrs["metric_names"]
        wanted = [n for n in names if columns is None or f"metrics/{n}" in columns]
        if not wanted:
            return {}
        block = self._read(f"updates/{METRICS_ARRAY}", start, stop)
        return {f"metrics/{n}": block[:, names.index(n)] for n in wanted}

    def _refresh(self) -> None:
        """Readers re-read the commit record so that rows flushed by a live writer become visible."""
        if self._mode == "r":
            self._root = _open_group(self._url, "r", self._storage_options)
            committed = self._attrs["committed"]
            self._attrs = dict(self._root.attrs)
            if self._attrs["committed"] != committed:  # arrays grew: their cached shapes are stale
                self._arrays = {}

    def _commit(self, committed: dict[str, int]) -> None:
        self._attrs["committed"] = committed
        self._root.attrs.update({k: self._attrs[k] for k in ("committed", "vocab", "metric_names")})

    def _ragged_ends(self, n_rows: int) -> dict[str, int]:
        ends = {}
        for name, spec in RAGGED.items():
            if n_rows == 0:
                ends[RAGGED_COUNTERS[name]] = 0
                continue
            last = self._read_table("trajectories", [spec.start_column, *spec.length_columns],
                                   rows=slice(n_rows - 1, n_rows), decode=False)
            ends[RAGGED_COUNTERS[name]] = int(sum(int(v[0]) for v in last.values()))
        return ends

    def _trim_uncommitted(self) -> None:
        committed = self._attrs["committed"]
        zio.trim_many([(self._array(path), int(committed[_counter(path)]))
                       for path in _array_paths(self.schema_version)])

    def _row_jobs(self, jobs: list, table: str, committed: dict[str, int]) -> None:
        """The buffered rows of a table of plain columns (dispatch, migrations): one tuple a row."""
        rows = self._pending[table]
        if rows:
            cols = {c.name: np.asarray([r[i] for r in rows], dtype=c.dtype) for i, c in enumerate(COLUMNS[table])}
            self._table_jobs(jobs, table, cols, committed)

    def _trajectory_jobs(self, jobs: list, committed: dict[str, int]) -> None:
        batches = self._pending["trajectories"]
        if not batches:
            return
        cols = {c.name: np.concatenate([b[0][c.name] for b in batches]) for c in COLUMNS["trajectories"]}
        cols["tokens_start"] += committed["tokens"]
        cols["response_start"] += committed["response_tokens"]
        flat = {name: np.concatenate([b[1][name] for b in batches]) for name in RAGGED}
        for name in RAGGED:
            jobs.append((self._array(f"ragged/{name}"), committed[RAGGED_COUNTERS[name]], flat[name]))
        committed["tokens"] += len(flat["tokens"])
        committed["response_tokens"] += len(flat["token_versions"])
        self._table_jobs(jobs, "trajectories", cols, committed)

    def _update_jobs(self, jobs: list, committed: dict[str, int]) -> None:
        pending = self._pending["updates"]
        if not pending:
            return
        cols = {c.name: np.asarray([r[0][i] for r in pending], dtype=c.dtype)
                for i, c in enumerate(COLUMNS["updates"])}
        names = self._attrs["metric_names"]
        block = np.full((len(pending), len(names)), np.nan)
        for row, (_, metrics) in enumerate(pending):
            for name, value in metrics.items():
                block[row, names.index(name)] = value
        jobs.append((self._array(f"updates/{METRICS_ARRAY}"), committed["updates"], block))
        self._table_jobs(jobs, "updates", cols, committed)

    def _table_jobs(self, jobs: list, table: str, cols: dict[str, np.ndarray], committed: dict[str, int]) -> None:
        jobs += [(self._array(f"{table}/{name}"), committed[table], data) for name, data in cols.items()]
        committed[table] += len(next(iter(cols.values())))
