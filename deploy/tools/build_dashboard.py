"""Writes deploy/grafana/kvpush-dashboard.json from the panel list below (`python deploy/tools/build_dashboard.py`).

The JSON is committed; tests/unit/deploy checks that it equals what this script builds, that every PromQL
expression parses, and that it names only metrics the router or vLLM really export.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "grafana" / "kvpush-dashboard.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
NS = 'namespace=~"$namespace"'
RATE = "$__rate_interval"
WIDTH = 24
EXEMPLARS = (
    " With tracing on, the dots are exemplars: one observed request each, linked to its trace (hover, then the "
    "trace_id link; the Prometheus data source's exemplar link, deploy/grafana/datasources.example.yaml)."
)


@dataclass
class Panel:
    title: str
    description: str
    targets: list[tuple[str, str]]  # (expr, legend)
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 8
    height: int = 8
    extra: dict[str, Any] = field(default_factory=dict)
    exemplars: bool = False  # show the series' exemplars: each links to its trace (router tracing on)


def q(quantile: float, metric: str, by: str, where: str = NS) -> str:
    return f"histogram_quantile({quantile}, sum by ({by}, le) (rate({metric}_bucket{{{where}}}[{RATE}])))"


def p50_p99(metric: str, by: str, legend: str) -> list[tuple[str, str]]:
    return [(q(0.5, metric, by), f"p50 {legend}"), (q(0.99, metric, by), f"p99 {legend}")]


ROWS: list[tuple[str, list[Panel]]] = [
    (
        "Traffic and errors",
        [
            Panel(
                "Requests / s by endpoint and mode",
                "Client requests finished per second, by OpenAI endpoint and dispatch mode (push or pull).",
                [(f"sum by (endpoint, mode) (rate(kvpush_requests_total{{{NS}}}[{RATE}]))", "{{endpoint}} {{mode}}")],
                unit="reqps",
            ),
            Panel(
                "Error ratio (not ok / all)",
                'Share of finished requests whose outcome is not "ok" (an error kind or client_gone), over 5 min. '
                "The KvpushErrorRatioHigh alert fires above 5 %.",
                [
                    (
                        f'sum(rate(kvpush_requests_total{{outcome!="ok", {NS}}}[5m])) '
                        f"/ sum(rate(kvpush_requests_total{{{NS}}}[5m]))",
                        "error ratio",
                    )
                ],
                unit="percentunit",
            ),
            Panel(
                "Errors / s by kind",
                "Router errors by kind: bad_request (the client's body), connect / timeout / status / protocol "
                "(a worker failed a leg), no_worker (a pool had no healthy member). client_gone: the client left.",
                [
                    (f"sum by (kind) (rate(kvpush_errors_total{{{NS}}}[{RATE}]))", "{{kind}}"),
                    (f'sum(rate(kvpush_requests_total{{outcome="client_gone", {NS}}}[{RATE}]))', "client_gone"),
                ],
                unit="reqps",
            ),
        ],
    ),
    (
        "Latency (router side)",
        [
            Panel(
                "Router TTFT p50 / p99 by mode",
                "Request arrival at the router to the first byte relayed to the client." + EXEMPLARS,
                p50_p99("kvpush_ttft_seconds", "mode", "{{mode}}"),
                unit="s",
                exemplars=True,
            ),
            Panel(
                "Router end-to-end p50 / p99 by mode",
                "Request arrival to the last byte relayed (whole generation).",
                p50_p99("kvpush_e2e_seconds", "mode", "{{mode}}"),
                unit="s",
            ),
            Panel(
                "TTFT p99 by decode worker",
                "Router TTFT by the decode worker that answered: one slow decode engine stands out here." + EXEMPLARS,
                [(q(0.99, "kvpush_decode_ttft_seconds", "pod, worker"), "{{pod}} {{worker}}")],
                unit="s",
                exemplars=True,
            ),
            Panel(
                "KV handoff p50 / p99 by mode",
                "Prefill leg answered to decode's first byte. In push mode the KV is written while decode waits; "
                "this is what push saves over pull." + EXEMPLARS,
                p50_p99("kvpush_handoff_seconds", "mode", "{{mode}}"),
                unit="s",
                exemplars=True,
            ),
            Panel(
                "Upstream leg p50 / p99",
                "Duration of each upstream leg: prefill to its answer, decode to its end.",
                p50_p99("kvpush_leg_seconds", "leg, mode", "{{leg}} {{mode}}"),
                unit="s",
                width=16,
            ),
        ],
    ),
    (
        "Workers and pools",
        [
            Panel(
                "In flight per worker",
                "Requests in flight through each router, per worker (pod: the router, worker: the vLLM instance).",
                [(f"sum by (pod, role, worker) (kvpush_worker_in_flight{{{NS}}})", "{{pod}} {{role}} {{worker}}")],
            ),
            Panel(
                "Worker health",
                "1 when the worker passes the health checks of the router in pod `pod`.",
                [(f"min by (pod, role, worker) (kvpush_worker_healthy{{{NS}}})", "{{pod}} {{role}} {{worker}}")],
                kind="state-timeline",
                extra={
                    "mappings": [
                        {
                            "type": "value",
                            "options": {
                                "0": {"text": "unhealthy", "color": "red"},
                                "1": {"text": "healthy", "color": "green"},
                            },
                        }
                    ]
                },
            ),
            Panel(
                "Pool members and healthy",
                "Workers per pool and how many are healthy (worst router view). Healthy 0 fires KvpushNoHealthy*.",
                [
                    (f"max by (role) (kvpush_pool_members{{{NS}}})", "{{role}} members"),
                    (f"min by (role) (kvpush_pool_healthy{{{NS}}})", "{{role}} healthy"),
                ],
            ),
            Panel(
                "Ejections / s by role",
                "Workers taken out of rotation after failures.",
                [(f"sum by (role) (rate(kvpush_ejections_total{{{NS}}}[{RATE}]))", "{{role}}")],
                unit="ops",
            ),
            Panel(
                "Worker /metrics scrape errors / s",
                "Failed reads of a worker's own load (vLLM /metrics) by the router, by role.",
                [(f"sum by (role) (rate(kvpush_scrape_errors_total{{{NS}}}[{RATE}]))", "{{role}}")],
                unit="ops",
            ),
            Panel(
                "Routers draining",
                "Routers that got SIGTERM and finish their streams before exiting.",
                [(f"sum(kvpush_draining{{{NS}}})", "draining")],
            ),
        ],
    ),
    (
        "Admission and retries",
        [
            Panel(
                "Client requests in flight and queued",
                "Requests being served, and requests waiting for admission (over all routers).",
                [(f"sum(kvpush_in_flight{{{NS}}})", "in flight"), (f"sum(kvpush_admission_queued{{{NS}}})", "queued")],
            ),
            Panel(
                "Admission rejections (429) / s",
                "Requests refused because the admission bound was reached: scale the pools or the routers.",
                [(f"sum(rate(kvpush_admission_rejected_total{{{NS}}}[{RATE}]))", "rejected")],
                unit="reqps",
            ),
            Panel(
                "Retries / s by failed leg",
                "Attempts retried with fresh ids on another worker, by the leg that failed.",
                [(f"sum by (leg) (rate(kvpush_retries_total{{{NS}}}[{RATE}]))", "{{leg}}")],
                unit="ops",
            ),
        ],
    ),
    (
        "vLLM engines and KV transfer",
        [
            Panel(
                "NIXL KV transfer time p50 / p99",
                "vLLM's NIXL transfer time per transfer, by pool (push: measured on prefill, which writes).",
                p50_p99("vllm:nixl_xfer_time_seconds", "pool", "{{pool}}"),
                unit="s",
            ),
            Panel(
                "NIXL KV bytes / s",
                "KV bytes moved per second by NIXL, by pool.",
                [(f"sum by (pool) (rate(vllm:nixl_bytes_transferred_sum{{{NS}}}[{RATE}]))", "{{pool}}")],
                unit="Bps",
            ),
            Panel(
                "NIXL bytes per transfer p50 / p99",
                "Size of one KV transfer: grows with prompt length.",
                p50_p99("vllm:nixl_bytes_transferred", "pool", "{{pool}}"),
                unit="bytes",
            ),
            Panel(
                "Prompt tokens / s by source",
                "Where each pool's prompt tokens came from. On decode, external_kv_transfer should carry almost "
                "everything: local_compute on decode means P/D is not happening (decode recomputes).",
                [
                    (
                        f"sum by (pool, source) (rate(vllm:prompt_tokens_by_source_total{{{NS}}}[{RATE}]))",
                        "{{pool}} {{source}}",
                    )
                ],
            ),
            Panel(
                "Requests running / waiting",
                "vLLM scheduler queues, by pool.",
                [
                    (f"sum by (pool) (vllm:num_requests_running{{{NS}}})", "{{pool}} running"),
                    (f"sum by (pool) (vllm:num_requests_waiting{{{NS}}})", "{{pool}} waiting"),
                ],
            ),
            Panel(
                "KV cache usage",
                "Share of each engine's KV cache in use (highest engine per pool, and the pool average).",
                [
                    (f"max by (pool) (vllm:kv_cache_usage_perc{{{NS}}})", "{{pool}} max"),
                    (f"avg by (pool) (vllm:kv_cache_usage_perc{{{NS}}})", "{{pool}} avg"),
                ],
                unit="percentunit",
            ),
            Panel(
                "NIXL failed transfers",
                "KV transfers that failed, by pool (the KvpushKVTransferFailures alert fires on any).",
                [(f"sum by (pool) (increase(vllm:nixl_num_failed_transfers_total{{{NS}}}[{RATE}]))", "{{pool}}")],
                width=16,
            ),
        ],
    ),
]


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit, **panel.extra}
    if panel.kind == "timeseries":
        defaults["custom"] = {"fillOpacity": 10, "showPoints": "never"}
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DS,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {
                "datasource": DS,
                "expr": expr,
                "legendFormat": legend,
                "refId": chr(ord("A") + i),
                **({"exemplar": True} if panel.exemplars else {}),
            }
            for i, (expr, legend) in enumerate(panel.targets)
        ],
    }


def build() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    next_id, y = 1, 0
    for row_title, row in ROWS:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id, y, x = next_id + 1, y + 1, 0
        for panel in row:
            if x + panel.width > WIDTH:
                x, y = 0, y + panel.height
            panels.append(_panel(panel, next_id, x, y))
            next_id, x = next_id + 1, x + panel.width
        y += max(p.height for p in row)
    return {
        "title": "kvpush",
        "uid": "kvpush-overview",
        "description": "kvpush router and its vLLM prefill/decode pools (deploy/README.md explains each panel).",
        "tags": ["kvpush", "vllm", "llm-serving"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                },
                {
                    "name": "namespace",
                    "label": "Namespace",
                    "type": "query",
                    "datasource": DS,
                    "query": {"query": "label_values(kvpush_requests_total, namespace)", "refId": "namespace"},
                    "definition": "label_values(kvpush_requests_total, namespace)",
                    "includeAll": True,
                    "allValue": ".*",
                    "multi": True,
                    "current": {},
                    "refresh": 2,
                    "hide": 0,
                    "sort": 1,
                },
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if argv[1:] == ["--check"]:
        same = OUT.exists() and OUT.read_text() == text
        print(f"{OUT}: {'up to date' if same else 'stale: run python deploy/tools/build_dashboard.py'}")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
