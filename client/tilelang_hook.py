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

import importlib.util
import os
import sys
import warnings

ENV = "KERNEL_SERVICE_TILELANG"


def _sibling(name: str):
    """This package's module `name`, loaded by its path: importing `client` would cost its imports at every start."""
    package = importlib.util.find_spec("client")  # finds the package without executing it
    spec = importlib.util.spec_from_file_location(f"kernel_service_tilelang_{name}", os.path.join(os.path.dirname(package.origin), f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _install() -> None:
    if os.environ.get(ENV) != "1":  # unset since the start: nothing to install
        return
    try:
        import client.tilelang

        client.tilelang.install_from_environment()
    except Exception as exc:  # noqa: BLE001 - TileLang itself must still import
        warnings.warn(f"{ENV}=1: the kernel service's TileLang cache was not installed: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3)


class AfterTileLang(_sibling("when_imported").AfterImport):
    """Finds nothing itself: wraps TileLang's own spec so that its import ends with the install."""

    def __init__(self):
        super().__init__("tilelang", _install)


def arm() -> None:
    if os.environ.get(ENV) == "1" and "tilelang" not in sys.modules and not any(type(f).__name__ == "AfterTileLang" for f in sys.meta_path):
        sys.meta_path.insert(0, AfterTileLang())


arm()
