"""`kvd serve --reflection`: generic gRPC tools see the services and read stats and config
without kvd's .proto file (what grpcurl does, done here with grpcio-reflection's own client)."""

from __future__ import annotations

import json
import os

import grpc
import pytest

from tests.support.daemon import Daemon, clean_env, target

pytestmark = pytest.mark.multiproc
reflection_db = pytest.importorskip(
    "grpc_reflection.v1alpha.proto_reflection_descriptor_database",
    reason="grpcio-reflection not installed (the test extras install it)")


def _call(channel: grpc.Channel, service: str, method: str) -> object:
    """Call `service/method` with an empty request, knowing the types only by reflection."""
    from google.protobuf import message_factory
    from google.protobuf.descriptor_pool import DescriptorPool

    pool = DescriptorPool(reflection_db.ProtoReflectionDescriptorDatabase(channel))
    desc = pool.FindServiceByName(service).methods_by_name[method]
    request = message_factory.GetMessageClass(desc.input_type)
    answer = message_factory.GetMessageClass(desc.output_type)
    stub = channel.unary_unary(f"/{service}/{method}", request.SerializeToString,
                               answer.FromString)
    return stub(request(), timeout=5)


def test_reflection_lists_the_services_and_reads_stats_and_config(start_daemon):
    daemon: Daemon = start_daemon("--pool-size", "8MiB", "--extent-size", "4MiB",
                                  "--reflection")
    with grpc.insecure_channel(target(daemon.socket)) as channel:
        services = set(reflection_db.ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {"kvd.v1.KvdEngine", "kvd.v1.KvdAdmin", "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection"} <= services
        stats = json.loads(_call(channel, "kvd.v1.KvdAdmin", "Stats").json)
        assert stats["pool"]["total_bytes"] == 8 << 20
        config = json.loads(_call(channel, "kvd.v1.KvdAdmin", "GetConfig").json)
        assert config["server"]["reflection"] is True
    assert "gRPC server reflection on" in daemon.log()


def test_no_reflection_without_the_flag(daemon: Daemon):
    with grpc.insecure_channel(target(daemon.socket)) as channel, \
            pytest.raises(grpc.RpcError) as err:
        reflection_db.ProtoReflectionDescriptorDatabase(channel).get_services()
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_reflection_without_its_package_says_which_extra_to_install(workdir, start_daemon):
    hidden = workdir / "hide" / "grpc_reflection"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(workdir / "hide"), env["PYTHONPATH"]])
    daemon: Daemon = start_daemon("--pool-size", "8MiB", "--extent-size", "4MiB",
                                  "--reflection", env=env)
    assert "pip install 'kvd-offload[reflection]'" in daemon.log()
    assert "serving without reflection" in daemon.log()
