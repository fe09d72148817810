"""Persistence of a run: what it generated and trained on, its weights and its checkpoints.

- `trajectory_store`: the zarr trajectory store (dispatches, consumed trajectories with per-token versions, updates);
  single writer, readable while the run is live. Schema in `schema` and `docs/storage-schema.md`.
- `audit`: checks C1-C3 and the multi-version timeline from the store alone (`python -m storage.audit <store>`).
- `weight_store`: one atomically published folder per policy version, with retention.
- `checkpoint`: atomic checkpoints (state.json + trainer/optimizer folders + COMPLETE marker) for resume.
- `objectstore`: local folder or object-store URL (s3://...) for every store: publication by marker, worker cache.
- `synthetic`: synthetic groups and runs for tests and the benchmark.

Nothing is imported here, so `import storage` stays cheap and free of side effects.
"""
