"""Renewal in a forked child: objects whose locks (and threads) a parent's thread may hold
(or run) while the process forks.

vLLM forks its workers. A child has only the thread that forked: a lock another parent thread
held at that moment stays held for ever in the child (the child's first call that needs it
hangs), and a thread the parent ran does not exist. Every tier object with such a lock or
thread registers with `renew_in_child`; the child renews it before anything else runs.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

logger = logging.getLogger(__name__)
_RENEW: weakref.WeakKeyDictionary[object, tuple[str, ...]] = weakref.WeakKeyDictionary()


def renew_in_child(obj: object, *locks: str) -> None:
    """Have a forked child give `obj` a fresh `threading.Lock` as each attribute named in
    `locks`, then call `obj._after_fork()` where it has one (for its threads and other
    state); holds no reference to `obj`."""
    _RENEW[obj] = locks


def _after_fork_in_child() -> None:
    """Renew every registered lock, then run each `_after_fork`: one that raises (no thread
    can start, say) is warned of and leaves the others renewed."""
    renewing = list(_RENEW.items())
    for obj, locks in renewing:
        for name in locks:
            setattr(obj, name, threading.Lock())
    for obj, _ in renewing:
        after_fork = getattr(obj, "_after_fork", None)
        if after_fork is not None:
            try:
                after_fork()
            except Exception as exc:  # its threads are missing: its calls fail or time out, counted
                logger.warning("kvstrata: renewing a %s in a forked child failed (%s: %s)",
                               type(obj).__name__, type(exc).__name__, exc)


os.register_at_fork(after_in_child=_after_fork_in_child)
