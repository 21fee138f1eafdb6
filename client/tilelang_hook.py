"""KERNEL_SERVICE_TILELANG=1: TileLang's compiles go through the kernel service from a process's
first compile, with no change to its code.

The package installs `kernel_service_tilelang.pth` into site-packages; Python runs its one line
at every start. With the variable unset that line costs a dictionary lookup. With it set to "1",
the line runs this file (by path: importing `client` would cost its imports at every start),
which puts a finder first on sys.meta_path. The finder does nothing until `tilelang` is
imported; then, once TileLang's own import has finished, it calls
client.tilelang.install_from_environment(), which reads the variable again (the daemon's compile
workers set it to "0": they are TileLang's compiler, never its client) and installs.
"""

import importlib.abc
import importlib.util
import os
import sys
import warnings

ENV = "KERNEL_SERVICE_TILELANG"


class _Installing(importlib.abc.Loader):
    """TileLang's own loader, then the install."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):  # resources, get_source, ...: the real loader's
        return getattr(self._real, name)

    def create_module(self, spec):
        return self._real.create_module(spec)

    def exec_module(self, module):
        self._real.exec_module(module)
        try:
            import client.tilelang

            client.tilelang.install_from_environment()
        except Exception as exc:  # noqa: BLE001 - TileLang itself must still import
            warnings.warn(f"{ENV}=1: the kernel service's TileLang cache was not installed: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)


class AfterTileLang(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps TileLang's own spec so that its import ends with the install."""

    def find_spec(self, name, path=None, target=None):
        if name != "tilelang":
            return None
        sys.meta_path.remove(self)  # once: the real finders answer from here on
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and os.environ.get(ENV) == "1":
            spec.loader = _Installing(spec.loader)
        return spec


def arm() -> None:
    if os.environ.get(ENV) == "1" and "tilelang" not in sys.modules and not any(type(f).__name__ == "AfterTileLang" for f in sys.meta_path):
        sys.meta_path.insert(0, AfterTileLang())


arm()
