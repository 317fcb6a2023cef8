"""Where a profiled router's time went: a cProfile dump folded into the categories issue 9 asks about.

Self time (pstats `tottime`) per function, summed by category from the function's file (or, for C builtins,
its name). cProfile slows Python code several-fold, so read the shares, not the absolute milliseconds.
"""

import json
import pstats
from pathlib import Path
from typing import Any

# (category, substrings of the file path); the first match wins, so specific entries come first
BY_FILE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("parse + shaping (protocol, JSON)", ("router/protocol.py", "router/values.py", "json/", "msgspec", "orjson")),
    ("SSE relay", ("router/sse.py", "router/answer.py")),
    (
        "legs: upstream client",
        (
            "router/legs/",
            "router/upstream.py",
            "/httptools/",
            "aiohttp",
            "httpx",
            "httpcore",
            "yarl",
            "multidict",
            "h2/",
            "anyio/",
        ),
    ),
    ("metrics", ("prometheus_client", "router/metrics.py")),
    ("logging", ("logging/", "router/logs.py")),
    ("timings", ("router/timings.py",)),
    (
        "dispatch, pool, admission, policy",
        (
            "router/dispatch.py",
            "router/workers/pool.py",
            "router/admission.py",
            "router/policy.py",
            "router/decider",
            "router/service.py",
            "router/domain.py",
            "router/errors.py",
        ),
    ),
    (
        "HTTP server (uvicorn, ASGI, FastAPI)",
        ("uvicorn", "h11", "httptools", "starlette", "fastapi", "pydantic", "router/app.py", "router/asgi"),
    ),
    ("tasks + event loop", ("asyncio/", "uvloop", "selectors.py", "contextvars", "_weakrefset.py")),
    ("copies (deepcopy, dataclass asdict)", ("/copy.py", "/dataclasses.py")),
    ("profiler switch", ("loadtest/bench/profiled.py",)),
)
BY_BUILTIN: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("parse + shaping (protocol, JSON)", ("json", "msgspec", "orjson", "loads", "dumps", "encode", "decode")),
    ("socket + poll syscalls", ("socket", "select", "epoll", "poll", "send", "recv", "sock_")),
    ("tasks + event loop", ("_asyncio", "Task", "Future", "call_soon", "run_once", "_run")),
)


def category(filename: str, funcname: str) -> str:
    if filename == "~":
        for name, keys in BY_BUILTIN:
            if any(k in funcname for k in keys):
                return name
        return "other C builtins"
    path = filename.replace("\\", "/")
    for name, keys in BY_FILE:
        if any(k in path for k in keys):
            return name
    return "other Python"


def breakdown(prof: Path, requests: int, top: int = 15) -> dict[str, Any]:
    """Self time by category (ms per request) and the top functions, from a cProfile dump of `requests`."""
    st = pstats.Stats(str(prof))
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = st.stats  # type: ignore[attr-defined]
    cats: dict[str, float] = {}
    funcs: list[tuple[float, str]] = []
    for (filename, line, func), (_, _, tt, _, _) in raw.items():
        cat = category(filename, func)
        cats[cat] = cats.get(cat, 0.0) + tt
        short = "/".join(Path(filename).parts[-2:])
        funcs.append((tt, f"{short}:{line}({func}) [{cat}]"))
    total = sum(cats.values())
    n = max(requests, 1)
    return {
        "requests": requests,
        "total_s": total,
        "per_request_ms": {k: 1000 * v / n for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "share": {k: v / total for k, v in sorted(cats.items(), key=lambda kv: -kv[1])} if total > 0 else {},
        "top": [[name, 1000 * tt / n] for tt, name in sorted(funcs, reverse=True)[:top]],
    }


def write(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
