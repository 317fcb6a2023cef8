#!/usr/bin/env bash
# Puts promtool (Debian's prometheus package, without installing or starting the service) at
# .cache/tools/bin/promtool, for the deploy tests. Idempotent; a no-op when it is already there.
#   deploy/tools/install-promtool.sh            # from the repository root (any directory works)
# Needs apt (Debian/Ubuntu). Without root, or without apt, it says so and exits 0 (the promtool tests then
# skip), unless KVPUSH_REQUIRE_PROMTOOL=1 (CI), which makes that an error, in the script and in the tests.
set -euo pipefail
give_up() {
  echo "install-promtool: $1" >&2
  if [[ "${KVPUSH_REQUIRE_PROMTOOL:-0}" == 1 ]]; then exit 1; fi
  exit 0
}
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="$root/.cache/tools"
bin="$dest/bin/promtool"
if [[ -x "$bin" ]] && "$bin" --version >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  give_up "no apt-get here; the promtool tests will skip (put promtool on PATH to run them)"
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
if ! apt-get download prometheus >/dev/null 2>&1; then
  if [[ "$(id -u)" != 0 ]]; then
    give_up "apt-get download prometheus failed and apt-get update needs root; the promtool tests will skip"
  fi
  apt-get update -qq >/dev/null 2>&1 || give_up "apt-get update failed; the promtool tests will skip"
  apt-get download prometheus >/dev/null 2>&1 || give_up "apt-get download prometheus failed; the promtool tests will skip"
fi
dpkg-deb -x prometheus_*.deb extracted
mkdir -p "$dest/bin"
install -m 755 extracted/usr/bin/promtool "$bin"
"$bin" --version 2>&1 | head -n 1
