#!/usr/bin/env bash
# Install kvd where the systemd unit and the container image run it: a virtual environment
# under /opt/kvd and /usr/local/bin/kvd linking to its `kvd`. Nothing goes into the system
# Python, so this works where `pip install` is refused (Debian 12: "externally managed").
# Run it again to upgrade, or to reinstall: a rebuilt wheel of the same version replaces the
# installed one, and a venv left half-made (no pip) is made anew. A checkout is built in a
# temporary copy, so `sudo deploy/install.sh` leaves no root-owned build/ or *.egg-info/ in it.
# Reference: docs/operations.md, "Installing".
set -euo pipefail

prefix=/opt/kvd
bin_dir=/usr/local/bin
python=python3
extras=""
source=""

usage() {
  cat <<EOF
usage: install.sh [--prefix DIR] [--bin-dir DIR] [--python PYTHON] [--extras LIST] [SOURCE]

Installs kvd into a virtual environment at DIR and links BIN_DIR/kvd to it.

  SOURCE           a kvd-offload wheel or a checkout (default: the checkout holding this script);
                   the same version again is reinstalled, not skipped
  --prefix DIR     the virtual environment (default: $prefix)
  --bin-dir DIR    where the kvd link goes (default: $bin_dir; the systemd unit runs
                   $bin_dir/kvd)
  --python PYTHON  the Python 3.11+ that creates the environment (default: $python)
  --extras LIST    extras to install with it, e.g. reflection or vllm (comma-separated)

Remove it with: rm -rf DIR BIN_DIR/kvd
EOF
}

die() { echo "install.sh: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix=${2:?--prefix needs a directory}; shift 2 ;;
    --bin-dir) bin_dir=${2:?--bin-dir needs a directory}; shift 2 ;;
    --python) python=${2:?--python needs an interpreter}; shift 2 ;;
    --extras) extras=${2:?--extras needs a list}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) usage >&2; die "unknown option $1" ;;
    *) [ -z "$source" ] || die "one SOURCE only"; source=$1; shift ;;
  esac
done
if [ -z "$source" ]; then
  source=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
fi
[ -e "$source" ] || die "$source does not exist"
if [ -d "$source" ]; then
  [ -f "$source/pyproject.toml" ] || die "$source is not a kvd checkout"
else
  case "$source" in *.whl) ;; *) die "$source is neither a wheel (.whl) nor a kvd checkout" ;; esac
fi

command -v "$python" >/dev/null || die "$python not found: install Python 3.11 or newer"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "$python is older than 3.11"

# A usable environment is a venv (pyvenv.cfg: never pip into a system Python given as --prefix)
# whose pip runs. Debian's python3 without python3-venv makes bin/python, then fails on
# ensurepip: such a half-made venv is cleared and made again.
venv_ok() { [ -f "$prefix/pyvenv.cfg" ] && "$prefix/bin/python" -m pip --version >/dev/null 2>&1; }
if ! venv_ok; then
  if [ -e "$prefix" ] && [ ! -f "$prefix/pyvenv.cfg" ] && [ -n "$(ls -A "$prefix")" ]; then
    die "$prefix exists and is not a virtual environment: name another --prefix, or remove it"
  fi
  [ -f "$prefix/pyvenv.cfg" ] \
    && echo "install.sh: $prefix is a virtual environment without a working pip (half-made): recreating it"
  venv_hint="on Debian or Ubuntu: apt-get install python3-venv, then run this again"
  "$python" -m venv --clear "$prefix" || die "cannot create a virtual environment at $prefix ($venv_hint)"
  venv_ok || die "$python -m venv made $prefix without pip ($venv_hint)"
fi
pip=("$prefix/bin/python" -m pip install --quiet --disable-pip-version-check)
before=$("$prefix/bin/python" -c 'from importlib.metadata import version; print(version("kvd-offload"))' 2>/dev/null || true)

# A checkout is built into a wheel in a temporary copy of what the wheel is made of (as the
# Containerfile's build stage copies it), so nothing is written into the checkout.
work=$(mktemp -d "${TMPDIR:-/tmp}/kvd-install.XXXXXX")
trap 'rm -rf "$work"' EXIT
wheel=$source
if [ -d "$source" ]; then
  parts=()
  for part in pyproject.toml setup.py README.md LICENSE kvd_server kvd_client kvd_proto; do
    [ -e "$source/$part" ] && parts+=("$part")
  done
  mkdir "$work/src"
  tar -C "$source" --exclude=__pycache__ --exclude='*.so' --exclude='*.egg-info' -cf - "${parts[@]}" \
    | tar -C "$work/src" --no-same-owner -xf -
  "$prefix/bin/python" -m pip wheel --quiet --disable-pip-version-check --no-deps \
    --wheel-dir "$work/wheel" "$work/src" || die "cannot build kvd from $source"
  wheel=$(echo "$work"/wheel/kvd_offload-*.whl)
fi

# pip skips a wheel whose version is installed; kvd itself is always replaced (no deps), then
# its dependencies and extras are brought up to what it asks for.
"${pip[@]}" --force-reinstall --no-deps "$wheel"
target=$wheel
[ -n "$extras" ] && target="${wheel}[${extras}]"
"${pip[@]}" --upgrade "$target"

mkdir -p "$bin_dir"
ln -sfn "$prefix/bin/kvd" "$bin_dir/kvd"
version=$("$bin_dir/kvd" --version | cut -d' ' -f2)
case "$before" in
  "") what="" ;;
  "$version") what=" (reinstalled over $version from $source)" ;;
  *) what=" (replacing $before)" ;;
esac
echo "kvd $version installed in $prefix$what; $bin_dir/kvd links to it"
