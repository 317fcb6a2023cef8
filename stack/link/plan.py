"""Pure decisions of the emulated P/D link: presets as ratios, the tbf they resolve to, addresses, engine env.

A preset does not name a rate. It names how long one prompt's KV transfer takes against one prefill on the
emulated network (`share` = transfer time / prefill time, kept equal to a real H200 pair's; research:
turn3-netem.md section 5). The rate follows from the run's own measured prefill and the KV bytes of one prompt:

    goodput = kv_bytes / (share * prefill_s);  tbf rate = goodput / FRAME_EFFICIENCY

so a faster or slower box keeps the same proportions. `resolve()` does that; `LinkPlan.record()` is what a
benchmark row carries. Nothing here touches the system: `stack.link.fabric` executes these plans.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from collections.abc import Collection, Mapping
from typing import Any

__all__ = [
    "DEVICE",
    "FAITHFUL_BIT_S",
    "FRAME_EFFICIENCY",
    "GSO_PACKET_BYTES",
    "NOMINAL_PREFILL_S_PER_TOKEN",
    "PRESETS",
    "LinkPlan",
    "Place",
    "Preset",
    "Shaping",
    "Subnet",
    "bytes_verdict",
    "engine_env",
    "nominal_prefill_s",
    "pick_subnet",
    "preset",
    "resolve",
]

# TCP payload per 1500-byte frame on the wire (1448 / 1514): tbf counts whole frames.
FRAME_EFFICIENCY = 1448 / 1514
# Above about 5 Gbit/s this box's two cores, not the shaper, set the pace (research 4.2): report it.
FAITHFUL_BIT_S = 5e9
# One whole TSO/GSO packet as tbf counts it: 64 KiB of TCP payload plus the headers of its ~45 frames. With a
# smaller bucket tbf splits every such packet into 1500-byte frames in software, and the kernel's per-frame work
# (the bridge, the receiver's TCP, its ACKs) runs on the engines' cores while P computes: about 19 ms of softirq
# per MiB on this box against 2 with whole packets. A real NIC segments in hardware and each host pays for its own
# side, so that cost is the emulation's artefact, not the network's.
GSO_PACKET_BYTES = 80 * 1024
# At least this bucket: a whole GSO packet, and never under 32 KiB, below which timer granularity caps the rate
# (research 2).
MIN_BURST_BYTES = max(32 * 1024, GSO_PACKET_BYTES)
BURST_SECONDS = 0.001  # a bucket of about 1 ms of traffic
LIMIT_BYTES = 32 * 1024 * 1024  # a deep queue: drops in the shaper are an artefact (research 2)
MIN_RATE_BIT_S = 100_000  # below this tbf's arithmetic and every test would crawl
# Before the run's prefill is measured: the benchmark's 120 ms per 1024 tokens (research 5.2).
NOMINAL_PREFILL_S_PER_TOKEN = 0.120 / 1024
DEVICE = "kvn0"  # every engine's one NIC, named the same in each namespace
BASE_NETWORK = ipaddress.IPv4Network("10.231.0.0/16")  # one /24 per link; nothing else uses it here


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named proportion: one prompt's KV transfer lasts `share` prefills. share None: no shaping at all."""

    name: str
    share: float | None
    emulates: str


PRESETS: Mapping[str, Preset] = {
    p.name: p
    for p in (
        Preset("efa-like", 0.038, "P5en EFA, 3.2 Tbit/s per node at 80 %: the transfer is 3.8 % of a prefill"),
        Preset("ethernet-100g-like", 1.09, "100 GbE, TCP at 90 %: the transfer is about one prefill (109 %)"),
        Preset("ethernet-25g-like", 4.38, "25 GbE, TCP at 90 %: the transfer is about 4.4 prefills (bandwidth-bound)"),
        Preset("unshaped", None, "namespaces and TCP but no rate limit (the veth's own speed, CPU-bound)"),
    )
}


def preset(name: str) -> Preset:
    """The preset called `name`; ValueError listing the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown link preset {name!r}; known: {', '.join(PRESETS)}") from None


@dataclasses.dataclass(frozen=True)
class Shaping:
    """One token bucket, applied to both directions of every engine's NIC."""

    rate_bit_s: int
    burst_bytes: int
    limit_bytes: int = LIMIT_BYTES

    def __post_init__(self) -> None:
        if self.rate_bit_s < MIN_RATE_BIT_S:
            raise ValueError(f"rate {self.rate_bit_s} bit/s is below the {MIN_RATE_BIT_S} bit/s this link supports")
        if self.burst_bytes < 1600 or self.limit_bytes < self.burst_bytes:
            raise ValueError("need burst >= 1600 bytes (one frame) and limit >= burst")

    @classmethod
    def for_rate(cls, rate_bit_s: float) -> Shaping:
        """A bucket of about 1 ms of traffic (at least one whole GSO packet) and a 32 MiB queue for `rate_bit_s`."""
        rate = max(MIN_RATE_BIT_S, math.ceil(rate_bit_s))
        return cls(rate, max(MIN_BURST_BYTES, math.ceil(rate / 8 * BURST_SECONDS)))

    def tbf_args(self) -> tuple[str, ...]:
        """The qdisc part of `tc qdisc add|change dev DEV root ...`."""
        return ("tbf", "rate", f"{self.rate_bit_s}bit", "burst", str(self.burst_bytes), "limit", str(self.limit_bytes))

    @property
    def goodput_bit_s(self) -> float:
        return self.rate_bit_s * FRAME_EFFICIENCY

    def wire_seconds(self, payload_bytes: int) -> float:
        """How long `payload_bytes` of TCP payload take at this rate once the bucket is empty."""
        return payload_bytes * 8 / self.goodput_bit_s


@dataclasses.dataclass(frozen=True)
class LinkPlan:
    """A preset resolved for one run: the shaping, and what it was derived from."""

    preset: Preset
    prefill_s: float
    kv_bytes: int  # KV bytes of one prompt (the run's prompt length x KV bytes per token)
    shaping: Shaping | None

    @property
    def faithful(self) -> bool:
        """Whether this box can shape at this rate (unshaped: never; above ~5 Gbit/s: the CPUs set the pace)."""
        return self.shaping is not None and self.shaping.rate_bit_s <= FAITHFUL_BIT_S

    @property
    def expected_transfer_s(self) -> float | None:
        return None if self.shaping is None else self.shaping.wire_seconds(self.kv_bytes)

    def record(self) -> dict[str, Any]:
        """What a benchmark row carries about the link (measured transfer times are the row's own).

        One prompt's KV is `link_prompt_kv_bytes`; `link_kv_bytes` is the bytes check's (meter.BytesCheck: the KV
        D received over a row), and both land in one row."""
        shaping = self.shaping
        return {
            "link": self.preset.name,
            "link_share": self.preset.share,
            "link_prefill_s": round(self.prefill_s, 6),
            "link_prompt_kv_bytes": self.kv_bytes,
            "link_rate_bit_s": shaping.rate_bit_s if shaping else None,
            "link_burst_bytes": shaping.burst_bytes if shaping else None,
            "link_expected_transfer_s": None if shaping is None else round(shaping.wire_seconds(self.kv_bytes), 6),
            "link_faithful": self.faithful,
        }


def resolve(chosen: Preset, *, prefill_s: float, kv_bytes: int) -> LinkPlan:
    """The shaping that makes one prompt's `kv_bytes` take `chosen.share` of a `prefill_s` prefill."""
    if not prefill_s > 0 or not math.isfinite(prefill_s):
        raise ValueError(f"prefill time must be a positive number of seconds, got {prefill_s!r}")
    if kv_bytes <= 0:
        raise ValueError(f"KV bytes per prompt must be positive, got {kv_bytes}")
    if chosen.share is None:
        return LinkPlan(chosen, prefill_s, kv_bytes, None)
    goodput = kv_bytes * 8 / (chosen.share * prefill_s)
    return LinkPlan(chosen, prefill_s, kv_bytes, Shaping.for_rate(goodput / FRAME_EFFICIENCY))


def nominal_prefill_s(prompt_tokens: int) -> float:
    """The prefill assumed until the run has measured its own (the benchmark's 120 ms per 1024 tokens)."""
    return NOMINAL_PREFILL_S_PER_TOKEN * prompt_tokens


@dataclasses.dataclass(frozen=True)
class Subnet:
    """One link's /24 inside 10.231.0.0/16: the host end is .254, engine i is .(i + 1)."""

    index: int

    def __post_init__(self) -> None:
        if not 0 <= self.index <= 255:
            raise ValueError(f"subnet index {self.index} is outside 0..255")

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{BASE_NETWORK.network_address + self.index * 256}/24")

    @property
    def host(self) -> str:
        return str(self.network.network_address + 254)

    def engine(self, slot: int) -> str:
        if not 0 <= slot < 250:
            raise ValueError(f"a link holds at most 250 engines, slot {slot} asked")
        return str(self.network.network_address + slot + 1)

    def cidr(self, address: str) -> str:
        return f"{address}/{self.network.prefixlen}"


def pick_subnet(used_addresses: Collection[str], start: int) -> Subnet:
    """The first /24 of 10.231.0.0/16 from `start` on (wrapping) that holds none of `used_addresses`."""
    taken = {
        (int(ipaddress.IPv4Address(a)) - int(BASE_NETWORK.network_address)) // 256
        for a in used_addresses
        if ipaddress.IPv4Address(a) in BASE_NETWORK
    }
    for step in range(256):
        index = (start + step) % 256
        if index not in taken:
            return Subnet(index)
    raise RuntimeError("every /24 of 10.231.0.0/16 is in use by another link")


# Set for an engine in a namespace; the harness switch that turns NIXL's progress thread off is removed
# (over TCP a WRITE needs the target to progress UCX: research 4.3).
_REMOVED = ("KVPUSH_NIXL_NO_PROG_THREAD",)
PTHR_DELAY_US = 1000  # NIXL's progress thread sleeps in poll() on UCX's event fd instead of spinning


def engine_env(base: Mapping[str, str], address: str, device: str = DEVICE) -> dict[str, str]:
    """`base` for an engine behind the link: UCX over TCP on its NIC only (cma would bypass the link), its own
    address for vLLM and the NIXL side channel, and an event-driven NIXL progress thread."""
    env = {k: v for k, v in base.items() if k not in _REMOVED}
    env.update(
        {
            "UCX_TLS": "tcp",
            "UCX_NET_DEVICES": device,
            "VLLM_HOST_IP": address,
            "VLLM_NIXL_SIDE_CHANNEL_HOST": address,
            "KVPUSH_NIXL_PTHR_DELAY_US": str(PTHR_DELAY_US),
        }
    )
    return env


# Run "$0" "$@" with /sys showing this network namespace's interfaces (a fresh sysfs: the old one may need
# a lazy unmount first, as `ip netns exec` does it).
_OWN_SYSFS = (
    'mount -t sysfs kvn-sysfs /sys 2>/dev/null || { umount -l /sys && mount -t sysfs kvn-sysfs /sys; }; exec "$0" "$@"'
)


@dataclasses.dataclass(frozen=True)
class Place:
    """Where an engine sits on the link: its namespace (a path for `nsenter --net=`), address and NIC."""

    name: str
    netns: str
    address: str
    device: str = DEVICE

    def argv_prefix(self) -> tuple[str, ...]:
        """Prefix of the engine's command: enter the namespace with a private mount namespace whose /sys is the
        namespace's own sysfs (UCX finds its NIC in /sys/class/net, as under `ip netns exec`), then exec the
        rest: same PID, same process group."""
        return ("nsenter", f"--net={self.netns}", "--", "unshare", "--mount", "--", "sh", "-c", _OWN_SYSFS)

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        return engine_env(base, self.address, self.device)


def bytes_verdict(crossed_bytes: int, kv_bytes: int) -> str | None:
    """None when the bytes that left P's NIC cover the KV bytes D received over the link; else why not
    (UCX took a shortcut around the link, e.g. cma: research 4.1)."""
    if crossed_bytes < 0 or kv_bytes < 0:
        raise ValueError("byte counts cannot be negative")
    if crossed_bytes >= kv_bytes:
        return None
    return (
        f"KV bypassed the link: {crossed_bytes} bytes left P's NIC for {kv_bytes} KV bytes transferred "
        "(is UCX_TLS=tcp set for every engine?)"
    )
