"""Emulated engines for scale studies: timing models of GPU rollout and training engines, never a default.

`hardware` holds public specifications, `cost_model` turns them into seconds, `lengths` draws DAPO-Math-like response
lengths. Nothing here imports torch, so an emulated Dask worker costs tens of MB.
"""
