"""Prompt sets: the procedural countdown task, or prompts read from jsonl, parquet or a Hugging Face dataset.

`load_prompts(task_cfg, tokenizer, seed)` returns `(train, eval)` lists of `records.Prompt`. Every row must hold
`task.prompt_key` and `task.answer_key`; a row without them raises `DatasetError` naming the file, the row and the
key, before any work starts. Each prompt carries its whole row (`Prompt.row_json`), which the reward function
receives as `row`. `task.num_prompts` sizes the procedural task only; a file dataset uses all its rows.

Simplified: files are read whole into memory (prompt sets are small next to rollouts); the eval set of a file dataset
is its last `task.eval_prompts` rows after a seeded shuffle, not a separate split; `hf:<name>[:split]` (or
`hf:<name>:<config>:<split>`) is read with `datasets.load_dataset` (offline here: a cached hub dataset) or, for a
folder written by `save_to_disk`, with `load_from_disk`. A row travels with its prompt to the rollout and reward
tasks, so very large fields (images, long test suites) cost their size on every dispatch; values JSON cannot hold
(dates, bytes) reach the reward as their `str()`.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable

import numpy as np

from dora_tasks.core.config import TaskConfig
from dora_tasks.core.records import Prompt
from dora_tasks.model import render_messages
from dora_tasks.workloads import countdown

EVAL_SEED_OFFSET = 1_000_003  # countdown eval prompts use seed + this, so they never share the train stream


class DatasetError(ValueError):
    """A prompt dataset is missing, unreadable, or a row lacks a field the task needs; the message says which."""


def load_prompts(task_cfg: TaskConfig, tokenizer, seed: int, emulation=None) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval) prompts for the configured task; eval prompts are held out (disjoint ids). `emulation` (the
    `EmulationConfig`) is needed by task.name=emulated only, whose prompts are synthetic (no tokenizer)."""
    if task_cfg.name == "countdown":
        return countdown_prompts(task_cfg, tokenizer, seed)
    if task_cfg.name == "arithmetic":
        from dora_tasks.workloads import calculator

        return (calculator.make_prompts(task_cfg.num_prompts, seed, tokenizer),
                calculator.make_prompts(task_cfg.eval_prompts, seed + EVAL_SEED_OFFSET, tokenizer,
                                        start_id=task_cfg.num_prompts))
    if task_cfg.name == "emulated":
        from dora_tasks.emulation.task import emulated_prompts

        return emulated_prompts(task_cfg.num_prompts, task_cfg.eval_prompts, emulation, seed)
    rows = read_rows(task_cfg.dataset)
    prompts = rows_to_prompts(rows, task_cfg, tokenizer, source=task_cfg.dataset)
    return split_eval(prompts, task_cfg.eval_prompts, seed)


def countdown_prompts(task_cfg: TaskConfig, tokenizer, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    train = countdown.make_prompts(task_cfg.num_prompts, seed, tokenizer, task_cfg.max_count)
    held_out = countdown.make_prompts(task_cfg.eval_prompts, seed + EVAL_SEED_OFFSET, tokenizer, task_cfg.max_count,
                                      start_id=task_cfg.num_prompts)
    return train, held_out


def read_rows(source: str) -> list[dict[str, Any]]:
    """Rows of a `.jsonl` / `.parquet` file or of `hf:<name-or-folder>[:split]`, as dicts."""
    if source.startswith("hf:"):
        return read_hf(source[3:])
    if not os.path.isfile(source):
        raise DatasetError(f"dataset file {source!r} does not exist")
    if source.endswith(".jsonl"):
        return read_jsonl(source)
    if source.endswith(".parquet"):
        return read_parquet(source)
    raise DatasetError(f"dataset {source!r}: unsupported format; use .jsonl, .parquet or hf:<name>[:split]")


def read_jsonl(path: str) -> list[dict[str, Any]]:
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path!r} row {number}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path!r} row {number}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def read_parquet(path: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise DatasetError(f"{path!r}: cannot read parquet ({type(exc).__name__}: {exc})") from None


def read_hf(spec: str) -> list[dict[str, Any]]:
    """`name[:split]` or `name:config:split` (split defaults to train); a local folder written by `save_to_disk` is
    read with `load_from_disk`, anything else with `load_dataset` (offline here: only cached datasets)."""
    import datasets

    name, config, split = parse_hf_spec(spec)
    try:
        if os.path.isdir(name) and os.path.isfile(os.path.join(name, "dataset_dict.json")):
            data = datasets.load_from_disk(name)[split]
        elif os.path.isdir(name) and os.path.isfile(os.path.join(name, "dataset_info.json")):
            data = datasets.load_from_disk(name)
        else:
            data = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # not found, offline, bad split: all reported the same way
        raise DatasetError(f"hf:{spec}: cannot load ({type(exc).__name__}: {exc})") from None
    return list(data)


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """`name` -> (name, None, "train"); `name:split`; `name:config:split`."""
    parts = spec.split(":")
    if not parts[0] or len(parts) > 3 or not all(parts):
        raise DatasetError(f"hf:{spec}: expected hf:<name>[:split] or hf:<name>:<config>:<split>")
    if len(parts) == 3:
        return parts[0], parts[1], parts[2]
    return parts[0], None, parts[1] if len(parts) == 2 else "train"


def rows_to_prompts(rows: Iterable[dict[str, Any]], task_cfg: TaskConfig, tokenizer, source: str) -> list[Prompt]:
    """A prompt field may be text or a chat-message list ([{"role", "content"}], rendered by the tokenizer: the
    model's chat template for a pretrained tokenizer); keys may be dotted paths into nested fields
    (`reward_model.ground_truth`)."""
    prompts = []
    for number, row in enumerate(rows, start=1):
        prompt = required_field(row, task_cfg.prompt_key, source, number)
        answer = required_field(row, task_cfg.answer_key, source, number)
        if not isinstance(prompt, (str, list)):
            prompt = str(prompt)
        prompts.append(Prompt(prompt_id=number - 1, text=render_messages(prompt), answer=str(answer),
                              token_ids=tuple(tokenizer.prompt_ids(prompt)), row_json=row_json(row)))
    if not prompts:
        raise DatasetError(f"{source!r} holds no rows")
    return prompts


def row_json(row: dict[str, Any]) -> str:
    """The row as compact JSON text (`Prompt.row_json`); a value JSON cannot hold becomes its str()."""
    return json.dumps(row, ensure_ascii=False, separators=(",", ":"), default=str)


def required_field(row: dict[str, Any], key: str, source: str, number: int) -> Any:
    """`row[key]`, following a dotted key through nested fields; a missing or null field is a DatasetError."""
    value: Any = row
    for depth, part in enumerate(key.split(".")):
        if not isinstance(value, dict) or value.get(part) is None:
            where = key.split(".")[:depth]
            keys = ", ".join(map(str, value)) if isinstance(value, dict) else type(value).__name__
            inside = f" inside {'.'.join(where)!r}" if where else ""
            raise DatasetError(f"{source!r} row {number}: missing key {key!r} ({part!r} not found{inside}; "
                               f"keys there: {keys})")
        value = value[part]
    return value


def split_eval(prompts: list[Prompt], eval_size: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """Seeded shuffle, then the last `eval_size` prompts are held out (at most half of the set)."""
    order = np.random.default_rng(seed).permutation(len(prompts))
    shuffled = [prompts[i] for i in order]
    held = min(eval_size, len(prompts) // 2)
    return shuffled[:len(prompts) - held], shuffled[len(prompts) - held:]
