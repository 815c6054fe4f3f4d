"""Generate the committed gRPC/protobuf Python code from proto/ into kvd_proto/.

Run by `make proto`; tests/unit/test_proto_fresh.py runs it into a temporary directory and
fails when the committed files differ (stale generated code).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PROTO_FILES = ["kvd/v1/kvd.proto"]
GENERATED = ["kvd_pb2.py", "kvd_pb2.pyi", "kvd_pb2_grpc.py"]


def generate(out_dir: pathlib.Path) -> None:
    """Run protoc (from grpcio-tools) and flatten its output into `out_dir`."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(PROTO_DIR / p) for p in PROTO_FILES],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        src = pathlib.Path(tmp) / "kvd" / "v1"
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            text = (src / name).read_text()
            # protoc writes absolute imports (`from kvd.v1 import kvd_pb2`); the flattened
            # package needs a relative one.
            text = re.sub(r"^from kvd\.v1 import (\w+)", r"from . import \1", text, flags=re.M)
            (out_dir / name).write_text(text)
        shutil.copy(PROTO_DIR / "kvd" / "v1" / "kvd.proto", out_dir / "kvd.proto")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "kvd_proto")
    args = parser.parse_args()
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
