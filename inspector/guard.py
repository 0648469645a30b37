"""Signals and temporaries around a write: what -o FILE and -o DIR share.

A write creates a temporary beside its target (`.inspect-model-PID-*`), fills it and renames it
into place. `write_guard()` holds SIGINT, SIGTERM and SIGHUP over that, so a signal never cuts it
between creating the temporary and renaming or removing it; `signals_released()` lets them
through where a slow write should stay interruptible. SIGKILL cannot be held or caught:
`remove_stale_temporaries()` removes what it left, at the next write in that folder.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any

TEMPORARY_PREFIX = ".inspect-model-"
_HELD = ("SIGINT", "SIGTERM", "SIGHUP")
_depth = [0]  # write_guard() blocks entered and not yet left


def _held() -> set[int]:
    return {getattr(signal, name) for name in _HELD if hasattr(signal, name)}


@contextlib.contextmanager
def write_guard() -> Iterator[None]:
    """Guard a write: SIGINT, SIGTERM and SIGHUP are held, except where signals_released().

    A held signal is delivered when the block ends, so a write is never cut between creating its
    temporary and renaming or removing it; inside signals_released() a signal interrupts a slow
    write at once (SIGTERM and SIGHUP as an exception, SIGINT as KeyboardInterrupt), and the
    cleanup runs held. Either way the process then ends as the signal asks. SIGKILL cannot be
    held: remove_stale_temporaries() removes what it left, at the next write in that folder.

    On the main thread the signals are held by handlers of Python's own, which note a signal and
    return: a signal mask is one thread's, and the kernel hands a process's signal to any thread
    that does not block it (torch's worker threads), whose C handler then has the main thread run
    Python's handler all the same. Elsewhere (no handler can be set) the thread's mask holds them.
    """
    import threading

    _depth[0] += 1
    try:
        if threading.current_thread() is threading.main_thread():
            with _deferred():
                yield
        else:
            with signals_held():
                yield
    finally:
        _depth[0] -= 1


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP on this thread for the block: one that arrives is
    delivered after it."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _held())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def signals_released() -> Iterator[None]:
    """Inside write_guard(), let the signals through for the block (a slow write); one that
    arrived while they were held is delivered as the block starts.

    Not inside a write_guard() within another: the outer one holds them over several writes.
    """
    if _depth[0] != 1:
        yield
        return
    if _state.handling:
        _state.released = True
        try:
            if _state.pending:
                _raise(_state.pending[0])
            yield
        finally:
            _state.released = False
        return
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _held())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, _held())


class _Interrupted(BaseException):
    """A termination signal arrived while a file was being written."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _State:
    handling = False  # _deferred()'s handlers are set
    released = False  # inside signals_released(): a signal interrupts at once
    pending: list[int] = []  # noqa: RUF012 - signals noted while held, in order


_state = _State()


def _raise(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise _Interrupted(signum)


@contextlib.contextmanager
def _deferred() -> Iterator[None]:
    """Hold the signals with handlers that note them (main thread), then deliver the first as
    the signal asks: SIGINT as KeyboardInterrupt, SIGTERM and SIGHUP by dying of them, after
    the block's own cleanup has run."""
    if _state.handling:  # inside another: the outer block holds them, and delivers them
        yield
        return
    wanted = sorted(_held())

    def note(signum: int, frame: Any) -> None:
        _state.pending.append(signum)  # kept also when raised: a __del__ the handler ran in drops it
        if _state.released:
            _raise(signum)

    # the list is fresh before the first handler is set: a signal noted while they are being set
    # is kept (it was lost when the list was replaced after them, and the write went on)
    _state.pending = []
    previous: dict[int, Any] = {}
    interrupted: int | None = None
    try:
        for signum in wanted:
            previous[signum] = signal.signal(signum, note)
        _state.handling = True
        yield
    except _Interrupted as exc:
        interrupted = exc.signum
    finally:
        _state.handling, _state.released = False, False
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    first: int | None = interrupted if interrupted is not None else next(iter(_state.pending), None)
    _state.pending = []
    if first is None:
        return
    if previous.get(first) is signal.SIG_DFL:
        os.kill(os.getpid(), first)
        raise SystemExit(128 + first)  # not reached where the signal kills
    signal.raise_signal(first)  # the caller's handler: Python's KeyboardInterrupt, or ignored


def remove_stale_temporaries(folder: str) -> None:
    """Remove `.inspect-model-PID-*` temporaries in folder whose process PID has ended (SIGKILL)."""
    import shutil

    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        pid = name[len(TEMPORARY_PREFIX) :].split("-", 1)[0]
        if not name.startswith(TEMPORARY_PREFIX) or not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


