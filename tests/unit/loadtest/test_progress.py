import io

from loadtest.progress import Progress, render


def test_render_and_counts() -> None:
    assert render("x", 5, 1, 10, 2.0).startswith("x [" + "#" * 15 + "." * 15 + "] 5/10 failed 1")
    out = io.StringIO()
    t = iter([0.0, 0.0, 0.05, 1.0, 1.0])
    p = Progress(3, out, lambda: next(t), "run")
    p.update(True)
    p.update(False)
    p.update(True)
    assert (p.done, p.failed) == (3, 1)
    assert out.getvalue().count("\r") == 2  # second update came too soon to redraw; the last always draws
    assert "3/3 failed 1" in out.getvalue()
