"""The soak's Markdown from its report."""

from __future__ import annotations

from loadtest.faults.soak.render import markdown


def test_the_figures_after_warm_up_and_the_verdict() -> None:
    samples = [{"t": t, "values": {"router rss_mib": 70.0 + t / 60, "d kv_usage": 0.01}} for t in (0, 60, 120, 180)]
    report = {
        "duration_s": 240.0,
        "warmup_s": 60.0,
        "capacity_jobs_s": 5.0,
        "rate_jobs_s": 3.0,
        "arrivals": 700,
        "outcomes": {"bad": {"400": 50}, "chat-json": {"200": 650}},
        "trends": [{"name": "router rss_mib", "first": 71.0, "last": 73.0, "grows": False, "change": 0.028}],
        "left": [],
        "write_shape_start": {"writes": 10.0},
        "write_shape_end": {},
        "samples": samples,
        "ok": True,
        "reasons": [],
    }
    text = markdown(report)
    assert "Traffic 4 min at 3.00 jobs/s (60% of the 5.00 jobs/s" in text and "**passed**" in text
    assert "| router rss_mib | 71.0 | 71.0 | 73.0 | 73.0 |" in text
    assert "| d kv_usage | 1.00% | 1.00% | 1.00% | 1.00% |" in text
    assert "bad: 400 x50; chat-json: 200 x650" in text and "Left at the end: nothing" in text
    assert "WRITE shape at the end: no WRITE" in text


def test_each_unexpected_outcome_is_listed_with_its_why() -> None:
    report = {
        "duration_s": 120.0,
        "warmup_s": 60.0,
        "capacity_jobs_s": 5.0,
        "rate_jobs_s": 3.0,
        "arrivals": 360,
        "outcomes": {"chat-stream": {"200": 359, "200 cut": 1}},
        "unexpected_details": [
            {"kind": "chat-stream", "label": "200 cut", "began_s": 90.0, "seconds": 2.5, "detail": "soak-ab: a|b"}
        ],
        "trends": [],
        "left": [],
        "write_shape_start": {},
        "write_shape_end": {},
        "samples": [],
        "ok": False,
        "reasons": ["1 unexpected outcomes of chat-stream"],
    }
    assert "| 1.5 | chat-stream | 200 cut | 2.5 | soak-ab: a/b |" in markdown(report)
