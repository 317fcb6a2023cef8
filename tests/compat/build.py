"""Build `.venv-vllm-<version>`: a published vLLM wheel on a CPU torch, for the vLLM-contract tests (`make compat`).

No GPU and no CUDA: the CUDA wheel of vLLM goes in with ``--no-deps`` (its kernels never load: the tests build
configs and drive the scheduler only), beside ``torch==2.13.0+cpu`` and the wheel's own pure-Python
requirements, read from its ``Requires-Dist`` less the GPU stack (:data:`GPU_STACK`). ``xgrammar`` goes in with
``--no-deps`` too (beside its FFI, ``apache-tvm-ffi``, which vLLM pins): its requirements pull in triton
(1 GB), which nothing here loads. kvpush itself is installed
editable without dependencies, then its runtime dependencies and the test tools from ``pyproject.toml``.
research: shared/research/turn4-vllm-compat.md, "Installability" and "Tier A".

Every wheel is downloaded once into the wheel cache (``.cache/compat-wheels``): a later build installs from it with
``--no-index`` and reaches the network only when something is missing. A stamp in the venv records what it was
built from; a venv whose stamp matches is reused as is.

    python3 tests/compat/build.py VERSION VENV WHEELS     # under any Python >= 3.11 (stdlib only)
    VENV/bin/python tests/compat/build.py --requires WHEEL  # inside the venv (needs `packaging`): the list
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tomllib
import venv
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0+cpu"  # the CPU build the main .venv runs; vLLM's own pin (2.14) has no CPU wheel here
# Names (PEP 503 normalised, or a prefix ending in "-") of the GPU and media stack: CUDA builds, kernels and the
# libraries only a GPU model runner loads. torch comes from TORCH, xgrammar without its dependencies.
GPU_STACK = (
    "torch",
    "torchaudio",
    "torchvision",
    "torchcodec",
    "triton",
    "xgrammar",
    "pynvvideocodec",
    "flashinfer-",
    "tilelang",
    "nvidia-",
    "cuda-",
    "nvtx",
    "fastsafetensors",
    "instanttensor",
    "quack-kernels",
    "tokenspeed-mla",
    "humming-kernels",
    "deep-gemm",
    "zentorch",
)
TEST_TOOLS = ("pytest", "pytest-asyncio", "hypothesis")  # taken with their pins from pyproject's dev extra
STAMP = ".kvpush-compat.json"
PIP_QUIET = ("--quiet", "--disable-pip-version-check")
# No byte-compiling at install: a test run imports a small part of vLLM (Python caches what it imports)
INSTALL = ("install", *PIP_QUIET, "--no-compile")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return normalise(match.group(1))


def is_gpu_stack(requirement: str) -> bool:
    name = requirement_name(requirement)
    return any(name.startswith(s) if s.endswith("-") else name == s for s in GPU_STACK)


def wheel_requires(wheel: Path) -> list[str]:
    """The wheel's ``Requires-Dist`` lines, markers included."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def applicable(requires: Iterable[str]) -> list[str]:
    """The requirements that apply to this interpreter without extras (run inside the venv: needs packaging)."""
    from packaging.requirements import Requirement

    kept = []
    for line in requires:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            req.marker = None
            kept.append(str(req))
    return kept


def vllm_requirements(requires: Iterable[str]) -> tuple[list[str], list[str]]:
    """(installed with dependencies, installed without): the GPU stack dropped, xgrammar without its own."""
    with_deps = [r for r in requires if not is_gpu_stack(r)]
    no_deps = [r for r in requires if requirement_name(r) == "xgrammar"]
    return with_deps, no_deps


def kvpush_requirements(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    tools = [r for r in project["optional-dependencies"]["dev"] if requirement_name(r) in TEST_TOOLS]
    return [*project["dependencies"], *tools]


def stamp_of(version: str) -> dict[str, str]:
    """What a venv was built from: a change to any of it rebuilds."""
    kvpush = "\n".join(kvpush_requirements(REPO / "pyproject.toml")).encode()
    digest = hashlib.sha256(Path(__file__).read_bytes() + kvpush).hexdigest()
    return {"vllm": version, "torch": TORCH, "inputs": digest}


def run(*argv: str | Path) -> None:
    print("+", " ".join(str(a) for a in argv), flush=True)
    subprocess.run([str(a) for a in argv], check=True)


def fetch_vllm(pip: Sequence[str], version: str, wheels: Path) -> Path:
    found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
    if not found:
        run(*pip, "download", *PIP_QUIET, "--no-deps", "--only-binary=:all:", "-d", wheels, f"vllm=={version}")
        found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
    if len(found) != 1:
        raise SystemExit(f"expected one vllm {version} wheel in {wheels}, found {[f.name for f in found]}")
    return found[0]


def install_cached(pip: Sequence[str], wheels: Path, args: Sequence[str | Path]) -> None:
    """``pip install args`` from the wheel cache; on a miss, download into it (one resolve) and install again."""
    offline = [*pip, *INSTALL, "--no-index", "--find-links", str(wheels), *args]
    print("+", " ".join(str(a) for a in offline), flush=True)
    tried = subprocess.run([str(a) for a in offline], check=False, capture_output=True, text=True)
    if tried.returncode == 0:
        return
    missing = [line for line in tried.stderr.splitlines() if line.startswith("ERROR")][-1:]
    print(f"wheel cache incomplete ({' '.join(missing)}): downloading what is missing", flush=True)
    run(*pip, "download", *PIP_QUIET, "--only-binary=:all:", "-d", wheels, *args)
    run(*offline)


def build(version: str, target: Path, wheels: Path) -> None:
    stamp_path = target / STAMP
    wanted = stamp_of(version)
    if stamp_path.exists() and json.loads(stamp_path.read_text()) == wanted:
        print(f"{target}: up to date (vllm {version})", flush=True)
        return
    wheels.mkdir(parents=True, exist_ok=True)
    if not (target / "bin" / "python").exists():
        venv.create(target, with_pip=True)
    python = target / "bin" / "python"
    pip = [str(python), "-m", "pip"]
    wheel = fetch_vllm(pip, version, wheels)
    install_cached(pip, wheels, ["packaging", "setuptools>=70.1"])
    listed = subprocess.run(
        [str(python), __file__, "--requires", str(wheel)], check=True, capture_output=True, text=True
    ).stdout.split("\n")
    with_deps, no_deps = vllm_requirements([r for r in listed if r])
    constraints = target / "compat-constraints.txt"
    constraints.write_text(f"{TORCH}\n")
    install_cached(pip, wheels, ["-c", constraints, TORCH, *with_deps, *kvpush_requirements(REPO / "pyproject.toml")])
    install_cached(pip, wheels, ["--no-deps", *no_deps])
    run(*pip, *INSTALL, "--no-deps", wheel)
    run(*pip, *INSTALL, "--no-deps", "--no-build-isolation", "-e", REPO)
    stamp_path.write_text(json.dumps(wanted))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requires", type=Path, help="print the wheel's requirements that apply here, one a line")
    parser.add_argument("version", nargs="?")
    parser.add_argument("venv", nargs="?", type=Path)
    parser.add_argument("wheels", nargs="?", type=Path)
    args = parser.parse_args(argv)
    if args.requires is not None:
        print("\n".join(applicable(wheel_requires(args.requires))))
        return 0
    if args.version is None or args.venv is None or args.wheels is None:
        parser.error("VERSION, VENV and WHEELS are required")
    build(args.version, args.venv, args.wheels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
