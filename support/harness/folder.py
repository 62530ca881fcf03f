"""
A run's folder and how it is kept: one writer at a time (OUT/.lock), a step's files written whole while Ctrl-C and
SIGTERM wait for them, and a run that a signal or a refused write ends in one line saying how to continue. One file
is written whole by lib/files.py (whole_write, append_lines), which the expert cache in lib/ writes with too.

  claim_folders(args, world)   before any model loads: --out made if missing and locked, --expert-cache made and
                               written to; let_go(life) undoes it however the run ends
  take_lock / release_lock     OUT/.lock, the one writer of a folder
  stop_on_signals(life, args)  Ctrl-C and SIGTERM end a run in one line: the checkpoint's step, the command that
                               continues (answer_signals; stopping_on_signals for a block of evaluate.py)
  writing_whole(life, args)    a step's log line, samples and checkpoint: a signal waits for them, a refused write
                               ends the run in one line (writes_or_fail: exit code 4; a link planted in --out: 2)

The lock. Two runs on one --out would both append to metrics.jsonl (steps 1, 1, 2, 2, ...), overwrite each other's
config and checkpoint, and both exit 0; so a run takes OUT/.lock before any model loads and a second one exits with
code 2 at once. The holder is decided by flock(2) on the open file, not by the process id written in it: the kernel
drops a flock when its process dies, however it dies (SIGKILL, the out-of-memory killer), so a lock file whose flock
is free is stale, and of two processes that find it only one flock succeeds. Without fcntl (Windows) a lock file that
exists counts as held. A `.lock` that is a link (never followed: O_NOFOLLOW) or not a plain file of its own is refused.

The signals. A run sent SIGTERM inside one long native call (a forward) kept going for 13 minutes: Python runs a
handler between two Python operations only. So a watchdog thread ends the process when the main thread has not
answered in STOP_GRACE_S seconds (answer_signals). Exit code 128 + the signal's number, as a shell reports it.
Nothing here is in the paper.

Try it on CPU:  python -m pytest tests/test_run_safety.py tests/test_write_safety.py -q
"""
import contextlib
import os
import shlex
import signal
import stat
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

from lib.files import NOFOLLOW, PENDING, UnsafePath, WriteFailed, exclusive_temporary, link_in_run_folder
from lib.files import remove_quietly
from support.harness.checkpoint import checkpoint_step
from support.harness.checks import holds_a_run, user_files_problem
from support.harness.config import create_folder, fail, remove_created

LOCK_NAME = ".lock"
STOP_GRACE_S = 2.0  # how long the main thread has to answer a signal before the watchdog ends the process
_FORK_HOOK = []  # registered once per process (os.register_at_fork cannot be undone)


def run_paths(out):
    names = {"config": "config.json", "metrics": "metrics.jsonl", "samples": "samples.jsonl",
             "checkpoint": "checkpoint.pt", "validation": "validation.json"}
    return {k: os.path.join(out, v) for k, v in names.items()}


# --------------------------------------------------------------------------------------------------
# Claimed before any model loads, let go however the run ends


def claim_folders(args, world):
    """--out made if missing and locked by this process (rank 0; another run there: exit code 2 at once), and
    --expert-cache made and written to, before any model loads. Returns what let_go undoes (Life.claim)."""
    if world.rank != 0:
        return {"lock": None, "made": []}
    if os.path.lexists(args.out) and (msg := link_in_run_folder(args.out)):  # before the lock is written there
        fail(msg)
    if not args.resume and (msg := user_files_problem(args.out)):  # a folder of the user's: never written
        fail(msg)
    made = create_folder(args.out, "--out")
    try:
        lock = take_lock(args.out)
    except LockHeld as e:
        fail(f"--out {args.out} is in use by process {e} (another run writes there; one run per folder). If no "
             f"such process runs, delete {os.path.join(args.out, LOCK_NAME)}")
    except ValueError as e:  # .lock is a link or not a plain file
        fail(f"--out {args.out}: {e}")
    except OSError as e:
        remove_created(made)
        fail(f"--out {args.out} cannot be written ({type(e).__name__}: {e.strerror})")
    if args.expert_cache:
        try:
            claim_expert_cache(args.expert_cache)
        except SystemExit:
            release_lock(lock)
            remove_created(made)
            raise
    return {"lock": lock, "made": made}


def claim_expert_cache(path):
    """--expert-cache made if missing, written to once (a file made and removed) and its width files read, before
    any model loads (train.py, --precompute-states, evaluate.py): a bad one fails in one line, exit code 2."""
    create_folder(path, "--expert-cache")  # a file there, or in its way: one line
    try:
        fd, probe = exclusive_temporary(os.path.join(path, ".probe"))  # a file made, removed
        os.close(fd)
        remove_quietly(probe)
        PENDING.discard(probe)
    except WriteFailed as e:
        fail(f"--expert-cache {path} cannot be written ({type(e.error).__name__}: {e.error.strerror})")
    from lib.state_store import cache_problem
    if msg := cache_problem(path, "--expert-cache"):
        fail(msg)


def let_go(life):
    """The lock on --out removed, and the folders claim_folders made removed again if still empty (once)."""
    claim, life.claim = life.claim, None
    if claim:
        release_lock(claim["lock"])
        remove_created(claim["made"])


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
    """Create and hold out/.lock (out must exist; a lock whose process is gone is taken over). Returns a Lock.
    Raises LockHeld when a live process holds it, OSError when the folder cannot be written, ValueError when
    .lock is a link or not a plain file."""
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


# --------------------------------------------------------------------------------------------------
# Writes that end whole, or end the run in one line


@contextlib.contextmanager
def writing_whole(life, args):
    """A block of writes (a step's log line, samples and checkpoint) that end whole: Ctrl-C and SIGTERM wait for
    it (SignalState.writing) and stop the run once it is done; a refused write ends the run in one line
    (writes_or_fail)."""
    life.writing = True
    try:
        with writes_or_fail(args):
            yield
    finally:
        life.writing = False
    if life.signal:  # a signal came while writing: now it stops the run
        signum, life.signal = life.signal, None
        signal.raise_signal(signum)


@contextlib.contextmanager
def writes_or_fail(args):
    """A write the system refuses (a full disk, a read-only folder, a permission: lib/files.WriteFailed,
    its temporary file already removed) ends the run in one line, exit code 4, saying what to free and how
    to continue; a link planted in --out while the run ran, in one line, exit code 2."""
    try:
        yield
    except (WriteFailed, UnsafePath) as e:
        from tqdm import tqdm
        if any(not bar.disable for bar in tqdm._instances):  # the line gets a line of its own
            print(file=sys.stderr)
        if isinstance(e, UnsafePath):
            fail(f"--out {args.out}: {e}")
        fail(write_failed_message(e, args), code=4)


def write_failed_message(e, args):
    """What a failed write says: which file and why (and the flag, for --expert-cache's), what is kept, what to
    free, the command that continues."""
    paths, folder = run_paths(args.out), os.path.dirname(os.path.abspath(e.path))
    step = checkpoint_step(paths["checkpoint"])
    kept = f"{paths['checkpoint']} holds step {step}" if step is not None else "no checkpoint was written yet"
    again = (f"continue with: {resume_command(args)}" if os.path.exists(paths["config"]) and step is not None
             else "run the same command again")
    cache = args.expert_cache and os.path.abspath(args.expert_cache)
    flag = f"--expert-cache {args.expert_cache}: " if cache and folder.startswith(cache) else ""
    return (f"{flag}{e}; nothing half-written was left and {kept}. Free space on the disk that holds {folder} "
            f"(df -h {folder}) or make it writable, then {again}")


def resume_command(args):
    """This process's command line with --resume: exact for a script started as `python SCRIPT.py ...`; for a
    run started another way (python -c, a notebook, a script that calls main) a description."""
    argv = sys.argv
    if os.path.basename(argv[0]) not in ("train.py", "conductor.py", "rlae.py"):
        return f"the same flags and --resume (--out {args.out})"
    return shlex.join(["python", *argv, *([] if "--resume" in argv else ["--resume"])])


# --------------------------------------------------------------------------------------------------
# Ctrl-C and SIGTERM: one line, within seconds, nothing left behind


@dataclass
class SignalState:
    """What the handler, the watchdog and the writer tell one another (a run's support/harness/run.Life is one)."""
    writing: bool = False           # a step's log line and checkpoint are being written: a signal waits
    signal: Optional[int] = None    # a signal that came while writing, raised again once they are whole
    stopping: bool = False          # the main thread answers a signal: the watchdog stands down


def stop_on_signals(life, args):
    """Ctrl-C (SIGINT) and SIGTERM end the run with one line: the step the checkpoint on disk holds (it is
    written whole or not at all, so it is safe at any moment) and the command that continues from it. A step's
    log line, samples and checkpoint being written are finished first (writing_whole); nothing else is saved on
    the way out: what ran after the checkpoint is lost, and --resume runs it again. Under torchrun
    lib/distributed.py turns SIGTERM (another rank failed) into its own line."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return
    life.signal_handlers = answer_signals(life, lambda name: stopped_message(name, life, args),
                                          cleanup=lambda: let_go(life))


def stopped_message(name, life, args):
    paths = life.paths
    if not os.path.exists(paths["config"]):
        return f"stopped by {name} before the run wrote anything; to start it, run the same command again"
    step, command = checkpoint_step(paths["checkpoint"]), resume_command(args)
    if step is None and not holds_a_run(args.out):
        return f"stopped by {name} before its first step ended: nothing to keep; run the same command again"
    if step is None:
        return (f"stopped by {name} before the first checkpoint (--save-every {args.save_every}): the steps "
                f"that ran are lost; start again from step 0 with: {command}")
    return (f"stopped by {name}: {paths['checkpoint']} is safe and holds step {step} of {args.steps} (any step "
            f"after it is lost and runs again); continue with: {command}")


def answer_signals(state, message, cleanup=lambda: None):
    """Make Ctrl-C and SIGTERM end the process in one line, `error: message(NAME)`, exit code 128 + the signal's
    number, leaving no lock or temporary file behind. Returns what restore_signals needs.

    The handler runs in the main thread between two Python operations. While state.writing (a step's log line
    and checkpoint) it only notes the signal (writing_whole raises it again once they are whole); else it exits
    through fail, and the callers' finally blocks let go of the folders. A forward over a long input is one
    native call that may not return for minutes, and the handler waits for it: so a watchdog thread, woken by
    the signal itself (signal.set_wakeup_fd), ends the process when the main thread has not answered within
    STOP_GRACE_S seconds (after any write in progress): it removes the temporary files being written
    (lib/files.PENDING), calls `cleanup` (the lock), writes the line and leaves with os._exit."""
    def stop(signum, frame):
        if state.writing:  # a step's log line and checkpoint are written first (writing_whole)
            state.signal = signum
            return
        state.stopping = True  # the main thread answers: the watchdog stands down
        from tqdm import tqdm
        if any(not bar.disable for bar in tqdm._instances):  # a progress bar (training, validation) keeps its line
            print(file=sys.stderr)
        fail(message(signal.Signals(signum).name), code=128 + signum)

    # a signal the process was started ignoring stays ignored (a shell's background job ignores Ctrl-C)
    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(sig) is not signal.SIG_IGN}
    read, write = os.pipe()
    os.set_blocking(write, False)
    wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    if not _FORK_HOOK:  # a forked child's signals are its own: they must not wake this process's watchdog
        os.register_at_fork(after_in_child=_no_wakeup)
        _FORK_HOOK.append(True)

    def watch():
        while (data := os.read(read, 64)) and 0 not in data:  # 0: restore_signals ends the watch
            # ours only: under torchrun lib/distributed.py answers SIGTERM with a handler of its own
            signums = [n for n in data if n in handlers and signal.getsignal(n) is stop]
            if not signums or state.stopping:
                continue
            deadline = time.monotonic() + STOP_GRACE_S
            while not state.stopping:
                if state.writing:  # a write in progress is finished first, however long it takes
                    deadline = time.monotonic() + STOP_GRACE_S
                elif time.monotonic() >= deadline:  # the main thread is inside a native call: end it here
                    end_now(signums[-1], state, message, cleanup)
                time.sleep(0.05)
        os.close(read)

    watchdog = threading.Thread(target=watch, name="signal-watchdog", daemon=True)
    watchdog.start()
    return {"handlers": handlers, "wakeup": (wakeup, write), "watchdog": watchdog}


def _no_wakeup():
    with contextlib.suppress(ValueError):  # forked from a thread other than the main one: nothing to undo there
        signal.set_wakeup_fd(-1)


def end_now(signum, state, message, cleanup):
    """The watchdog's exit: temporary files removed, `cleanup`, the line, exit code 128 + signum."""
    for tmp in list(PENDING):
        remove_quietly(tmp)
    try:
        cleanup()
        line = message(signal.Signals(signum).name)
    except Exception:  # the exit must not fail
        line = f"stopped by {signal.Signals(signum).name}"
    from tqdm import tqdm
    newline = "\n" if any(not bar.disable for bar in list(tqdm._instances)) else ""
    os.write(2, f"{newline}error: {line}\n".encode())
    os._exit(128 + signum)


def restore_signals(saved):
    """Undo answer_signals: the previous handlers and wakeup fd, the watchdog ended."""
    if not saved or threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in saved["handlers"].items():
        signal.signal(sig, handler)
    previous, write = saved["wakeup"]
    signal.set_wakeup_fd(previous)
    os.set_blocking(write, True)
    os.write(write, b"\0")
    os.close(write)
    # Wait for the watchdog to end here: a daemon thread still waking while the interpreter shuts down is
    # ended by pthread_exit when it asks for the GIL, and under load that aborted ~1 process in 2 after a
    # finished run ("terminate called without an active exception", exit -6)
    saved["watchdog"].join(timeout=5)


@contextlib.contextmanager
def stopping_on_signals(message, cleanup=lambda: None):
    """answer_signals for a script without a run folder of its own to lock (evaluate.py, the neighbours'
    evaluate): within the block, Ctrl-C and SIGTERM end the process in one line, exit code 130 / 143."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    state = SignalState()
    saved = answer_signals(state, message, cleanup)
    try:
        yield state
    finally:
        restore_signals(saved)
