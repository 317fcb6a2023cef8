"""Each bypass's prediction against what decode computed, request by request (issue 40: "predicted uncached
tokens equal decode's computed tokens exactly for every bypass").

A kvpush router with a decider logs one line per checked bypass (router/deciders/session_affinity.py,
"bypass checked", INFO, JSON): the client's x-request-id, the decode, exact or estimate path, the predicted
cached and uncached tokens and decode's reported prompt and cached tokens. The suite runs its decider fronts'
routers at INFO and reads those lines from their log files; the bypasses themselves come from each router's
/debug/timings (mode "bypass"). A bypass with no line had no usage to check against.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

CHECKED = "bypass checked"
SHOWN = 5  # differing and unchecked bypasses named in a row


def logged_checks(paths: Iterable[Path], prefix: str) -> list[dict[str, Any]]:
    """The 'bypass checked' lines of the routers' JSON logs whose request id starts with `prefix`."""
    out = []
    for path in paths:
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError as error:
            print(f"multiturn: no bypass checks from {path}: {error}")
            continue
        for line in lines:
            if CHECKED not in line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            rid = record.get("request_id")
            if isinstance(record, dict) and record.get("msg", "").startswith(CHECKED) and str(rid).startswith(prefix):
                out.append(record)
    return out


def bypass_ids(base: str, prefix: str) -> set[str]:
    """The request ids the router at `base` bypassed (its /debug/timings), of those starting with `prefix`."""
    try:
        records = httpx.get(f"{base}/debug/timings", timeout=30).raise_for_status().json()["requests"]
    except (httpx.HTTPError, KeyError, ValueError) as error:
        print(f"multiturn: no bypasses from {base}: {error}")
        return set()
    return {
        str(r["request_id"])
        for r in records
        if r.get("mode") == "bypass" and str(r.get("request_id", "")).startswith(prefix)
    }


def verdict(checks: Sequence[Mapping[str, Any]], bypassed: set[str]) -> dict[str, Any]:
    """{"bypasses", "checked", "equal", "exact_path", "differ", "unchecked"}: `equal` counts the checked
    bypasses whose predicted uncached tokens are decode's computed tokens exactly; `differ` and `unchecked` name
    the first few of the others (request id, predicted, computed) and of the bypasses with no check."""
    equal = [c for c in checks if c.get("predicted_uncached_tokens") == c.get("computed_tokens")]
    differ = [c for c in checks if c.get("predicted_uncached_tokens") != c.get("computed_tokens")]
    seen = {str(c.get("request_id")) for c in checks}
    return {
        "bypasses": len(bypassed),
        "checked": len(checks),
        "equal": len(equal),
        "exact_path": sum(1 for c in checks if c.get("exact") is True),
        "differ": [
            [c.get("request_id"), c.get("predicted_uncached_tokens"), c.get("computed_tokens")] for c in differ[:SHOWN]
        ],
        "unchecked": sorted(bypassed - seen)[:SHOWN],
    }
