"""What `get_kernel` raises. Each is also a familiar builtin type."""

from proto.errors import EntryRefused, InvalidSpec  # InvalidSpec: a ValueError whose `field` names the bad parameter

# The errors a failed call raises are the contract's (proto/channel.py maps each status to one).
from proto.channel import NOT_READY_FIX, CompileError, CompileTimeout, KernelNotReady, KernelServiceError, ServiceError, ServiceUnavailable


class UntrustedService(ServiceUnavailable):
    """The service found is not the trusted daemon: its process runs as another uid than
    expected (SO_PEERCRED), or its socket sits in a directory another user controls. Nothing
    is asked of it and nothing it names is loaded."""


class CorruptArtifact(KernelServiceError, EntryRefused):
    """A cache file failed its checks (digest, size, owner, permissions, symlink); it is not loaded.
    An OSError, and the client's form of the contract's EntryRefused (proto.entry's rules)."""


__all__ = [
    "NOT_READY_FIX",
    "CompileError",
    "CompileTimeout",
    "CorruptArtifact",
    "InvalidSpec",
    "KernelNotReady",
    "KernelServiceError",
    "ServiceError",
    "ServiceUnavailable",
    "UntrustedService",
]
