"""What every request passes before a servicer sees it: a grpc.ServerInterceptor.

- Decoding: bytes that are no valid message get INVALID_ARGUMENT (gRPC's own
  answer is INTERNAL, with a traceback logged for every such request). Unknown
  fields are dropped as the message is decoded, so nothing they carry (up to
  the 16 MiB message limit) outlives the request: not in a memo key, not in a log.
- TCP: a call that did not come over the Unix socket must carry the daemon's
  token, `authorization: Bearer <token>` (the token is the content of
  <cache root>/tcp-token, owner-only, new at every start), compared in constant
  time; else UNAUTHENTICATED. On the Unix socket the socket file's permissions
  decide who may connect.
"""

from __future__ import annotations

import hmac

import grpc


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


class RequestGuard(grpc.ServerInterceptor):
    def __init__(self, token: str | None = None):
        self._expected = f"Bearer {token}".encode() if token else None

    def _authorized(self, metadata) -> bool:
        if self._expected is None:
            return False  # no TCP listener: nothing but the Unix socket may call
        for key, value in metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._expected)
        return False

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.request_streaming:  # unknown method (gRPC answers UNIMPLEMENTED), or none of ours
            return handler
        name = "unary_stream" if handler.response_streaming else "unary_unary"
        behavior = getattr(handler, name)
        metadata = details.invocation_metadata

        def guarded(request, context):
            if not context.peer().startswith("unix:") and not self._authorized(metadata):
                context.abort(
                    grpc.StatusCode.UNAUTHENTICATED, "this TCP call lacks the daemon's token (authorization: Bearer <the content of <cache root>/tcp-token>)"
                )
            if isinstance(request, Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid message for {details.method} ({request.why})")
            return behavior(request, context)

        return handler._replace(request_deserializer=_decoder(handler.request_deserializer), **{name: guarded})
