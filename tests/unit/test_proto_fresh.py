"""The committed generated code in kvd_proto/ matches proto/ (run `make proto` when it fails)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path):
    pytest.importorskip("grpc_tools")
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = gen
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    for name in [*gen.GENERATED, "kvd.proto"]:
        fresh = (tmp_path / name).read_text()
        committed = (ROOT / "kvd_proto" / name).read_text()
        assert fresh == committed, f"kvd_proto/{name} is stale: run `make proto`"


def test_every_engine_rpc_is_served():
    from kvd_proto import kvd_pb2
    from kvd_server.rpc.admin import AdminService
    from kvd_server.rpc.engine import EngineService

    for service, impl in (("KvdEngine", EngineService), ("KvdAdmin", AdminService)):
        for method in kvd_pb2.DESCRIPTOR.services_by_name[service].methods:
            assert callable(getattr(impl, method.name, None)), f"{service}.{method.name}"
