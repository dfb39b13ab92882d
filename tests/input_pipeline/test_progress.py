"""Progress lines: redrawn in place on a terminal, plain log lines elsewhere."""

import io
import logging

from absl import logging as absl_logging

from input_pipeline.progress import Progress, format_duration, track


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_one_line_is_redrawn_and_log_lines_start_on_a_clean_line(monkeypatch):
    monkeypatch.setattr("input_pipeline.progress._REDRAW_EVERY_S", 0.0)
    terminal = Terminal()
    handler = absl_logging.get_absl_handler()
    filters_before = list(handler.filters)
    with Progress("step", 100, unit="steps", stream=terminal, initial=40) as progress:
        progress.update(50, loss=0.12345)
        assert terminal.getvalue().startswith("\r\033[Kstep 50/100 steps | ")
        assert "loss 0.1235" in terminal.getvalue() and "ETA" in terminal.getvalue()
        assert len(handler.filters) == len(filters_before) + 1
        handler.filters[-1].filter(logging.LogRecord("x", logging.INFO, "f", 1, "msg", None, None))
        assert terminal.getvalue().endswith("\r\033[K")  # a log record first clears the live line
    assert terminal.getvalue().endswith("\n")
    assert handler.filters == filters_before


def test_elsewhere_plain_log_lines_at_the_interval(monkeypatch):
    logged = []
    monkeypatch.setattr(absl_logging, "info", lambda fmt, *args: logged.append(fmt % args))
    stream = io.StringIO()  # not a terminal
    list(track(range(3), "eval", 3, unit="batches", log_every_s=0.0, stream=stream))
    assert stream.getvalue() == ""
    assert [line.split(" | ")[0] for line in logged] == ["eval 1/3 batches", "eval 2/3 batches", "eval 3/3 batches"]
    logged.clear()
    list(track(range(3), "eval", 3, log_every_s=None, stream=stream))  # the caller logs on its own
    assert logged == []


def test_durations():
    assert format_duration(249) == "4m09s"
    assert format_duration(3900) == "1h05m"
    assert format_duration(-3) == "0m00s"
