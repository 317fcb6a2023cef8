"""The multiturn suite on a link (`link=<preset>`, suite multiturn-link; with replicas, multiturn-replicas): the
engines in network namespaces behind a shaped link (stack.link), calibrated on P's prefill, the decider's bypass
threshold derived from the calibrated link, and each front's KV bytes checked on P's NIC."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from loadtest.bench.suites.multiturn.plan import MultiTurnPlan, on_link
from stack.link import bypass
from stack.link.calibrate import calibrate
from stack.link.fabric import Link
from stack.link.plan import Shaping, nominal_prefill_s, preset, resolve
from stack.tiny_model import SIZES


@contextlib.contextmanager
def maybe_link(plan: MultiTurnPlan) -> Iterator[Link | None]:
    """The plan's link, open (shaped at the nominal prefill until calibrated), or None on loopback."""
    if not plan.link:
        yield None
        return
    kv = plan.link_calibrate_tokens * SIZES[plan.model_size].kv_bytes_per_token()
    first = resolve(preset(plan.link), prefill_s=nominal_prefill_s(plan.link_calibrate_tokens), kv_bytes=kv)
    with Link(first.shaping or Shaping.for_rate(1e9)) as link:
        yield link


def calibrated(plan: MultiTurnPlan, link: Link, prefill_url: str) -> tuple[MultiTurnPlan, dict[str, Any]]:
    """The link shaped to the preset at P's measured prefill, the plan with the threshold it derives, and the
    calibration's record (each row of the run carries it)."""
    per_token = SIZES[plan.model_size].kv_bytes_per_token()
    cal = calibrate(
        link, preset(plan.link), prefill_url, prompt_tokens=plan.link_calibrate_tokens, kv_bytes_per_token=per_token
    )
    record = cal.record()
    plan = on_link(plan, cal.plan)
    record["link_bypass_max_uncached_tokens"] = dict(plan.decider_options)[bypass.OPTION]
    print(f"multiturn: on the link {record}")
    return plan, record
