"""The link planner: preset + measured prefill -> tbf and the engines' environment; addresses; the bytes check."""

from __future__ import annotations

import math

import pytest

from stack.link import plan
from stack.link.plan import PRESETS, Shaping, Subnet, bytes_verdict, engine_env, pick_subnet, preset, resolve

MIB = 1024 * 1024


@pytest.mark.parametrize(
    ("name", "share"), [("efa-like", 0.038), ("ethernet-100g-like", 1.09), ("ethernet-25g-like", 4.38)]
)
def test_a_resolved_preset_makes_one_prompt_take_its_share_of_the_measured_prefill(name: str, share: float) -> None:
    for prefill_s in (0.120, 0.270):
        got = resolve(preset(name), prefill_s=prefill_s, kv_bytes=4 * MIB)
        assert got.shaping is not None
        assert got.expected_transfer_s == pytest.approx(share * prefill_s, rel=1e-6)
        assert got.shaping.wire_seconds(4 * MIB) / prefill_s == pytest.approx(share, rel=1e-6)


def test_the_research_rates_come_out_for_the_benchmark_prefill() -> None:
    """Section 5.4 of the research: 1024-token bench prompts (4 MiB), 120 ms prefill -> 7.6 / 0.267 / 0.067 Gbit/s."""
    rates = {
        name: resolve(preset(name), prefill_s=0.120, kv_bytes=4 * MIB).shaping.rate_bit_s  # type: ignore[union-attr]
        for name in ("efa-like", "ethernet-100g-like", "ethernet-25g-like")
    }
    assert rates["efa-like"] == pytest.approx(7.7e9, rel=0.03)
    assert rates["ethernet-100g-like"] == pytest.approx(2.68e8, rel=0.03)
    assert rates["ethernet-25g-like"] == pytest.approx(6.67e7, rel=0.03)


def test_a_slower_prefill_means_a_proportionally_slower_link() -> None:
    fast = resolve(preset("ethernet-25g-like"), prefill_s=0.120, kv_bytes=4 * MIB).shaping
    slow = resolve(preset("ethernet-25g-like"), prefill_s=0.270, kv_bytes=4 * MIB).shaping
    assert fast is not None and slow is not None
    assert fast.rate_bit_s / slow.rate_bit_s == pytest.approx(2.25, rel=1e-3)


def test_efa_like_at_the_benchmark_prefill_is_marked_beyond_what_this_box_shapes_faithfully() -> None:
    assert not resolve(preset("efa-like"), prefill_s=0.120, kv_bytes=4 * MIB).faithful
    assert resolve(preset("efa-like"), prefill_s=0.270, kv_bytes=4 * MIB).faithful
    assert resolve(preset("ethernet-25g-like"), prefill_s=0.120, kv_bytes=4 * MIB).faithful


def test_unshaped_resolves_to_no_shaping_and_is_never_faithful() -> None:
    got = resolve(preset("unshaped"), prefill_s=0.2, kv_bytes=MIB)
    assert got.shaping is None and got.expected_transfer_s is None and not got.faithful
    assert got.record()["link_rate_bit_s"] is None


def test_the_record_says_preset_share_measured_prefill_and_rate() -> None:
    got = resolve(preset("ethernet-100g-like"), prefill_s=0.25, kv_bytes=2 * MIB).record()
    assert got["link"] == "ethernet-100g-like" and got["link_share"] == 1.09
    assert got["link_prefill_s"] == 0.25 and got["link_prompt_kv_bytes"] == 2 * MIB
    assert got["link_rate_bit_s"] > 0 and got["link_burst_bytes"] >= 32 * 1024
    assert got["link_expected_transfer_s"] == pytest.approx(1.09 * 0.25, rel=1e-5)


@pytest.mark.parametrize("prefill_s", [0.0, -1.0, math.nan, math.inf])
def test_a_prefill_time_that_is_not_a_positive_number_is_refused(prefill_s: float) -> None:
    with pytest.raises(ValueError, match="prefill time"):
        resolve(preset("efa-like"), prefill_s=prefill_s, kv_bytes=MIB)


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="efa-like, ethernet-100g-like, ethernet-25g-like, unshaped"):
        preset("infiniband")
    assert set(PRESETS) == {"efa-like", "ethernet-100g-like", "ethernet-25g-like", "unshaped"}


def test_tbf_gets_about_a_millisecond_of_bucket_at_least_one_whole_gso_packet_and_a_32_mib_queue() -> None:
    assert Shaping.for_rate(1e9).tbf_args() == ("tbf", "rate", "1000000000bit", "burst", "125000", "limit", "33554432")
    # below ~650 Mbit/s a millisecond is less than one 64 KiB TSO packet with its frames' headers: tbf would split it
    assert plan.GSO_PACKET_BYTES >= 64 * 1024 + 45 * 66
    for rate in (4e6, 67e6, 232e6):
        assert Shaping.for_rate(rate).burst_bytes == plan.GSO_PACKET_BYTES
    with pytest.raises(ValueError, match="below"):
        Shaping(1000, 32 * 1024)
    assert Shaping.for_rate(10.0).rate_bit_s == plan.MIN_RATE_BIT_S


def test_an_engine_behind_the_link_speaks_ucx_over_tcp_on_its_own_nic_and_address() -> None:
    base = {"KVPUSH_NIXL_NO_PROG_THREAD": "1", "UCX_NET_DEVICES": "lo", "VLLM_HOST_IP": "127.0.0.1", "KEEP": "x"}
    env = engine_env(base, "10.231.7.2")
    assert env["UCX_TLS"] == "tcp" and env["UCX_NET_DEVICES"] == "kvn0"
    assert env["VLLM_HOST_IP"] == env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.231.7.2"
    assert env["KVPUSH_NIXL_PTHR_DELAY_US"] == "1000"
    assert "KVPUSH_NIXL_NO_PROG_THREAD" not in env and env["KEEP"] == "x"
    assert base["UCX_NET_DEVICES"] == "lo"  # the base is not changed


def test_subnet_addresses_and_picking_skip_subnets_in_use() -> None:
    net = Subnet(7)
    assert (net.host, net.engine(0), net.engine(1), net.cidr(net.engine(0))) == (
        "10.231.7.254",
        "10.231.7.1",
        "10.231.7.2",
        "10.231.7.1/24",
    )
    assert pick_subnet(["10.231.7.254", "192.0.2.2", "10.231.8.254"], start=7) == Subnet(9)
    assert pick_subnet([], start=300 % 256) == Subnet(44)
    assert pick_subnet([f"10.231.{i}.254" for i in range(255)], start=3) == Subnet(255)
    with pytest.raises(RuntimeError, match="every /24"):
        pick_subnet([f"10.231.{i}.1" for i in range(256)], start=0)
    with pytest.raises(ValueError):
        net.engine(250)


def test_the_bytes_check_fails_when_fewer_bytes_crossed_than_kv_moved() -> None:
    assert bytes_verdict(4 * MIB + 4000, 4 * MIB) is None
    assert bytes_verdict(4 * MIB, 4 * MIB) is None
    verdict = bytes_verdict(4278, 252 * MIB)
    assert verdict is not None and "bypassed" in verdict
    with pytest.raises(ValueError):
        bytes_verdict(-1, 0)


def test_an_engine_enters_its_namespace_with_its_own_sysfs_and_execs_the_command() -> None:
    place = plan.Place("p0", "/proc/42/ns/net", "10.231.3.1")
    prefix = place.argv_prefix()
    assert prefix[:6] == ("nsenter", "--net=/proc/42/ns/net", "--", "unshare", "--mount", "--")
    assert prefix[6:8] == ("sh", "-c") and "mount -t sysfs" in prefix[8] and prefix[8].endswith('exec "$0" "$@"')
    assert place.env({})["VLLM_HOST_IP"] == "10.231.3.1"
