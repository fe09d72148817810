"""Records cross Dask's wire whole: a trajectory's arrays travel in band, not as a frame each."""
from __future__ import annotations

import numpy as np
from distributed.protocol import dumps, loads
from distributed.protocol.serialize import ToPickle

from dora_tasks.core.records import Group, Prompt, Trajectory


def trajectory(sample_idx: int) -> Trajectory:
    return Trajectory(7, sample_idx, np.arange(5, dtype=np.int32), np.arange(3, dtype=np.int64),
                      np.array([2, 2, 3], dtype=np.int32), np.array([-0.5, -1.0, -0.25], dtype=np.float32), False,
                      reward=1.0, reward_error="timeout", advantage=-0.5)


def test_a_group_is_one_frame_on_the_wire_and_comes_back_equal_and_writable():
    group = Group(7, Prompt(3, "count 1 step 1:", "1", (4, 5)), 2, "tcp://a:1", 1, [trajectory(i) for i in range(8)])
    frames = dumps({"group": ToPickle(group)})
    assert len(frames) <= 2  # header + payload; out-of-band arrays would add 32 frames
    back = loads(frames)["group"]
    assert (back.group_id, back.version, back.instance, back.attempt, back.prompt) == (7, 2, "tcp://a:1", 1, group.prompt)
    for a, b in zip(group.trajectories, back.trajectories):
        assert (b.sample_idx, b.finished, b.reward, b.reward_error, b.advantage) == (a.sample_idx, False, 1.0,
                                                                                      "timeout", -0.5)
        for name in ("prompt_ids", "response_ids", "versions", "behaviour_logprobs"):
            x, y = getattr(a, name), getattr(b, name)
            assert y.dtype == x.dtype and np.array_equal(x, y) and y.flags.writeable


def test_the_pickled_form_covers_every_field_of_a_trajectory():
    from dataclasses import fields

    _, (_group_id, _sample_idx, arrays, *rest) = trajectory(0).__reduce__()
    assert 2 + len(arrays) + len(rest) == len(fields(Trajectory)), "a field was added: update Trajectory.__reduce__"
