"""The run's clock: wall time, or emulated time running `scale` times faster (emulated engines).

Every timestamp the pipeline records (dispatch, a group's start and end, an update's start and end, a publish, the
rollout instances' busy spans) is taken with the run's clock, so every metric derived from them is in one unit:
wall seconds on real engines, emulated seconds under `rollout.engine=emulated` (design: "under emulated engines every
figure is in emulated seconds"). Emulated time is an affine map of wall time, ``origin + (wall - origin) * scale``,
the same in every process of the run (the driver fixes `origin` when the run opens), so a wall timestamp taken
anywhere converts exactly (`at`), and an emulated engine that sleeps ``cost / scale`` wall seconds advances the
clock by ``cost``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Clock:
    scale: float = 1.0  # emulated seconds per wall second (`emulation.speedup`); 1 = wall time
    origin: float = 0.0  # the wall time at which both clocks read the same

    @property
    def emulated(self) -> bool:
        return self.scale != 1.0

    @property
    def unit(self) -> str:
        """How a reader should take the figures: 'wall seconds' or 'emulated seconds (x20)'."""
        return f"emulated seconds (x{self.scale:g} wall)" if self.emulated else "wall seconds"

    def now(self) -> float:
        return self.at(time.time())

    def at(self, wall: float) -> float:
        """The clock's reading at wall time `wall` (`time.time()` of any process of the run)."""
        return self.origin + (wall - self.origin) * self.scale

    def span(self, wall_seconds: float) -> float:
        return wall_seconds * self.scale

    def sleep(self, seconds: float) -> None:
        """Let `seconds` of this clock pass."""
        if seconds > 0:
            time.sleep(seconds / self.scale)
