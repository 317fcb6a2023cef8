"""`Link`: the emulated network itself. Engines in their own namespaces, a bridge, one veth to the harness.

Topology (research turn3-netem.md 7.1): a fabric namespace holds a bridge `br0`; each engine namespace has one
NIC `kvn0` (address 10.231.S.N/24, no default route) whose peer is a port of the bridge; the harness's own
namespace (the router, the load generator, the tests) reaches the bridge through one veth `kvn-<fabric pid>h`
with 10.231.S.254/24, the only thing the link puts there. Shaping is a tbf on both ends of every engine NIC
(the engine's TX on `kvn0`, its RX on the bridge port), so every engine has its own NIC limit, as on real hosts.
Every namespace is owned by a `Holder`: when the harness ends, however it ends, the holders exit and the
kernel removes the namespaces, every veth (the host one with its peer), address and qdisc.

    with Link(shaping) as link:                # or Link(None): unshaped
        place = link.add("t-p0")               # stack.link.plan.Place: netns, address, device
        ...                                    # start the engine with place.argv_prefix() / place.env(...)
        link.shape(Shaping.for_rate(2e8))      # live: tc qdisc replace on every engine NIC, no restart
        link.nic_bytes("t-p0").tx              # bytes that left that engine's NIC
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from stack.link.access import require_access
from stack.link.holders import Holder, NetnsError, run
from stack.link.meter import NicMeter
from stack.link.plan import DEVICE, Place, Shaping, Subnet, pick_subnet

__all__ = ["BRIDGE", "LOCK_PATH", "Link", "NicBytes", "ensure_loopback", "loopback_up", "remove_stale_host_links"]

BRIDGE = "br0"
UPLINK = "up0"  # the host veth's end on the bridge
LOCK_PATH = Path("/tmp/kvpush-link.lock")  # held while a link picks its /24 and claims it
_HOST_NAME = re.compile(r"kvn-(\d+)h")
_DROPPED = re.compile(r"dropped (\d+)")


@dataclasses.dataclass(frozen=True)
class NicBytes:
    """Counters of one engine NIC (its own side: tx = bytes the engine sent onto the link; tx_packets = the
    packets that carried them, a TSO packet counting once when the shaper lets it through whole)."""

    rx: int
    tx: int
    tx_packets: int = 0


@dataclasses.dataclass
class _Member:
    place: Place
    holder: Holder
    port: str  # its NIC's peer on the bridge


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    fd = os.open(LOCK_PATH, os.O_RDONLY | os.O_CREAT, 0o644)  # read-only: another user's lock file works too
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def loopback_up(ip_link_lo: str) -> bool:
    """Whether `ip -o link show lo` says lo is up (UP among the flags in angle brackets)."""
    flags = ip_link_lo.partition("<")[2].partition(">")[0]
    return "UP" in flags.split(",")


def ensure_loopback() -> None:
    """Bring this namespace's `lo` up when it is down. The root namespace's is up; a fresh network namespace's is
    not, and that is where a rootless harness runs (`unshare -Urn`): its router, load generator and the engines'
    host-side ports all live on 127.0.0.1 (a bind there may even succeed while lo is down, then fail later)."""
    if not loopback_up(run(["ip", "-o", "link", "show", "lo"])):
        run(["ip", "link", "set", "lo", "up"])


def remove_stale_host_links() -> list[str]:
    """Delete host veths `kvn-<pid>h` whose fabric holder is gone (normally the kernel already did)."""
    removed = []
    for line in run(["ip", "-o", "link", "show"]).splitlines():
        fields = line.split(":", 2)
        name = fields[1].strip().split("@", 1)[0] if len(fields) > 2 else ""
        match = _HOST_NAME.fullmatch(name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            with contextlib.suppress(NetnsError):  # it may go by itself meanwhile
                run(["ip", "link", "del", name])
                removed.append(name)
    return removed


class Link:
    """One emulated network: `open()` (or `with`) makes the fabric, `add()` one namespace per engine."""

    def __init__(self, shaping: Shaping | None = None) -> None:
        self._shaping = shaping
        self._fabric: Holder | None = None
        self._subnet: Subnet | None = None
        self._members: dict[str, _Member] = {}

    # ---- lifecycle -------------------------------------------------------------------------

    def open(self) -> Link:
        """Make the fabric namespace, its bridge and the host veth; refuses with one line where it cannot."""
        if self._fabric is not None:
            raise RuntimeError("this link is already open")
        require_access()
        ensure_loopback()  # the harness's own namespace may be a fresh one (rootless): its lo starts down
        remove_stale_host_links()
        fabric = self._fabric = Holder("fabric")
        try:
            fabric.script(
                [
                    ["ip", "link", "set", "lo", "up"],
                    ["ip", "link", "add", BRIDGE, "type", "bridge", "forward_delay", "0"],
                    ["ip", "link", "set", BRIDGE, "up"],
                ]
            )
            run(
                [
                    "ip",
                    "link",
                    "add",
                    "name",
                    self.host_device,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    UPLINK,
                    "netns",
                    str(fabric.pid),
                ]
            )
            fabric.script([["ip", "link", "set", UPLINK, "master", BRIDGE], ["ip", "link", "set", UPLINK, "up"]])
            self._claim_subnet()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """End every holder (the kernel removes the namespaces, veths and qdiscs with them); idempotent."""
        if self._fabric is not None and self._subnet is not None:
            with contextlib.suppress(NetnsError):  # the kernel frees namespaces asynchronously: be explicit here
                run(["ip", "link", "del", self.host_device])
        holders = [m.holder for m in self._members.values()] + ([self._fabric] if self._fabric else [])
        for holder in holders:
            holder.close()
        self._members.clear()
        self._fabric = None
        self._subnet = None

    def __enter__(self) -> Link:
        return self.open()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ---- engines ---------------------------------------------------------------------------

    def add(self, name: str) -> Place:
        """A new namespace for engine `name` with its NIC on the bridge, shaped like the others."""
        fabric, subnet = self._open_parts()
        if name in self._members:
            raise ValueError(f"{name} already has a place on this link")
        slot = len(self._members)
        holder = Holder(name)
        member = _Member(Place(name, holder.netns, subnet.engine(slot)), holder, f"e{slot}")
        self._members[name] = member
        run(
            [
                "ip",
                "link",
                "add",
                "name",
                DEVICE,
                "netns",
                str(holder.pid),
                "type",
                "veth",
                "peer",
                "name",
                member.port,
                "netns",
                str(fabric.pid),
            ]
        )
        holder.script(
            [
                ["ip", "link", "set", "lo", "up"],
                ["ip", "addr", "add", subnet.cidr(member.place.address), "dev", DEVICE],
                ["ip", "link", "set", DEVICE, "up"],
            ]
        )
        fabric.script([["ip", "link", "set", member.port, "master", BRIDGE], ["ip", "link", "set", member.port, "up"]])
        self._shape_member(member, self._shaping, replace=False)
        return member.place

    def place(self, name: str) -> Place:
        return self._members[name].place

    @property
    def places(self) -> dict[str, Place]:
        return {name: m.place for name, m in self._members.items()}

    # ---- the link's state ------------------------------------------------------------------

    @property
    def shaping(self) -> Shaping | None:
        return self._shaping

    @property
    def host_device(self) -> str:
        """The harness side's veth (in the namespace the link was opened from)."""
        return f"kvn-{self._open_parts()[0].pid}h"

    @property
    def host_address(self) -> str:
        return self._open_parts()[1].host if self._subnet else ""

    def shape(self, shaping: Shaping | None) -> None:
        """Set every engine NIC's limit now (both directions); None removes it. Live: no restart."""
        for member in self._members.values():
            self._shape_member(member, shaping, replace=True)
        self._shaping = shaping

    def nic_bytes(self, name: str) -> NicBytes:
        """The byte counters of engine `name`'s NIC, read from /proc/<holder>/net/dev."""
        for line in self._members[name].holder.read_proc("dev").splitlines():
            label, _, counters = line.partition(":")
            if label.strip() == DEVICE:
                values = [int(v) for v in counters.split()]
                return NicBytes(rx=values[0], tx=values[8], tx_packets=values[9])
        raise NetnsError(f"{name}: no {DEVICE} in its namespace")

    def meter(self, name: str) -> NicMeter:
        """A byte meter on engine `name`'s NIC from now on: its `check(kv_bytes)` is a row's honesty check."""
        return NicMeter(self, name)

    def drops(self) -> int:
        """Packets the shapers dropped so far, over every engine NIC (both ends): should stay 0."""
        fabric, _ = self._open_parts()
        total = 0
        for member in self._members.values():
            for where, dev in ((member.holder, DEVICE), (fabric, member.port)):
                total += sum(int(n) for n in _DROPPED.findall(where.run(["tc", "-s", "qdisc", "show", "dev", dev])))
        return total

    def holder_pids(self) -> list[int]:
        """Every holder's PID (the fabric's first): the processes whose end removes the link."""
        fabric, _ = self._open_parts()
        return [fabric.pid, *(m.holder.pid for m in self._members.values())]

    # ---- internals -------------------------------------------------------------------------

    def _open_parts(self) -> tuple[Holder, Subnet]:
        if self._fabric is None:
            raise RuntimeError("open the link first")
        return self._fabric, self._subnet or Subnet(0)

    def _claim_subnet(self) -> None:
        fabric, _ = self._open_parts()
        with _subnet_lock():
            used = [w.split("/", 1)[0] for w in run(["ip", "-4", "-o", "addr", "show"]).split() if "/" in w]
            subnet = pick_subnet([a for a in used if a.count(".") == 3], start=fabric.pid % 256)
            run(["ip", "addr", "add", subnet.cidr(subnet.host), "dev", self.host_device])
            run(["ip", "link", "set", self.host_device, "up"])
        self._subnet = subnet

    def _shape_member(self, member: _Member, shaping: Shaping | None, *, replace: bool) -> None:
        fabric, _ = self._open_parts()
        for where, dev in ((member.holder, DEVICE), (fabric, member.port)):
            if shaping is not None:
                where.run(["tc", "qdisc", "replace", "dev", dev, "root", *shaping.tbf_args()])
            elif replace and self._shaping is not None:
                where.run(["tc", "qdisc", "del", "dev", dev, "root"])
