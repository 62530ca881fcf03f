"""A user's files are never lost, and evaluation is as careful as training: one regression test per way it went
wrong, on the tiny team.
  1. a folder the user already had: `train.py --out DIR` on a folder that never held a run deleted its
     validation.json and overwrote its samples.jsonl and plot.png (exit 0); a failed first step's clean-up
     removed files without checking that the run wrote them;
  2. evaluate.py took a run's config.json on trust: a negative --max-new-tokens, a 200,000-character prefix or
     deep JSON reached the models (tracebacks, one allocating 4 TB), and a recorded --expert-cache outside the
     run folder was made again and written into;
  3. `evaluate.py --summarize` read a tiny run's base_model/config.json as a run (KeyError: 'method'), died on a
     torn last metrics line, globbed folder names unescaped and printed an empty table for a folder of no run;
  4. the expert cache's writes: a full disk in step 1 gave a WriteFailed traceback (exit 1), and
     --precompute-states with an --expert-cache that is a file failed after the models loaded;
  5. streams: `train.py | head -1`, `> /dev/full` and PYTHONIOENCODING=ascii with a non-ASCII --out ended in
     tracebacks;
  6. --resume adding a precomputed --expert-cache moved weights in their last bits, yet was allowed.

Try it on CPU:  python -m pytest tests/test_user_files.py -q
"""
import errno
import json
import os
import shutil
import subprocess
import sys

import pytest

import evaluate
import train
from support.harness import checkpoint
from test_hardening import FLAGS, RUN_SCRIPT, letter_reward, snapshot
from test_write_safety import copy_of, finished, one_error, one_thread, outside  # noqa: F401 (fixtures)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USERS = {"validation.json": '{"my": "own scores"}\n', "samples.jsonl": "my own samples\n", "plot.png": "my plot"}


def folder_of(tmp_path, files, name="mine"):
    out = tmp_path / name
    out.mkdir()
    for file, text in files.items():
        (out / file).write_text(text)
    return str(out)


def no_model_loads(monkeypatch):
    for where in ("support.harness.build.load_model", "evaluate.load_model", "experts.load_model"):
        monkeypatch.setattr(where, lambda *a, **k: pytest.fail("a model loaded"))


# ----------------------------------------------------------------------------------------------------------
# 1. A folder the user already had


@pytest.mark.parametrize("files", [USERS, {"notes.txt": "mine\n"},
                                   {"config.json": '{"name": "my own"}\n', "samples.jsonl": "mine\n"}],
                         ids=["scores", "notes", "own-config"])
def test_a_folder_that_never_held_a_run_is_refused_and_kept(files, tmp_path, capfd, monkeypatch):
    """The issue's case: exit 0, validation.json deleted, samples.jsonl and plot.png overwritten."""
    out = folder_of(tmp_path, files)
    before = snapshot(out)
    no_model_loads(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        train.main(FLAGS + ["--steps", "1", "--out", out], score_batch=letter_reward)
    line = one_error(capfd)
    assert exc.value.code == 2 and "--out" in line and "no run" in line, line
    assert snapshot(out) == before


def test_an_empty_folder_takes_a_run(tmp_path):
    out = folder_of(tmp_path, {})
    train.main(FLAGS + ["--steps", "1", "--out", out], score_batch=letter_reward)
    assert os.path.isfile(os.path.join(out, "checkpoint.pt"))


def failed_first_step(finished, tmp_path, validation, name):
    """A folder as a run that failed in its first step leaves it: config.json, step 1's samples, and the
    validation before training (`validation`'s text)."""
    out = folder_of(tmp_path, {"validation.json": validation}, name=name)
    shutil.copy(os.path.join(finished, "config.json"), out)
    with open(os.path.join(finished, "samples.jsonl")) as f:
        (tmp_path / name / "samples.jsonl").write_text(f.readline())
    return out


def test_a_failed_first_step_is_cleaned_up_only_where_the_run_wrote(finished, tmp_path, capfd, monkeypatch):
    """Its own samples and validation go (the same command starts again); a validation.json that is not the
    run's stays, and the start is refused in one line naming it."""
    out = failed_first_step(finished, tmp_path, validation='{"my": "own"}', name="foreign")
    before = snapshot(out)
    monkeypatch.setattr("support.harness.build.load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit) as exc:
        train.main(FLAGS + ["--steps", "1", "--eval-items", "2", "--out", out], score_batch=letter_reward)
    line = one_error(capfd)
    assert exc.value.code == 2 and "validation.json" in line, line
    assert snapshot(out) == before
    monkeypatch.undo()
    with open(os.path.join(finished, "validation.json")) as f:
        own = json.dumps({"items": 2, "before": json.load(f)["before"]})
    out = failed_first_step(finished, tmp_path, validation=own, name="own")
    train.main(FLAGS + ["--steps", "1", "--eval-items", "2", "--out", out], score_batch=letter_reward)
    with open(os.path.join(out, "samples.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1] * 4  # the new run's alone


# ----------------------------------------------------------------------------------------------------------
# 2. evaluate.py reads a run's config.json through training's own checks, before any model loads


def edited(finished, tmp_path, change=None, text=None, name="run"):
    out = str(tmp_path / name)
    shutil.copytree(finished, out)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    with open(path, "w") as f:
        f.write(text if text is not None else json.dumps({**cfg, **change}))
    return out


@pytest.mark.parametrize("change,text,named", [
    ({"max_new_tokens": -1}, None, "--max-new-tokens"),
    ({"response_prefix": "x" * 200_000}, None, "--response-prefix"),
    ({"lr": float("nan")}, None, "config.json"),
    ({"warp_drive": 9}, None, "warp_drive"),
    (None, '{"team": ' + "[" * 100_000 + "]" * 100_000 + "}", "config.json"),
    (None, "[1, 2]", "config.json"),
    (None, '{"lr": 0.1}', "config.json"),
], ids=["negative", "long-prefix", "nan", "unknown-key", "deep", "a-list", "no-team-models"])
def test_evaluate_refuses_what_train_refuses_before_any_model_loads(change, text, named, finished, tmp_path, capfd,
                                                                   monkeypatch):
    out = edited(finished, tmp_path, change, text)
    before = snapshot(out)
    no_model_loads(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        evaluate.main(["--run", out, "--n", "2"])
    line = one_error(capfd)
    assert exc.value.code == 2 and named in line and "--run" in line, line
    assert snapshot(out) == before


def test_evaluate_checks_a_run_with_the_function_train_replays_configs_with(finished, monkeypatch):
    """The same function, not a second copy: what checks.replayed_values refuses, evaluate.py refuses."""
    from support.harness import checks
    seen = []
    real = checks.replayed_values
    monkeypatch.setattr(checks, "replayed_values", lambda *a, **k: seen.append(a[1]) or real(*a, **k))
    evaluate.run_config(finished)
    assert seen == [os.path.join(finished, "config.json")]


def test_a_recorded_expert_cache_outside_the_run_is_neither_made_nor_written(finished, tmp_path, capfd):
    gone = tmp_path / "gone" / "cache"
    out = edited(finished, tmp_path, {"expert_cache": str(gone)})
    evaluate.main(["--run", out, "--n", "2"])
    assert not (tmp_path / "gone").exists()
    victim = outside(tmp_path)
    out = edited(finished, tmp_path, {"expert_cache": str(victim)}, name="run-b")
    evaluate.main(["--run", out, "--n", "2"])
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("who", ["--run", "--untrained"])
def test_evaluate_checks_an_expert_cache_named_on_its_command_line(who, finished, tmp_path, capfd, monkeypatch):
    victim = outside(tmp_path)
    argv = ["--run", finished] if who == "--run" else ["--untrained", "--team", "tiny", "--task", "chain_sum",
                                                        "--out", str(tmp_path / "out")]
    no_model_loads(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        evaluate.main(argv + ["--n", "2", "--expert-cache", str(victim)])
    line = one_error(capfd)
    assert exc.value.code == 2 and "--expert-cache" in line and "file" in line, line
    assert victim.read_text() == "precious\n" and not (tmp_path / "out").exists()  # no folder made for a result


# ----------------------------------------------------------------------------------------------------------
# 3. --summarize reads run folders: config.json and metrics.jsonl together


def test_summarize_reads_run_folders_only(finished, tmp_path, capfd):
    """A tiny run exports base_model/config.json (a model's): read as a run it raised KeyError: 'method'. A torn
    last metrics line is skipped as --resume skips it, and a folder named with glob characters is found."""
    top = tmp_path / "runs[1]*"
    shutil.copytree(finished, top / "run")
    with open(top / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rew')  # a run killed while logging
    assert os.path.isfile(top / "run" / "base_model" / "config.json")
    evaluate.main(["--summarize", str(top), "--out", str(tmp_path / "out")])
    assert (tmp_path / "out" / "table.md").exists()
    from support.harness.report import load_runs
    assert [(r["dir"], len(r["metrics"])) for r in load_runs([str(top)])] == [(str(top / "run"), 2)]


def test_summarize_says_when_it_finds_no_run(tmp_path, capfd):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "sub" / "config.json").write_text("{}")  # a config alone is no run
    with pytest.raises(SystemExit) as exc:
        evaluate.main(["--summarize", str(tmp_path / "empty"), "--out", str(tmp_path / "out")])
    line = one_error(capfd)
    assert exc.value.code == 2 and "no run found under" in line, line
    assert not (tmp_path / "out").exists()


def test_summarize_names_a_metrics_line_that_is_not_json(finished, tmp_path, capfd):
    shutil.copytree(finished, tmp_path / "runs" / "run")
    path = tmp_path / "runs" / "run" / "metrics.jsonl"
    path.write_text("{oops\n" + path.read_text())
    with pytest.raises(SystemExit) as exc:
        evaluate.main(["--summarize", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    line = one_error(capfd)
    assert exc.value.code == 2 and "metrics.jsonl" in line, line


# ----------------------------------------------------------------------------------------------------------
# 4. The expert cache: checked on every path, written through the one discipline


def test_precompute_states_checks_its_cache_before_any_model_loads(tmp_path, capfd, monkeypatch):
    victim = outside(tmp_path)
    no_model_loads(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        train.main(FLAGS + ["--steps", "1", "--out", str(tmp_path / "out"), "--precompute-states", "--expert-cache",
                            str(victim)], score_batch=letter_reward)
    line = one_error(capfd)
    assert exc.value.code == 2 and "--expert-cache" in line, line
    assert victim.read_text() == "precious\n" and not (tmp_path / "out").exists()


def full_disk_in_cache(monkeypatch):
    """The expert cache's state files meet a full disk (every other write goes through)."""
    from lib import state_store
    from lib.files import WriteFailed
    real = state_store.whole_write

    def whole_write(path, *a, **k):
        if path.endswith(".pt"):
            raise WriteFailed(path, OSError(errno.ENOSPC, "No space left on device"))
        return real(path, *a, **k)
    monkeypatch.setattr(state_store, "whole_write", whole_write)


@pytest.mark.parametrize("precompute", [False, True], ids=["step", "precompute"])
def test_a_full_disk_under_the_expert_cache_ends_in_one_line(precompute, tmp_path, capfd, monkeypatch):
    full_disk_in_cache(monkeypatch)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        train.main(FLAGS + ["--steps", "1", "--out", str(out), "--expert-cache", str(tmp_path / "cache"),
                            *(["--precompute-states"] if precompute else [])], score_batch=letter_reward)
    line = one_error(capfd)
    assert exc.value.code == 4 and "--expert-cache" in line and "No space left" in line, line
    assert not [n for d, _, ns in os.walk(tmp_path) for n in ns if ".tmp" in n or n == ".lock"]


def test_resume_refuses_an_expert_cache_the_run_did_not_use(finished, tmp_path, capfd, monkeypatch):
    """States read from a cache were computed in other batches (--precompute-states: 64 prompts) and differ from
    the run's in their last bits: adding one on --resume moved weights by 1.5e-8, so it is refused."""
    assert "expert_cache" not in checkpoint.RESUME_MAY_CHANGE
    out = copy_of(finished, tmp_path)
    monkeypatch.setattr("support.harness.build.load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit) as exc:
        train.main(FLAGS + ["--steps", "3", "--eval-items", "2", "--out", out, "--resume", "--expert-cache",
                            str(tmp_path / "cache")], score_batch=letter_reward)
    line = one_error(capfd)
    assert exc.value.code == 2 and "--expert-cache" in line, line


# ----------------------------------------------------------------------------------------------------------
# 5. Streams


STREAM = r"""
import subprocess, sys
how, rest = sys.argv[1], sys.argv[2:]
if how == "head":  # | head -1
    proc = subprocess.Popen([sys.executable, *rest], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
else:  # > /dev/full
    with open("/dev/full", "w") as f:
        proc = subprocess.Popen([sys.executable, *rest], stdout=f, stderr=subprocess.PIPE)
        err = proc.communicate()[1].decode()
print(proc.wait(), err, sep="\n")
"""


@pytest.mark.parametrize("how,code", [("head", 141), ("full", 4)])
def test_a_closed_or_full_stdout_stops_the_run_as_a_signal_does(how, code, tmp_path):
    """`train.py ... | head -1` (BrokenPipeError at step 1's log line) and `> /dev/full` (OSError at the first
    line, "run folder: ..."): one line on stderr, exit 141 (128 + SIGPIPE) or 4, the checkpoint of the step
    kept, and the command that continues; run as the line says it finishes the run."""
    out = str(tmp_path / "out")
    done = subprocess.run([sys.executable, "-c", STREAM, how, "-c", RUN_SCRIPT, *FLAGS, "--steps", "3",
                           "--save-every", "1", "--out", out], capture_output=True, text=True, cwd=ROOT, timeout=600)
    got, _, stderr = done.stdout.partition("\n")
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    assert int(got) == code and len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert "stdout" in errors[0] and not os.path.exists(os.path.join(out, ".lock")), errors[0]
    if how == "head":  # the log line of step 1 failed: its checkpoint was written first
        assert "--resume" in errors[0] and checkpoint.checkpoint_step(os.path.join(out, "checkpoint.pt")) == 1
    else:  # nothing was written yet
        assert "run the same command again" in errors[0] and not os.path.exists(out), errors[0]
    again = subprocess.run([sys.executable, "-c", RUN_SCRIPT, *FLAGS, "--steps", "3", "--save-every", "1", "--out",
                            out, *(["--resume"] if how == "head" else [])], capture_output=True, text=True, cwd=ROOT,
                           timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert checkpoint.checkpoint_step(os.path.join(out, "checkpoint.pt")) == 3


def test_output_that_cannot_be_encoded_is_written_with_replacement_characters(tmp_path):
    out = str(tmp_path / "r\u00e9sum\u00e9")
    done = subprocess.run([sys.executable, "-c", RUN_SCRIPT, *FLAGS, "--steps", "1", "--out", out],
                          capture_output=True, cwd=ROOT, timeout=600, env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert b"run folder: " in done.stdout and b"r?sum?" in done.stdout
    assert os.path.isfile(os.path.join(out, "checkpoint.pt"))
