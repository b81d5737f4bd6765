"""`make demo` (common/demo.py) is never silent for long (issue 43.11: three silences of ~20 s: the
talker's warm-up, the gateway admitting it, the first answer shown only once its speech was done):
while it waits, a line saying what for comes at least every HEARTBEAT_S; `serve`'s own output is
relayed line by line; a log gets plain whole lines."""

from __future__ import annotations

import io
import subprocess
import sys
import time

from omnistage.common import demo

from tests.waits import wait_for


def test_a_wait_says_what_it_waits_for_whenever_nothing_else_was_shown(monkeypatch):
    monkeypatch.setattr(demo, "HEARTBEAT_S", 0.2)
    log = io.StringIO()
    console = demo.Console(log)
    steps = [0]
    with console.waiting(lambda: f"the pipeline is starting, step {steps[0]}"):
        wait_for(lambda: log.getvalue().count("\n") >= 2, 30, "two heartbeat lines")
        steps[0] = 7
        console.line("serve: something happened")
        wait_for(lambda: "step 7" in log.getvalue(), 30, "a heartbeat after the serve's line")
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("demo: the pipeline is starting, step 0 (")
    assert "serve: something happened" in lines
    assert lines[-1].startswith("demo: the pipeline is starting, step 7 (")
    shown = len(lines)
    time.sleep(0.5)
    assert len(log.getvalue().splitlines()) == shown, "no heartbeat once the wait is over"


def test_serves_output_is_relayed_line_by_line_and_keeps_the_heartbeat_quiet(monkeypatch):
    monkeypatch.setattr(demo, "HEARTBEAT_S", 60.0)
    log = io.StringIO()
    console = demo.Console(log)
    proc = subprocess.Popen(
        [sys.executable, "-c", "print('omnistage: started thinker r0'); print('talker r0 warming_up')"],
        stdout=subprocess.PIPE,
        text=True,
    )
    serve = demo.ServeOutput(proc, console)
    proc.wait(timeout=60)
    serve.join(30)
    assert log.getvalue().splitlines() == ["omnistage: started thinker r0", "talker r0 warming_up"]
    assert serve.last == "talker r0 warming_up"
    assert not console.tty and time.monotonic() - console.last < 60


def test_the_heartbeat_ends_a_streamed_line_first_on_a_terminal(monkeypatch):
    monkeypatch.setattr(demo, "HEARTBEAT_S", 0.2)

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    console = demo.Console(screen)
    with console.waiting(lambda: "text: 3 tokens so far"):
        console.partial("demo: text: answer: a b c")
        wait_for(lambda: "tokens so far" in screen.getvalue(), 30, "a heartbeat")
    assert screen.getvalue().startswith("demo: text: answer: a b c\ndemo: text: 3 tokens so far (")
