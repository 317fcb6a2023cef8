"""The umbrella `kvpush` command: usage, unknown commands, and each command's package imported only when chosen."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpush import cli


def test_no_command_prints_usage_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert capsys.readouterr().out.startswith("kvpush <command>")
    assert cli.main(["--help"]) == 0


def test_unknown_command_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err


def test_serve_help_loads_no_harness() -> None:
    code = (
        "import json, sys\nfrom kvpush.cli import main\ntry:\n    main(['serve', '--help'])\n"
        "except SystemExit:\n    pass\nprint(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    assert "router" in loaded
    assert not {"loadtest", "stack", "connector"} & loaded


def test_load_is_loadtest_run(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    import loadtest.cli

    def fake_main(argv: list[str]) -> int:
        seen.append(argv)
        return 0

    monkeypatch.setattr(loadtest.cli, "main", fake_main)
    assert cli.main(["load", "--qps", "1"]) == 0
    assert cli.main(["bench", "--suite", "all"]) == 0
    assert seen == [["run", "--qps", "1"], ["bench", "--suite", "all"]]
