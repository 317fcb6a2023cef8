"""The suite's per-bypass check: the routers' 'bypass checked' log lines against their bypassed requests."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from loadtest.bench.suites.multiturn import checks
from router.logs import JsonFormatter


def line(rid: str, predicted: int, computed: int, msg: str = "bypass checked: predicted 1 uncached") -> str:
    fields = {"request_id": rid, "exact": True, "predicted_uncached_tokens": predicted, "computed_tokens": computed}
    return json.dumps({"ts": "t", "level": "info", "logger": "kvpush.decider", "msg": msg, **fields})


def test_the_routers_own_log_line_is_read() -> None:
    """The router's JsonFormatter puts the decider's fields at the top level, where the suite reads them."""
    record = logging.LogRecord("kvpush.decider", logging.INFO, "f", 1, "bypass checked: x", (), None)
    record.fields = {"request_id": "mt-1-t2", "predicted_uncached_tokens": 3, "computed_tokens": 3}
    parsed = json.loads(JsonFormatter().format(record))
    assert checks.verdict([parsed], {"mt-1-t2"})["equal"] == 1


def test_lines_of_the_run_are_read_and_each_bypass_judged(tmp_path: Path) -> None:
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("\n".join([line("mt-1-t2", 70, 70), "not json bypass checked", line("old-1-t2", 5, 9)]) + "\n")
    b.write_text(line("mt-2-t3", 60, 188) + "\n" + json.dumps({"msg": "request done", "request_id": "mt-2-t3"}))
    found = checks.logged_checks([a, b, tmp_path / "missing.log"], "mt-")
    assert [c["request_id"] for c in found] == ["mt-1-t2", "mt-2-t3"]
    verdict = checks.verdict(found, {"mt-1-t2", "mt-2-t3", "mt-3-t2"})
    assert verdict == {
        "bypasses": 3,
        "checked": 2,
        "equal": 1,
        "exact_path": 2,
        "differ": [["mt-2-t3", 60, 188]],
        "unchecked": ["mt-3-t2"],
    }
