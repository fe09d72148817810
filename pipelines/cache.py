"""The driver machine's cache of what runs build once and reuse: warm-started policies (`run.initial_policy`) and an
empty MLflow store (`tracking`). `$DORA_CACHE`, else `~/.cache/dora`."""
from __future__ import annotations

import os


def cache_root() -> str:
    return os.environ.get("DORA_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dora"))
