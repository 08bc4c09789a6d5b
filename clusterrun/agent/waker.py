"""``Waker``: sleep until inotify, a pidfd or a signal's wake-up pipe says something happened."""

from __future__ import annotations

import os
import select
import sys
import time

# The supervisor and ``follow`` wait for inotify to say that something changed instead of waking
# up at their intervals (a quiet job then costs no CPU), so the first line after a quiet spell
# goes at once. They look anyway after IDLE_CHECK seconds without any event.
IDLE_CHECK = 1.0

IN_MODIFY, IN_MOVED_TO, IN_CREATE, IN_Q_OVERFLOW = 0x2, 0x80, 0x100, 0x4000


class Waker:
    """Sleeps until something may have changed: a file in a watched directory was written,
    created or renamed into it (inotify), a descriptor became readable (the pidfd of a process
    that ended, a signal's wake-up pipe), or the timeout passed.

    create → ``watch(folder)`` → ``wait(timeout, fds)`` ... → ``close()``. ``reliable`` is False
    when inotify is missing (no ctypes, or the kernel's per-user limits reached) or a directory
    could not be watched: the caller must then poll, as it did before inotify.
    """

    def __init__(self) -> None:
        self.fd = -1
        self.watched: set[str] = set()
        self.missed = False
        self.created = False  # a file was created or renamed into a watched directory (cleared by the caller)
        try:
            import ctypes

            self._libc = ctypes.CDLL(None, use_errno=True)
            self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (ImportError, OSError, AttributeError):
            self.fd = -1

    @property
    def reliable(self) -> bool:
        return self.fd >= 0 and not self.missed

    def watch(self, folder: str, mask: int = IN_MODIFY | IN_CREATE | IN_MOVED_TO) -> None:
        """Watch ``folder`` for changes of the files in it (not deeper): before listing it, so that
        nothing written after the listing goes unnoticed."""
        if self.fd >= 0 and folder not in self.watched:
            if self._libc.inotify_add_watch(self.fd, os.fsencode(folder), mask) >= 0:
                self.watched.add(folder)
            elif os.path.isdir(folder):
                self.missed = True  # fs.inotify.max_user_watches, or a file system without inotify

    def wait(self, timeout: float, fds: list[int] | None = None) -> list[int]:
        """Block for at most ``timeout`` seconds; the descriptors of ``fds`` that are readable."""
        watch = [*(fds or []), *([self.fd] if self.fd >= 0 else [])]
        ready = select.select(watch, [], [], max(timeout, 0.0))[0] if watch else []
        if not watch:
            time.sleep(max(timeout, 0.0))
        if self.fd in ready and _read_events(self.fd) & (IN_CREATE | IN_MOVED_TO | IN_Q_OVERFLOW):
            self.created = True  # the caller lists its directories again; only then (4 scandirs a wake-up)
        return [fd for fd in ready if fd != self.fd]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _read_events(fd: int) -> int:
    """Read every pending inotify event of ``fd``; their masks OR'ed together."""
    masks = 0
    try:
        while data := os.read(fd, 65536):
            at = 0
            while at + 16 <= len(data):  # struct inotify_event: wd, mask, cookie, len, then len bytes of name
                masks |= int.from_bytes(data[at + 4:at + 8], sys.byteorder)
                at += 16 + int.from_bytes(data[at + 12:at + 16], sys.byteorder)
    except BlockingIOError:
        pass
    return masks


def drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
