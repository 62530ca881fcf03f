"""A run folder's safety on the tiny team, one regression test per way a run used to go wrong:
  1. one writer per folder: two runs started on one --out (before: both exited 0, metrics.jsonl held steps
     1, 1, 2, 2, ...); a folder whose lock is held refuses --resume too; a dead run's lock is taken over;
  2. an update that leaves a weight non-finite is undone, weights and AdamW state, and counted as a skipped
     step (before: the run went on from NaN weights and exited 0);
  3. a run that failed in its first step does not block its own retry (before: "already holds a run");
  4. Ctrl-C and SIGTERM end in one line naming the checkpoint's step and the command that resumes, with exit
     codes 130 and 143, a checkpoint being written finished first (before: an 85-line traceback, or nothing,
     and death by the signal);
  5. checkpoints are read with weights_only=True: a crafted pickle in a run folder runs no code (before: it
     ran), and an older checkpoint is refused in one line until it is converted on purpose.
Bad input in one line, exit code 2, is tests/test_hardening.py's table."""
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import train
from support.harness import checkpoint, run
from support.harness.folder import LOCK_NAME, release_lock, take_lock
from test_hardening import FLAGS, KILL_AT, RUN_SCRIPT, letter_reward, read_metrics, same_weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def start(out, *extra, steps=4, signal_at=""):
    """train.main in a subprocess (test_hardening's RUN_SCRIPT), its log lines unbuffered; signal_at:
    "POINT:STEP:SIGNAL" sends the run that signal there (experiments/kill_at.py)."""
    env, launcher = {**os.environ, "PYTHONUNBUFFERED": "1"}, [KILL_AT, signal_at] if signal_at else []
    return subprocess.Popen([sys.executable, *launcher, "-c", RUN_SCRIPT, *FLAGS, "--steps", str(steps), "--out", out,
                             *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=at_a_terminal)


def at_a_terminal():
    """Ctrl-C's default, as at a terminal: pytest started as a shell's background job passes on SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run, to copy."""
    out = str(tmp_path_factory.mktemp("safety") / "finished")
    train.main(FLAGS + ["--steps", "2", "--out", out], score_batch=letter_reward)
    return out


def copy_of(finished, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(finished, out)
    return out


def files(out):
    return sorted(os.listdir(out)) if os.path.isdir(out) else None


# ----------------------------------------------------------------------------------------------------------
# 1. One writer per folder


def test_two_runs_on_one_folder_one_writes_the_other_exits_2(tmp_path):
    out = str(tmp_path / "shared")
    procs = [start(out, "--seed", str(seed), steps=20) for seed in (0, 1)]
    results = [(p.returncode, stderr) for p in procs for _, stderr in [p.communicate(timeout=600)]]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], [(code, stderr[-1500:]) for code, stderr in results]
    loser = next(stderr for code, stderr in results if code == 2)
    assert len(error_lines(loser)) == 1 and "--out" in error_lines(loser)[0] and "in use" in error_lines(loser)[0]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 21))  # one run's steps, once each
    assert LOCK_NAME not in os.listdir(out)  # the winner let go of it


def test_resume_takes_the_lock_and_a_dead_runs_lock_is_taken_over(finished, tmp_path, capfd):
    out = copy_of(finished, tmp_path)
    before = {n: open(os.path.join(out, n), "rb").read() for n in ("metrics.jsonl", "checkpoint.pt")}
    lock = take_lock(out)  # another live run holds the folder
    try:
        with pytest.raises(SystemExit) as exc:
            train.main(FLAGS + ["--steps", "3", "--out", out, "--resume"], score_batch=letter_reward)
    finally:
        release_lock(lock)
    err = error_lines(capfd.readouterr().err)
    assert exc.value.code == 2 and len(err) == 1 and f"process {os.getpid()}" in err[0], err
    assert {n: open(os.path.join(out, n), "rb").read() for n in before} == before
    # A run killed with SIGKILL leaves its lock file behind, holding a process id that is gone.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(os.path.join(out, LOCK_NAME), "w") as f:
        f.write(f"{dead.pid}\n")
    train.main(FLAGS + ["--steps", "3", "--out", out, "--resume"], score_batch=letter_reward)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3] and LOCK_NAME not in os.listdir(out)


# ----------------------------------------------------------------------------------------------------------
# 2. Weights checked after every update


def test_an_update_that_makes_a_weight_non_finite_is_undone_and_skipped(monkeypatch, tmp_path, capfd):
    """AdamW.step is made to leave one LoRA weight NaN in step 2, with a finite loss and gradient, as an Adam
    denominator that underflows does."""
    real_step, calls, saved = torch.optim.AdamW.step, [0], {}

    def poisoned_step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == 2:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("nan")
        return out

    def save_checkpoint(path, step, policy, method, optimizer, pool):  # what each checkpoint holds
        state = optimizer.state_dict()["state"]
        saved[step] = ({k: v.clone() for k, v in policy.state_dict().items() if "lora" in k},
                       {(i, k): v.clone() for i, s in state.items() for k, v in s.items()})
        real_save(path, step, policy, method, optimizer, pool)

    real_save = run.save_checkpoint
    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned_step)
    monkeypatch.setattr(run, "save_checkpoint", save_checkpoint)
    out = str(tmp_path / "poisoned")
    train.main(FLAGS + ["--steps", "3", "--save-every", "1", "--out", out], score_batch=letter_reward)
    assert [r["skipped_update"] for r in read_metrics(out)] == [False, True, False]
    assert same_weights(saved[1][0], saved[2][0])  # the weights of step 1, bit for bit
    assert same_weights(saved[1][1], saved[2][1])  # and AdamW's moments and step counts
    assert not same_weights(saved[2][0], saved[3][0])  # training goes on
    assert all(torch.isfinite(v).all() for v in saved[3][0].values())
    assert "update skipped" in capfd.readouterr().out


# ----------------------------------------------------------------------------------------------------------
# 3. A failed first step does not block its retry


def test_a_run_that_failed_in_its_first_step_can_run_again(monkeypatch, tmp_path):
    out = str(tmp_path / "oom")
    argv = FLAGS + ["--steps", "2", "--out", out, "--eval-items", "2"]

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(train, "grpo_step", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        train.main(argv, score_batch=letter_reward)
    assert files(out) == ["config.json", "validation.json"]  # the lock went with the run
    monkeypatch.undo()
    train.main(argv, score_batch=letter_reward)  # the same command, as the README advises after running out
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


# ----------------------------------------------------------------------------------------------------------
# 4. Ctrl-C and SIGTERM


def stopped(proc):
    """(exit code, stderr, the step the one error line says the checkpoint holds) of a stopped run."""
    _, stderr = proc.communicate(timeout=600)
    err = error_lines(stderr)
    assert "Traceback" not in stderr and len(err) == 1 and "--resume" in err[0], stderr[-3000:]
    found = re.search(r"holds step (\d+) of 200", err[0])
    assert found, err[0]
    return proc.returncode, stderr, int(found.group(1))


def test_ctrl_c_ends_the_run_in_one_line_that_says_how_to_resume(tmp_path):
    out = str(tmp_path / "stopped")
    proc = start(out, steps=200)
    for line in proc.stdout:  # Ctrl-C after step 3's log line: in step 4 (--save-every 2: no checkpoint at 3)
        if line.startswith("step 3/"):
            proc.send_signal(signal.SIGINT)
            break
    code, stderr, step = stopped(proc)
    assert code == 130, stderr[-3000:]
    assert step in (2, 4)  # 2, or 4 if step 4 ended before the signal came
    assert checkpoint.read_checkpoint(os.path.join(out, "checkpoint.pt"), "test")["step"] == step
    assert LOCK_NAME not in os.listdir(out)


# The run's scorer is the task's own (rewards.score_batch, its worker process and forkserver), fed an answer block
# made of each completion's first characters, so that every step sends the worker jobs.
SCORER_SCRIPT = ("import sys, torch; sys.path[:0] = [{root!r}]; torch.set_num_threads(1); import rewards, train; "
                 "train.main(sys.argv[1:], score_batch=lambda items, texts: rewards.score_batch(items, "
                 "['<answer>' + t[:2] + '</answer>' for t in texts]))").format(root=ROOT)


def test_ctrl_c_at_a_terminal_reaches_the_scoring_worker_too_and_still_ends_in_one_line(tmp_path):
    """A terminal's Ctrl-C signals the whole process group: the run and the children it started (the scoring
    worker and its forkserver). The children ignore it and the run ends them (before: the worker printed a
    17-line KeyboardInterrupt traceback above the run's one line)."""
    out = str(tmp_path / "stopped")
    proc = subprocess.Popen([sys.executable, "-c", SCORER_SCRIPT, *FLAGS, "--steps", "200", "--out", out], cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=at_a_terminal, start_new_session=True)
    for line in proc.stdout:  # the group is the run's own (start_new_session): its id is the run's pid
        if line.startswith("step 3/"):
            os.killpg(proc.pid, signal.SIGINT)
            break
    code, stderr, step = stopped(proc)
    assert code == 130 and step in (2, 4), stderr[-3000:]
    assert "KeyboardInterrupt" not in stderr, stderr[-3000:]
    for _ in range(100):  # the worker and the forkserver end with the run, within a few seconds
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("a child of the run outlived it")


def test_sigterm_while_a_checkpoint_is_written_waits_for_it(tmp_path):
    """SIGTERM arrives inside save_checkpoint of step 2, its temporary file written and not yet renamed: the
    checkpoint is finished first, and the line names it."""
    out = str(tmp_path / "stopped")
    code, stderr, step = stopped(start(out, steps=200, signal_at="checkpoint:2:SIGTERM"))
    assert code == 143 and step == 2, stderr[-3000:]
    assert checkpoint.read_checkpoint(os.path.join(out, "checkpoint.pt"), "test")["step"] == 2
    assert not [n for n in os.listdir(out) if ".tmp" in n or n == LOCK_NAME]


# ----------------------------------------------------------------------------------------------------------
# 5. Checkpoints that cannot run code


class RunsCode:
    """What a crafted checkpoint holds: unpickling it calls os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("script", ["train", "evaluate"])
def test_a_crafted_checkpoint_is_refused_and_runs_nothing(script, finished, tmp_path, capfd):
    out = copy_of(finished, tmp_path)
    marker = tmp_path / "code_ran"
    with open(os.path.join(out, "checkpoint.pt"), "wb") as f:
        pickle.dump({"step": 2, "lora": RunsCode(marker)}, f, protocol=2)
    main, argv = (train.main, FLAGS + ["--steps", "3", "--out", out, "--resume"]) if script == "train" else \
        (__import__("evaluate").main, ["--run", out, "--n", "2"])
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = error_lines(capfd.readouterr().err)
    assert not marker.exists(), "unpickling the checkpoint ran its code"
    assert exc.value.code == 2 and len(err) == 1 and ("--resume" in err[0] or "--run" in err[0]), err


def test_an_older_checkpoint_is_refused_until_converted_and_then_resumes_exactly(finished, tmp_path, capfd):
    """A checkpoint of the format before (numpy's generator state pickled as an array, Python's as tuples) is
    refused in one line naming the converting command; converted, it resumes to the numbers of a run that never
    stopped."""
    out = copy_of(finished, tmp_path)
    path = os.path.join(out, "checkpoint.pt")
    state = torch.load(path, weights_only=True)
    n = state["rng"]["numpy"]
    state["rng"]["numpy"] = (n["name"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"])
    version, internal, gauss_next = state["rng"]["python"]
    state["rng"]["python"] = (version, tuple(internal), gauss_next)
    torch.save(state, path)
    with pytest.raises(SystemExit) as exc:
        train.main(FLAGS + ["--steps", "3", "--out", out, "--resume"], score_batch=letter_reward)
    err = error_lines(capfd.readouterr().err)
    assert exc.value.code == 2 and len(err) == 1 and "python -m support.harness.checkpoint" in err[0], err
    subprocess.run([sys.executable, "-m", "support.harness.checkpoint", path], cwd=ROOT, check=True, capture_output=True)
    train.main(FLAGS + ["--steps", "3", "--out", out, "--resume"], score_batch=letter_reward)
    whole = str(tmp_path / "whole")
    train.main(FLAGS + ["--steps", "3", "--out", whole], score_batch=letter_reward)
    for got, want in zip(read_metrics(out), read_metrics(whole)):
        assert all(got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-9) for k in ("reward", "loss", "kl"))
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["steps"] == 3
