"""What `get_kernel` raises. Each is also a familiar builtin type."""

from proto.errors import EntryRefused, InvalidSpec  # InvalidSpec: a ValueError whose `field` names the bad parameter

# The errors a failed call raises are the contract's (proto/channel.py maps each status to one).
# UntrustedService: the daemon found is not the trusted one (proto.channel.verify_daemon).
from proto.channel import NOT_READY_FIX, CompileError, CompileTimeout, KernelNotReady, KernelServiceError, ServiceError, ServiceUnavailable, UntrustedService  # noqa: F401  (NOT_READY_FIX: importable from here, as before)


class CorruptArtifact(KernelServiceError, EntryRefused):
    """A cache file failed its checks (digest, size, owner, permissions, symlink); it is not loaded.
    An OSError, and the client's form of the contract's EntryRefused (proto.entry's rules)."""


class LoadError(KernelServiceError, OSError):
    """A kernel that passed every check could not be loaded into this process (no directory
    lets its library be executed: a noexec TMPDIR); the message names the fix."""


# The exceptions, which the package exports as they are (client/__init__.py).
__all__ = [
    "CompileError",
    "CompileTimeout",
    "CorruptArtifact",
    "InvalidSpec",
    "KernelNotReady",
    "KernelServiceError",
    "LoadError",
    "ServiceError",
    "ServiceUnavailable",
    "UntrustedService",
]
