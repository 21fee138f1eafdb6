"""A bounded memo: remembers answers that repeat (hits ask for the same few kernels) and forgets
them all at once when full, which bounds its memory without an LRU's bookkeeping per look-up."""

from __future__ import annotations

MEMO_ENTRIES = 4096  # what a memo holds before it forgets everything


class Memo(dict):
    """A dict whose `remember` clears it first when it holds `limit` entries."""

    def __init__(self, limit: int = MEMO_ENTRIES):
        super().__init__()
        self.limit = limit

    def remember(self, key, value) -> None:
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
