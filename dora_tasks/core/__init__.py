"""The ground floor every layer builds on: the typed configuration (`config`), the records that travel between tasks
(`records`) and the engine contracts (`contracts`).

Layers, each importing only those below it (checked by `tests/test_layers.py`): `dora_tasks.core` imports no other
module of the project; `storage` imports only `dora_tasks.core`; the rest of `dora_tasks` imports `dora_tasks.core`
and `storage`, never `pipelines`; `pipelines` imports anything. Nothing is imported here.
"""
