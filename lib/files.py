"""
Writes that stay in the run folder and leave nothing behind: how every file of a run is written.

A shared run folder is untrusted input. Writing `eval.json` through a fixed temporary name `eval.json.tmp`
opened with open(..., "w") followed a link planted under that name and overwrote the file it pointed to, outside
the folder; a full disk in the middle of a checkpoint left `checkpoint.pt.tmpPID` behind, keeping the disk full.
So here:

  replaced(path)        `with replaced(path) as f:` a new temporary file beside `path`, created exclusively and
                        never through a link (O_CREAT | O_EXCL | O_NOFOLLOW, a random name), fsynced and renamed
                        over `path`: a reader or a kill sees the old file or the new one. Any failure removes it
                        at once and leaves `path` as it was
  whole_write(path, x)  every whole file of a run, written by replaced: text, bytes, JSON (config.json,
                        validation.json, eval.json) or tensors (checkpoint.pt, the expert cache's states)
  replaced_name(path)   the same for a writer that takes a file name (matplotlib, save_pretrained)
  append_lines(path)    a log grows by whole lines (O_APPEND | O_NOFOLLOW); a failed write is cut back
  refuse_link(path)     a file or folder the run writes that is a symbolic link (or a pipe, a device) is refused
  WriteFailed           what a write the system refused raises (a full disk, a read-only folder, a permission);
                        support/harness/folder.py turns it into one line and exit code 4
  link_in_run_folder    the one-line refusal, before any model loads, of a run folder holding such a link
  remove_stray_temporary_files   what a run killed while writing (SIGKILL, a power cut) left, removed on resume
                                 (is_temporary: such a name)

Nothing here is in the paper.

Try it on CPU:  python -m pytest tests/test_write_safety.py -q
"""
import contextlib
import errno
import glob
import json
import os
import secrets
import shutil
import stat

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
PENDING = set()  # temporary files being written now: the signal watchdog (support/harness/folder.py) removes them


class WriteFailed(Exception):
    """A write the system refused (a full disk, a read-only folder, a permission). Its temporary file is gone and
    the file it would have replaced is as it was. `path`: that file; `error`: the OSError."""

    def __init__(self, path, error):
        self.path, self.error = path, error
        super().__init__(f"{path} could not be written ({type(error).__name__}: {error.strerror or error})")


class UnsafePath(ValueError):
    """A file the run would write or read that is a link, or not a plain file of its own (one line)."""


def refuse_link(path):
    """ValueError (one line) when `path` is a symbolic link, or something other than a plain file or folder: a run
    folder holds its own files, and a write through a link planted there lands outside it."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (or a file where its folder would be)
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{path} is a symbolic link (to {os.readlink(path)}): a run folder holds its own files, "
                         "never links; remove the link (or choose another folder)")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise UnsafePath(f"{path} is not a plain file (a pipe, a socket or a device): remove it")


def remove_quietly(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def exclusive_temporary(path, suffix=""):
    """(fd, name) of a new file beside `path`, created exclusively and never through a link: a name already
    there, planted or not, is never opened. Listed in PENDING until the caller is done with it."""
    for _ in range(100):
        tmp = f"{path}.tmp{os.getpid()}.{secrets.token_hex(3)}{suffix}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644)
        except FileExistsError:
            continue
        except OSError as e:
            raise WriteFailed(path, e) from None
        PENDING.add(tmp)
        return fd, tmp
    raise WriteFailed(path, FileExistsError(errno.EEXIST, "no free temporary name"))


@contextlib.contextmanager
def replaced(path, mode="wb"):
    """`with replaced(path) as f:` writes f, which becomes `path`, whole, when the block ends (fsync, rename). f is a
    new file beside `path` (exclusive_temporary). Any failure removes it and leaves `path` as it was: WriteFailed
    for an OSError (a full disk), UnsafePath when `path` is a link."""
    with replaced_name(path) as tmp, open(os.open(tmp, os.O_WRONLY | NOFOLLOW), mode) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def whole_write(path, obj):
    """`path` replaced by `obj`, whole (replaced): a str as text, bytes as they are, a .json file as JSON (its folder
    made if missing: evaluate.py's results), anything else with torch.save (a checkpoint, a tensor)."""
    if path.endswith(".json"):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with replaced(path, "w" if isinstance(obj, str) or path.endswith(".json") else "wb") as f:
        if isinstance(obj, (str, bytes)):
            f.write(obj)
        elif path.endswith(".json"):
            json.dump(obj, f, indent=2)
        else:
            import torch
            torch.save(obj, f)


@contextlib.contextmanager
def replaced_name(path, suffix=""):
    """replaced() for a writer that takes a file name (matplotlib's savefig, save_pretrained): yields the name of
    a new empty file beside `path` (ending in `suffix`), renamed over `path` when the block ends."""
    refuse_link(path)
    fd, tmp = exclusive_temporary(path, suffix)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:  # a full disk, a signal's exit, anything: the temporary file goes at once
        remove_quietly(tmp)
        if error := os_error_in(e):
            raise WriteFailed(path, error) from None
        raise
    finally:
        PENDING.discard(tmp)


def os_error_in(e):
    """The OSError `e` is, or was raised while handling (torch.save into a file on a full disk raises the C++
    writer's RuntimeError "unexpected pos" on top of the file's OSError): None when there is none."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


@contextlib.contextmanager
def replaced_folder(path):
    """replaced() for a folder a library writes whole (a PEFT adapter, save_pretrained): yields a new empty
    folder beside `path` (mkdtemp: exclusive, ours alone), which takes `path`'s place when the block ends (a
    folder already there, from a run killed while exporting, is removed first). Any failure removes it."""
    refuse_link(path)
    import tempfile
    try:
        tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp", dir=os.path.dirname(path) or ".")
    except OSError as e:
        raise WriteFailed(path, e) from None
    PENDING.add(tmp)
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # mkdtemp's folder is private; the export is as readable as any file here
        yield tmp
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if error := os_error_in(e):
            raise WriteFailed(path, error) from None
        raise
    finally:
        PENDING.discard(tmp)


def append_lines(path, text):
    """Append `text` (whole lines) to a log, never through a link (O_NOFOLLOW) nor into a file with another name
    elsewhere (a hard link). A write that fails part-way is cut back to where the log ended: it never keeps half
    a line. WriteFailed for an OSError, ValueError for a link."""
    refuse_link(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:  # a link planted after refuse_link looked
            refuse_link(path)
        raise WriteFailed(path, e) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            raise UnsafePath(f"{path} is not a plain file of its own ({st.st_nlink} names): a run folder holds "
                             "its own files; remove it")
        end, data = st.st_size, memoryview(text.encode())
        try:
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, end)
            raise WriteFailed(path, e) from None
    finally:
        os.close(fd)


RUN_FILES = ("config.json", "metrics.jsonl", "samples.jsonl", "checkpoint.pt", "validation.json", ".lock",
             "lora_peft", "base_model", "g_phi.safetensors", "g_phi.json", "plot.png", "eval.json",
             "eval_no_context.json", "eval_paired.json")  # every name a run (and evaluate.py) writes in --out


def link_in_run_folder(out, flag="--out"):
    """The one-line refusal of a run folder that is a symbolic link or holds one (or a pipe, a device) under a
    name the run writes or reads, or None. A write through a link planted in a shared folder would land outside
    it; writes are exclusive and never follow links anyway (replaced), this says so before
    any model loads."""
    if os.path.islink(out.rstrip("/") or "/"):
        return (f"{flag} {out} is a symbolic link (to {os.readlink(out.rstrip('/'))}): pass the folder it points to, "
                f"{os.path.realpath(out)}, if that is where the run belongs")
    for name in RUN_FILES if os.path.isdir(out) else ():
        try:
            refuse_link(os.path.join(out, name))
        except UnsafePath as e:
            return f"{flag} {out}: {e}"
    return None


def is_temporary(name):
    """Whether a file name in --out is a temporary file of a run's (NAME.tmpPID.XXXXXX, or the older NAME.tmpPID)."""
    return any(name.startswith(f"{run_file}.tmp") for run_file in RUN_FILES)


def remove_stray_temporary_files(out):
    """The temporary files (NAME.tmpPID.XXXXXX, and the older NAME.tmpPID) a run killed while writing left
    in --out: this process holds the folder's lock, so none of them is being written."""
    for name in RUN_FILES:
        for tmp in glob.glob(glob.escape(os.path.join(out, name)) + ".tmp*"):
            if os.path.isdir(tmp) and not os.path.islink(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                remove_quietly(tmp)
