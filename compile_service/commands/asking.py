"""One call to a running daemon, for the commands that ask it (stats, zero-stats, kinds, info,
explain, prewarm). They speak the wire contract (proto/) directly: the daemon's package never
imports the client library."""

from __future__ import annotations


class NoDaemon(ConnectionError):
    """No daemon answers on the socket."""


def ask(socket, rpc: str, request, timeout: float = 10, metadata: tuple = ()):
    """One call to the daemon at `socket` (default: the default socket) through the contract's
    stubs, after the client's own trust checks (proto.channel.verify_daemon: the socket's
    directory and the peer's uid; the uid expected is $KERNEL_SERVICE_DAEMON_UID, else ours).
    Raises NoDaemon at once when none answers, UntrustedService (a ConnectionError) when the
    one answering is not to be trusted, InvalidSpec (a ValueError) when it refuses the request
    as invalid, ConnectionError on any other failure (its message from proto/channel.py)."""
    import grpc

    from proto import channel
    from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc

    address = channel.target(socket)
    where = address.removeprefix("unix:")
    path = channel.socket_path(address)
    gone = f"no kernel-service daemon answers at {where} (its socket file is there, left by a daemon that was killed); start one with `kernel-service serve`"
    if path is not None:
        if not path.exists():
            raise NoDaemon(f"no kernel-service daemon at {where}; start one with `kernel-service serve`")
        try:
            channel.verify_daemon(path, channel.daemon_uid())
        except channel.NotListening:
            raise NoDaemon(gone) from None
        except channel.UntrustedService:
            raise
        except channel.ServiceUnavailable as exc:
            raise NoDaemon(str(exc)) from None
    with channel.open_channel(address) as ch:
        try:
            return getattr(pb_grpc.KernelServiceStub(ch), rpc)(request, timeout=timeout, metadata=(channel.auth_metadata(address) or ()) + metadata)
        except grpc.RpcError as err:
            exc = channel.error_for(err, f"the daemon at {where}", where)
    if isinstance(exc, channel.ServiceUnavailable):
        raise NoDaemon(gone if path is not None else str(exc))  # over TCP, what gRPC says (a TLS daemon closes plaintext connections)
    if isinstance(exc, ValueError):
        raise exc
    raise ConnectionError(str(exc))  # one line for the caller to print, whatever the status
