"""How a caller talks to the daemon, defined once for the client, the CLI and the dev tools:
the gRPC target of an address, TLS over TCP, the call metadata (the TCP token), replies as dicts, and the
exception each failure status is raised as.

Part of the contract: imports nothing from kernels/, compile_service/ or client/. The client
re-exports the exceptions (client.CompileError is CompileError here).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import grpc
from google.protobuf import json_format

from . import wire
from .errors import InvalidSpec
from .paths import TOKEN_FILE_ENV, default_socket, default_token_file, socket_address
from .trust import NotRegularFile, open_regular, peer_uid, problem
from .wire import Status

DAEMON_UID_ENV = "KERNEL_SERVICE_DAEMON_UID"  # the uid the daemon must run as, when the caller names none
TLS_CA_ENV = "KERNEL_SERVICE_TLS_CA"  # over TCP: the CA (PEM) the daemon's --tls-cert is verified against
MAX_TOKEN = 4096  # bytes read of a TCP token file: the daemon's token is far shorter

# ----- where and how


def target(where: str | Path | None = None) -> str:
    """The gRPC target for a Unix socket path or a TCP "host:port" (None: the default socket)."""
    return socket_address(where or default_socket())


def socket_path(address: str) -> Path | None:
    """The socket file of a Unix-socket target (None over TCP): its absence means "no daemon" at once."""
    return Path(address.removeprefix("unix:")) if address.startswith("unix:") else None


def open_channel(address: str, tls_ca: str | Path | None = None) -> grpc.Channel:
    """A channel to `address`: over TLS when tls_credentials gives credentials, else plaintext."""
    credentials = tls_credentials(address, tls_ca)
    if credentials is None:
        return grpc.insecure_channel(address, options=wire.channel_options())
    return grpc.secure_channel(address, credentials, options=wire.channel_options())


def tls_credentials(address: str, tls_ca: str | Path | None = None, env=os.environ) -> grpc.ChannelCredentials | None:
    """Over TCP, given a CA to verify the daemon's certificate against (`tls_ca`, else
    $KERNEL_SERVICE_TLS_CA; a PEM file, such as the system's bundle for a certificate a public
    CA signed): TLS credentials. Else None: plaintext (a Unix socket never uses TLS). Raises
    ServiceUnavailable when the CA cannot be read."""
    path = tls_ca or env.get(TLS_CA_ENV)
    if socket_path(address) is not None or not path:
        return None
    try:
        roots = Path(path).read_bytes()
    except OSError as exc:
        raise ServiceUnavailable(
            f"kernel service at {address}: cannot read the TLS CA {path} ({exc.strerror}); pass a PEM file you can read "
            f"(client.connect(tls_ca=...), or set {TLS_CA_ENV})"
        ) from None
    return grpc.ssl_channel_credentials(root_certificates=roots)


def daemon_uid(given: int | None = None) -> int:
    """The uid a daemon must run as to be trusted: `given`, else $KERNEL_SERVICE_DAEMON_UID, else ours."""
    if given is not None:
        return given
    return int(os.environ[DAEMON_UID_ENV]) if os.environ.get(DAEMON_UID_ENV) else os.getuid()


class NotListening(OSError):
    """A socket file with nothing accepting connections on it (yet): the caller may retry."""


def verify_daemon(socket: Path, uid: int) -> None:
    """The check before the first call on a Unix socket, for the client and the CLI alike: the
    socket's directory must be a real directory of `uid` that no one else may write (so no one
    else can swap the socket later, and reconnects need no new check), and the process
    listening there must run as `uid` (SO_PEERCRED, which the server cannot fake).

    Raises UntrustedService, ServiceUnavailable (no such directory) or NotListening."""
    directory = socket.parent
    try:
        why = problem(os.lstat(directory), uid)
    except FileNotFoundError:
        raise ServiceUnavailable(f"no kernel service at {socket} (start one with `kernel-service serve`)") from None
    if why:
        raise UntrustedService(f"the socket directory {directory} {why}: another user could put their own server there; refusing to use {socket}")
    try:
        served_by = peer_uid(socket)
    except OSError as exc:
        raise NotListening(exc.errno, exc.strerror or str(exc)) from None
    if served_by != uid:
        raise UntrustedService(
            f"the process serving {socket} runs as uid {served_by}, not as the daemon's uid {uid}: refusing to use it "
            f"(if you trust it, set {DAEMON_UID_ENV}={served_by}, or pass daemon_uid={served_by} to client.connect)"
        )


def auth_metadata(address: str, token_file: str | Path | None = None) -> tuple | None:
    """The metadata every call carries: over TCP the daemon's token, read from `token_file`
    (default $KERNEL_SERVICE_TOKEN_FILE, else tcp-token under the default cache root); none on
    a Unix socket (the daemon checks the peer's uid there). Raises ServiceUnavailable when the
    token cannot be read."""
    if socket_path(address) is not None:
        return None
    path = Path(token_file) if token_file else default_token_file()
    try:
        with os.fdopen(open_regular(path, "token file"), "rb") as f:
            token = f.read(MAX_TOKEN + 1).decode(errors="replace").strip()
    except NotRegularFile as exc:
        raise ServiceUnavailable(f"kernel service at {address}: {exc}") from None
    except OSError as exc:
        raise ServiceUnavailable(
            f"kernel service at {address}: cannot read the daemon's TCP token from {path} ({exc.strerror}); "
            f"pass its path (client.connect(token_file=...), or set {TOKEN_FILE_ENV})"
        ) from None
    return (("authorization", f"Bearer {token}"),)


# ----- replies


def reply_to_dict(message) -> dict:
    """A reply as JSON-like data: proto field names, every field present (64-bit ints as strings)."""
    return json_format.MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def fields_of(message) -> dict:
    """A flat reply's fields as Python values (native ints, unlike reply_to_dict): Stats."""
    return {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields}


# ----- failures: what each status is raised as (InvalidSpec aside, all KernelServiceError)


class KernelServiceError(Exception):
    """Base of the service's own errors (besides InvalidSpec)."""


class CompileError(KernelServiceError, RuntimeError):
    """The kernel failed to compile; the message holds the compiler's output."""


class CompileTimeout(CompileError):
    """The kernel's build ran past the daemon's --compile-timeout; its worker was killed. The
    message names the kind and the limit. Remembered like a compile failure (--failure-ttl)."""


class ServiceUnavailable(KernelServiceError, ConnectionError):
    """No daemon answers on the socket (and no fallback was asked for)."""


class UntrustedService(ServiceUnavailable):
    """The service found is not the trusted daemon: its process runs as another uid than
    expected (SO_PEERCRED), or its socket sits in a directory another user controls. Nothing
    is asked of it and nothing it names is loaded."""


class ServiceError(KernelServiceError, RuntimeError):
    """The daemon failed for another reason (cache write failed, queue full, deadline passed)."""

    def __init__(self, message: str, code: str = ""):
        super().__init__(message)
        self.code = code


# How to have a kernel ready next time: the tail of every KernelNotReady's message.
NOT_READY_FIX = (
    "to have it ready, build it ahead on a daemon that compiles (`kernel-service prewarm MANIFEST`, "
    "a manifest from `kernel-service manifest --app NAME`), or import a bundle that holds it "
    "(`kernel-service bundle import BUNDLE`); or let it compile on demand: a client without strict "
    "(strict=False, KERNEL_SERVICE_STRICT unset) and a daemon without --no-compile"
)


class KernelNotReady(KernelServiceError, LookupError):
    """Not in the cache, and nothing may compile it: this client is strict, or the daemon serves
    only (`serve --no-compile`). The message names the spec, its key (`.key`), why it missed,
    and how to have it ready (NOT_READY_FIX)."""

    def __init__(self, message: str, key: str = ""):
        super().__init__(message if NOT_READY_FIX in message else f"{message}\n{NOT_READY_FIX}")
        self.key = key


def _unavailable(code, details: str, what: str, address: str, waited: float | None) -> Exception:
    tried = f" (retried for {waited:.1f} s)" if waited else ""
    tls = ""
    if "Socket closed" in details:  # how a TLS listener answers a plaintext client: it closes the connection
        tls = f"; if the daemon serves TLS (--tls-cert), give its CA: client.connect(tls_ca=...), or set {TLS_CA_ENV}"
    elif "handshake failed" in details.lower():
        tls = (
            f"; TLS failed: the daemon serves plaintext (no --tls-cert), or the CA given (tls_ca=, {TLS_CA_ENV}) did not sign its certificate for this address"
        )
    return ServiceUnavailable(f"no kernel service answers at {address}{tried}: {details}{tls}; start one with `kernel-service serve`")


def _deadline(code, details: str, what: str, *_) -> Exception:
    """DEADLINE_EXCEEDED: a compile timeout (its details say so), else a deadline that passed."""
    if details.startswith(wire.COMPILE_TIMEOUT_DETAILS):
        return CompileTimeout(f"{what} timed out compiling: {details.removeprefix(wire.COMPILE_TIMEOUT_DETAILS)}")
    return _other(code, details, what)


def _other(code, details: str, what: str, *_) -> Exception:
    return ServiceError(f"{what}: {code.name}: {details}", code.name)


# status -> (code, details, what, address, waited) -> the exception; any other status: ServiceError
STATUS_ERRORS = {
    Status.INVALID_SPEC: lambda code, details, *_: wire.invalid_spec_from_details(details),
    Status.COMPILE_FAILED: lambda code, details, what, *_: CompileError(f"{what} failed to compile:\n{details}"),
    **dict.fromkeys(Status.RETRYABLE, _unavailable),
    Status.CRASHED: lambda code, details, what, *_: ServiceError(f"{what}: the compiler worker crashed: {details}", code.name),
    Status.NOT_READY: lambda code, details, *_: KernelNotReady(details, wire.not_ready_key(details)),
    Status.COMPILE_TIMEOUT: _deadline,  # Status.DEADLINE's code too
}


def error_from(code: grpc.StatusCode, details: str, what: str, address: str = "", waited: float | None = None) -> Exception:
    """The exception a failure with status `code` raises: `what` names the call (a spec, "prefetch"),
    `address` the daemon, `waited` how long retries took."""
    return STATUS_ERRORS.get(code, _other)(code, details, what, address, waited)


def error_for(err: grpc.RpcError, what: str, address: str = "", waited: float | None = None) -> Exception:
    """The exception a failed call raises (error_from of its status and details)."""
    return error_from(err.code(), err.details() or "", what, address, waited)


def event_error(event, what: str) -> Exception:
    """The exception a failed Prefetch event (error_code: a status name) stands for, as a call for
    that one kernel would raise it. The daemon answered: a retryable status there (a compile
    dropped, a daemon stopping) is that kernel's ServiceError, not "no daemon"."""
    code = getattr(grpc.StatusCode, event.error_code, grpc.StatusCode.UNKNOWN)
    if code in Status.RETRYABLE:
        return _other(code, event.error_message, what)
    return error_from(code, event.error_message, what)


def refused_spec(err: grpc.RpcError, sent: int) -> tuple[int, InvalidSpec] | None:
    """(its place in the request, its error) when a Prefetch of `sent` specs was refused for one
    invalid spec ("specs[3].N: ...", which the daemon sends for a kind only it knows); None for any
    other failure."""
    match = re.fullmatch(r"specs\[(\d+)\]\.(.+)", err.details() or "", re.DOTALL) if err.code() == Status.INVALID_SPEC else None
    if match is None or int(match[1]) >= sent:
        return None
    return int(match[1]), wire.invalid_spec_from_details(match[2])
