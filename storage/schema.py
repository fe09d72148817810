"""The trajectory store's schema, declared once: tables, columns, dtypes, ragged arrays, attributes, errors.

`trajectory_store.py` builds and checks stores from these declarations and `docs/storage-schema.md` documents them
(a test checks that every column named here appears there). Bump `SCHEMA_VERSION` whenever an array is added,
removed, renamed or changes dtype or meaning; stores of another version are refused, never migrated silently, except
that a version-1 store (no migrations table) is read as one with an empty migrations table, and a store older than
version 3 (single-turn only: no loss mask, turns, tool calls or environment errors) as one whose every response token
is the model's, with one turn and no tool call; each is given what it lacks when it is opened for appending
(`TABLES_SINCE`, `ARRAYS_SINCE`: an added array reads its `fill` on the rows written before it existed).

Layout (zarr v3 group):
    /                       attrs: format, schema_version, meta, committed, vocab, metric_names
    /dispatch/<column>      one row per dispatched group (re-dispatch = new row, attempt + 1)
    /trajectories/<column>  one row per consumed trajectory (group fields repeated on each of its rows)
    /updates/<column>       one row per update; /updates/metrics is 2-D [rows, len(metric_names)]
    /migrations/<column>    one row per response handed over from one rollout instance to another (version 2)
    /ragged/loss_mask       which response tokens the model produced (1) and which an environment did (version 3)
    /ragged/<name>          flat per-token arrays; row i of trajectories owns [start_i, start_i + length_i)
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = 3
READABLE_SCHEMA_VERSIONS = (1, 2, 3)
FORMAT_NAME = "dora-trajectory-store"
TABLES = ("dispatch", "trajectories", "updates", "migrations")
TABLES_SINCE = {"migrations": 2}  # tables added after version 1: a store of an older version has none
ARRAYS_SINCE = {"trajectories/turns": 3, "trajectories/tool_calls": 3, "trajectories/env_error": 3,
                "ragged/loss_mask": 3}  # arrays added to existing tables: older stores read their fill value
METRICS_ARRAY = "metrics"  # 2-D float64 array in the updates group, one column per name in attrs["metric_names"]
VOCAB_COLUMNS = ("instance", "filtered", "reward_error", "env_error")  # the vocabularies in attrs["vocab"]
CODED_COLUMNS = {"instance": "instance", "filtered": "filtered", "reward_error": "reward_error",
                 "env_error": "env_error", "source": "instance", "target": "instance"}  # int16 code -> vocabulary
ERROR_COLUMNS = ("reward_error", "env_error")  # stored as `short_error`, at most REWARD_ERROR_MAX_VOCAB distinct
REWARD_ERROR_MAX_CHARS = 80  # reward errors are stored as their first line, cut to this length
REWARD_ERROR_MAX_VOCAB = 256  # distinct reward-error strings kept; later ones are coded as OTHER_ERROR
OTHER_ERROR = "<other>"


class StoreError(Exception):
    """Base class of the trajectory store's errors."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """No store at the given path."""


class StoreExistsError(StoreError, FileExistsError):
    """`create` found a store (or other data) at the path and `overwrite` was not given."""


class StoreSchemaError(StoreError):
    """The store was written with another schema version (or is not a trajectory store)."""


class StoreCorruptError(StoreError):
    """Arrays are missing, shorter than the committed row count, or unreadable."""


class StoreReadOnlyError(StoreError):
    """A write was attempted on a store opened with mode="r" (or after close)."""


class StoreLockedError(StoreError):
    """Another process holds the store's writer lock (zarr loses rows with two writers)."""


@dataclass(frozen=True)
class Column:
    name: str
    dtype: str
    doc: str
    fill: float | int | bool = -1  # read back for rows whose chunk is missing; -1 is invalid for every id column


@dataclass(frozen=True)
class RaggedArray:
    name: str
    dtype: str
    start_column: str  # trajectories column holding the row's first index into the flat array
    length_columns: tuple[str, ...]  # the row's length is the sum of these trajectories columns
    doc: str
    fill: float | int | None = None  # read back where a chunk is missing; None: -1 for integers, NaN for floats


_F = float("nan")

COLUMNS: dict[str, tuple[Column, ...]] = {
    "dispatch": (
        Column("group_id", "int64", "id of the dispatched group"),
        Column("prompt_id", "int64", "dataset id of the group's prompt"),
        Column("version", "int32", "policy version the group was dispatched on"),
        Column("attempt", "int16", "0 for the first dispatch, +1 for each re-dispatch after a lost instance"),
        Column("time", "float64", "wall time of the dispatch (seconds since the epoch)", _F),
    ),
    "trajectories": (
        Column("group_id", "int64", "id of the trajectory's group"),
        Column("prompt_id", "int64", "dataset id of the group's prompt"),
        Column("version", "int32", "policy version the group was dispatched on"),
        Column("instance", "int16", "rollout instance (code into attrs.vocab.instance: worker address)", 0),
        Column("attempt", "int16", "dispatch attempt that produced this group"),
        Column("start_time", "float64", "wall time the group started generating", _F),
        Column("end_time", "float64", "wall time the group's last trajectory finished", _F),
        Column("filtered", "int16", "filter that excluded the group from the loss (code into attrs.vocab.filtered; "
               "0 = '' = not filtered)", 0),
        Column("consumed_by", "int32", "update that consumed the group (it starts from version consumed_by)"),
        Column("consumed_time", "float64", "wall time the consuming batch was recorded", _F),
        Column("sample_idx", "int16", "index of the trajectory in its group, 0..G-1"),
        Column("reward", "float32", "scalar reward (NaN when the reward function failed)", _F),
        Column("reward_error", "int16", "reward failure (code into attrs.vocab.reward_error; 0 = '' = none)", 0),
        Column("advantage", "float32", "group-relative advantage used by the loss", _F),
        Column("finished", "bool", "True when the response ended with EOS, False when cut at max_new_tokens", False),
        Column("prompt_len", "int32", "number of prompt tokens"),
        Column("response_len", "int32", "number of response tokens"),
        Column("tokens_start", "int64", "first index of the row's prompt+response tokens in ragged/tokens"),
        Column("response_start", "int64",
               "first index of the row's response in ragged/token_versions, behaviour_logprobs and loss_mask"),
        Column("turns", "int16", "model turns of the episode (1 for a single-turn response)", 1),
        Column("tool_calls", "int16", "environment steps of the episode that ran a tool", 0),
        Column("env_error", "int16", "environment failure that ended the episode (code into attrs.vocab.env_error; "
               "0 = '' = none)", 0),
    ),
    "updates": (
        Column("update", "int32", "update index u (starts from version u)"),
        Column("start", "float64", "wall time the update started", _F),
        Column("end", "float64", "wall time the update ended", _F),
        Column("published_version", "int32", "version the update published (u + 1)"),
        Column("publish_seconds", "float64", "seconds spent publishing the new weights", _F),
    ),
    "migrations": (
        Column("group_id", "int64", "id of the group whose response moved"),
        Column("attempt", "int16", "dispatch attempt of the group"),
        Column("sample_idx", "int16", "index of the response in its group, 0..G-1"),
        Column("version", "int32", "version of the session that handed the response over"),
        Column("target_version", "int32", "version of the tokens the receiving instance produced (-1: none)"),
        Column("source", "int16", "instance that handed it over (code into attrs.vocab.instance)", 0),
        Column("target", "int16", "instance that continued it (code into attrs.vocab.instance)", 0),
        Column("bytes", "int64", "bytes of the continuation: token arrays, KV cache and sampler state"),
        Column("reprefill_tokens", "int32", "tokens the receiver encoded again (0 when the KV cache travelled)"),
        Column("seconds", "float64", "seconds taking it in: inserting its cache or re-encoding it", _F),
        Column("handed_over_time", "float64", "time the response left the source's batch", _F),
        Column("adopted_time", "float64", "time it joined the receiver's session", _F),
    ),
}

RAGGED: dict[str, RaggedArray] = {
    "tokens": RaggedArray("tokens", "int32", "tokens_start", ("prompt_len", "response_len"),
                          "prompt token ids followed by response token ids"),
    "token_versions": RaggedArray("token_versions", "int32", "response_start", ("response_len",),
                                  "policy version that produced each response token"),
    "behaviour_logprobs": RaggedArray("behaviour_logprobs", "float32", "response_start", ("response_len",),
                                      "log-prob of each response token under the policy that sampled it"),
    "loss_mask": RaggedArray("loss_mask", "int8", "response_start", ("response_len",),
                             "1 on response tokens the model produced, 0 on an environment's (left out of the loss)",
                             fill=1),
}

# Commit counters in attrs["committed"]: rows of each table plus the used length of each flat ragged array.
RAGGED_COUNTERS = {"tokens": "tokens", "token_versions": "response_tokens", "behaviour_logprobs": "response_tokens",
                   "loss_mask": "response_tokens"}


@dataclass(frozen=True)
class ChunkSizes:
    """Rows per chunk (elements for ragged arrays). Appends are buffered to these sizes (see stack-notes: zarr)."""

    dispatch: int = 8192
    trajectories: int = 8192
    updates: int = 1024
    migrations: int = 8192
    ragged: int = 1 << 18
    metric_columns: int = 64

    def rows(self, table: str) -> int:
        return int(getattr(self, table))


def tables_of(schema_version: int) -> tuple[str, ...]:
    """The tables a store of `schema_version` holds."""
    return tuple(t for t in TABLES if TABLES_SINCE.get(t, 1) <= schema_version)


def holds_array(path: str, schema_version: int) -> bool:
    """Whether a store of `schema_version` holds the array at `path` ("table/column" or "ragged/name")."""
    return ARRAYS_SINCE.get(path, 1) <= schema_version and path.split("/")[0] in (*tables_of(schema_version),
                                                                                   "ragged")


def ragged_fill(spec: RaggedArray) -> float | int:
    if spec.fill is not None:
        return spec.fill
    return -1 if spec.dtype.startswith("int") else float("nan")


def short_error(text: str) -> str:
    """The stored form of a reward error: its first line, cut to REWARD_ERROR_MAX_CHARS."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first[:REWARD_ERROR_MAX_CHARS]
