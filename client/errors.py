"""What `get_kernel` raises. Each is also a familiar builtin type."""

from proto.errors import EntryRefused, InvalidSpec  # InvalidSpec: a ValueError whose `field` names the bad parameter


class KernelServiceError(Exception):
    """Base of the service's own errors (besides InvalidSpec)."""


class CompileError(KernelServiceError, RuntimeError):
    """The kernel failed to compile; the message holds the compiler's output."""


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


class KernelNotReady(KernelServiceError, LookupError):
    """Not in the cache, and nothing may compile it: this client is strict, or the daemon serves
    only (`serve --no-compile`). The message names the spec, its key (`.key`) and why it missed."""

    def __init__(self, message: str, key: str = ""):
        super().__init__(message)
        self.key = key


class CorruptArtifact(KernelServiceError, EntryRefused):
    """A cache file failed its checks (digest, size, owner, permissions, symlink); it is not loaded.
    An OSError, and the client's form of the contract's EntryRefused (proto.entry's rules)."""


__all__ = ["InvalidSpec", "KernelServiceError", "CompileError", "ServiceUnavailable", "UntrustedService", "ServiceError", "KernelNotReady", "CorruptArtifact"]
