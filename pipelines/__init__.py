"""DORA on Dask: the driver side. `from pipelines import Pipeline` is the Python API (`pipelines.api`); it is
imported on first use, so that `dora --help` and the light modules load nothing heavy."""
from __future__ import annotations

__all__ = ["Pipeline"]


def __getattr__(name: str):
    if name == "Pipeline":
        from pipelines.api import Pipeline

        return Pipeline
    raise AttributeError(f"module 'pipelines' has no attribute {name!r}")
