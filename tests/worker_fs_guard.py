"""Dask worker preload of tests/test_object_store.py: records every file access of this worker process under the
folders listed in DORA_FORBIDDEN_ROOTS (os.pathsep-separated: the driver's folders) to FORBIDDEN_LOG in the worker's
own folder (its working directory at start), through a Python audit hook (`sys.addaudithook`).

It sees what Python code opens, lists, creates, renames or removes (config.json, tokenizer files, torch.load,
copytree, ...); a native library opening a file by itself (safetensors' mmap) is not seen, but always after Python
code found the folder. The test checks the hook with a canary read before the run.
"""
from __future__ import annotations

import os
import sys

FORBIDDEN_LOG = "forbidden-access.log"
EVENTS = {"open", "os.listdir", "os.scandir", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.chdir",
          "shutil.copytree", "shutil.rmtree", "shutil.copyfile"}
ROOTS = [os.path.realpath(r) for r in os.environ.get("DORA_FORBIDDEN_ROOTS", "").split(os.pathsep) if r]
LOG = os.path.join(os.getcwd(), FORBIDDEN_LOG)


def _hook(event: str, args: tuple) -> None:
    if event not in EVENTS or not args or isinstance(args[0], int) or args[0] is None:
        return
    try:
        text = os.fsdecode(os.fspath(args[0]))
    except TypeError:
        return
    full = os.path.normpath(os.path.join(os.getcwd(), text))
    if any(full == root or full.startswith(root + os.sep) for root in ROOTS):
        with open(LOG, "a") as f:  # the log is in the worker's own folder: no recursion
            f.write(f"{event} {full}\n")


if ROOTS:
    sys.addaudithook(_hook)
