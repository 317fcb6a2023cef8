#!/usr/bin/env bash
# `make compat VLLM=<version>`: build .venv-vllm-<version> (tests/compat/build.py) and run the vLLM-contract tests
# in it against that published vLLM wheel, on CPU. Needs no GPU; never touches .venv.
#   tests/compat/run.sh 0.34.0 [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${1:?usage: tests/compat/run.sh VLLM_VERSION [pytest args...]}
shift
venv=.venv-vllm-$version
wheels=${KVPUSH_COMPAT_WHEELS:-.cache/compat-wheels}
PYTHON=${PYTHON:-python3}

start=$SECONDS
"$PYTHON" tests/compat/build.py "$version" "$venv" "$wheels"
echo "compat: $venv ready in $((SECONDS - start)) s, $(du -sh "$venv" | cut -f1)"

# Every test that touches vLLM: each unit test module that imports vLLM or a connector module built on it
# (plugin, worker, stats), found by its imports so that a new one or a moved one is never left out; the
# scheduler half's and the wire metadata's unit tests, which encode vLLM's shapes in fakes; and tests/compat's
# own conformance tests, which drive vLLM's real scheduler with the connector's scheduler half.
vllm_imports='^\s*(from|import) (vllm|connector\.(plugin|worker|stats))\b|importorskip\("vllm"'
mapfile -t tests < <(
  {
    grep -rlE "$vllm_imports" tests/unit --include='test_*.py'
    echo tests/unit/connector/test_scheduler.py
    echo tests/unit/connector/wire/test_metadata.py
    ls tests/compat/test_*.py
  } | sort -u
)
echo "compat: ${#tests[@]} test modules: ${tests[*]}"
# The CUDA wheel picks its platform from this (the CPU platform of 0.34 refuses x86 without triton-cpu); no
# kernel runs, so no GPU is needed.
export VLLM_TARGET_DEVICE=cuda
start=$SECONDS
rc=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" "$@" || rc=$?
echo "compat: vllm $version tests in $((SECONDS - start)) s (pytest exit $rc)"
exit "$rc"
