"""The connector's rooms: what vLLM loads at the top, the parts in four rooms below it, no import cycle and no
arrow from a lower room to a higher one. Read from the source with ast; nothing is imported.

Floors, lowest first: ``wire/`` (what crosses processes: request params, notices, the handshake, the step plan),
``rendezvous/`` (the pure state machines and the actions they return), ``parallel/`` (TP/PP: which rank writes
which bytes, fan-out per P rank, fan-in per D rank), ``transfer/`` (the backend seam, its backends, descriptor
arithmetic, the CUDA-event seam), and the top (the plugin's two halves, the thread that joins them, settings,
metrics), which may reach every room.
"""

from __future__ import annotations

from pathlib import Path

from tests.unit.loadtest import test_layout
from tests.unit.loadtest.test_layout import cycles

ROOT = Path(__file__).resolve().parents[3] / "connector"
FLOORS = ("wire", "rendezvous", "parallel", "transfer", "top")
MAX_TOP = 12  # modules at the top, __init__ included


def floor(module: str) -> int:
    parts = module.split(".")
    return FLOORS.index(parts[1]) if len(parts) > 1 and parts[1] in FLOORS else FLOORS.index("top")


def test_every_module_lives_in_a_known_room() -> None:
    rooms = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(FLOORS) - {"top"}
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= MAX_TOP, top


def test_the_connector_has_no_import_cycle() -> None:
    assert cycles(test_layout.graph(ROOT)) == []


def test_no_arrow_points_from_a_lower_room_to_a_higher_one() -> None:
    up = sorted(
        f"{src} -> {dst}"
        for src, dsts in test_layout.graph(ROOT).items()
        for dst in dsts
        if floor(dst) > floor(src) and dst != "connector"
    )
    assert up == []


def test_the_floors_see_real_arrows() -> None:
    """The checks above are not vacuous: the graph holds arrows between rooms in the expected direction."""
    g = test_layout.graph(ROOT)
    assert "connector.wire.metadata" in g["connector.rendezvous.prefill"]
    assert "connector.rendezvous.prefill" in g["connector.parallel.fanout"]
    assert "connector.parallel.topology" in g["connector.transfer.nixl"]
    assert "connector.transfer.base" in g["connector.transfer_thread"]
    assert floor("connector.wire.plan") < floor("connector.rendezvous.actions") < floor("connector.worker")
