"""Folding a cProfile dump into the router's cost categories (a real dump of a tiny function; no sockets)."""

import cProfile
import json
from pathlib import Path

from loadtest.bench import profiling


def test_categories_follow_the_file_or_the_builtin_name() -> None:
    assert profiling.category("/x/router/protocol.py", "prefill_body") == "parse + shaping (protocol, JSON)"
    assert profiling.category("/v/site-packages/aiohttp/client.py", "_request") == "legs: upstream client"
    assert profiling.category("/x/router/legs/http1.py", "send") == "legs: upstream client"
    server = profiling.category("/v/site-packages/uvicorn/protocols/http/httptools_impl.py", "send")
    assert server == "HTTP server (uvicorn, ASGI, FastAPI)", "uvicorn's httptools protocol is the server, not a leg"
    assert profiling.category("/v/site-packages/prometheus_client/metrics.py", "inc") == "metrics"
    assert profiling.category("/usr/lib/python3.11/asyncio/events.py", "_run") == "tasks + event loop"
    assert profiling.category("/usr/lib/python3.11/logging/__init__.py", "info") == "logging"
    assert profiling.category("~", "<method 'send' of '_socket.socket' objects>") == "socket + poll syscalls"
    assert profiling.category("<frozen abc>", "__instancecheck__") == "other Python"
    assert profiling.category("/x/router/sse.py", "frames") == "SSE relay"


def test_breakdown_reports_per_request_self_time_and_shares(tmp_path: Path) -> None:
    prof = cProfile.Profile()
    prof.enable()
    json.loads(json.dumps({"a": list(range(2000))}))
    prof.disable()
    out = tmp_path / "p.prof"
    prof.dump_stats(str(out))
    data = profiling.breakdown(out, requests=4)
    assert data["requests"] == 4 and data["total_s"] > 0
    assert abs(sum(data["share"].values()) - 1.0) < 1e-9
    assert data["per_request_ms"]["parse + shaping (protocol, JSON)"] > 0
    assert data["top"] and all(len(t) == 2 for t in data["top"])
    profiling.write(data, tmp_path / "sub" / "router-profile.json")
    assert json.loads((tmp_path / "sub" / "router-profile.json").read_text())["requests"] == 4
