"""stack.family without processes: the specs of a P/D family (names, engine ids, cores, connector, flags)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stack.engines import Engine
from stack.family import PdEngines, pd_family

MODEL = Path("/models/tiny")


class TestPdFamily:
    def test_prefills_on_one_core_decode_on_another_one_connector(self) -> None:
        family = pd_family("kv", MODEL, "KvpushConnector", module="connector.plugin", n_prefill=2, engine_suffix="-x")
        assert [s.name for s in family.specs] == ["kv-p0", "kv-p1", "kv-d"]
        assert [s.engine_id for s in family.prefills] == ["kv-p0-x", "kv-p1-x"]
        assert family.decode.engine_id is None
        assert {s.core for s in family.prefills} == {0}
        assert family.decode.core == 1
        assert {(s.connector, s.connector_module) for s in family.specs} == {("KvpushConnector", "connector.plugin")}
        assert [s.effective_kv_role for s in family.specs] == ["kv_producer", "kv_producer", "kv_consumer"]
        assert {(s.http_port, s.side_port) for s in family.specs} == {(0, None)}  # picked when the Engine is made

    def test_extra_flags_per_engine(self) -> None:
        family = pd_family("f", MODEL, "NixlPushConnector", n_prefill=2, prefill_args=[("--a",)], decode_args=("--b",))
        assert [s.extra_args for s in family.specs] == [("--a",), (), ("--b",)]

    @pytest.mark.parametrize(
        ("kwargs", "fragment"),
        [
            ({"n_prefill": 0}, "at least one"),
            ({"n_decode": 0}, "at least one"),
            ({"prefill_args": [(), ()]}, "2 prefill"),
        ],
    )
    def test_impossible_families_are_refused(self, kwargs: dict[str, object], fragment: str) -> None:
        with pytest.raises(ValueError, match=fragment):
            pd_family("f", MODEL, "NixlPushConnector", **kwargs)  # type: ignore[arg-type]


def test_started_engines_name_every_prefill_to_the_router_in_order() -> None:
    ports = iter(range(42000, 42100))
    family = pd_family("kv", MODEL, "NixlPushConnector", n_prefill=2)
    prefills = tuple(Engine(s, log_dir=Path("/logs"), pick_port=ports.__next__) for s in family.prefills)
    decode = Engine(family.decode, log_dir=Path("/logs"), pick_port=ports.__next__)
    engines = PdEngines(prefills, (decode,))
    assert engines.prefill_args() == [
        "http://127.0.0.1:42000,engine_id=kv-p0,side_port=42001",
        "http://127.0.0.1:42002,engine_id=kv-p1,side_port=42003",
    ]
    assert engines.urls == ["http://127.0.0.1:42000", "http://127.0.0.1:42002", "http://127.0.0.1:42004"]


def test_several_decodes_share_the_decode_core_and_flags() -> None:
    family = pd_family(
        "mt",
        MODEL,
        "KvpushConnector",
        n_decode=2,
        extra_args=("--enable-prompt-tokens-details",),
        decode_args=("--x",),
        connector_extra={"kv_timeout_s": 5},
        max_model_len=4096,
        engine_suffix="-r",
        decode_engine_ids=True,
    )
    assert [s.name for s in family.specs] == ["mt-p0", "mt-d0", "mt-d1"]
    assert [s.engine_id for s in family.specs] == ["mt-p0-r", "mt-d0-r", "mt-d1-r"]
    assert [s.core for s in family.decodes] == [1, 1]
    assert [s.extra_args for s in family.specs] == [
        ("--enable-prompt-tokens-details",),
        ("--enable-prompt-tokens-details", "--x"),
        ("--enable-prompt-tokens-details", "--x"),
    ]
    assert {s.max_model_len for s in family.specs} == {4096}
    assert all(s.connector_extra == {"kv_timeout_s": 5} for s in family.specs)
    with pytest.raises(ValueError, match="2 decode engines"):
        family.decode  # noqa: B018
