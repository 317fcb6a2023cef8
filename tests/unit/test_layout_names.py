"""One name per concept (issue 43 item 6): a class name is defined once across the house's packages, unless the
pair is listed below with the reason two classes share it. A new duplicate fails; so does a listed pair that
no longer holds exactly as listed (renamed away, moved or defined a third time), so the list only shrinks."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("router", "connector", "loadtest", "stack", "kvpush", "deploy")

# name -> (the files defining it, why they share it). "pending" entries name a rename that waits on files other
# work holds at the time of writing; do it and delete the entry.
SHARED: dict[str, tuple[frozenset[str], str]] = {
    "Unpairable": (
        frozenset({"router/errors.py", "connector/parallel/ranks.py"}),
        "one concept (this P and D cannot be paired) in two processes that share only JSON; the router's is its 503",
    ),
    "_Peer": (
        frozenset({"connector/transfer/memory.py", "connector/transfer/nixl.py"}),
        "one concept (a backend's record of a peer) private to each TransferBackend implementation",
    ),
    "Timeouts": (
        frozenset({"router/config.py", "connector/rendezvous/actions.py"}),
        "one concept (a process's `timeouts:` settings group) in two processes that share only JSON",
    ),
}


def class_definitions(root: Path = ROOT) -> dict[str, set[str]]:
    """Per class name, the files (relative to the root) that define it, at any depth (nested classes too)."""
    found: dict[str, set[str]] = defaultdict(set)
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef):
                    found[node.name].add(path.relative_to(root).as_posix())
    return found


def duplicates(found: dict[str, set[str]]) -> dict[str, frozenset[str]]:
    return {name: frozenset(files) for name, files in found.items() if len(files) > 1}


def unjustified(found: dict[str, set[str]], shared: dict[str, tuple[frozenset[str], str]]) -> list[str]:
    """Each duplicate not listed exactly as it is, and each listed pair that no longer holds, as one line."""
    dups = duplicates(found)
    lines = [
        f"{name}: defined in {sorted(files)}; rename one side, or list it with a reason"
        for name, files in sorted(dups.items())
        if shared.get(name, (frozenset(), ""))[0] != files
    ]
    lines += [
        f"{name}: listed as {sorted(files)} but defined in {sorted(found.get(name, ()))}; delete the entry"
        for name, (files, _) in sorted(shared.items())
        if name not in dups
    ]
    return lines


def test_every_class_name_defined_twice_is_listed_with_its_reason() -> None:
    assert unjustified(class_definitions(), SHARED) == []


def test_every_listed_pair_has_a_reason() -> None:
    assert all(len(files) >= 2 and reason.strip() for files, reason in SHARED.values())


def test_a_new_duplicate_fails(tmp_path: Path) -> None:
    for package, body in (("router", "class Pool:\n    pass\n"), ("loadtest", "class Pool:\n    pass\n")):
        (tmp_path / package).mkdir()
        (tmp_path / package / "a.py").write_text(body, encoding="utf-8")
    assert unjustified(class_definitions(tmp_path), {}) == [
        "Pool: defined in ['loadtest/a.py', 'router/a.py']; rename one side, or list it with a reason"
    ]


def test_a_nested_class_counts_and_a_stale_entry_fails(tmp_path: Path) -> None:
    (tmp_path / "stack").mkdir()
    (tmp_path / "stack" / "b.py").write_text("def f():\n    class Pool:\n        pass\n", encoding="utf-8")
    assert class_definitions(tmp_path)["Pool"] == {"stack/b.py"}
    stale = {"Pool": (frozenset({"stack/b.py", "router/a.py"}), "was shared")}  # router/a.py renamed it away
    assert unjustified(class_definitions(tmp_path), stale) == [
        "Pool: listed as ['router/a.py', 'stack/b.py'] but defined in ['stack/b.py']; delete the entry"
    ]
