"""Everything about the wire that both sides must agree on, defined once.

- specs <-> proto messages, with the request limits checked before anything else;
- outcomes (how a request was satisfied) by name;
- which gRPC status code each kind of failure travels as;
- the stats fields: the proto's `Stats` message is their one definition.
"""

from __future__ import annotations

import enum
import json
import re

import grpc
from google.protobuf import struct_pb2

from .entry import HEX64
from .errors import InvalidSpec
from .kernelservice.v1 import kernel_service_pb2 as pb

# Far above any real signature, far below what could cost memory or time: checked
# before anything else, so hostile input never reaches validation messages or keys.
MAX_PARAMS = 64
MAX_NAME = 64  # kind, target and parameter names
MAX_STRING = 256  # string parameter values
# The parameter that travels in KernelSpec.program instead (kind "tilelang": kernels.program), and
# its bound: a program's IR is tens of kilobytes.
PROGRAM = "program"
MAX_PROGRAM = 8 << 20
MAX_BATCH = 4096  # specs in one Prefetch; the compiles it may queue are bounded apart (a share of the queue)
MAX_MESSAGE = 16 << 20  # bytes of one gRPC message, both ways
# Bytes of an error's text in a status's details, as sent: gRPC percent-encodes them into the
# grpc-message header (a newline or a non-ASCII byte takes 3), and all of a reply's metadata must
# fit in 8 KiB, or the caller gets RESOURCE_EXHAUSTED instead of the error. The full text is in the
# daemon's log and, for a compile failure, in Explain's `failure`.
MAX_ERROR_BYTES = 4096
COMPILE_TIMEOUT_DETAILS = "compile timeout: "  # how a COMPILE_TIMEOUT's details start


class Outcome(enum.Enum):
    """How a request was satisfied; the values are the proto enum's."""

    HIT = pb.OUTCOME_HIT  # already in the cache
    COMPILED = pb.OUTCOME_COMPILED  # this request started the build (or got a remembered failure)
    JOINED = pb.OUTCOME_JOINED  # waited on a build another request had started

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def from_proto(cls, value: int) -> str:
        try:
            return cls(value).label
        except ValueError:
            return "unknown"


class Status:
    """The gRPC status each kind of failure travels as (each RPC's "Errors:" list in the proto)."""

    INVALID_SPEC = grpc.StatusCode.INVALID_ARGUMENT  # details: "<field>: <message>"
    COMPILE_FAILED = grpc.StatusCode.FAILED_PRECONDITION  # details: the compiler's output
    BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED  # the compile queue is full
    UNAVAILABLE = grpc.StatusCode.UNAVAILABLE  # shutting down, or not started
    CACHE_FAILED = grpc.StatusCode.INTERNAL  # the cache could not be written (disk full)
    DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED  # still compiling when the deadline passed
    # The build ran past --compile-timeout (its worker killed): DEADLINE_EXCEEDED too, told
    # apart by details that start with COMPILE_TIMEOUT_DETAILS; remembered like COMPILE_FAILED.
    COMPILE_TIMEOUT = grpc.StatusCode.DEADLINE_EXCEEDED
    NOT_READY = grpc.StatusCode.NOT_FOUND  # a miss where nothing may compile; details: not_ready_details
    CRASHED = grpc.StatusCode.ABORTED  # the compiler worker died, on a retry too (not remembered)
    DROPPED = grpc.StatusCode.CANCELLED  # the compile joined was dropped with the Prefetch that queued it
    # A blocking call cannot be cancelled by its caller: CANCELLED means the daemon went
    # away mid-call (a drain cuts calls that arrived as it stopped); retried like UNAVAILABLE.
    RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


STATS_FIELDS = tuple(f.name for f in pb.Stats.DESCRIPTOR.fields)


def _short(text: str) -> str:
    return text if len(text) <= 40 else f"{text[:40]!r}... ({len(text)} characters)"


def param_value(name: str, value) -> pb.ParamValue:
    if value is None:
        return pb.ParamValue(null_value=struct_pb2.NULL_VALUE)
    if isinstance(value, bool):
        return pb.ParamValue(bool_value=value)
    if isinstance(value, int):
        return pb.ParamValue(int_value=value)
    if isinstance(value, float):
        return pb.ParamValue(float_value=value)
    if isinstance(value, str):
        return pb.ParamValue(string_value=value)
    raise InvalidSpec(name, f"values must be int, float, bool, str or None, got {type(value).__name__}")


def spec_to_proto(kind: str, params: dict, target: str | None) -> pb.KernelSpec:
    """A spec as sent: `target` None or "" leaves the choice to the daemon's default; a parameter
    named `program` travels in its own field."""
    program = params.get(PROGRAM)
    if program is not None and not isinstance(program, str):
        raise InvalidSpec(PROGRAM, f"expected the program's JSON text, got {type(program).__name__}")
    rest = {k: param_value(k, v) for k, v in params.items() if k != PROGRAM}
    return pb.KernelSpec(kind=kind, target=target or "", params=rest, program=program or "")


def spec_from_proto(spec: pb.KernelSpec) -> tuple[str, dict, str]:
    """(kind, params, target) of a received spec, after the size limits; validation is the kinds' job."""
    if len(spec.kind) > MAX_NAME:
        raise InvalidSpec("kind", f"at most {MAX_NAME} characters, got {_short(spec.kind)}")
    if len(spec.target) > MAX_NAME:
        raise InvalidSpec("target", f"at most {MAX_NAME} characters, got {_short(spec.target)}")
    if len(spec.params) > MAX_PARAMS:
        raise InvalidSpec("params", f"at most {MAX_PARAMS} parameters, got {len(spec.params)}")
    params = {}
    for name, value in spec.params.items():
        if len(name) > MAX_NAME:
            raise InvalidSpec("params", f"parameter names have at most {MAX_NAME} characters, got {_short(name)}")
        which = value.WhichOneof("value")
        if which == "string_value" and len(value.string_value) > MAX_STRING:
            raise InvalidSpec(name, f"string values have at most {MAX_STRING} characters, got {len(value.string_value)}")
        if which is None:
            raise InvalidSpec(name, "parameter sent with no value")
        params[name] = None if which == "null_value" else getattr(value, which)
    if spec.program:
        if len(spec.program) > MAX_PROGRAM:
            raise InvalidSpec(PROGRAM, f"at most {MAX_PROGRAM} characters, got {len(spec.program)}")
        if PROGRAM in params:
            raise InvalidSpec(PROGRAM, "sent twice, in params and in the program field")
        params[PROGRAM] = spec.program
    return spec.kind, params, spec.target


def not_ready_details(spec_json: str, key: str, why: str) -> str:
    """What a NOT_FOUND answer says: the spec, its key (as "(key <hex>)") and why it missed."""
    return f"kernel {spec_json} (key {key}) is not in the cache and {why}"


def not_ready_key(details: str) -> str:
    """The key a NOT_FOUND answer names ("" if none)."""
    match = re.search(rf"\(key ({HEX64})\)", details)
    return match.group(1) if match else ""


def invalid_spec_details(exc: InvalidSpec) -> str:
    return str(exc)  # "<field>: <message>", split back by invalid_spec_from_details


def invalid_spec_from_details(details: str) -> InvalidSpec:
    field, _, message = details.partition(": ")
    return InvalidSpec(field, message or details)


def _sent_bytes(char: str) -> int:
    """What one character costs in a grpc-message header: printable ASCII but '%' as is, the
    rest percent-encoded byte by byte."""
    if " " <= char <= "~" and char != "%":
        return 1
    return 3 * len(char.encode("utf-8", "surrogatepass"))


def _fitting(chars, budget: int) -> int:
    """How many of `chars` fit in `budget` sent bytes."""
    count = 0
    for char in chars:
        budget -= _sent_bytes(char)
        if budget < 0:
            break
        count += 1
    return count


def clip(text: str) -> str:
    """An error's text cut in the middle to fit MAX_ERROR_BYTES as sent in a status's details
    (the one rule for every error the daemon sends back)."""
    if len(text) * 12 <= MAX_ERROR_BYTES or sum(map(_sent_bytes, text)) <= MAX_ERROR_BYTES:
        return text
    marker = "\n... [{} characters cut: the daemon's log and `kernel-service explain` have the full text] ...\n"
    half = (MAX_ERROR_BYTES - sum(map(_sent_bytes, marker.format(len(text))))) // 2
    head = _fitting(text, half)
    tail = _fitting(reversed(text), half)
    return f"{text[:head]}{marker.format(len(text) - head - tail)}{text[len(text) - tail :]}"


# A sidecar starts beside its agents: a channel that tried before the daemon listened must try
# again within tens of ms, not after gRPC's default 1 s (+-20%) reconnect backoff, which made
# an agent (and `serve`'s own SERVING measurement) wait about a second after the daemon was up.
# (Not grpc.min_reconnect_backoff_ms: gRPC takes that as each attempt's connect timeout, and
# 20 ms of it fails handshakes on a loaded machine.)
RECONNECT_BACKOFF_MS = (20, 250)  # initial, maximum


def channel_options() -> list[tuple[str, int]]:
    initial, maximum = RECONNECT_BACKOFF_MS
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.max_send_message_length", MAX_MESSAGE),
        ("grpc.initial_reconnect_backoff_ms", initial),
        ("grpc.max_reconnect_backoff_ms", maximum),
    ]


def kind_to_proto(described: dict, origin: str) -> pb.KindInfo:
    """A kind's schema (KernelKind.describe()) as sent by ListKinds."""
    info = pb.KindInfo(name=described["name"], doc=described["doc"], origin=origin)
    for p in described["params"]:
        param = info.params.add(name=p["name"], type=p["type"], doc=p["doc"], required=p["required"], nullable=p["nullable"])
        if "default" in p:
            param.default_json = json.dumps(p["default"])
        if "choices" in p:
            param.choices_json = json.dumps(p["choices"])
        for bound in ("min", "max"):
            if bound in p:
                setattr(param, bound, p[bound])
    return info


def kind_from_proto(info: pb.KindInfo) -> dict:
    """The schema as plain data, in KernelKind.describe()'s shape, plus its origin."""
    params = []
    for p in info.params:
        out = {"name": p.name, "type": p.type, "doc": p.doc, "required": p.required, "nullable": p.nullable}
        if p.default_json:
            out["default"] = json.loads(p.default_json)
        if p.choices_json:
            out["choices"] = json.loads(p.choices_json)
        for bound in ("min", "max"):
            if p.HasField(bound):
                out[bound] = getattr(p, bound)
        params.append(out)
    return {"name": info.name, "doc": info.doc, "origin": info.origin, "params": params}


def explanation_from_proto(reply: pb.ExplainResponse) -> dict:
    """An Explain answer as plain data: hit, key, spec, toolchain (parts as values), reason,
    failure (the remembered compile failure's full text, "" if none), and nearest:
    [{key, spec, differences: [{part, field, wanted, found, text}]}]."""
    return {
        "hit": reply.hit,
        "key": reply.key,
        "spec": json.loads(reply.canonical_spec),
        "toolchain": {name: json.loads(value) for name, value in sorted(reply.toolchain.items())},
        "reason": reply.reason,
        "failure": reply.failure,
        "nearest": [
            {
                "key": n.key,
                "spec": json.loads(n.canonical_spec),
                "differences": [
                    {"part": d.part, "field": d.field, "wanted": json.loads(d.wanted), "found": json.loads(d.found), "text": d.text} for d in n.differences
                ],
            }
            for n in reply.nearest
        ],
    }
