"""The `kvd` command's client of a running daemon: which socket (or TLS address) it talks to,
the admin token a call carries, and every failure of a call mapped to a one-line `CliError`
with its exit code, so that no client command prints a traceback.

grpc and the generated stubs are imported when a client is made, not with this module: `kvd
--help` and `kvd serve` never load them for nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvd_proto import paths
from kvd_proto.paths import (
    SOCKET_ENV,
    SocketState,
    daemon_socket_path,
    default_socket_path,
    grpc_target,
    probe_socket,
)
from kvd_proto.wire import ADMIN_TOKEN_METADATA, TENANT_TOKEN_METADATA
from kvd_server.cli.errors import EXIT_UNREACHABLE, CliError
from kvd_server.config import CONFIG_ENV, ConfigError, load_config

if TYPE_CHECKING:
    import argparse


def client_socket(args: argparse.Namespace) -> str:
    """The socket a client subcommand talks to: --socket, $KVD_SOCKET or $KVD_SERVER_SOCKET,
    $KVD_CONFIG's server.socket, else the client rule (kvd_proto.paths.default_socket_path:
    the user's default, or /run/kvd/kvd.sock when only that one exists)."""
    if args.socket:
        return os.path.abspath(args.socket)
    if os.environ.get(CONFIG_ENV) and not any(os.environ.get(name) for name in SOCKET_ENV):
        try:
            configured = load_config().server.socket
        except ConfigError:
            configured = ""
        if configured and configured != daemon_socket_path():
            return configured
    return default_socket_path()


class AdminClient:
    """A short-lived channel to the daemon with one-line errors instead of tracebacks.

    Over the Unix socket, `admin=True` calls (reset, drain) carry an admin token: read from
    --admin-token-file, else asked for on the attach socket. Over --address (TLS) every call
    carries the token from --admin-token-file.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        import grpc

        from kvd_proto import kvd_pb2_grpc

        self._grpc = grpc
        self.timeout = args.timeout
        self._token_file = args.admin_token_file
        self._token: str | None = None
        self._tenant_token: str | None = None
        self.tenant = ""                    # this process's tenant, once a tenant token came
        self.remote = bool(getattr(args, "address", None))
        self._client_cert = bool(getattr(args, "tls_cert", None))
        if self.remote:
            self.path = args.address
            if not self._token_file:
                raise CliError("--address needs --admin-token-file (the remote listener "
                               "answers only admin-token holders)", EXIT_UNREACHABLE)
            self.channel = grpc.secure_channel(args.address, _tls_credentials(args))
        else:
            self.path = client_socket(args)
            _probe(self.path)
            self.channel = grpc.insecure_channel(grpc_target(self.path))
        self.admin = kvd_pb2_grpc.KvdAdminStub(self.channel)

    def admin_token(self) -> str:
        if self._token is None:
            from kvd_proto.attach import AttachError, request_admin_token
            from kvd_server.rpc.admin_tokens import TokenFileError, read_token_file

            if self._token_file:
                try:
                    self._token = read_token_file(self._token_file)
                except TokenFileError as exc:
                    raise CliError(f"--admin-token-file: {exc}") from None
            else:
                try:
                    self._token = request_admin_token(self.path, self.timeout)
                except AttachError as exc:
                    if exc.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                        raise CliError(f"the daemon at {self.path} did not answer on its "
                                       f"attach socket ({exc.code}: {exc}); is it running? "
                                       "(its log, `systemctl status kvd`)", EXIT_UNREACHABLE,
                                       transient=True) from None
                    raise CliError(f"no admin permission: {exc.code}: {exc} (pass "
                                   "--admin-token-file, or run as root, the daemon's user or "
                                   "one of server.admin_uids/admin_gids)") from None
        return self._token

    def tenant_token(self) -> str:
        """A token for the agent-session calls, scoped to this process's tenant (asked for on
        the attach socket: the daemon decides the tenant from SO_PEERCRED)."""
        if self._tenant_token is None:
            from kvd_proto.attach import AttachError, request_tenant_token

            try:
                self._tenant_token, self.tenant = request_tenant_token(self.path, self.timeout)
            except AttachError as exc:
                if exc.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
                    raise CliError(f"the daemon at {self.path} did not answer on its attach "
                                   f"socket ({exc.code}: {exc}); is it running?",
                                   EXIT_UNREACHABLE, transient=True) from None
                raise CliError(f"the daemon refused a tenant token: {exc.code}: {exc}") \
                    from None
        return self._tenant_token

    def call(self, method: Callable[..., Any], request: Any, *, admin: bool = False,
             tenant: bool = False) -> Any:
        """One call within the deadline; `admin`: with the admin token; `tenant`: with this
        process's tenant token (the agent-session calls), unless over --address."""
        metadata: tuple[tuple[str, str], ...] = ()
        if admin or self.remote:
            metadata = ((ADMIN_TOKEN_METADATA, self.admin_token()),)
        elif tenant:
            metadata = ((TENANT_TOKEN_METADATA, self.tenant_token()),)
        try:
            return method(request, timeout=self.timeout, metadata=metadata)
        except self._grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code not in (self._grpc.StatusCode.UNAVAILABLE,
                            self._grpc.StatusCode.DEADLINE_EXCEEDED):
                raise CliError(f"the daemon refused: {code.name}: {details}") from None
            if not self.remote:
                raise CliError(f"the daemon at {self.path} did not answer ({code.name}: "
                               f"{details}); is it running? (its log, `systemctl status kvd`)",
                               EXIT_UNREACHABLE, transient=True) from None
            problem = _tls_problem(details, self._client_cert)
            if problem:
                raise CliError(f"{self.path}: {problem}", EXIT_UNREACHABLE) from None
            reason = details.rsplit(": ", 1)[-1].rstrip(".") or code.name
            raise CliError(f"no answer from {self.path} ({reason}): is the daemon's "
                           "server.admin_listen on this address, and the port reachable?",
                           EXIT_UNREACHABLE, transient=True) from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tls_credentials(args: argparse.Namespace) -> Any:
    import grpc

    def read(path: str | None, flag: str) -> bytes | None:
        if not path:
            return None
        try:
            with open(path, "rb") as fh:
                return fh.read(1 << 20)
        except OSError as exc:
            raise CliError(f"{flag} {path}: {exc.strerror or exc}", EXIT_UNREACHABLE) from None

    if bool(args.tls_cert) != bool(args.tls_key):
        raise CliError("--tls-cert and --tls-key go together", EXIT_UNREACHABLE)
    return grpc.ssl_channel_credentials(read(args.tls_ca, "--tls-ca"),
                                        read(args.tls_key, "--tls-key"),
                                        read(args.tls_cert, "--tls-cert"))


# gRPC reports a failed TLS handshake as UNAVAILABLE with the TLS library's words in the
# details; these name the usual causes, most specific first.
_TLS_PROBLEMS: tuple[tuple[str, str], ...] = (
    ("CERTIFICATE_VERIFY_FAILED", "the daemon's certificate is not trusted: pass --tls-ca "
                                  "CA.pem, the CA that signed it"),
    ("Hostname Verification", "the daemon's certificate does not name this host: connect by "
                              "a name or address the certificate holds"),
    ("WRONG_VERSION_NUMBER", "this port does not speak TLS: is it the daemon's "
                             "server.admin_listen?"),
)


def _tls_problem(details: str, client_cert: bool) -> str | None:
    """One line for a TLS failure in gRPC's error text, or None when it is not one."""
    for marker, message in _TLS_PROBLEMS:
        if marker in details:
            return message
    if details.endswith("Socket closed"):
        # What a daemon that requires client certificates does to a client without a good one.
        return ("the daemon closed the connection: is your certificate signed by its "
                "server.tls_client_ca?" if client_cert else
                "the daemon closed the connection: if it requires client certificates "
                "(server.tls_client_ca), pass --tls-cert and --tls-key")
    if "handshake" in details.lower() or "SSL_ERROR" in details:
        reason = details.rsplit("OPENSSL_internal:", 1)[-1] if "OPENSSL_internal:" in details \
            else details.rsplit(": ", 1)[-1]
        return f"TLS handshake failed: {reason.strip()}"
    return None


def _probe(path: str) -> None:
    """Connect once with a plain socket to turn the usual mistakes into clear messages."""
    state, detail = probe_socket(path, timeout=2.0)
    if state is SocketState.LIVE:
        return
    if state is SocketState.ABSENT:
        raise CliError(f"no kvd daemon socket at {path}: start one with `kvd serve` or pass "
                       "--socket PATH", EXIT_UNREACHABLE, transient=True, nobody=True)
    if state in (SocketState.DENIED, SocketState.ERROR):
        closed = _closed_directory(path)
        if closed:
            raise CliError(f"permission denied on {path}: {closed}", EXIT_UNREACHABLE)
    if state is SocketState.DENIED:
        raise CliError(f"permission denied on {path}: run as the daemon's user or a member of "
                       "the socket's group", EXIT_UNREACHABLE)
    if state is SocketState.STALE:
        raise CliError(f"nothing is listening on {path} (a stale socket?): start the daemon "
                       "with `kvd serve`", EXIT_UNREACHABLE, transient=True, nobody=True)
    raise CliError(f"cannot connect to {path}: {detail}", EXIT_UNREACHABLE)


def _closed_directory(path: str) -> str | None:
    """Why this user cannot reach `path` when a directory on the way is the reason."""
    return paths.closed_directory(path, "run as its owner or a member of group {group}, or "
                                        "ask for a socket directory you may enter")

