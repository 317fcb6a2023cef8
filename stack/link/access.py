"""May this process build a link? Root (or CAP_NET_ADMIN + CAP_SYS_ADMIN in its user namespace), else no.

Without root the link works inside an unprivileged user namespace (`unshare -Urn`: research 7.4): the whole
harness then runs in it, and what it serves is reachable only from inside (`user_namespace_argv()`;
`kvpush stack --link` re-runs itself that way). Where neither works, `require_access()` refuses with one line.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

__all__ = ["LinkUnavailable", "can_admin_network", "require_access", "user_namespace_argv", "user_namespaces_work"]

_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21
USERNS_PREFIX = ("unshare", "--user", "--map-root-user", "--net", "--")


class LinkUnavailable(RuntimeError):
    """This process cannot make network namespaces; the message is the one line to show."""


def effective_caps(status: str) -> int:
    """The CapEff mask from the text of /proc/<pid>/status."""
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def can_admin_network(status_path: Path = Path("/proc/self/status")) -> bool:
    """Whether this process may create namespaces, veths and qdiscs here (root, or root of its user namespace)."""
    caps = effective_caps(status_path.read_text())
    return all(caps >> bit & 1 for bit in (_CAP_NET_ADMIN, _CAP_SYS_ADMIN))


def user_namespaces_work() -> str | None:
    """None when `unshare -Urn true` works for this user; else its error, in one line."""
    try:
        done = subprocess.run([*USERNS_PREFIX, "true"], capture_output=True, text=True, timeout=10.0, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or [f"status {done.returncode}"])[-1]


def user_namespace_argv(argv: Sequence[str]) -> list[str]:
    """`argv` run as root of a new user namespace with its own network namespace (the rootless link)."""
    return [*USERNS_PREFIX, *argv]


def require_access() -> None:
    """Return when this process can build a link; raise LinkUnavailable with the one line to show otherwise."""
    if can_admin_network():
        return
    error = user_namespaces_work()
    if error is None:
        raise LinkUnavailable(
            "the link needs root or a user namespace: run the harness as "
            f"`{' '.join(USERNS_PREFIX)} COMMAND` (kvpush stack --link does this itself)"
        )
    raise LinkUnavailable(
        f"network emulation needs root or unprivileged user namespaces (`unshare -Urn true`: {error}); "
        "without it KV transfers between local engines use cma and cost ~0"
    )
