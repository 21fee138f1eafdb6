"""What every request passes before a servicer sees it: a grpc.aio.ServerInterceptor, one per listener.

It runs on the call's metadata, which arrives before the request message, and
decides there, so a refused call costs no read of its message:

- TCP: a call to the TCP listener must carry the daemon's token,
  `authorization: Bearer <token>` (the token is the content of
  <cache root>/tcp-token, owner-only, new at every start), compared in constant
  time; else UNAUTHENTICATED. On the Unix socket the socket file's permissions
  decide who may connect.
- Owner-only RPCs (ZeroStats): the call must carry the daemon's admin secret,
  `kernel-service-admin: <secret>` (the content of <cache root>/admin-token,
  owner-only whatever --mode says, new at every start); else PERMISSION_DENIED.
  A group member of a --mode 0750 cache may connect, but cannot read that file.
- Decoding: bytes that are no valid message get INVALID_ARGUMENT (gRPC's own
  answer is INTERNAL, with a traceback logged for every such request). Unknown
  fields are dropped as the message is decoded, so nothing they carry (up to
  the 16 MiB message limit) outlives the request: not in a memo key, not in a log.

A refusal is answered by a handler that never reads the request: gRPC then
reads no more of its bytes than the HTTP/2 flow-control window lets the client
send before the call is closed.
"""

from __future__ import annotations

import hmac
import inspect

import grpc

from proto.paths import ADMIN_METADATA

OWNER_ONLY = frozenset({"/kernelservice.v1.KernelService/ZeroStats"})


class Undecodable:
    """Stands in for a request whose bytes did not decode; the guard answers it."""

    def __init__(self, why: str):
        self.why = why


def _decoder(deserialize):
    def decode(data: bytes):
        try:
            message = deserialize(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or whatever hostile bytes provoke
            return Undecodable(type(exc).__name__)
        message.DiscardUnknownFields()
        return message

    return decode


def _refusal(handler, code: grpc.StatusCode, message: str):
    """A handler of the call's shape that answers `code` at once, its request never read
    (a request-streaming handler starts before any message has arrived)."""

    async def refuse(requests, context):
        await context.abort(code, message)

    if handler.response_streaming:

        async def refuse_stream(requests, context):
            await context.abort(code, message)
            yield  # pragma: no cover - makes it an async generator

        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    return grpc.stream_unary_rpc_method_handler(refuse)


def _secret(metadata, key: str) -> bytes | None:
    for name, value in metadata or ():
        if name == key:
            return value.encode() if isinstance(value, str) else value
    return None


def _matches(given: bytes | None, expected: bytes) -> bool:
    return given is not None and hmac.compare_digest(given, expected)


class RequestGuard(grpc.aio.ServerInterceptor):
    """`token`: the TCP token every call must carry (the TCP listener's guard), or None (the
    Unix socket's); `admin`: the secret the owner-only RPCs need."""

    def __init__(self, token: str | None, admin: str):
        self._token = f"Bearer {token}".encode() if token else None
        self._admin = admin.encode()
        self._guarded: dict[str, grpc.RpcMethodHandler] = {}  # per method: its handler, guarded (made once)

    def _refused(self, details) -> tuple[grpc.StatusCode, str] | None:
        metadata = details.invocation_metadata
        if self._token is not None and not _matches(_secret(metadata, "authorization"), self._token):
            return grpc.StatusCode.UNAUTHENTICATED, "this TCP call lacks the daemon's token (authorization: Bearer <the content of <cache root>/tcp-token>)"
        if details.method in OWNER_ONLY and not _matches(_secret(metadata, ADMIN_METADATA), self._admin):
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"{details.method.rsplit('/', 1)[-1]} is for the daemon's owner: the call must carry {ADMIN_METADATA}: <the content of <cache root>/admin-token>, "
                "which only the daemon's uid can read (run `kernel-service zero-stats` as that user)",
            )
        return None

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_streaming:  # unknown method (gRPC answers UNIMPLEMENTED), or none of ours
            return handler
        refused = self._refused(details)
        if refused is not None:
            return _refusal(handler, *refused)
        guarded = self._guarded.get(details.method)
        if guarded is None:
            guarded = self._guarded[details.method] = _guard(handler, details.method)
        return guarded


def _guard(handler, method: str):
    """`handler` with its requests decoded by _decoder and an Undecodable one answered."""
    name = "unary_stream" if handler.response_streaming else "unary_unary"
    behavior = getattr(handler, name)

    def undecodable(request, context):
        return context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid message for {method} ({request.why})")

    if inspect.isasyncgenfunction(behavior):  # a stream of yielded events (Prefetch)

        async def guarded_stream(request, context):
            if isinstance(request, Undecodable):
                await undecodable(request, context)
            async for event in behavior(request, context):
                yield event

        guarded = guarded_stream
    else:  # a coroutine: one reply, or a stream it writes itself (health's Watch)

        async def guarded(request, context):
            if isinstance(request, Undecodable):
                await undecodable(request, context)
            return await behavior(request, context)

    return handler._replace(request_deserializer=_decoder(handler.request_deserializer), **{name: guarded})
