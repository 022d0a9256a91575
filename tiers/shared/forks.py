"""Renewal in a forked child: objects whose locks (and threads) a parent's thread may hold
(or run) while the process forks.

vLLM forks its workers. A child has only the thread that forked: a lock another parent thread
held at that moment stays held for ever in the child (the child's first call that needs it
hangs), and a thread the parent ran does not exist. Every tier object with such a lock or
thread registers with `renew_in_child`; the child calls its `_after_fork()` before anything else.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol


class Renewable(Protocol):
    def _after_fork(self) -> None: ...


_RENEW: weakref.WeakSet[Renewable] = weakref.WeakSet()


def renew_in_child(obj: Renewable) -> None:
    """Have a forked child call `obj._after_fork()` (renewing its locks and threads, which the
    parent may have held or run while forking); holds no reference to `obj`."""
    _RENEW.add(obj)


def _after_fork_in_child() -> None:
    for obj in list(_RENEW):
        obj._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
