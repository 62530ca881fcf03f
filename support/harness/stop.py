"""
How a process stops on Ctrl-C (SIGINT) and SIGTERM: one line `error: ...`, exit code 128 + the signal's number
(130, 143, as a shell reports a process a signal ended), within a few seconds, and no lock or temporary file left.

  answer_signals(state, message, cleanup)   train.py and the neighbours (support/harness/run.stop_on_signals)
  stopping_on_signals(message)              a block of evaluate.py or a neighbour's evaluate
  restore_signals(saved)                    the handlers as they were (a test calls train.main in-process)

Python runs a signal's handler in the main thread between two Python operations; a forward over a long input is
one native call, and a run sent SIGTERM in one kept going for 13 minutes. A watchdog thread, woken by the signal
itself (signal.set_wakeup_fd), ends the process when the main thread has not answered in STOP_GRACE_S seconds.
Nothing here is in the paper.

Try it on CPU:  python -m pytest tests/test_write_safety.py -q -k signal
"""
import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

from support.harness.config import fail
from lib.files import PENDING, remove_quietly

STOP_GRACE_S = 2.0  # how long the main thread has to answer a signal before the watchdog ends the process
_FORK_HOOK = []  # registered once per process (os.register_at_fork cannot be undone)


@dataclass
class SignalState:
    """What the handler, the watchdog and the writer tell one another (a run's support/harness/run.Life is one)."""
    writing: bool = False           # a step's log line and checkpoint are being written: a signal waits
    signal: Optional[int] = None    # a signal that came while writing, raised again once they are whole
    stopping: bool = False          # the main thread answers a signal: the watchdog stands down


def answer_signals(state, message, cleanup=lambda: None):
    """Make Ctrl-C and SIGTERM end the process in one line, `error: message(NAME)`, exit code 128 + the signal's
    number, leaving no lock or temporary file behind. Returns what restore_signals needs.

    The handler runs in the main thread between two Python operations. While state.writing (a step's log line
    and checkpoint) it only notes the signal (after_step raises it again once they are whole); else it exits
    through fail, and the callers' finally blocks let go of the folders. A forward over a long input is one
    native call that may not return for minutes, and the handler waits for it: so a watchdog thread, woken by
    the signal itself (signal.set_wakeup_fd), ends the process when the main thread has not answered within
    STOP_GRACE_S seconds (after any write in progress): it removes the temporary files being written
    (lib/files.PENDING), calls `cleanup` (the lock), writes the line and leaves with os._exit."""
    def stop(signum, frame):
        if state.writing:  # a step's log line and checkpoint are written first (after_step)
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
