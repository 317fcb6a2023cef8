"""router/workers/pairing.py and the worker specs it relies on: which prefill/decode parallelism the router refuses
before the decode leg leaves (TP sizes that do not divide, a prefill TP never stated while decode runs TP > 1,
PP on decode), and what it leaves to the engines (decode's TP unknown)."""

from __future__ import annotations

import pytest

from router.domain import ConnectorKind, NixlIdentity
from router.errors import ConfigError
from router.protocol import identity_from
from router.workers.pairing import parallelism_mismatch
from router.workers.specs import parse_decode_url, parse_prefill_spec


def ident(tp: int = 1, known: bool = True) -> NixlIdentity:
    return NixlIdentity("p0", "h", 5600, tp_size=tp, tp_known=known)


@pytest.mark.parametrize(
    ("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (8, 1), (1, 8), (3, None), (2, None)]
)
def test_pairs_either_connector_serves_are_not_refused(p_tp: int, d_tp: int | None) -> None:
    assert parallelism_mismatch(ident(p_tp), d_tp) is None


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 3), (3, 2), (4, 6)])
def test_tp_sizes_that_do_not_divide_are_refused_naming_both(p_tp: int, d_tp: int) -> None:
    why = parallelism_mismatch(ident(p_tp), d_tp)
    assert why is not None and f"tensor_parallel_size {p_tp}" in why and str(d_tp) in why


def test_a_prefill_that_never_stated_its_tp_is_refused_only_when_decode_runs_tp() -> None:
    learned = identity_from({"remote_engine_id": "p0", "remote_host": "h", "remote_port": 5600})  # no tp_size
    assert learned is not None and not learned.tp_known and learned.tp_size == 1
    why = parallelism_mismatch(learned, 2)
    assert why is not None and "did not state its tensor-parallel size" in why
    assert parallelism_mismatch(learned, 1) is None and parallelism_mismatch(learned, None) is None
    stated = identity_from({"remote_engine_id": "p0", "remote_host": "h", "remote_port": 5600, "tp_size": 2})
    assert stated is not None and stated.tp_known and parallelism_mismatch(stated, 4) is None


def test_worker_specs_carry_the_connector_kind_and_decode_parallelism() -> None:
    spec = parse_prefill_spec("http://p:8100,engine_id=p0,side_port=5600,tp=2,dp=2,connector=kvpush")
    assert spec.identity is not None and spec.identity.connector is ConnectorKind.KVPUSH
    assert parse_prefill_spec("http://p:8100,engine_id=p0,side_port=5600").identity.connector is ConnectorKind.NIXL  # type: ignore[union-attr]
    assert parse_decode_url("http://d:8200,tp=4").tp_size == 4
    assert parse_decode_url("http://d:8200").tp_size is None
    with pytest.raises(ConfigError, match="pp must be 1"):
        parse_decode_url("http://d:8200,pp=2")
    staged = parse_prefill_spec("http://p:8100,engine_id=p0,side_port=5600,tp=2,pp=2,connector=kvpush").identity
    assert staged is not None and (staged.tp_size, staged.pp_size) == (2, 2)  # PP prefill: each stage its layers
    with pytest.raises(ConfigError, match="connector 'lmcache' is not one of nixl, kvpush"):
        parse_prefill_spec("http://p:8100,engine_id=p0,side_port=5600,connector=lmcache")
