"""NicMeter on a fake link: the window's bytes, the verdict and the row record."""

from __future__ import annotations

from stack.link.calibrate import Calibration
from stack.link.fabric import NicBytes
from stack.link.meter import NicMeter
from stack.link.plan import preset, resolve


class FakeLink:
    def __init__(self) -> None:
        self.tx = 1000
        self.dropped = 2

    def nic_bytes(self, name: str) -> NicBytes:
        assert name == "p0"
        return NicBytes(rx=0, tx=self.tx)

    def drops(self) -> int:
        return self.dropped


def test_the_window_counts_only_bytes_sent_after_the_meter_was_made() -> None:
    link = FakeLink()
    meter = NicMeter(link, "p0")
    link.tx += 5000
    check = meter.check(4096)
    assert check.ok and check.crossed_bytes == 5000 and check.drops == 0
    assert check.record()["link_bytes_ok"] is True and check.record()["link_nic_tx_bytes"] == 5000


def test_fewer_bytes_than_kv_fails_the_window_and_says_why() -> None:
    link = FakeLink()
    meter = NicMeter(link, "p0")
    link.tx += 4278
    link.dropped += 3
    check = meter.check(252 * 1024 * 1024)
    assert not check.ok and check.verdict is not None and "bypassed the link" in check.verdict
    assert check.record()["link_drops"] == 3 and check.record()["link_bytes_ok"] is False


def test_a_row_keeps_one_prompts_kv_and_the_checked_kv_under_two_names() -> None:
    """A row is the calibration's record plus the bytes check's: no key may mean two things (they collided on
    `link_kv_bytes`, one prompt's KV against the KV D received over the row, and the later one won)."""
    plan = resolve(preset("ethernet-25g-like"), prefill_s=0.12, kv_bytes=4 * 2**20)
    link = FakeLink()
    meter = NicMeter(link, "p0")
    link.tx += 40 * 2**20
    check = meter.check(36 * 2**20)
    calibrated, checked = Calibration(plan, (0.12,)).record(), check.record()
    assert not set(calibrated) & set(checked)
    row = {**calibrated, **checked}
    assert row["link_prompt_kv_bytes"] == 4 * 2**20 and row["link_kv_bytes"] == 36 * 2**20
