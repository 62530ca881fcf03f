"""What a run writes, reads and how it stops, on the tiny team; one regression test per way it used to go wrong:
  1. writes stay in the run folder: a link planted under any name a run writes (or under the old fixed temporary
     names, `eval.json.tmp`...) is never written through (before: evaluate.py --run overwrote the file that
     `eval.json.tmp` pointed to, and a `.lock` link had its target truncated);
  2. a failing write (a full disk: a real one on a small tmpfs where the machine allows mounting, else an
     injected OSError) removes its temporary file, keeps the last good file and ends in one line, exit code 4
     (before: two chained tracebacks and `checkpoint.pt.tmpPID` left behind);
  3. bounded inputs: prompts against the policy's context, text flags, data rows, JSON values (before: a 1 MB
     question never ended step 1, a 2 MB prefix died allocating 4 TB after the models loaded, NaN and deep
     nesting were accepted or raised a traceback);
  4. --resume's checkpoint and --expert-cache's files are checked before any model loads;
  5. SIGTERM ends a process inside one long native call within seconds (before: it waited for the call).
The chaos test (kills at random moments, resumed, bit-identical) is tests/test_chaos.py."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import evaluate
import train
from support.harness import checkpoint
from test_hardening import FLAGS, RUN_SCRIPT, letter_reward, read_metrics, snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run (checkpoints at steps 1 and 2, 2 validation items)."""
    out = str(tmp_path_factory.mktemp("write") / "run")
    train.main(FLAGS + ["--steps", "2", "--save-every", "1", "--eval-items", "2", "--out", out],
               score_batch=letter_reward)
    return out


def copy_of(finished, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(finished, out)
    return out


def outside(tmp_path):
    """A file outside the run folder, which no write may touch."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    return victim


def one_error(capfd):
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def no_temporary_files(out):
    return [os.path.join(d, n) for d, ds, ns in os.walk(out) for n in ns + ds if ".tmp" in n]


# ----------------------------------------------------------------------------------------------------------
# 1. Links planted in a shared run folder


@pytest.mark.parametrize("name", checkpoint_names := ["config.json", "metrics.jsonl", "samples.jsonl",
                                                      "checkpoint.pt", "validation.json", ".lock", "lora_peft",
                                                      "g_phi.safetensors", "plot.png"])
def test_resume_refuses_a_run_folder_holding_a_link_before_any_model_loads(name, finished, tmp_path, capfd,
                                                                          monkeypatch):
    out, victim = copy_of(finished, tmp_path), outside(tmp_path)
    path = os.path.join(out, name)
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)
    os.symlink(victim, path)
    monkeypatch.setattr("support.harness.build.load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit) as exc:
        train.main(FLAGS + ["--steps", "3", "--save-every", "1", "--eval-items", "2", "--out", out, "--resume"],
                   score_batch=letter_reward)
    line = one_error(capfd)
    assert exc.value.code == 2 and "--out" in line and "symbolic link" in line and name in line, line
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("name", ["eval.json.tmp", "eval.json"])
def test_evaluate_never_writes_through_a_planted_link(name, finished, tmp_path, capfd):
    """The issue's case: eval.json.tmp planted as a link made evaluate.py --run overwrite its target (exit 0).
    Now the old fixed name is never opened (the run is scored, the target untouched), and a link under the
    result's own name is refused before anything loads."""
    out, victim = copy_of(finished, tmp_path), outside(tmp_path)
    os.symlink(victim, os.path.join(out, name))
    if name == "eval.json":
        with pytest.raises(SystemExit) as exc:
            evaluate.main(["--run", out, "--n", "2"])
        assert exc.value.code == 2 and "symbolic link" in one_error(capfd)
    else:
        evaluate.main(["--run", out, "--n", "2"])
        with open(os.path.join(out, "eval.json")) as f:
            assert json.load(f)["n"] == 2
    assert victim.read_text() == "precious\n"
    assert os.path.islink(os.path.join(out, name))  # left where it was: not ours to remove


def test_the_old_temporary_names_planted_as_links_are_never_opened(finished, tmp_path):
    """config.json.tmp, metrics.jsonl.tmp, validation.json.tmp and checkpoint.pt.tmp<pid> planted as links: a
    resumed run writes every one of its files and never touches their targets."""
    out, victim = copy_of(finished, tmp_path), outside(tmp_path)
    for name in ("config.json.tmp", "metrics.jsonl.tmp", "validation.json.tmp", "samples.jsonl.tmp",
                 f"checkpoint.pt.tmp{os.getpid()}", "g_phi.json.tmp"):
        os.symlink(victim, os.path.join(out, name))
    train.main(FLAGS + ["--steps", "3", "--save-every", "1", "--eval-items", "2", "--out", out, "--resume"],
               score_batch=letter_reward)
    assert victim.read_text() == "precious\n"
    assert len(read_metrics(out)) == 3 and checkpoint.checkpoint_step(os.path.join(out, "checkpoint.pt")) == 3


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_kept(tmp_path, capfd):
    """take_lock opened an existing .lock following links, then truncated and wrote it: a `.lock` planted as a
    link to another file emptied that file."""
    out, victim = tmp_path / "out", outside(tmp_path)
    out.mkdir()
    os.symlink(victim, out / ".lock")
    with pytest.raises(SystemExit) as exc:
        train.main(FLAGS + ["--steps", "1", "--out", str(out)], score_batch=letter_reward)
    assert exc.value.code == 2 and ".lock" in one_error(capfd)
    assert victim.read_text() == "precious\n"


def test_each_writer_refuses_a_link_and_leaves_nothing(tmp_path):
    """The writers themselves (lib/files.py), for every kind of write: replaced, replaced_name,
    replaced_folder, append_lines, whole_write."""
    from lib import files
    victim = outside(tmp_path)
    link = tmp_path / "link"
    os.symlink(victim, link)
    writers = [lambda: files.whole_write(str(link), {"a": 1}),
               lambda: files.append_lines(str(link), "x\n"),
               lambda: files.replaced_name(str(link)).__enter__(),
               lambda: files.replaced_folder(str(link)).__enter__()]
    for write in writers:
        with pytest.raises(files.UnsafePath):
            write()
    assert victim.read_text() == "precious\n" and sorted(os.listdir(tmp_path)) == ["link", "victim.txt"]
    os.link(victim, tmp_path / "hard")  # a hard link: a log never grows into a file with another name
    with pytest.raises(files.UnsafePath):
        files.append_lines(str(tmp_path / "hard"), "x\n")
    assert victim.read_text() == "precious\n"


# ----------------------------------------------------------------------------------------------------------
# 2. A full disk


def test_a_full_disk_while_saving_a_checkpoint_keeps_the_last_one_and_says_how_to_resume(tmp_path, capfd,
                                                                                         monkeypatch):
    out = str(tmp_path / "full")
    real_save, saves = torch.save, []

    def save(obj, f, *args, **kwargs):  # the second checkpoint fills the disk half-way
        saves.append(obj["step"] if isinstance(obj, dict) and "step" in obj else None)
        if saves[-1] == 2:
            f.write(b"half a checkpoint")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(SystemExit) as exc:
        train.main(FLAGS + ["--steps", "3", "--save-every", "1", "--out", out], score_batch=letter_reward)
    line = one_error(capfd)
    assert exc.value.code == 4, line
    assert "No space left on device" in line and "holds step 1" in line and "--resume" in line, line
    assert not no_temporary_files(out) and not os.path.exists(os.path.join(out, ".lock")), os.listdir(out)
    assert checkpoint.checkpoint_step(os.path.join(out, "checkpoint.pt")) == 1
    monkeypatch.undo()  # space freed: the command in the line continues the run
    train.main(FLAGS + ["--steps", "3", "--save-every", "1", "--out", out, "--resume"], score_batch=letter_reward)
    assert len(read_metrics(out)) == 3


def test_a_full_disk_while_logging_cuts_the_log_back_to_whole_lines(tmp_path, capfd, monkeypatch):
    out = str(tmp_path / "full")
    real_write, metrics = os.write, os.path.join(out, "metrics.jsonl")

    def write(fd, data):  # step 2's line: half of it lands, then the disk is full
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if name == os.path.realpath(metrics) and os.fstat(fd).st_size > 0:
            real_write(fd, bytes(data[:10]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    if not os.path.exists("/proc/self/fd"):
        pytest.skip("no /proc/self/fd to tell the log's writes from others")
    monkeypatch.setattr(os, "write", write)
    with pytest.raises(SystemExit) as exc:
        train.main(FLAGS + ["--steps", "3", "--save-every", "1", "--out", out], score_batch=letter_reward)
    monkeypatch.undo()
    line = one_error(capfd)
    assert exc.value.code == 4 and "metrics.jsonl" in line, line
    assert len(read_metrics(out)) == 1  # step 1 whole, nothing of step 2
    assert not no_temporary_files(out) and not os.path.exists(os.path.join(out, ".lock"))


TMPFS_RUN = r"""
import json, os, subprocess, sys
mnt, root, flags = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
def train(*extra):
    return subprocess.run([sys.executable, "-c", RUN_SCRIPT, *flags, "--out", mnt + "/run", *extra], cwd=root,
                          capture_output=True, text=True)
first = train()
listing = sorted(os.listdir(mnt + "/run"))
step = __import__("support.harness.checkpoint", fromlist=["x"]).checkpoint_step(mnt + "/run/checkpoint.pt")
subprocess.run(["mount", "-o", "remount,size=64m", mnt], check=True)  # space freed
second = train("--resume")
print(json.dumps({"first": [first.returncode, first.stderr], "listing": listing, "step": step,
                  "second": [second.returncode, second.stderr], "after": sorted(os.listdir(mnt + "/run"))}))
"""


def test_a_real_full_disk_on_a_small_tmpfs(tmp_path):
    """A tmpfs with room for one checkpoint but not for its successor beside it (a checkpoint is written whole
    before the old one goes): the run stops at its second save in one line, exit code 4, nothing left behind,
    and after the space is freed --resume finishes it."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare(1): a tmpfs cannot be mounted without root here")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            f"mount -t tmpfs -o size=1m tmpfs {mnt}"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"mounting a tmpfs in a user namespace is not allowed here: {probe.stderr.strip()[:120]}")
    flags = FLAGS + ["--steps", "3", "--save-every", "1"]
    script = TMPFS_RUN.replace("RUN_SCRIPT", repr(RUN_SCRIPT))
    # the checkpoint of these flags is ~390 kB: 600 kB hold one, not two
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                           f'mount -t tmpfs -o size=600k tmpfs {mnt} && exec "$0" -c "$1" {mnt} {ROOT} "$2"',
                           sys.executable, script, json.dumps(flags)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    code, stderr = result["first"]
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    assert code == 4 and len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert "No space left on device" in errors[0] and "--resume" in errors[0], errors[0]
    assert result["step"] == 1 and not [n for n in result["listing"] if ".tmp" in n or n == ".lock"], result
    assert result["second"][0] == 0, result["second"][1][-3000:]
    assert "lora_peft" in result["after"] and not [n for n in result["after"] if ".tmp" in n or n == ".lock"]


# ----------------------------------------------------------------------------------------------------------
# 3. Bounded inputs: each fails in one line, exit code 2, before any model loads (or, for a prompt's length in
# tokens, before the first forward), --out as it was


def gsm8k_folder(tmp_path, question):
    folder = tmp_path / "gsm8k"
    folder.mkdir(exist_ok=True)
    row = json.dumps({"question": question, "answer": "#### 5"}) + "\n"
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text(row * 4)
    return str(folder)


BOUNDED = {  # case: (extra flags, {placeholders} made below; the text the line must hold)
    "a 1 MB question in the data file": (["--task", "gsm8k", "--data-path", "{gsm8k_1mb}"], "--data-path"),
    "a question longer than the policy's context": (["--task", "gsm8k", "--data-path", "{gsm8k_5k}"],
                                                     "above the policy's context"),
    "a 200 kB --response-prefix": (["--response-prefix", "x" * 200_000], "--response-prefix"),
    "--task-config with NaN": (["--task-config", '{"min_terms": NaN}'], "--task-config"),
    "--task-config with 1e400": (["--task-config", '{"min_terms": 1e400}'], "--task-config"),
    "--task-config nested 5000 deep": (["--task-config", "[" * 5000 + "]" * 5000], "--task-config"),
    "--config with a 2 MB response prefix": (["--config", "{config_2mb}"], "--config"),
    "--config nested 100000 deep": (["--config", "{config_deep}"], "--config"),
}


@pytest.mark.parametrize("case", BOUNDED, ids=list(BOUNDED))
def test_inputs_too_large_are_refused_in_one_line(case, tmp_path, capfd, monkeypatch):
    extra, must = BOUNDED[case]
    paths = {"{gsm8k_1mb}": lambda: gsm8k_folder(tmp_path, "1 + " * 250_000 + "1?"),
             "{gsm8k_5k}": lambda: gsm8k_folder(tmp_path, "1 + " * 1250 + "1?"),
             "{config_2mb}": lambda: str(write(tmp_path / "c.json", json.dumps({"response_prefix": "x" * 2_000_000}))),
             "{config_deep}": lambda: str(write(tmp_path / "d.json", '{"team": ' + "[" * 100_000 + "]" * 100_000
                                                + "}"))}
    extra = [paths[a]() if a in paths else a for a in extra]
    out = str(tmp_path / "out")
    if "context" not in must:  # refused before the policy loads
        monkeypatch.setattr("support.harness.build.load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit) as exc:
        train.main(FLAGS + ["--steps", "1", "--out", out, *extra], score_batch=letter_reward)
    line = one_error(capfd)
    assert exc.value.code == 2 and must in line, line
    assert not os.path.exists(out) or os.listdir(out) == [], os.listdir(out)


def write(path, text):
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------------------------------------
# 4. What --resume reads, checked before any model loads


def damage(kind, ckpt):
    if kind == "truncated":
        data = open(ckpt, "rb").read()
        open(ckpt, "wb").write(data[:len(data) // 3])
    elif kind == "empty":
        open(ckpt, "wb").close()
    elif kind in ("newer format", "foreign", "rank 4", "other latents"):
        state = torch.load(ckpt, weights_only=True)
        if kind == "newer format":
            state["format"] = checkpoint.CHECKPOINT_FORMAT + 1
        elif kind == "foreign":
            state = {"model": torch.zeros(3), "epoch": 7}
        elif kind == "rank 4":
            state["lora"] = {k: v[:4] if k.endswith("lora_A") else v[:, :4] for k, v in state["lora"].items()}
        else:
            state["method"] = {k: v[:2] if k.endswith("latents") else v for k, v in state["method"].items()}
        torch.save(state, ckpt)
    elif kind == "a folder":
        os.remove(ckpt)
        os.mkdir(ckpt)


@pytest.mark.parametrize("kind", ["truncated", "empty", "newer format", "foreign", "rank 4", "other latents",
                                  "a folder"])
def test_a_damaged_checkpoint_is_refused_before_any_model_loads(kind, finished, tmp_path, capfd, monkeypatch):
    out = copy_of(finished, tmp_path)
    damage(kind, os.path.join(out, "checkpoint.pt"))
    before = snapshot(out)
    monkeypatch.setattr("support.harness.build.load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit) as exc:
        train.main(FLAGS + ["--steps", "3", "--save-every", "1", "--eval-items", "2", "--out", out, "--resume"],
                   score_batch=letter_reward)
    line = one_error(capfd)
    assert exc.value.code == 2 and "--resume" in line and "checkpoint" in line, line
    assert snapshot(out) == before


def test_an_unreadable_expert_state_is_computed_again_and_a_bad_width_refused(tmp_path, capfd, monkeypatch):
    from lib.state_store import StateStore, cache_problem
    store = StateStore(str(tmp_path / "cache"), "tiny:qwen2|cpu|float32|last|1.0|1024")
    store.write({"a": torch.ones(4), "b": torch.ones(4)})
    store.set_dim(4)
    with open(store.path("a"), "wb") as f:
        f.write(b"not a tensor")
    os.remove(store.path("b"))
    os.symlink("/etc/hostname", store.path("b"))
    assert store.read(["a", "b"]) == {}  # computed again, not a traceback
    store.write({"a": torch.ones(4)})
    assert torch.equal(store.read(["a"])["a"], torch.ones(4)) and store.dim() == 4
    width = store.path("\0width")[:-3] + ".width"
    open(width, "w").write("lots")
    assert store.dim() is None and "--expert-cache" in cache_problem(str(tmp_path / "cache"), "--expert-cache")
    monkeypatch.setattr("support.harness.build.load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit) as exc:
        train.main(FLAGS + ["--steps", "1", "--out", str(tmp_path / "out"), "--expert-cache",
                            str(tmp_path / "cache")], score_batch=letter_reward)
    assert exc.value.code == 2 and ".width" in one_error(capfd)


# ----------------------------------------------------------------------------------------------------------
# 5. A signal inside one long native call

LONG_CALL = r"""
import sys, threading, torch
sys.path[:0] = [{root!r}, {tests!r}]
torch.set_num_threads(1)
import train, test_hardening
real = train.sample_rows
def sample_rows(*args, **kwargs):  # the step's forward, made one native call that runs for minutes
    a = torch.rand(3000, 3000, dtype=torch.float64)
    threading.Timer(1.0, print, ["in the long call"], {{"flush": True}}).start()  # said from inside the call
    torch.linalg.matrix_power(a, 2 ** 62 - 1)  # 124 products of 54 GFLOP: minutes on any CPU core
    print("the long call returned", flush=True)
    return real(*args, **kwargs)
train.sample_rows = sample_rows
train.main(sys.argv[1:], score_batch=test_hardening.letter_reward)
""".format(root=ROOT, tests=os.path.join(ROOT, "tests"))

EVAL_LONG_CALL = r"""
import sys, threading, torch
sys.path[:0] = [{root!r}]
torch.set_num_threads(1)
from support.harness.folder import stopping_on_signals
with stopping_on_signals(lambda name: f"stopped by {{name}}: nothing written; run the same command again"):
    a = torch.rand(3000, 3000, dtype=torch.float64)
    threading.Timer(1.0, print, ["in the long call"], {{"flush": True}}).start()  # said from inside the call
    torch.linalg.matrix_power(a, 2 ** 62 - 1)
    print("the long call returned", flush=True)
""".format(root=ROOT)


@pytest.mark.parametrize("who", ["train", "evaluate"])
def test_sigterm_inside_a_long_native_call_ends_the_process_in_seconds(who, tmp_path):
    """One native call (here torch.linalg.matrix_power: 124 products of 3000 x 3000 matrices, minutes on one
    core) never returns to Python, where a signal's handler runs: the run used to ignore SIGTERM until it
    returned (and was killed here after 120 s). The watchdog ends it: exit code 143, one line, no lock and no
    temporary file left. `evaluate` is the block evaluate.py and the neighbours' evaluate run in."""
    out = str(tmp_path / "out")
    script = LONG_CALL if who == "train" else EVAL_LONG_CALL
    argv = [*FLAGS, "--steps", "2", "--out", out] if who == "train" else []
    proc = subprocess.Popen([sys.executable, "-c", script, *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        if line.startswith("in the long call"):
            break
    proc.send_signal(signal.SIGTERM)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    assert proc.returncode == 143, (proc.returncode, stderr[-2000:])
    assert len(errors) == 1 and "stopped by SIGTERM" in errors[0] and "Traceback" not in stderr, stderr[-2000:]
    assert "the long call returned" not in stdout
    if who == "train":
        assert not os.path.exists(os.path.join(out, ".lock")) and not no_temporary_files(out), os.listdir(out)


def test_the_watchdog_has_ended_when_the_signals_are_restored():
    """Regression: restore_signals woke the watchdog thread and returned at once; at the end of a run the thread
    could still be asking for the GIL while the interpreter shut down, and was ended by pthread_exit there: under
    load ~1 finished pocket run in 2 aborted with "terminate called without an active exception" (exit -6, seen
    in the test suite as well). The watchdog is now joined before restore_signals returns."""
    import threading
    from support.harness.folder import SignalState, answer_signals, restore_signals
    for _ in range(20):
        saved = answer_signals(SignalState(), lambda name: f"stopped by {name}")
        restore_signals(saved)
        assert not [t for t in threading.enumerate() if t.name == "signal-watchdog" and t.is_alive()]
