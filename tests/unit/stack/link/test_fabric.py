"""stack/link/fabric.py's pure part: reading whether `lo` is up from `ip -o link show lo`."""

from __future__ import annotations

import pytest

from stack.link.fabric import loopback_up

ROOT_NS = (
    "1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN mode DEFAULT group default qlen 1000"
    "\\    link/loopback 00:00:00:00:00:00 brd 00:00:00:00:00:00"
)
FRESH_NS = (
    "1: lo: <LOOPBACK> mtu 65536 qdisc noop state DOWN mode DEFAULT group default qlen 1000"
    "\\    link/loopback 00:00:00:00:00:00 brd 00:00:00:00:00:00"
)


@pytest.mark.parametrize(
    ("line", "up"),
    [
        (ROOT_NS, True),
        (FRESH_NS, False),  # `unshare -Urn`: the rootless harness's own namespace
        ("1: lo: <LOOPBACK,UP> mtu 65536 qdisc noqueue state UNKNOWN", True),
        ("1: lo: <LOOPBACK,LOWER_UP> mtu 65536 state UP", False),  # "state UP" outside the flags is not the flag
        ("", False),
    ],
)
def test_lo_is_up_only_when_up_is_among_its_flags(line: str, up: bool) -> None:
    assert loopback_up(line) is up
