"""The dashboard and the alert rules: generated file up to date, PromQL valid (promtool), only metric names and
labels the router declares (its real registry, in process), bounded label sets, and the PromQL reader itself."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from router.metrics import Metrics
from tests.unit.deploy import promql

BOUNDED = {"endpoint", "mode", "outcome", "kind", "leg", "role", "worker", "source", "pool", "pod", "namespace", "le"}


def load_builder() -> ModuleType:
    path = promql.REPO / "deploy" / "tools" / "build_dashboard.py"
    spec = importlib.util.spec_from_file_location("kvpush_build_dashboard", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def router_labels() -> dict[str, set[str]]:
    """Series name → label names, from the router's own collectors (histograms: _bucket with le, _sum, _count)."""
    registry: CollectorRegistry = Metrics().registry
    out: dict[str, set[str]] = {}
    for collector in list(registry._collector_to_names):
        labels = set(getattr(collector, "_labelnames", ()))
        kind = getattr(collector, "_type", "")
        for name in registry._collector_to_names[collector]:
            out[name] = labels | ({"le"} if kind == "histogram" and name.endswith("_bucket") else set())
    return out


# --- the PromQL reader ------------------------------------------------------------------------------------------


def test_the_reader_finds_names_matchers_and_grouping() -> None:
    found = promql.usage(
        'histogram_quantile(0.99, sum by (mode, le) (rate(kvpush_ttft_seconds_bucket{namespace=~"$namespace"}'
        '[$__rate_interval]))) / on (mode) group_left sum(kvpush_in_flight) > 2 or absent(up{job="x", a!="b"})'
    )
    assert [(s.name, sorted(s.matchers)) for s in found.selectors] == [
        ("kvpush_ttft_seconds_bucket", ["namespace"]),
        ("kvpush_in_flight", []),
        ("up", ["a", "job"]),
    ]
    assert found.grouping == {"mode", "le"}


def test_the_reader_does_not_take_functions_keywords_or_strings_for_metrics() -> None:
    found = promql.usage(
        'sum without (pod) (increase(vllm:nixl_num_failed_transfers_total{x="rate(a[5m])"}[10m]))'
        " > bool 0 unless topk(3, foo offset 5m)"
    )
    assert found.names == {"vllm:nixl_num_failed_transfers_total", "foo"}
    assert found.grouping == {"pod"}


def test_the_reader_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError):
        promql.usage('kvpush_requests_total{outcome="ok" mode="push"}')


def test_exposition_declares_derived_series_names() -> None:
    text = "\n".join(
        [
            "# HELP a_seconds x",
            "# TYPE a_seconds histogram",
            "# HELP b_total x",
            "# TYPE b_total counter",
            "# HELP c x",
            "# TYPE c gauge",
            'c{role="prefill"} 1.0',
            "",
        ]
    )
    page = promql.Exposition(text)
    assert {"a_seconds_bucket", "a_seconds_sum", "a_seconds_count", "b_total", "c"} <= page.declared()
    assert page.exports("a_seconds_bucket") and not page.exports("a_seconds")
    assert page.labels_of("c") == {"role"}
    assert page.labels_of("b_total") is None


# --- the dashboard and the rules ---------------------------------------------------------------------------------


def test_the_committed_dashboard_is_what_the_builder_makes() -> None:
    builder = load_builder()
    assert promql.DASHBOARD.read_text() == builder.render(), "run: python deploy/tools/build_dashboard.py"


def test_the_dashboard_has_the_panels_an_operator_needs() -> None:
    board = json.loads(promql.DASHBOARD.read_text())
    exprs = " ".join(e for _, e in promql.dashboard_exprs())
    for needed in (
        "kvpush_requests_total",
        "kvpush_errors_total",
        "kvpush_ttft_seconds_bucket",
        "kvpush_e2e_seconds_bucket",
        "kvpush_decode_ttft_seconds_bucket",
        "kvpush_handoff_seconds_bucket",
        "kvpush_worker_in_flight",
        "kvpush_worker_healthy",
        "kvpush_pool_members",
        "kvpush_pool_healthy",
        "kvpush_admission_queued",
        "kvpush_admission_rejected_total",
        "kvpush_retries_total",
        "vllm:nixl_xfer_time_seconds_bucket",
        "vllm:nixl_bytes_transferred",
        "vllm:prompt_tokens_by_source_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert needed in exprs, f"no panel reads {needed}"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        assert panel["type"] == "row" or (panel["targets"] and panel["description"]), panel["title"]


def test_every_expression_names_known_kinds_of_metrics_with_bounded_labels() -> None:
    for where, expr in promql.all_exprs():
        found = promql.usage(expr)
        assert found.selectors, f"{where}: no metric in {expr!r}"
        for selector in found.selectors:
            assert selector.name.startswith(("kvpush_", "vllm:")) or selector.name in promql.SYNTHETIC, where
        unbounded = found.grouping - BOUNDED
        assert not unbounded, f"{where}: groups by {unbounded}, which are not bounded label sets"


def test_router_metric_names_and_labels_exist_in_the_router_registry() -> None:
    declared = router_labels()
    used = 0
    for where, expr in promql.all_exprs():
        found = promql.usage(expr)
        router_selectors = [s for s in found.selectors if s.name.startswith("kvpush_")]
        for selector in router_selectors:
            assert selector.name in declared, f"{where}: the router has no series {selector.name}"
            unknown = selector.matchers - declared[selector.name] - promql.TARGET_LABELS
            assert not unknown, f"{where}: {selector.name} has no label(s) {unknown}"
            used += 1
        if router_selectors and all(s.name.startswith("kvpush_") for s in found.selectors):
            have = set().union(*(declared[s.name] for s in router_selectors)) | promql.TARGET_LABELS
            assert found.grouping <= have, f"{where}: groups by {found.grouping - have}, not on the router's series"
    assert used > 20


def dashboard_as_rules(tmp_path: Path) -> Path:
    rules = [
        {"record": f"kvpush_dashboard:check_{i}", "expr": promql.substitute(expr)}
        for i, (_, expr) in enumerate(promql.dashboard_exprs())
    ]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    return path


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promql.require_promtool(), *args], input=stdin, capture_output=True, text=True, timeout=60, check=False
    )


def test_promtool_accepts_the_alert_rules() -> None:
    done = promtool("check", "rules", str(promql.RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 6 rules found" in done.stdout


def test_every_alert_fires_when_it_should_and_not_before(tmp_path: Path) -> None:
    """deploy/prometheus/rules.test.yml: synthetic series per alert, firing and quiet times, rendered text."""
    tests = promql.REPO / "deploy" / "prometheus" / "rules.test.yml"
    done = promtool("test", "rules", str(tests))
    assert done.returncode == 0, done.stdout + done.stderr
    covered = {
        case["alertname"]
        for test in yaml.safe_load(tests.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert covered == set(alerts()), f"alerts without a firing test: {set(alerts()) - covered}"


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    done = promtool("check", "rules", str(dashboard_as_rules(tmp_path)))
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_catches_a_broken_query(tmp_path: Path) -> None:
    path = tmp_path / "broken.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "x",
                        "rules": [{"record": "x:y", "expr": "sum by (mode (rate(kvpush_requests_total[5m]))"}],
                    }
                ]
            }
        )
    )
    assert promtool("check", "rules", str(path)).returncode != 0


def test_promtool_lints_the_router_exposition_clean() -> None:
    metrics = Metrics()
    metrics.requests.labels("chat", "push", "ok").inc()
    metrics.ttft.labels("chat", "push").observe(0.2)
    metrics.healthy.labels("prefill", "http://p:8000").set(1)
    content, _ = metrics.render()
    done = promtool("check", "metrics", stdin=content.decode())
    assert done.returncode == 0, done.stdout + done.stderr


def alerts() -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load(promql.RULES.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"]}


def test_the_alerts_cover_what_operators_are_paged_for() -> None:
    rules = alerts()
    assert 'kvpush_requests_total{outcome!="ok"}' in rules["KvpushErrorRatioHigh"]["expr"]
    assert "[5m]" in rules["KvpushErrorRatioHigh"]["expr"]
    assert "histogram_quantile(0.99" in rules["KvpushTTFTP99High"]["expr"]
    assert rules["KvpushNoHealthyPrefill"]["expr"] == 'kvpush_pool_healthy{role="prefill"} == 0'
    assert rules["KvpushNoHealthyDecode"]["expr"] == 'kvpush_pool_healthy{role="decode"} == 0'
    assert 'up{job="kvpush-router"} == 0' in rules["KvpushRouterDown"]["expr"]
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_promtool_accepts_the_plain_scrape_config_and_the_rules_it_loads() -> None:
    config = promql.REPO / "deploy" / "prometheus" / "prometheus.example.yml"
    done = promtool("check", "config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    jobs = {c["job_name"] for c in yaml.safe_load(config.read_text())["scrape_configs"]}
    assert jobs == {"kvpush-router", "kvpush-vllm"}  # the names the alert rules select on
