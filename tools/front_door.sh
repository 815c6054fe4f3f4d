#!/usr/bin/env bash
# The README's front door as a newcomer meets it: `make run` in a venv that has only what
# `make run` installs (not the test extras), no setuptools banner on the way, the daemon
# answering health, and a clean exit on SIGTERM. CI runs this after `make test`, so a runtime import that only the test extras
# provide cannot land.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d /tmp/kvd-front-door.XXXXXX)
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$work"' EXIT
venv="$work/venv"
export XDG_RUNTIME_DIR="$work/run"          # the default socket: $XDG_RUNTIME_DIR/kvd/kvd.sock
mkdir -p "$XDG_RUNTIME_DIR"
export KVD_POOL_SIZE=64MiB                  # the embedded 1 GiB default would work too, slower
make --no-print-directory run VENV="$venv" > "$work/run.log" 2>&1 &
pid=$!
for _ in $(seq 1 600); do                   # up to 5 minutes: the venv is installed first
  if "$venv/bin/kvd" health --timeout 1 >/dev/null 2>&1; then
    break
  fi
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "front door: make run exited early:"; cat "$work/run.log"; exit 1
  fi
  sleep 0.5
done
"$venv/bin/kvd" health --timeout 2 || { echo "front door: never healthy:"; cat "$work/run.log"; exit 1; }
"$venv/bin/kvd" stats > /dev/null
# make runs kvd serve as a child: stop the daemon itself, then wait for make.
pkill -TERM -f "$venv/bin/kvd serve" || true
wait "$pid" || { echo "front door: make run did not exit 0 after SIGTERM:"; cat "$work/run.log"; exit 1; }
grep -q "kvd stopped" "$work/run.log" || { echo "front door: no clean stop:"; cat "$work/run.log"; exit 1; }
# A newcomer's first `make run` shows kvd's own lines, not the build backend's banners.
if grep -E "BuildBackendWarning|SetuptoolsDeprecationWarning|SetuptoolsWarning" "$work/run.log"; then
  echo "front door: make run printed a setuptools banner (above)"; exit 1
fi
echo "front door: make run serves with its own dependencies and stops cleanly"
