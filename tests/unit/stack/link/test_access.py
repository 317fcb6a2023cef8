"""Who may build a link: the capability mask read from /proc/<pid>/status."""

from __future__ import annotations

from pathlib import Path

from stack.link.access import can_admin_network, effective_caps, user_namespace_argv


def test_root_and_user_namespace_root_may_and_a_plain_user_may_not(tmp_path: Path) -> None:
    status = tmp_path / "status"
    for caps, allowed in (("000001fffeffffff", True), ("0000000000000000", False), ("0000000000001000", False)):
        status.write_text(f"Name:\tpython\nCapInh:\t0000000000000000\nCapEff:\t{caps}\n")
        assert can_admin_network(status) is allowed
    assert effective_caps("Name: x\n") == 0


def test_the_rootless_prefix_maps_root_and_makes_a_network_namespace() -> None:
    assert user_namespace_argv(["python", "-V"]) == [
        "unshare",
        "--user",
        "--map-root-user",
        "--net",
        "--",
        "python",
        "-V",
    ]
