import io

from loadtest.progress import Progress, render


def test_render_and_counts() -> None:
    assert render("x", 5, 1, 10, 2.0).startswith("x [" + "#" * 15 + "." * 15 + "] 5/10 failed 1")
    out = io.StringIO()
    t = iter([0.0, 0.0, 0.05, 1.0, 1.0])
    p = Progress(3, out, lambda: next(t), "run", tty=True)
    p.update(True)
    p.update(False)
    p.update(True)
    assert (p.done, p.failed) == (3, 1)
    assert out.getvalue().count("\r") == 2  # second update came too soon to redraw; the last always draws
    assert "3/3 failed 1" in out.getvalue()


def test_off_a_terminal_it_writes_plain_lines_at_a_bounded_rate_and_the_last_one_once() -> None:
    out = io.StringIO()  # not a terminal: a log file
    now = [0.0]
    p = Progress(100, out, lambda: now[0], "run", log_interval_s=5.0)
    for k in range(99):
        now[0] = 0.1 * k  # 99 updates over 9.8 s: lines at 0 s and 5 s, not one per update
        p.update(k % 10 != 0)
    now[0] = 10.0
    p.update(True)  # the last request: always written
    p.close()  # already written: not again
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split("] ")[1].split(" failed")[0] for line in lines] == ["1/100", "51/100", "100/100"]
    assert lines[-1].startswith("run [" + "#" * 30 + "]") and "failed 10" in lines[-1]


def test_off_a_terminal_close_writes_the_state_not_yet_written() -> None:
    out = io.StringIO()
    now = [0.0]
    p = Progress(10, out, lambda: now[0], "run")
    p.update(True)
    now[0] = 1.0
    p.update(False)  # too soon for a line
    p.close()  # a run cut short: its last state still reaches the log
    assert [line.split("] ")[1].split("  ")[0] for line in out.getvalue().splitlines()] == [
        "1/10 failed 0",
        "2/10 failed 1",
    ]
