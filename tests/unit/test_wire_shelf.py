"""The shelf both sides import (kvd_proto.wire, .paths, .attach) says what the proto says, and
each shared fact has one definition."""

from __future__ import annotations

import pathlib
import re

import pytest

from kvd_proto import attach, kvd_pb2, paths, wire

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO = (ROOT / "proto" / "kvd" / "v1" / "kvd.proto").read_text()


def _stated_bounds() -> dict[str, set[int]]:
    """Every `(NAME)` tag in the proto's comments with the numbers stated before it on its
    line (a bound may be tagged on several lines)."""
    out: dict[str, set[int]] = {}
    for line in PROTO.splitlines():
        if "//" not in line:
            continue
        comment = line.split("//", 1)[1]
        start = 0
        for tag in re.finditer(r"\(((?:MAX|DEFAULT|SLOT)_[A-Z_]+)\)", comment):
            numbers = {int(n) for n in re.findall(r"\b\d+\b", comment[start:tag.start()])}
            out.setdefault(tag.group(1), set()).update(numbers)
            start = tag.end()
    return out


def test_every_bound_the_proto_states_is_the_shelfs_value():
    stated = _stated_bounds()
    assert len(stated) >= 13, sorted(stated)
    for name, numbers in stated.items():
        value = getattr(wire, name, None)
        assert value is not None, f"the proto names {name}, kvd_proto.wire does not define it"
        assert value in numbers, f"the proto states {sorted(numbers)} for {name}, wire has {value}"


def test_the_shelfs_bounds_are_all_stated_in_the_proto():
    stated = _stated_bounds()
    for name in dir(wire):
        if re.fullmatch(r"(MAX|DEFAULT)_[A-Z_]+|SLOT_ALIGNMENT", name):
            assert name in stated, f"kvd_proto.wire.{name} is not stated in kvd.proto"


def test_metadata_keys_are_the_documented_ones():
    assert f"`{wire.SESSION_TOKEN_METADATA}`" in PROTO
    assert f"`{wire.ADMIN_TOKEN_METADATA}`" in PROTO


def test_attach_limits_are_the_documented_ones():
    doc = (ROOT / "docs" / "attach.md").read_text()
    assert f"at most {attach.MAX_REQUEST_BYTES} bytes" in doc
    assert f"at most {attach.MAX_REQUEST_BYTES} bytes" in PROTO
    assert f"protocol version {attach.PROTOCOL_VERSION}" in doc


def test_attach_request_round_trip_and_refusals():
    line = attach.encode_request(attach.AttachRequest(attach.ROLE_DATAPLANE, "w0"))
    assert line.endswith(b"\n") and len(line) <= attach.MAX_REQUEST_BYTES
    assert attach.parse_request(line.rstrip(b"\n")) == attach.AttachRequest("dataplane", "w0")
    for bad in (b"", b"nope", b"[]", b'{"version": 2}', b'{"version": 1, "role": "root"}',
                b"[" * 100_000, b"x" * (attach.MAX_REQUEST_BYTES + 1)):
        with pytest.raises(attach.AttachError) as err:
            attach.parse_request(bad)
        assert err.value.code == "INVALID_ARGUMENT"


def test_one_socket_rule(tmp_path):
    env = {"XDG_RUNTIME_DIR": "/run/user/7"}
    assert paths.daemon_socket_path(env) == "/run/user/7/kvd/kvd.sock"
    assert paths.daemon_socket_path({**env, "KVD_SOCKET": "/x/k.sock"}) == "/x/k.sock"
    assert paths.daemon_socket_path({"KVD_SERVER_SOCKET": "/y/k.sock"}) == "/y/k.sock"
    assert paths.attach_path("/x/k.sock") == "/x/k.sock.attach"
    assert paths.grpc_target("rel.sock") == f"unix://{pathlib.Path('rel.sock').resolve()}"
    assert paths.probe_socket(str(tmp_path / "none"))[0] is paths.SocketState.ABSENT
    (tmp_path / "file").write_text("")
    assert paths.probe_socket(str(tmp_path / "file"))[0] is paths.SocketState.NOT_SOCKET


def test_clients_fall_back_to_the_system_socket_only_when_theirs_is_absent(tmp_path,
                                                                            monkeypatch):
    """On a systemd or Kubernetes node `kvd stats` needs no --socket; a daemon never binds the
    system path by surprise."""
    system = tmp_path / "run-kvd" / "kvd.sock"
    monkeypatch.setattr(paths, "SYSTEM_SOCKET", str(system))
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "user")}
    own = str(tmp_path / "user" / "kvd" / "kvd.sock")
    assert paths.default_socket_path(env) == own           # neither exists: the user's own
    system.parent.mkdir()
    system.touch()
    assert paths.default_socket_path(env) == str(system)   # only the system's exists
    assert paths.daemon_socket_path(env) == own            # the daemon keeps its own rule
    assert paths.default_socket_path({**env, "KVD_SOCKET": "/x/k.sock"}) == "/x/k.sock"
    (tmp_path / "user" / "kvd").mkdir(parents=True)
    pathlib.Path(own).touch()
    assert paths.default_socket_path(env) == own           # the user's own exists: it wins


def test_no_side_defines_a_shared_fact_again():
    """The facts of the shelf have one definition: no module of either side assigns them."""
    names = ("SESSION_TOKEN_METADATA", "ADMIN_TOKEN_METADATA", "SLOT_ALIGNMENT",
             "ATTACH_SUFFIX", "MAX_MESSAGE_BYTES", "MAX_KEYS_PER_CALL", "PROTOCOL_VERSION",
             "MAX_REQUEST_BYTES")
    for package in ("kvd_server", "kvd_client"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            for name in names:
                assert not re.search(rf"^{name}\s*=", text, re.M), f"{path} defines {name}"
            assert '"kvd-session-token"' not in text and '"kvd-admin-token"' not in text, path
            assert '+ ".attach"' not in text, f"{path} builds the attach path by hand"


def test_block_states_are_the_wires() -> None:
    """kvd_proto.wire.BlockState is the proto's enum (less its UNSPECIFIED zero): the daemon
    answers its members as the wire's numbers, the client's Lookup has its members by name."""
    from kvd_client.offload.session import Lookup as ClientLookup
    from kvd_proto.wire import BlockState
    from kvd_server.manager import Lookup as DaemonLookup

    wire = {name: number for name, number in kvd_pb2.BlockState.items()
            if number != 0}
    assert {s.name: s.value for s in BlockState} == {
        name.removeprefix("BLOCK_STATE_"): number for name, number in wire.items()}
    assert DaemonLookup is BlockState
    assert [(m.name, m.value) for m in ClientLookup] == [
        ("MISS", "miss"), ("HIT", "hit"), ("HIT_PENDING", "hit_pending")]   # as the checker reads it
    assert [m.name for m in ClientLookup] == [s.name for s in BlockState]
