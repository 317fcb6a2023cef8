"""stack.link on the real kernel: namespaces owned by holders, the bridge, the host veth, tbf, live rate changes,
the NIC byte counters, cleanup after SIGKILL of the harness, and the rootless path (`unshare -Urn` as nobody).

Needs root or user namespaces (skips with the link's own one-line reason otherwise). Small payloads at slow
rates: a transfer's time is only bounded below (the shaper cannot make it faster), never above.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import stack.link
from stack.engines import vllm_env
from stack.link.access import LinkUnavailable, require_access, user_namespace_argv
from stack.link.fabric import Link
from stack.link.plan import Place, Shaping
from tests.integration.support import INTEGRATION, REPO, alive, wait_for

pytestmark = INTEGRATION
PROBE = Path(__file__).with_name("link_probe.py")
HARNESS = Path(__file__).with_name("link_harness.py")
KIB = 1024


@pytest.fixture(autouse=True)
def _needs_access() -> None:
    try:
        require_access()
    except LinkUnavailable as exc:
        pytest.skip(str(exc))


def probe(place: Place, *args: str) -> list[str]:
    return [*place.argv_prefix(), sys.executable, str(PROBE), *args]


def stream(src: Place, dst: Place, size: int, port: int = 7000) -> dict[str, float]:
    """`size` bytes from src to dst over the link; the receiver's count and the sender's time to the end."""
    with subprocess.Popen(probe(dst, "sink", dst.address, str(port)), stdout=subprocess.PIPE, text=True) as sink:
        assert sink.stdout is not None
        assert json.loads(sink.stdout.readline()) == {"listening": True}
        sent = subprocess.run(
            probe(src, "send", dst.address, str(port), str(size)),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        received = json.loads(sink.stdout.readline())
    return {"received": received["bytes"], "seconds": json.loads(sent.stdout)["seconds"]}


def qdisc(place: Place) -> str:
    return subprocess.run(
        [*place.argv_prefix(), "tc", "qdisc", "show", "dev", place.device], capture_output=True, text=True, check=True
    ).stdout


def link_names() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def pair() -> Iterator[tuple[Link, Place, Place]]:
    with Link(Shaping.for_rate(4e6)) as link:
        yield link, link.add("t-p"), link.add("t-d")


def test_engines_reach_each_other_and_the_harness_reaches_them_but_they_reach_nothing_else(
    pair: tuple[Link, Place, Place],
) -> None:
    link, p, d = pair
    assert p.address != d.address and link.host_address.endswith(".254")
    with subprocess.Popen(probe(d, "serve", d.address, "8000"), stdout=subprocess.PIPE, text=True) as server:
        assert server.stdout is not None and server.stdout.readline()
        with urllib.request.urlopen(f"http://{d.address}:8000/health", timeout=10) as answer:  # the router's path
            assert answer.status == 200
    unreachable = subprocess.run([*p.argv_prefix(), "ip", "route", "get", "1.1.1.1"], capture_output=True, text=True)
    assert unreachable.returncode != 0 and "unreachable" in unreachable.stderr  # no default route: nothing leaves
    assert stream(p, d, 16 * KIB)["received"] == 16 * KIB


def test_a_stream_is_held_to_the_rate_its_bytes_are_counted_and_the_rate_changes_live(
    pair: tuple[Link, Place, Place],
) -> None:
    link, p, d = pair
    shaping = link.shaping
    assert shaping is not None
    before = link.nic_bytes("t-p")
    got = stream(p, d, 256 * KIB)
    assert got["received"] == 256 * KIB
    # at least the wire time of what the bucket (32 KiB) does not let through at once
    assert got["seconds"] >= 0.8 * shaping.wire_seconds(256 * KIB - shaping.burst_bytes)
    assert link.nic_bytes("t-p").tx - before.tx >= 256 * KIB
    assert link.drops() == 0
    assert "rate 4Mbit" in qdisc(p)
    link.shape(Shaping.for_rate(2e8))
    assert "rate 200Mbit" in qdisc(p) and "rate 200Mbit" in qdisc(d)
    link.shape(None)
    assert "tbf" not in qdisc(p)
    assert stream(p, d, 64 * KIB, port=7001)["received"] == 64 * KIB


def test_tso_packets_cross_the_shaper_whole_so_the_emulation_adds_no_per_frame_work() -> None:
    # A smaller bucket than one TSO packet makes tbf cut each into 1500-byte frames in software: 10x the kernel's
    # per-packet work, on the engines' cores (stack.link.plan.GSO_PACKET_BYTES).
    with Link(Shaping.for_rate(2e8)) as link:
        p, d = link.add("g-p"), link.add("g-d")
        before = link.nic_bytes("g-p")
        assert stream(p, d, 4 * 1024 * KIB)["received"] == 4 * 1024 * KIB
        after = link.nic_bytes("g-p")
    frames = (after.tx - before.tx) / 1514
    assert after.tx_packets - before.tx_packets < frames / 4  # on average a packet carried 4 frames or more


def test_closing_the_link_removes_the_host_veth_and_ends_every_holder() -> None:
    link = Link(None).open()
    link.add("c-p")
    device, holders = link.host_device, link.holder_pids()
    assert device in link_names()
    link.close()
    assert device not in link_names()
    assert not any(alive(pid) for pid in holders)


def test_a_sigkilled_harness_leaves_no_namespace_veth_or_process_behind(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with subprocess.Popen(
        [sys.executable, str(HARNESS), str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
    ) as harness:
        try:
            assert harness.stdout is not None
            made = json.loads(harness.stdout.readline())
            assert made["host_device"] in link_names()
            assert all(alive(pid) for pid in [*made["holders"], made["inside"]])
        finally:
            harness.send_signal(signal.SIGKILL)
            harness.wait(timeout=10)
    wait_for(lambda: not any(alive(pid) for pid in [*made["holders"], made["inside"]]), "holders and engine gone", 15)
    wait_for(lambda: made["host_device"] not in link_names(), "the host veth removed by the kernel", 15)


ROOTLESS = """
import json, socket, sys
from stack.link.fabric import Link
from stack.link.plan import Shaping
with Link(Shaping.for_rate(2e7)) as link:
    p, d = link.add("u-p"), link.add("u-d")
    with socket.create_server(("127.0.0.1", 0)) as server:  # the router's and the engines' host-side ports
        with socket.create_connection(server.getsockname(), timeout=5):
            pass
    print(json.dumps({"addresses": [p.address, d.address], "nic": link.nic_bytes("u-p").tx, "loopback": True}))
"""
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def test_without_root_the_link_refuses_with_one_line_and_works_inside_a_user_namespace() -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to become nobody")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    refused = subprocess.run(
        [*NOBODY, sys.executable, "-c", "from stack.link.fabric import Link; Link().open()"],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=30,
    )
    assert refused.returncode != 0
    assert "LinkUnavailable: the link needs root or a user namespace: run the harness as `unshare" in refused.stderr
    for python in (sys.executable, "/usr/bin/python3"):  # stack.link is stdlib only: any python 3.11 runs it
        rootless = subprocess.run(
            [*NOBODY, *user_namespace_argv([python, "-c", ROOTLESS])],
            capture_output=True,
            text=True,
            env=env,
            cwd="/",
            timeout=60,
        )
        if "failed to execute" not in rootless.stderr:  # the venv may sit where nobody cannot read it
            break
    if rootless.returncode != 0 and "unshare" in (rootless.stderr.splitlines() or [""])[-1]:
        pytest.skip(f"no unprivileged user namespaces here: {rootless.stderr.strip()}")
    assert rootless.returncode == 0, rootless.stderr
    made = json.loads(rootless.stdout)
    assert made["addresses"][0].startswith("10.231.") and made["nic"] >= 0
    assert made["loopback"]  # a fresh namespace starts with lo down: the link brings it up for the harness


NIXL_PEER = Path(stack.link.__file__).with_name("nixl_peer.py")  # run as a script in each namespace


def nixl_write(link: Link, p: Place, d: Place, size: int, *, tcp: bool) -> dict[str, object]:
    """A NIXL WRITE of `size` bytes from p to d, each peer in its namespace with the engines' environment of the
    link (tcp) or the same without UCX_TLS (UCX's default: cma for processes of one kernel)."""
    base = vllm_env(core=0, side_port=None)

    def env(place: Place) -> dict[str, str]:
        chosen = place.env(base)
        if not tcp:
            del chosen["UCX_TLS"]
        return chosen

    peer = [sys.executable, str(NIXL_PEER)]
    with subprocess.Popen(
        [*d.argv_prefix(), *peer, "target", d.address, "7100", str(size)],
        env=env(d),
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    ) as target:
        done = subprocess.run(
            [*p.argv_prefix(), *peer, "initiator", d.address, "7100", str(size)],
            env=env(p),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        target.wait(timeout=30)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["arrived"] == result["sha"]  # every byte landed in D's buffer
    return result


def test_a_nixl_write_between_two_namespaces_follows_the_rate_and_a_cma_bypass_is_caught() -> None:
    pytest.importorskip("nixl", reason="needs nixl")
    size = 2 * 1024 * KIB
    shaping = Shaping.for_rate(4e7)
    with Link(shaping) as link:
        p, d = link.add("n-p"), link.add("n-d")
        meter = link.meter("n-p")
        over_tcp = nixl_write(link, p, d, size, tcp=True)
        check = meter.check(size)
        assert check.ok, check.verdict
        seconds = over_tcp["seconds"]
        assert isinstance(seconds, list) and seconds[0] >= 0.8 * shaping.wire_seconds(size - shaping.burst_bytes)
        meter = link.meter("n-p")
        nixl_write(link, p, d, size, tcp=False)
        bypass = meter.check(size)
        assert not bypass.ok and bypass.crossed_bytes < size // 4, bypass
        assert "bypassed the link" in (bypass.verdict or "")
        assert check.drops == bypass.drops == 0
        print(f"tcp: {over_tcp['seconds']} s, {check.record()}; cma: {bypass.record()}")
