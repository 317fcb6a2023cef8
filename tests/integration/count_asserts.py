"""How many `assert` statements run against real engines: an ast count over the integration test modules that are
marked `vllm` (`pytestmark` naming VLLM or pytest.mark.vllm), helpers in the module included, shared helper
modules not. Issue 19 item 6 compares the figure before and after a change to the suite.

    .venv/bin/python -m tests.integration.count_asserts [ROOT]   # ROOT: tests/integration (default)
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Count:
    path: Path
    asserts: int


def marks_vllm(tree: ast.Module) -> bool:
    """Whether the module's `pytestmark` names the vllm marker (directly, or as support's VLLM list)."""
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if not any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
            continue
        for sub in ast.walk(node.value if isinstance(node, ast.Assign) else node):
            if isinstance(sub, ast.Name) and sub.id == "VLLM":
                return True
            if isinstance(sub, ast.Attribute) and sub.attr == "vllm":
                return True
    return False


def count(path: Path) -> Count | None:
    """The module's assert count, or None when it is not marked vllm."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    if not marks_vllm(tree):
        return None
    return Count(path, sum(isinstance(node, ast.Assert) for node in ast.walk(tree)))


def counts(root: Path) -> list[Count]:
    found = (count(path) for path in sorted(root.rglob("test_*.py")))
    return [c for c in found if c is not None]


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else HERE
    found = counts(root)
    for c in found:
        print(f"{c.asserts:5d}  {c.path.relative_to(root)}")
    print(f"{sum(c.asserts for c in found):5d}  asserts in {len(found)} real-engine modules")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
