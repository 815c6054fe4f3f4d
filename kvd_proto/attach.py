"""The attach side channel's wire format (protocol version 1), and its client exchange.

One exchange per connection on the plain Unix socket `<socket>.attach` (docs/attach.md):

- the client sends one line of UTF-8 JSON ending in `\\n`, at most MAX_REQUEST_BYTES:
  `{"version": 1, "role": "engine" | "dataplane" | "admin" | "report", "engine_id": "..."}`
  (`pid` may be sent by older clients and is ignored: the daemon asks the kernel; a `report`
  request also carries `"report": {...}`, a worker's transfer sizes and times);
- the daemon answers with a 4-byte big-endian length N and N bytes of UTF-8 JSON, with
  `"ok": true` and the role's fields (the pool's descriptor rides on the first bytes via
  SCM_RIGHTS for engines and data-plane workers), or `"ok": false` with a gRPC status name in
  `code` and a message in `error`;
- the daemon closes the connection.

Both sides import this module: the daemon parses requests and frames answers with it, the
client library and the `kvd` CLI run `exchange` to attach or to ask for an admin token.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

from .paths import attach_path
from .wire import MAX_TRANSFER_SAMPLES

PROTOCOL_VERSION = 1
MAX_REQUEST_BYTES = 4096
MAX_REPLY_BYTES = 65536
REQUEST_TIMEOUT_S = 2.0      # the daemon drops a peer that has not sent its line by then
ROLE_ENGINE = "engine"       # open a session: token + pool descriptor
ROLE_DATAPLANE = "dataplane"  # an engine's worker: the pool descriptor only
ROLE_ADMIN = "admin"         # an operator tool: an admin token, no descriptor
ROLE_INDEX = "index"         # a registered session: its namespace's index + its marks file
ROLE_REPORT = "report"       # a worker's transfer sizes and times: no descriptor, no session
ROLE_CHANNEL = "channel"     # a registered session: its channel (rings file + eventfd)
ROLE_BELOW = "below"         # a registered session: its namespace's "held below" table
ROLE_TENANT = "tenant"       # an agent tool: a tenant token (its own tenant's agent sessions)
ROLES = (ROLE_ENGINE, ROLE_DATAPLANE, ROLE_ADMIN, ROLE_INDEX, ROLE_REPORT, ROLE_CHANNEL,
         ROLE_BELOW, ROLE_TENANT)
REPORT_COUNTERS = ("load_bytes", "load_seconds", "store_bytes", "store_seconds")
REPORT_SAMPLES = ("load_sizes", "store_sizes")
MAX_COUNT = 1 << 63          # report integers are below this (int64 on the daemon's side)
_HEADER = struct.Struct(">I")


class AttachError(Exception):
    """An attach that failed; `code` is a gRPC status name, the message says what to do."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True, frozen=True)
class TransferReport:
    """What a data-plane worker moved since its last report (role `report`).

    The worker has no session, so this rides on the attach socket; the daemon adds it to the
    `kvd_transfer_*` totals and histogram.
    """

    load_bytes: int = 0
    load_seconds: float = 0.0
    store_bytes: int = 0
    store_seconds: float = 0.0
    load_sizes: tuple[int, ...] = ()     # bytes per transfer, at most MAX_TRANSFER_SAMPLES
    store_sizes: tuple[int, ...] = ()


@dataclass(slots=True, frozen=True)
class AttachRequest:
    role: str
    engine_id: str = ""
    report: TransferReport | None = None   # role `report` only
    token: str = ""              # role "index": the session whose namespace is mapped


def encode_request(request: AttachRequest) -> bytes:
    doc: dict[str, Any] = {"version": PROTOCOL_VERSION, "pid": os.getpid(),
                           "engine_id": request.engine_id, "role": request.role}
    if request.token:
        doc["token"] = request.token
    if request.report is not None:
        r = request.report
        doc["report"] = {"load_bytes": r.load_bytes, "load_seconds": r.load_seconds,
                         "store_bytes": r.store_bytes, "store_seconds": r.store_seconds,
                         "load_sizes": list(r.load_sizes), "store_sizes": list(r.store_sizes)}
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def parse_request(line: bytes) -> AttachRequest:
    """A request line as the daemon reads it; AttachError(INVALID_ARGUMENT) when malformed."""
    if len(line) > MAX_REQUEST_BYTES:
        raise AttachError("INVALID_ARGUMENT",
                          f"attach request longer than {MAX_REQUEST_BYTES} bytes")
    if not line.strip():
        raise AttachError("INVALID_ARGUMENT", "empty attach request")
    try:
        doc = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AttachError("INVALID_ARGUMENT", f"attach request is not JSON: {exc}") from None
    except RecursionError:
        raise AttachError("INVALID_ARGUMENT", "attach request nests too deeply") from None
    if not isinstance(doc, dict):
        raise AttachError("INVALID_ARGUMENT", "attach request must be a JSON object")
    version = doc.get("version")
    if version != PROTOCOL_VERSION:
        raise AttachError("INVALID_ARGUMENT",
                          f"unsupported attach protocol version {version!r}; "
                          f"this daemon speaks {PROTOCOL_VERSION}")
    pid = doc.get("pid", 0)
    engine_id = doc.get("engine_id", "")
    role = doc.get("role", ROLE_ENGINE)
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 0:
        raise AttachError("INVALID_ARGUMENT", "pid must be a non-negative integer")
    if not isinstance(engine_id, str) or len(engine_id.encode()) > 256:
        raise AttachError("INVALID_ARGUMENT", "engine_id must be a string of at most 256 bytes")
    if role not in ROLES:
        raise AttachError("INVALID_ARGUMENT", f"role must be one of {', '.join(ROLES)}")
    token = doc.get("token", "")
    if not isinstance(token, str) or len(token) > 128:
        raise AttachError("INVALID_ARGUMENT", "token must be a string of at most 128 characters")
    if role in (ROLE_INDEX, ROLE_CHANNEL, ROLE_BELOW) and not token:
        raise AttachError("INVALID_ARGUMENT", f"role \"{role}\" needs the session's token")
    report = doc.get("report")
    if (role == ROLE_REPORT) != (report is not None):
        raise AttachError("INVALID_ARGUMENT", "a `report` object comes with role `report`, "
                          "and only with it")
    return AttachRequest(role, engine_id, None if report is None else _parse_report(report),
                         token=token)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_COUNT


def _is_seconds(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value >= 0


def _parse_report(doc: Any) -> TransferReport:
    if not isinstance(doc, dict):
        raise AttachError("INVALID_ARGUMENT", "report must be a JSON object")
    unknown = set(doc) - set(REPORT_COUNTERS) - set(REPORT_SAMPLES)
    if unknown:
        raise AttachError("INVALID_ARGUMENT", f"unknown report fields: {sorted(unknown)}")
    counters: dict[str, int | float] = {}
    for name in REPORT_COUNTERS:
        value = doc.get(name, 0)
        integral = name.endswith("_bytes")
        if not _is_count(value) and (integral or not _is_seconds(value)):
            kind = "integer" if integral else "number"
            raise AttachError("INVALID_ARGUMENT",
                              f"report.{name} must be a non-negative finite {kind}")
        counters[name] = value
    samples: dict[str, tuple[int, ...]] = {}
    for name in REPORT_SAMPLES:
        value = doc.get(name, [])
        if not isinstance(value, list) or len(value) > MAX_TRANSFER_SAMPLES:
            raise AttachError("INVALID_ARGUMENT", f"report.{name} must be a list of at most "
                              f"{MAX_TRANSFER_SAMPLES} sizes")
        if not all(_is_count(v) for v in value):
            raise AttachError("INVALID_ARGUMENT",
                              f"report.{name} must hold non-negative integers")
        samples[name] = tuple(value)
    return TransferReport(load_bytes=int(counters["load_bytes"]),
                          load_seconds=float(counters["load_seconds"]),
                          store_bytes=int(counters["store_bytes"]),
                          store_seconds=float(counters["store_seconds"]),
                          load_sizes=samples["load_sizes"], store_sizes=samples["store_sizes"])


def encode_reply(fields: dict[str, Any]) -> bytes:
    """A success answer (`fields` must be JSON-able), framed."""
    return _frame({"version": PROTOCOL_VERSION, "ok": True, **fields})


def encode_refusal(code: str, message: str) -> bytes:
    """A refusal with a gRPC status name, framed."""
    return _frame({"version": PROTOCOL_VERSION, "ok": False, "code": code, "error": message})


def _frame(doc: dict[str, Any]) -> bytes:
    body = json.dumps(doc, separators=(",", ":")).encode()
    return _HEADER.pack(len(body)) + body


def exchange(socket_path: str, request: AttachRequest, timeout: float
             ) -> tuple[dict[str, Any], list[int]]:
    """Run one exchange with the daemon serving `socket_path` (its gRPC socket; the attach
    socket is derived). Returns the answer's fields and the descriptors that came with it
    (the caller owns them); raises AttachError for a refusal or a failure."""
    path = attach_path(socket_path)
    deadline = time.monotonic() + timeout
    fds: list[int] = []
    ok = False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        try:
            try:
                sock.connect(path)
            except FileNotFoundError:
                raise AttachError("UNAVAILABLE", f"no kvd daemon at {path} (is `kvd serve` "
                                  f"running with --socket {socket_path}?)") from None
            except PermissionError:
                raise AttachError("PERMISSION_DENIED", f"permission denied on {path}: this "
                                  f"user (uid {os.getuid()}) may not connect; join the "
                                  "daemon's group") from None
            except ConnectionRefusedError:
                raise AttachError("UNAVAILABLE", f"kvd daemon at {path} is not accepting "
                                  "connections (stopped or restarting)") from None
            sock.sendall(encode_request(request))
            header = _recv_exact(sock, _HEADER.size, deadline, fds)
            (length,) = _HEADER.unpack(header)
            if length > MAX_REPLY_BYTES:
                raise AttachError("INTERNAL", f"attach reply of {length} bytes is too large")
            doc = json.loads(_recv_exact(sock, length, deadline, fds))
            if not isinstance(doc, dict):
                raise AttachError("INTERNAL", "malformed attach reply: not a JSON object")
            if not doc.get("ok"):
                raise AttachError(str(doc.get("code", "UNKNOWN")),
                                  f"kvd refused the attach: {doc.get('error', 'no reason given')}")
            ok = True
            return doc, fds
        except TimeoutError:
            raise AttachError("DEADLINE_EXCEEDED", f"kvd daemon at {path} did not answer "
                              f"within {timeout:.1f}s") from None
        except (ValueError, RecursionError) as exc:
            raise AttachError("INTERNAL", f"malformed attach reply: {exc}") from None
        except ConnectionError as exc:
            raise AttachError("UNAVAILABLE", f"attach connection to {path} failed: {exc}") \
                from None
        except OSError as exc:
            raise AttachError("UNAVAILABLE", f"cannot use {path}: {exc.strerror or exc}") \
                from None
        finally:
            if not ok:
                for fd in fds:
                    os.close(fd)


def request_admin_token(socket_path: str, timeout: float) -> str:
    """Ask the daemon serving `socket_path` for an admin token (what `kvd reset` does).

    The daemon decides from this process's SO_PEERCRED, never from anything sent here.
    """
    doc, fds = exchange(socket_path, AttachRequest(ROLE_ADMIN, "kvd-cli"), timeout)
    for fd in fds:
        os.close(fd)
    token = doc.get("admin_token")
    if not isinstance(token, str) or not token:
        raise AttachError("UNIMPLEMENTED", "this daemon does not issue admin tokens; upgrade it "
                          "or use --admin-token-file")
    return token


def request_tenant_token(socket_path: str, timeout: float) -> tuple[str, str]:
    """Ask the daemon serving `socket_path` for a tenant token: (token, tenant). It scopes the
    agent-session calls (`kvd session ...`) to this process's tenant, which the daemon decides
    from SO_PEERCRED, never from anything sent here."""
    doc, fds = exchange(socket_path, AttachRequest(ROLE_TENANT, "kvd-cli"), timeout)
    for fd in fds:
        os.close(fd)
    token, tenant = doc.get("tenant_token"), doc.get("tenant")
    if not isinstance(token, str) or not token or not isinstance(tenant, str):
        raise AttachError("UNIMPLEMENTED", "this daemon does not issue tenant tokens; upgrade "
                          "it")
    return token, tenant


def split_report(report: TransferReport, engine_id: str = "") -> list[AttachRequest]:
    """`report` as report requests that each fit MAX_REQUEST_BYTES: the counters ride on the
    first one, the size samples on as many as it takes (at most MAX_TRANSFER_SAMPLES each)."""
    out: list[AttachRequest] = []
    head = TransferReport(report.load_bytes, report.load_seconds, report.store_bytes,
                          report.store_seconds)
    pending = {"load_sizes": list(report.load_sizes), "store_sizes": list(report.store_sizes)}
    while True:
        base = len(encode_request(AttachRequest(ROLE_REPORT, engine_id, head)))
        taken: dict[str, list[int]] = {"load_sizes": [], "store_sizes": []}
        room = MAX_REQUEST_BYTES - base
        for name, values in pending.items():
            n = 0
            while n < len(values) and n < MAX_TRANSFER_SAMPLES:
                cost = len(str(values[n])) + 1      # the number and a comma
                if cost > room:
                    break
                room -= cost
                n += 1
            taken[name], pending[name] = values[:n], values[n:]
        out.append(AttachRequest(ROLE_REPORT, engine_id, TransferReport(
            head.load_bytes, head.load_seconds, head.store_bytes, head.store_seconds,
            tuple(taken["load_sizes"]), tuple(taken["store_sizes"]))))
        if not pending["load_sizes"] and not pending["store_sizes"]:
            return out
        head = TransferReport()


def send_report(socket_path: str, report: TransferReport, timeout: float,
                engine_id: str = "") -> None:
    """Hand a worker's transfer report to the daemon serving `socket_path` (one exchange per
    request of `split_report`); AttachError when the daemon refuses or cannot be reached."""
    for request in split_report(report, engine_id):
        _, fds = exchange(socket_path, request, timeout)
        for fd in fds:
            os.close(fd)


def _recv_exact(sock: socket.socket, n: int, deadline: float, fds: list[int]) -> bytes:
    """`n` bytes, collecting any descriptors that ride with them into `fds`."""
    buf = b""
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        sock.settimeout(remaining)
        data, got, _, _ = socket.recv_fds(sock, n - len(buf), 4)
        fds += got
        if not data:
            raise ConnectionError("the daemon closed the attach connection early")
        buf += data
    return buf
