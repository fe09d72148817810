"""Emulated engines for scale studies: timing models of GPU rollout and training engines, never a default.

`hardware` holds public specifications, `cost_model` turns them into seconds, `lengths` draws DAPO-Math-like response
lengths; `rollout` and `trainer` are the emulated engines (`rollout.engine=emulated`, `train.engine=emulated`) and
`task` the synthetic prompts, responses and rewards (`task.name=emulated`). Nothing here imports torch, so an emulated
Dask worker costs tens of MB.
"""
