"""A one-line live status of the run in the terminal.

    [dora] update 7 | newest v8 | live v6..v8 (3, K=2) | in flight 16 | reward 0.412 | 1,234 tok/s | 0:42

On a TTY the line is redrawn in place (carriage return) at most every `min_interval_s` (default 0.2 s); on a pipe or
log file each shown status is its own line, at most one every 5 s by default, so logs stay short. `close()` prints
the last status if rate limiting held it back, so the final state is always visible.

Simplified on purpose: no curses, no colours, no progress bar; the Dask dashboard and MLflow carry the detail.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Sequence, TextIO


def format_versions(live_versions: Sequence[int], max_staleness: int) -> str:
    live = sorted(set(int(v) for v in live_versions))
    if not live:
        return f"live - (K={max_staleness})"
    span = f"v{live[0]}" if len(live) == 1 else f"v{live[0]}..v{live[-1]}"
    return f"live {span} ({len(live)}, K={max_staleness})"


def format_rate(tokens_per_s: float) -> str:
    if not math.isfinite(tokens_per_s):
        return "- tok/s"
    return f"{tokens_per_s:,.0f} tok/s"


def format_elapsed(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def status_line(update: int, newest_version: int, live_versions: Sequence[int], in_flight: int, reward: float,
                tokens_per_s: float, max_staleness: int, elapsed_s: float, reward_failure_share: float = 0.0) -> str:
    reward_text = f"{reward:.3f}" if math.isfinite(reward) else "-"
    if reward_failure_share > 0:  # a failed reward counts as 0 in the mean: say how many there were
        reward_text += f" ({reward_failure_share:.0%} FAILED)"
    return (f"[dora] update {update} | newest v{newest_version} | {format_versions(live_versions, max_staleness)}"
            f" | in flight {in_flight} | reward {reward_text} | {format_rate(tokens_per_s)}"
            f" | {format_elapsed(elapsed_s)}")


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):  # no isatty, or a closed stream
        return False


class LiveView:
    """Prints the status line; does nothing when `enabled` is False."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None, min_interval_s: float | None = None,
                 clock=time.monotonic) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = _is_tty(self.stream)
        self.min_interval_s = min_interval_s if min_interval_s is not None else (0.2 if self.is_tty else 5.0)
        self._clock = clock
        self._started = clock()
        self._last_shown = -math.inf
        self._pending: str | None = None  # newest line not yet shown
        self._width = 0  # length of the line currently drawn (TTY)

    def update(self, update: int, newest_version: int, live_versions: Sequence[int], in_flight: int,
               reward: float, tokens_per_s: float, max_staleness: int, reward_failure_share: float = 0.0) -> None:
        if not self.enabled:
            return
        now = self._clock()
        self._pending = status_line(update, newest_version, live_versions, in_flight, float(reward),
                                    float(tokens_per_s), max_staleness, now - self._started, reward_failure_share)
        if now - self._last_shown >= self.min_interval_s:
            self._show(self._pending)
            self._last_shown = now

    def event(self, message: str) -> None:
        """A line of its own for something the operator must see (a lost trainer), above the status line."""
        if not self.enabled:
            return
        try:
            self.stream.write(("\r" + " " * self._width + "\r" if self.is_tty else "") + f"[dora] {message}\n")
            self.stream.flush()
        except (OSError, ValueError):
            self.enabled = False
        self._width = 0
        self._last_shown = -math.inf  # redraw the status line at once

    def close(self) -> None:
        if not self.enabled:
            return
        if self._pending is not None:
            self._show(self._pending)
        if self.enabled and self.is_tty and self._width:
            try:
                self.stream.write("\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass
        self._width = 0
        self.enabled = False

    def __enter__(self) -> "LiveView":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def _show(self, line: str) -> None:
        try:
            if self.is_tty:
                self.stream.write("\r" + line.ljust(self._width))
                self._width = len(line)
            else:
                self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # closed stream or broken pipe: the view is cosmetic, never fatal
            self.enabled = False
        self._pending = None
