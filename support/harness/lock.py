"""
One writer per run folder: a lock file, OUT/.lock, that holds the process id of the run writing there.

Two runs on one --out would both append to metrics.jsonl (steps 1, 1, 2, 2, ...) and overwrite each other's
config and checkpoint, and both exit 0. So train.py (and --resume, and the neighbours' scripts) take the lock
before any model loads, and a second run on the same folder exits with code 2 at once.

  take_lock(out)     create OUT/.lock atomically (O_CREAT | O_EXCL) and hold it; a lock whose process is gone is
                     taken over; one held by a live process raises LockHeld
  release_lock(lk)   remove it (support/harness/run.py calls it at the end, on errors and on SIGINT / SIGTERM)

Who holds the lock is decided by flock(2) on the open file, not by the process id written in it: the kernel
drops a flock when its process dies, however it dies (SIGKILL, the out-of-memory killer), so a lock file
whose flock is free is stale, and two processes that find the same stale file cannot both take it (only one
flock succeeds). Where fcntl is missing (Windows) a lock file that exists counts as held. The lock file is never
opened through a link (O_NOFOLLOW) and must be a plain file of its own: a `.lock` planted in a shared folder as a
link to another file would otherwise be truncated and written (ValueError). Nothing here is in the paper.

Try it on CPU:  python -m pytest tests/test_run_safety.py -q -k lock
"""
import os
import stat
from dataclasses import dataclass

LOCK_NAME = ".lock"
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


@dataclass
class Lock:
    path: str        # OUT/.lock
    fd: int | None   # the open file that holds the flock; None once released


class LockHeld(Exception):
    """The run folder is held by another live process (its id is the message's first word)."""


def _flock(fd):
    """Hold an exclusive flock on fd: True, or False when another open file holds it; None where fcntl is
    missing."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _holder(path):
    """The process id written in a lock file, as text ('?' when unreadable or empty)."""
    try:
        with open(path) as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


def take_lock(out):
    """Create and hold out/.lock (out must exist). Returns a Lock. Raises LockHeld when a live process holds
    it, OSError when the folder cannot be written, ValueError when .lock is a link or not a plain file."""
    path = os.path.join(out, LOCK_NAME)
    for _ in range(3):  # a holder may release the file between our open and our flock: try again
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | NOFOLLOW, 0o644)
        except FileExistsError:
            try:  # someone's lock file: stale if nobody holds its flock; never a link to another file
                fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | NOFOLLOW)
            except FileNotFoundError:  # released in between
                continue
            except OSError:
                if os.path.islink(path):
                    raise ValueError(f"{path} is a symbolic link (to {os.readlink(path)}), not a lock file; "
                                     "remove it") from None
                raise
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
                os.close(fd)
                raise ValueError(f"{path} is not a plain lock file of its own; remove it")
            if not _flock(fd):  # held by a live process (or, without flock, there at all)
                os.close(fd)
                raise LockHeld(_holder(path)) from None
        else:
            if _flock(fd) is False:  # another process took our new file over before we flocked it
                os.close(fd)
                raise LockHeld(_holder(path))
        # we hold the flock; the file must still be the one at `path` (not one released and unlinked meanwhile)
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return Lock(path, fd)
    raise LockHeld(_holder(path))


def release_lock(lock):
    """Remove the lock file (if it is still ours) and let go of it. Safe to call twice, or with None."""
    if lock is None or lock.fd is None:
        return
    try:
        if os.stat(lock.path).st_ino == os.fstat(lock.fd).st_ino:
            os.remove(lock.path)
    except OSError:
        pass
    os.close(lock.fd)
    lock.fd = None
