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
    """
    _depth[0] += 1
    try:
        with _signals_interrupt(), signals_held():
            yield
    finally:
        _depth[0] -= 1


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP for the block: one that arrives is delivered after it."""
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
    """Inside write_guard(), let the signals through for the block (a slow write).

    Not inside a write_guard() within another: the outer one holds them over several writes.
    """
    if not hasattr(signal, "pthread_sigmask") or _depth[0] != 1:
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


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into an exception for the block, then die of the signal.

    The exception lets the write clean up its temporary file; afterwards the process ends
    exactly as the signal would have ended it. SIGINT is already KeyboardInterrupt.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wanted = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])

    def interrupt(signum: int, frame: Any) -> None:
        raise _Interrupted(signum)

    previous = {signum: signal.signal(signum, interrupt) for signum in wanted}
    try:
        yield
    except _Interrupted as exc:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        signal.signal(exc.signum, signal.SIG_DFL)
        os.kill(os.getpid(), exc.signum)
        raise SystemExit(128 + exc.signum) from None  # not reached where the signal kills
    finally:
        for signum, handler in previous.items():
            if signal.getsignal(signum) is interrupt:
                signal.signal(signum, handler)


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


