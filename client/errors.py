"""What `get_kernel` raises. Each is also a familiar builtin type."""

from kernels.spec import InvalidSpec  # a ValueError whose `field` names the bad parameter


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


class CorruptArtifact(KernelServiceError, OSError):
    """A cache file failed its checks (digest, size, owner, permissions, symlink); it is not loaded."""


__all__ = ["InvalidSpec", "KernelServiceError", "CompileError", "ServiceUnavailable", "UntrustedService", "ServiceError", "KernelNotReady", "CorruptArtifact"]
