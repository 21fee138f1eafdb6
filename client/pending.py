"""prefetch(..., wait=False): a batch sent to the daemon now, its kernels taken later.

An agent's first lines can ask for its kernels before it imports torch (seconds on a GPU
host): the daemon builds them while the agent imports and makes its weights. Sending needs
neither torch nor a load, so it runs on a thread; taking is an ordinary prefetch, in the
caller's thread, that joins whatever is still building and loads what is built.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class PendingPrefetch:
    """A batch the daemon is building; `result()` returns what prefetch returns for it."""

    def __init__(self, prefetch: Callable[..., list], specs: list, options: dict):
        self._prefetch, self._specs, self._options = prefetch, specs, options
        self._sending = threading.Thread(target=self._send, name="kernel-service-prefetch", daemon=True)
        self._sending.start()

    def _send(self) -> None:
        try:
            self._prefetch(self._specs, **{**self._options, "load": False, "progress": None})
        except Exception:  # noqa: BLE001 - result() asks again, and meets the same trouble in the caller's thread
            pass

    def sent(self) -> bool:
        """Whether the daemon has answered the whole batch (built, joined, hit or failed)."""
        return not self._sending.is_alive()

    def result(self) -> list:
        """The batch's kernels, as prefetch(specs, **options) returns them: it does not wait for
        the sending thread (builds still running are joined), and loads in this thread."""
        return self._prefetch(self._specs, **self._options)
