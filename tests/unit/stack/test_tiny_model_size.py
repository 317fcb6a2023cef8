"""stack.tiny_model without torch: the size table, shape checks, the stamp that makes build() idempotent."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from stack import tiny_model
from stack.tiny_model import SIZES, STAMP_NAME, ModelSize, build, is_built, resolve_size, stamp_for


def test_the_named_sizes() -> None:
    assert SIZES["tiny"] == ModelSize(
        layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2, max_positions=4096, vocab=2048
    )
    assert SIZES["bench"] == ModelSize(
        layers=4, hidden=256, intermediate=768, heads=4, kv_heads=2, max_positions=8192, vocab=2048
    )
    assert SIZES["bench-deep"].layers == 16 and SIZES["bench-deep"].problems() == []


@pytest.mark.parametrize(("size", "kib"), [("tiny", 1), ("bench", 4), ("bench-deep", 8)])
def test_kv_bytes_per_token_match_the_research_numbers(size: str, kib: int) -> None:
    assert SIZES[size].kv_bytes_per_token() == kib * 1024


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"layers": 0}, "layers must be positive"),
        ({"hidden": 130}, "not a multiple of heads"),
        ({"hidden": 64}, "head_dim 16"),
        ({"kv_heads": 3}, "not a multiple of kv_heads"),
        ({"vocab": 100}, "cannot hold"),
    ],
)
def test_unservable_shapes_are_refused(changes: dict[str, int], fragment: str) -> None:
    shape = dataclasses.replace(SIZES["tiny"], **changes)
    with pytest.raises(ValueError, match="bad model size") as info:
        resolve_size(shape)
    assert fragment in str(info.value)


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        resolve_size("huge")


class TestStamp:
    def test_a_folder_counts_as_built_only_with_a_matching_stamp(self, tmp_path: Path) -> None:
        assert not is_built(tmp_path, "tiny")
        (tmp_path / STAMP_NAME).write_text("{not json")
        assert not is_built(tmp_path, "tiny")
        (tmp_path / STAMP_NAME).write_text(json.dumps(stamp_for(SIZES["bench"])))
        assert not is_built(tmp_path, "tiny")
        assert is_built(tmp_path, "bench")

    def test_the_stamp_names_everything_that_shapes_the_files(self) -> None:
        stamp = stamp_for(SIZES["tiny"])
        assert set(stamp) == {"recipe", "seed", "corpus", "size"}
        assert stamp["size"]["max_positions"] == 4096
        assert stamp != stamp_for(dataclasses.replace(SIZES["tiny"], max_positions=2048))

    def test_build_skips_a_folder_that_is_already_built(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        (tmp_path / STAMP_NAME).write_text(json.dumps(stamp_for(SIZES["tiny"])))

        def must_not_build(target: Path, shape: ModelSize) -> None:
            raise AssertionError("rebuilt a folder that was already built")

        monkeypatch.setattr(tiny_model, "_write_files", must_not_build)
        assert build(tmp_path, "tiny") == tmp_path

    def test_build_replaces_a_stale_folder_and_leaves_no_staging_behind(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        out = tmp_path / "model"
        out.mkdir()
        (out / "old-file").write_text("from another size")

        def fake_write(target: Path, shape: ModelSize) -> None:
            target.mkdir(parents=True)
            (target / "weights").write_text("w")
            (target / STAMP_NAME).write_text(json.dumps(stamp_for(shape)))

        monkeypatch.setattr(tiny_model, "_write_files", fake_write)
        assert build(out, "tiny") == out
        assert sorted(p.name for p in out.iterdir()) == [STAMP_NAME, "weights"]
        assert [p.name for p in tmp_path.iterdir()] == ["model"]

    def test_a_failed_build_leaves_nothing(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        def broken_write(target: Path, shape: ModelSize) -> None:
            target.mkdir(parents=True)
            raise OSError("disk full")

        monkeypatch.setattr(tiny_model, "_write_files", broken_write)
        with pytest.raises(OSError, match="disk full"):
            build(tmp_path / "model", "tiny")
        assert list(tmp_path.iterdir()) == []


def test_cli_rejects_an_unservable_override(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert tiny_model.main([str(tmp_path / "m"), "--hidden", "130"]) == 2
    assert "not a multiple of heads" in capsys.readouterr().err


def test_cli_overrides_start_from_the_named_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[ModelSize] = []

    def fake_build(out_dir: Path, size: ModelSize) -> Path:
        seen.append(size)
        return out_dir

    monkeypatch.setattr(tiny_model, "build", fake_build)
    assert tiny_model.main([str(tmp_path), "--size", "bench", "--max-positions", "2048", "--layers", "1"]) == 0
    assert seen == [dataclasses.replace(SIZES["bench"], max_positions=2048, layers=1)]
