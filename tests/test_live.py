"""LiveView: one compact status line; in-place refresh on a TTY, rate-limited plain lines otherwise."""
from __future__ import annotations

import io

from pipelines.live import LiveView, status_line


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def show(view: LiveView, update: int, reward: float = 0.5) -> None:
    view.update(update, update + 1, [update - 1, update, update + 1], 8, reward, 1234.5, 2)


def test_status_line_is_compact_and_complete():
    line = status_line(7, 8, [6, 7, 8], 16, 0.4123, 1234.4, 2, 42.0)
    assert line == ("[dora] update 7 | newest v8 | live v6..v8 (3, K=2) | in flight 16 | reward 0.412 | "
                    "1,234 tok/s | 0:42")
    assert "reward - " in status_line(0, 0, [0], 0, float("nan"), float("nan"), 0, 3700.0)
    assert len(line) < 110


def test_plain_stream_gets_rate_limited_lines_and_the_last_one_on_close():
    clock, out = FakeClock(), io.StringIO()
    view = LiveView(True, out, min_interval_s=5.0, clock=clock)
    show(view, 0)
    clock.t = 1.0
    show(view, 1)  # held back: within 5 s
    clock.t = 6.0
    show(view, 2)
    clock.t = 7.0
    show(view, 3)  # held back, printed by close()
    view.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["[dora] update 0", "[dora] update 2", "[dora] update 3"]
    assert "\r" not in out.getvalue()


def test_tty_redraws_in_place_and_ends_with_a_newline():
    clock, out = FakeClock(), FakeTTY()
    view = LiveView(True, out, clock=clock)
    show(view, 10)
    clock.t = 1.0
    show(view, 1)
    view.close()
    text = out.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1
    second = text.split("\r")[2]
    assert second.startswith("[dora] update 1 ") and len(second.rstrip("\n")) >= len(text.split("\r")[1])


def test_disabled_view_prints_nothing_and_broken_stream_is_not_fatal():
    out = io.StringIO()
    view = LiveView(False, out)
    show(view, 0)
    view.close()
    assert out.getvalue() == ""
    closed = io.StringIO()
    closed.close()
    view = LiveView(True, closed, min_interval_s=0.0)
    show(view, 0)
    view.close()
