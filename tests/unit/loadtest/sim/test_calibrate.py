"""The honest calibration: only the marked unmeasured numbers move; the calibrated YAML says so."""

from pathlib import Path

import yaml

from loadtest.sim import calibrate, pair
from loadtest.sim.profile import PROFILE_DIR, from_mapping

TEXT = (PROFILE_DIR / f"{calibrate.APRIORI}.yaml").read_text(encoding="utf-8")
DOC = yaml.safe_load(TEXT)


def test_with_values_replaces_only_the_named_numbers() -> None:
    out = calibrate.with_values(DOC, {"efficiency.mfu": 0.9})
    assert out["efficiency"]["mfu"] == 0.9 and DOC["efficiency"]["mfu"] == 0.5
    assert out["network"] == DOC["network"]


def test_calibrated_yaml_marks_each_fitted_number_and_keeps_the_rest() -> None:
    values = {"efficiency.mfu": 1.25, "network.setup_per_descriptor_s": 2.5e-7}
    text = calibrate.calibrated_yaml(TEXT, values, 0.01)
    doc = yaml.safe_load(text)
    assert doc["name"] == calibrate.CALIBRATED
    assert doc["efficiency"]["mfu"] == 1.25 and doc["network"]["setup_per_descriptor_s"] == 2.5e-7
    assert text.count("FITTED to the seed's pull row") == 2
    assert "a-priori 0.5" in text
    for section in ("model", "node", "engine", "api"):
        assert doc[section] == DOC[section]
    assert doc["efficiency"]["mbu"] == DOC["efficiency"]["mbu"]
    from_mapping(doc)  # still a valid profile


def test_error_is_zero_on_target_and_symmetric_in_log() -> None:
    def stats(ttft: float, tpot: float) -> pair.Scores:
        return pair.Scores("pull", 8.0, 10, ttft, ttft, tpot, 0.0, 0)

    t = calibrate.SEED_PULL
    assert calibrate.error(stats(t.ttft_mean_ms, t.tpot_mean_ms), t) == 0.0
    up = calibrate.error(stats(2 * t.ttft_mean_ms, t.tpot_mean_ms), t)
    down = calibrate.error(stats(t.ttft_mean_ms / 2, t.tpot_mean_ms), t)
    assert abs(up - down) < 1e-12 and up > 0


def test_a_tiny_fit_stays_inside_the_ranges_and_writes_both_files(tmp_path: Path) -> None:
    (tmp_path / f"{calibrate.APRIORI}.yaml").write_text(TEXT, encoding="utf-8")
    plan = calibrate.CalibrationPlan(n=12, seeds=(1,), coarse=2, fine=2, passes=1)
    data = calibrate.write_files(plan, tmp_path / "results", profile_dir=tmp_path)
    for knob in calibrate.KNOBS:
        v = data["fitted"][f"{knob.section}.{knob.key}"]
        assert knob.lo <= v <= knob.hi
    assert set(data["predicted"]) == {"pull", "upstream-push", "kvpush-push", "kvpush-progressive"}
    assert (tmp_path / f"{calibrate.CALIBRATED}.yaml").exists()
    assert (tmp_path / "results" / "calibration.json").exists()
    assert (tmp_path / f"{calibrate.APRIORI}.yaml").read_text(encoding="utf-8") == TEXT  # a-priori untouched
