"""Run a callback once a module's import has finished: now, if it has, else right after it does.

`import client` registers the kernels' torch ops once torch is there, without importing torch
itself (the client stays light). With torch not yet imported, a finder put first on
sys.meta_path waits for torch's import and wraps torch's own loader, so the callback runs right
after torch's module code: `import client, torch` (isort's order) then registers the ops as
`import torch, client` does, before anything such as `torch.export.load` needs them.
(client/tilelang_hook.py does the same for TileLang with this file's AfterImport, loaded by its
path: it runs from a .pth line, before this package may be imported.)
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable


def when_imported(name: str, callback: Callable[[], object]) -> None:
    """callback() once the top-level module `name` is imported: now if it is, else after its import."""
    if name in sys.modules:
        callback()
    else:
        sys.meta_path.insert(0, AfterImport(name, callback))


class _ThenCall(importlib.abc.Loader):
    """The module's own loader, then the callback."""

    def __init__(self, real, callback: Callable[[], object]):
        self._real = real
        self._callback = callback

    def __getattr__(self, name):  # resources, get_source, ...: the real loader's
        return getattr(self._real, name)

    def create_module(self, spec):
        return self._real.create_module(spec)

    def exec_module(self, module):
        self._real.exec_module(module)
        self._callback()


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real spec's loader so that the import ends with the callback."""

    def __init__(self, name: str, callback: Callable[[], object]):
        self._name = name
        self._callback = callback

    def find_spec(self, name, path=None, target=None):
        if name != self._name:
            return None
        sys.meta_path.remove(self)  # once: the real finders answer from here on
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenCall(spec.loader, self._callback)
        return spec
