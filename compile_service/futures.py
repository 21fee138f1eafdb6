"""Small helpers on concurrent.futures: a settled future, one settled like another, a callback
once a group is done."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable


def done(result) -> cf.Future:
    future = cf.Future()
    future.set_result(result)
    return future


def failed(exc: BaseException) -> cf.Future:
    future = cf.Future()
    future.set_exception(exc)
    return future


def settle(future: cf.Future, outcome) -> None:
    """Sets `outcome` as `future`'s exception when it is one, else as its result."""
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def chain(source: cf.Future, target: cf.Future) -> None:
    """Settles `target` as `source` settles."""

    def copy(_):
        if source.exception() is not None:
            target.set_exception(source.exception())
        else:
            target.set_result(source.result())

    source.add_done_callback(copy)


def when_all_done(futures: list[cf.Future], then: Callable[[], None]) -> None:
    """Calls `then()` once every one of `futures` is done: on the thread that settles the last
    of them, or on this one when they all are already."""
    if not futures:
        then()
        return
    left, lock = [len(futures)], threading.Lock()

    def one_done(_):
        with lock:
            left[0] -= 1
            if left[0]:
                return
        then()

    for future in futures:
        future.add_done_callback(one_done)
