#!/usr/bin/env bash
# Install kvd where the systemd unit and the container image run it: a virtual environment
# under /opt/kvd and /usr/local/bin/kvd linking to its `kvd`. Nothing goes into the system
# Python, so this works where `pip install` is refused (Debian 12: "externally managed").
# Run it again to upgrade. Reference: docs/operations.md, "Installing".
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

  SOURCE           a kvd-offload wheel or a checkout (default: the checkout holding this script)
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
[ -d "$source" ] && [ ! -f "$source/pyproject.toml" ] && die "$source is not a kvd checkout"

command -v "$python" >/dev/null || die "$python not found: install Python 3.11 or newer"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "$python is older than 3.11"
if [ ! -x "$prefix/bin/python" ]; then
  # Debian and Ubuntu ship venv's pip bootstrap separately.
  "$python" -m venv "$prefix" || die "cannot create a virtual environment at $prefix (on Debian or Ubuntu: apt-get install python3-venv)"
fi

target=$source
[ -n "$extras" ] && target="${source}[${extras}]"
"$prefix/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade "$target"

mkdir -p "$bin_dir"
ln -sfn "$prefix/bin/kvd" "$bin_dir/kvd"
echo "kvd $("$bin_dir/kvd" --version | cut -d' ' -f2) installed in $prefix; $bin_dir/kvd links to it"
