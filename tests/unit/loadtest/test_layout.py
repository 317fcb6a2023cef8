"""loadtest's rooms: no import cycle (lazy and type-only imports included) and no arrow from a lower room to a
higher one. Read from the source with ast; nothing is imported.

Floors, lowest first: the load generator (the package root), the simulator (sim/), the report (report/), the
suites and their kit (bench/), the micro-benchmarks and probes (micro/, which may use the suites' kit), the fault
matrix (faults/), and the door (cli.py, __main__.py), which may reach every room. The probes live in micro/, not
in the packages that ship: no module of router/, connector/ or stack/ is a benchmark or the GPU check.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] / "loadtest"
FLOORS = ("generator", "sim", "report", "bench", "micro", "faults", "door")
DOOR = {"loadtest.cli", "loadtest.__main__"}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """The package's modules by dotted name (``root``: the package's folder; connector's rooms test uses it too)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _targets(node: ast.AST, package: str, known: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join([*up, base] if base else up)
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    else:
        return set()
    return {n for n in names if n in known}


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Every import of a loadtest module by a loadtest module, wherever it is written (top, function, TYPE_CHECKING)."""
    mods = modules(root)
    out: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            edges |= _targets(node, package, set(mods))
        out[name] = edges - {name}
    return out


def floor(module: str) -> int:
    if module in DOOR:
        return FLOORS.index("door")
    parts = module.split(".")
    room = parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in FLOORS) else "generator"
    return FLOORS.index(room) if room in FLOORS else FLOORS.index("generator")


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_every_room_and_a_lazy_import() -> None:
    g = graph()
    assert {floor(m) for m in g} == set(range(len(FLOORS)))
    assert "loadtest.sim.server" in g["loadtest.cli"]  # imported inside main(): still an arrow


def test_loadtest_has_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_no_arrow_runs_from_a_lower_room_to_a_higher_one() -> None:
    g = graph()
    up = sorted(f"{a} ({FLOORS[floor(a)]}) -> {b} ({FLOORS[floor(b)]})" for a in g for b in g[a] if floor(b) > floor(a))
    assert up == []


def test_the_probes_live_in_micro_and_not_in_the_packages_that_ship() -> None:
    g = graph()
    micro = {"gpu_check.check", "notices", "descriptors", "kv_events_rate", "prompt_ids"}
    assert {f"loadtest.micro.{name}" for name in micro} <= set(g)
    assert floor("loadtest.micro.gpu_check.vmm") == FLOORS.index("micro")
    shipped = [ROOT.parent / pkg for pkg in ("router", "connector", "stack")]
    probes = [p for d in shipped for p in d.rglob("*.py") if "bench" in p.stem or p.stem.startswith("gpu_check")]
    assert probes == []


def test_a_cycle_and_an_arrow_up_would_be_seen() -> None:
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert floor("loadtest.results") < floor("loadtest.sim.calibrate") < floor("loadtest.report.readme")
    assert floor("loadtest.report.readme") < floor("loadtest.bench.run") < floor("loadtest.micro.notices")
    assert floor("loadtest.micro.notices") < floor("loadtest.faults.matrix")
    assert floor("loadtest.faults.matrix") < floor("loadtest.cli")
