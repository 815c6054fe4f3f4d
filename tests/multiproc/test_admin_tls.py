"""The optional TLS TCP admin listener (`server.admin_listen`) against a real daemon."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import subprocess
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvd_proto import kvd_pb2, kvd_pb2_grpc
from tests.support.daemon import clean_env
from tests.support.engine import Engine, keys_for

pytestmark = pytest.mark.multiproc
TOKEN = "t0ps3cret-admin-token-" + "x" * 16
ADMIN_MD = (("kvd-admin-token", TOKEN),)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_pki(directory: Path, ip_name: bool = True) -> dict[str, str]:
    """A CA and a server certificate for localhost (and 127.0.0.1 unless `ip_name` is
    False), valid for a day."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvd test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost")]
                + [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))] * ip_name),
                critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": directory / "ca.pem", "cert": directory / "server.pem",
             "key": directory / "server.key", "token": directory / "admin.token"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(_pem_key(key))
    paths["token"].write_text(TOKEN + "\n")
    for p in (paths["key"], paths["token"]):
        os.chmod(p, 0o600)
    return {k: str(v) for k, v in paths.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tls_daemon(workdir, start_daemon):
    pki = make_pki(workdir)
    address = f"127.0.0.1:{free_port()}"
    env = clean_env(KVD_SERVER_ADMIN_LISTEN=address, KVD_SERVER_TLS_CERT=pki["cert"],
                    KVD_SERVER_TLS_KEY=pki["key"], KVD_SERVER_ADMIN_TOKEN_FILE=pki["token"],
                    KVD_MANAGER_HEARTBEAT_INTERVAL="200ms", KVD_MANAGER_LIVENESS_TIMEOUT="1s")
    daemon = start_daemon("--pool-size", "16MiB", "--extent-size", "4MiB", env=env)
    return daemon, address, pki


def secure_channel(address: str, ca: str) -> grpc.Channel:
    with open(ca, "rb") as fh:
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(fh.read()))


def test_remote_admin_needs_tls_and_the_token(tls_daemon):
    daemon, address, pki = tls_daemon
    with secure_channel(address, pki["ca"]) as ch:
        admin = kvd_pb2_grpc.KvdAdminStub(ch)
        for md in ((), (("kvd-admin-token", "wrong-token-wrong-token"),)):
            with pytest.raises(grpc.RpcError) as e:
                admin.Stats(kvd_pb2.StatsRequest(), metadata=md, timeout=5)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value
        assert admin.Stats(kvd_pb2.StatsRequest(), metadata=ADMIN_MD, timeout=5).json
        # The engine service never leaves the node.
        with pytest.raises(grpc.RpcError) as e:
            kvd_pb2_grpc.KvdEngineStub(ch).Lookup(kvd_pb2.LookupRequest(keys=[b"k"]),
                                                  metadata=ADMIN_MD, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # Plaintext on the TLS port gets nowhere.
    with grpc.insecure_channel(address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            kvd_pb2_grpc.KvdAdminStub(ch).Stats(kvd_pb2.StatsRequest(), metadata=ADMIN_MD,
                                                timeout=3)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_cli_over_tls_resets_with_the_static_token(tls_daemon):
    daemon, address, pki = tls_daemon
    engine = Engine(daemon.socket, block=64 * 1024)
    try:
        engine.store(keys_for("tls", 4))
        remote = ("--address", address, "--tls-ca", pki["ca"])
        out = daemon.kvd("stats", *remote, socket=False)
        assert out.returncode == 2 and "--admin-token-file" in out.stderr, out.stderr
        out = daemon.kvd("stats", "--json", *remote, "--admin-token-file", pki["token"],
                         socket=False)
        assert out.returncode == 0, out.stderr
        out = daemon.kvd("health", *remote, "--admin-token-file", pki["token"], socket=False)
        assert out.returncode == 0 and "SERVING" in out.stdout, out.stderr
        out = daemon.kvd("reset", "--yes", *remote, "--admin-token-file", pki["token"],
                         socket=False)
        assert out.returncode == 0 and "dropped 4 block(s)" in out.stdout, out.stderr
        # Without the CA the daemon's certificate is not trusted: one line naming the fix.
        out = daemon.kvd("stats", "--address", address, "--admin-token-file", pki["token"],
                         "--timeout", "2", socket=False)
        assert out.returncode == 2, out.stderr
        assert out.stderr == (f"kvd: {address}: the daemon's certificate is not trusted: pass "
                              "--tls-ca CA.pem, the CA that signed it\n")
        # The static token works on the Unix socket too.
        md = (("kvd-admin-token", TOKEN),)
        daemon.admin().Reset(kvd_pb2.AdminResetRequest(), metadata=md, timeout=5)
    finally:
        engine.close()


def _one_line(out: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("kvd: "), out.stderr
    assert fragment in out.stderr and "kvd health" not in out.stderr, out.stderr


def test_tls_mistakes_are_one_clear_line(workdir, start_daemon):
    """The usual TLS mistakes, each told in one line with its fix, never gRPC's own words."""
    pki = make_pki(workdir, ip_name=False)
    address, metrics = f"127.0.0.1:{free_port()}", free_port()
    daemon = start_daemon("--pool-size", "16MiB", "--extent-size", "4MiB", "--metrics-port",
                          str(metrics), env=clean_env(
                              KVD_SERVER_ADMIN_LISTEN=address, KVD_SERVER_TLS_CERT=pki["cert"],
                              KVD_SERVER_TLS_KEY=pki["key"], KVD_SERVER_TLS_CLIENT_CA=pki["ca"],
                              KVD_SERVER_ADMIN_TOKEN_FILE=pki["token"]))
    token = ("--admin-token-file", pki["token"], "--timeout", "2")
    port = address.rsplit(":", 1)[1]
    # The certificate names localhost only.
    _one_line(daemon.kvd("stats", "--address", address, "--tls-ca", pki["ca"], *token,
                         socket=False), "certificate does not name this host")
    # By its name, the daemon still wants a client certificate (server.tls_client_ca).
    _one_line(daemon.kvd("stats", "--address", f"localhost:{port}", "--tls-ca", pki["ca"],
                         *token, socket=False), "pass --tls-cert and --tls-key")
    # The metrics port speaks plain HTTP.
    _one_line(daemon.kvd("health", "--address", f"127.0.0.1:{metrics}", "--tls-ca", pki["ca"],
                         *token, socket=False), "this port does not speak TLS")
    # Nothing listens there.
    _one_line(daemon.kvd("health", "--address", f"127.0.0.1:{free_port()}", "--tls-ca",
                         pki["ca"], *token, socket=False),
              "is the daemon's server.admin_listen on this address")


def test_bad_tls_settings_stop_the_daemon_with_a_message(workdir, start_daemon):
    from tests.support.daemon import spawn_daemon

    pki = make_pki(workdir)
    (workdir / "not.pem").write_text("hello")
    cases = [
        ({"KVD_SERVER_ADMIN_LISTEN": "127.0.0.1:1"}, "is required when server.admin_listen"),
        ({"KVD_SERVER_ADMIN_LISTEN": f"127.0.0.1:{free_port()}",
          "KVD_SERVER_TLS_CERT": str(workdir / "not.pem"), "KVD_SERVER_TLS_KEY": pki["key"],
          "KVD_SERVER_ADMIN_TOKEN_FILE": pki["token"]}, "not a PEM file"),
        ({"KVD_SERVER_ADMIN_TOKEN_FILE": str(workdir / "missing")}, "does not exist"),
    ]
    for extra, message in cases:
        daemon = spawn_daemon(workdir, env=clean_env(**extra), wait=False)
        try:
            assert daemon.proc.wait(timeout=30) == 1
            assert message in daemon.log(), daemon.log()
            assert "Traceback" not in daemon.log()
        finally:
            daemon.close()
