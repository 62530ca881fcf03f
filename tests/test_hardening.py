"""Hardening of train.py and evaluate.py on the tiny team:
  1. bad input fails at once with one line on stderr naming the flag, exit code 2, no traceback, and --out
     exactly as it was (one table, BAD_INPUT);
  2. a run killed with SIGKILL (after an update, before its log and checkpoint; mid-checkpoint) resumes to the very numbers of a run never killed,
     and a resumed run refuses flags that change the maths;
  3. a non-finite loss or gradient skips the update (weights bit-identical), is counted and logged, and
     --max-bad-steps of them in a row stop the run (exit code 3) with a usable checkpoint.
Untrusted model outputs (item 1 of the issue) are tested in test_rewards.py; here only that train.py counts
scorer failures and goes on."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from support.harness import checkpoint
import evaluate
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--team", "tiny", "--task", "chain_sum", "--device", "cpu", "--dataset-size", "64", "--system-prompt",
         "simple", "--batch-size", "2", "--grad-accum", "1", "--group-size", "4", "--max-new-tokens", "4",
         "--latent-dim", "32", "--num-heads", "4", "--num-latents", "4", "--lr", "3e-2", "--router-lr", "3e-2",
         "--save-every", "2", "--sample-every", "1"]
STEPS = 4
# A subprocess that trains like the in-process runs: the same reward, the same single torch thread.
RUN_SCRIPT = ("import sys, torch; sys.path[:0] = [{root!r}, {tests!r}]; torch.set_num_threads(1); "
              "import train, test_hardening; train.main(sys.argv[1:], score_batch=test_hardening.letter_reward)")
RUN_SCRIPT = RUN_SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
KILL_AT = os.path.join(ROOT, "experiments", "kill_at.py")  # runs a script killed at a chosen point


def letter_reward(items, completions):
    """1 if the completion starts with a lowercase ASCII letter (as test_train.py): signal from step 1, and
    one scorer "timeout" per batch, which train.py must count and get on with."""
    r = [1.0 if c[:1].isascii() and c[:1].islower() else 0.0 for c in completions]
    return r, {"ok": len(r) - 1, "timeout": 1, "no_answer": 2}


def read_metrics(out):
    """metrics.jsonl, checking that it is whole: every line complete JSON, steps 1, 2, ... once each."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        text = f.read()
    assert text == "" or text.endswith("\n"), "torn last line"
    rows = [json.loads(line) for line in text.splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "missing or duplicated steps"
    return rows


def checkpoint_step(path):
    return torch.load(path, map_location="cpu", weights_only=False)["step"]


def snapshot(path):
    """{file: (mtime_ns, sha256)} under path (a folder or a file); None when it does not exist."""
    if not os.path.exists(path):
        return None
    files = [path] if os.path.isfile(path) else [os.path.join(d, n) for d, _, ns in os.walk(path) for n in ns]
    out = {}
    for p in files:
        with open(p, "rb") as f:
            out[os.path.relpath(p, path)] = (os.stat(p).st_mtime_ns, hashlib.sha256(f.read()).hexdigest())
    return out


def same_math(a, b):
    """The config keys a resumed run must keep (everything but checkpoint.RESUME_MAY_CHANGE and the folder)."""
    keys = (set(a) | set(b)) - checkpoint.RESUME_MAY_CHANGE
    return {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, here and in the subprocesses: the same arithmetic in both, and steady timings on a
    busy machine (two threads that wait for each other slow down several-fold when the cores are shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def start_training(out, *extra, kill_at=None):
    """train.main in a subprocess; with kill_at="POINT:STEP" experiments/kill_at.py SIGKILLs it there."""
    launcher = [KILL_AT, kill_at] if kill_at else []
    return subprocess.Popen([sys.executable, *launcher, "-c", RUN_SCRIPT, *FLAGS, "--steps", str(STEPS), "--out", out,
                             *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def start_cli(cmd):
    """Start cmd; a thread collects {"returncode", "stdout", "stderr", "seconds"} the moment it ends."""
    t0, result = time.time(), {}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def collect():
        result["stdout"], result["stderr"] = proc.communicate(timeout=300)
        result["returncode"], result["seconds"] = proc.returncode, time.time() - t0

    thread = threading.Thread(target=collect, daemon=True)
    thread.start()
    return thread, result


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Every subprocess, started at once (each is mostly Python start-up), and meanwhile the reference run:
    {"crash": first killed run (Popen, out), "reference": out, bad-input case id: (thread, result, out,
    snapshot before)}. The reference is one uninterrupted run: the numbers a killed-and-resumed run must
    reproduce, and the finished run that bad-input cases try to damage (each its own copy)."""
    tmp = tmp_path_factory.mktemp("hardening")
    crash = str(tmp / "crash")
    started = {"crash": (start_training(crash, kill_at="step:3"), crash)}

    def launch(cases):
        for case in cases:
            script, kind, args, _, _ = case
            out = prepare(kind, started.get("reference"), tmp_path_factory.mktemp("bad"))
            before = snapshot(out)
            started[case_id(case)] = (*start_cli([sys.executable, f"{script}.py", *argv_of(script, args, out)]),
                                      out, before)

    launch([c for c in BAD_INPUT if c[4] and c[1] == "fresh"])
    started["reference"] = str(tmp / "reference")
    train.main(FLAGS + ["--steps", str(STEPS), "--out", started["reference"]], score_batch=letter_reward)
    launch([c for c in BAD_INPUT if c[4] and c[1] != "fresh"])
    return started


@pytest.fixture(scope="module")
def reference(started):
    return started["reference"]


# ----------------------------------------------------------------------------------------------------------
# 1. Bad input. OUT is a fresh path, or a copy of the reference run ("run"), damaged as the kind says.

def prepare(kind, reference, tmp_path):
    out = str(tmp_path / "out")
    if kind == "file":
        open(out, "w").write("not a folder\n")
    elif kind != "fresh":
        shutil.copytree(reference, out)
    (tmp_path / "a_file").write_text("not a folder\n")  # {file} in a case's arguments
    rows = "".join(json.dumps({"question": f"{i} + 1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(8))
    (tmp_path / "gsm8k.jsonl").write_text(rows)  # {gsm8k}: one file, no test split
    (tmp_path / "gsm8k_bad.jsonl").write_text(rows + "{not json\n" + rows)  # {gsm8k_bad}: line 9 is not JSON
    ckpt = os.path.join(out, "checkpoint.pt")
    if kind == "garbage_checkpoint":
        open(ckpt, "wb").write(b"\x80\x02 not a checkpoint " * 200)
    elif kind == "truncated_checkpoint":  # a torn write, had it not been atomic
        data = open(ckpt, "rb").read()
        open(ckpt, "wb").write(data[:len(data) // 2])
    elif kind == "rank4_checkpoint":  # same config, but the LoRA tensors of a rank-4 run
        state = torch.load(ckpt, weights_only=False)
        state["lora"] = {k: v[:4] if k.endswith("lora_A") else v[:, :4] for k, v in state["lora"].items()}
        torch.save(state, ckpt)
    elif kind == "garbage_config":
        open(os.path.join(out, "config.json"), "w").write('{"task": "chain_s')
    elif kind == "gsm8k_file_run":  # a run trained on one GSM8K file: it has no validation split
        config = json.load(open(os.path.join(out, "config.json")))
        config.update(task="gsm8k", data_path=str(tmp_path / "gsm8k.jsonl"))
        json.dump(config, open(os.path.join(out, "config.json"), "w"))
    elif kind == "garbage_metrics_line":  # not the torn last line of a kill: line 2 of 4
        lines = open(os.path.join(out, "metrics.jsonl")).readlines()
        open(os.path.join(out, "metrics.jsonl"), "w").writelines(lines[:1] + ['{"step": 2, "rew\n'] + lines[2:])
    return out


# (script, what --out holds, arguments, the flag the message must name, how it runs). In-process (False), or in
# a subprocess ("cli"): the real exit path, no usage block, nothing printed but the one line; "hub": a subprocess
# too, that must fail in seconds, not after minutes of download retries (huggingface_hub logs each on stderr).
TRAIN = FLAGS + ["--steps", str(STEPS), "--out", "{out}"]
BAD_INPUT = [
    # unknown names
    ("train", "fresh", ["--team", "nope"], "--team", "cli"),
    ("train", "fresh", ["--method", "nope"], "--method", False),
    ("train", "fresh", ["--pooling", "mean_of_all"], "--pooling", False),
    ("train", "fresh", ["--task", "no_such_task"], "--task", False),
    ("train", "fresh", ["--loss-aggregation", "sum"], "--loss-aggregation", False),
    ("train", "fresh", ["--no-such-flag"], "--no-such-flag", False),
    # numbers: non-positive, not a number, inconsistent
    ("train", "fresh", ["--steps", "0"], "--steps", False),
    ("train", "fresh", ["--steps", "ten"], "--steps", False),
    ("train", "fresh", ["--batch-size", "0"], "--batch-size", False),
    ("train", "fresh", ["--grad-accum", "-1"], "--grad-accum", False),
    ("train", "fresh", ["--group-size", "1"], "--group-size", False),
    ("train", "fresh", ["--max-new-tokens", "0"], "--max-new-tokens", False),
    ("train", "fresh", ["--latent-dim", "30"], "--latent-dim", False),  # not divisible by --num-heads 4
    ("train", "fresh", ["--num-latents", "0"], "--num-latents", False),
    ("train", "fresh", ["--lr", "nan"], "--lr", False),
    ("train", "fresh", ["--temperature", "0"], "--temperature", False),
    ("train", "fresh", ["--router-lr", "-0.0001"], "--router-lr", False),
    ("train", "fresh", ["--beta", "-0.1"], "--beta", False),
    ("train", "fresh", ["--clip-eps", "1.5"], "--clip-eps", False),
    ("train", "fresh", ["--context-anchor", "newline", "--method", "single"], "--context-anchor", False),
    ("train", "fresh", ["--grad-clip", "0"], "--grad-clip", False),
    ("train", "fresh", ["--seed", "-1"], "--seed", False),
    ("train", "fresh", ["--max-bad-steps", "0"], "--max-bad-steps", False),
    ("train", "fresh", ["--expert-depth", "0"], "--expert-depth", False),
    ("train", "fresh", ["--expert-depth", "1.5"], "--expert-depth", False),
    ("train", "fresh", ["--method", "single", "--state-norm", "standardize"], "--state-norm", False),
    ("train", "fresh", ["--tis-cap", "2"], "--tis-cap", False),  # nothing to correct with a float32 rollout
    ("train", "fresh", ["--format-bonus", "-0.1"], "--format-bonus", False),
    ("train", "fresh", ["--dynamic-sampling", "-1"], "--dynamic-sampling", False),
    ("train", "fresh", ["--lr-schedule", "step"], "--lr-schedule", False),
    ("train", "fresh", ["--rollout-dtype", "float16"], "--rollout-dtype", False),
    ("train", "fresh", ["--rollout-dtype", "int8", "--device", "mps"], "--rollout-dtype", False),
    ("train", "fresh", ["--device", "tpu"], "--device", False),
    # models and data that are not there
    ("train", "fresh", ["--policy", "/no/such/model"], "--policy", False),
    ("train", "fresh", ["--experts", "tiny:qwen2,./no/such.gguf"], "--experts", False),
    ("train", "fresh", ["--policy", "Qwen/Qwen2.5-3B-Instruct"], "--policy", "hub"),  # no network here
    ("train", "fresh", ["--team", "default"], "--team", "hub"),
    ("train", "fresh", ["--task", "gsm8k", "--data-path", "/no/such.jsonl"], "--data-path", False),
    ("train", "fresh", ["--data-path", ROOT], "--data-path", False),  # chain_sum does not read it
    ("train", "fresh", ["--task", "gsm8k", "--data-path", "{gsm8k}", "--eval-items", "2"], "--data-path",
     False),  # one file: validation would score training items
    ("train", "fresh", ["--task", "gsm8k", "--data-path", "{gsm8k_bad}"], "--data-path", False),
    ("train", "fresh", ["--task", "gsm8k", "--data-path", ROOT], "--data-path", False),  # no train.jsonl
    ("train", "fresh", ["--dataset-size", "100000000"], "--dataset-size", False),
    ("train", "fresh", ["--seed", "99999999999"], "--seed", False),  # numpy's seeds are 32-bit
    ("train", "fresh", ["--experts", "tiny:qwen2,"], "--experts", False),
    ("train", "fresh", ["--expert-cache", "{file}"], "--expert-cache", False),
    # numbers that cannot work in float32, where LoRA, g_phi and AdamW's state live
    ("train", "fresh", ["--adam-eps", "1e-50"], "--adam-eps", False),
    ("train", "fresh", ["--lr", "1e39"], "--lr", False),
    ("train", "fresh", ["--method", "single", "--experts", "tiny:gpt2"], "--experts", False),  # has none
    # the output folder
    ("train", "file", [], "--out", False),
    ("train", "fresh", ["--out", "{file}/out"], "--out", False),  # inside a file
    ("train", "fresh", ["--out", "/proc/no-such-folder/out"], "--out", False),  # looks writable, is not
    ("train", "fresh", ["--out", ""], "--out", False),
    ("train", "run", [], "--out", False),  # holds a run, no --resume: nothing overwritten
    ("train", "fresh", ["--resume"], "--resume", False),
    ("train", "garbage_checkpoint", ["--resume"], "--resume", "cli"),
    ("train", "truncated_checkpoint", ["--resume"], "--resume", False),
    ("train", "rank4_checkpoint", ["--resume"], "--resume", False),
    ("train", "garbage_config", ["--resume"], "--resume", False),
    ("train", "run", ["--resume", "--num-latents", "8"], "--num-latents", False),  # would change the maths
    ("train", "run", ["--resume", "--lora-rank", "4"], "--lora-rank", False),
    ("train", "run", ["--resume", "--method", "no_xattn"], "--method", False),
    ("train", "run", ["--resume", "--group-size", "8"], "--group-size", False),
    ("train", "run", ["--resume", "--steps", "3"], "--steps", False),  # below the checkpoint's step 4
    ("train", "garbage_metrics_line", ["--resume", "--steps", "5"], "line 2 of", False),  # not dropped quietly
    # evaluate.py
    ("evaluate", "run", ["--run", "{out}", "--n", "0"], "--n", False),
    ("evaluate", "run", ["--run", "{out}", "--batch-size", "0"], "--batch-size", False),
    ("evaluate", "run", ["--run", "{out}", "--untrained"], "--run", False),  # two modes at once
    ("evaluate", "fresh", ["--run", "{out}"], "--run", False),
    ("evaluate", "garbage_checkpoint", ["--run", "{out}", "--n", "2"], "--run", False),
    ("evaluate", "garbage_config", ["--run", "{out}", "--n", "2"], "--run", False),
    ("evaluate", "run", ["--run", "{out}", "--n", "2", "--out", "{file}"], "--out", False),  # before evaluating
    ("evaluate", "gsm8k_file_run", ["--run", "{out}", "--n", "2"], "--run", False),  # would score training items
    ("evaluate", "run", ["--run", "{out}", "--n", "2", "--out", "{file}/x"], "--out", False),
    ("evaluate", "fresh", ["--untrained", "--team", "tiny", "--task", "no_such_task", "--out", "{out}"], "--task",
     False),
    ("evaluate", "fresh", ["--untrained", "--team", "tiny", "--task", "chain_sum", "--policy", "/no/such",
                           "--out", "{out}"], "--policy", False),
    ("evaluate", "fresh", ["--untrained", "--team", "default", "--task", "chain_sum", "--out", "{out}"], "--team",
     "hub"),
    ("evaluate", "fresh", ["--summarize", "{out}"], "--summarize", False),
]
# --device cuda is bad input only where there is no CUDA: on a GPU machine these cases do not exist
if not torch.cuda.is_available():
    BAD_INPUT += [("train", "fresh", ["--device", "cuda"], "--device", False),
                  ("evaluate", "run", ["--run", "{out}", "--device", "cuda"], "--device", False)]


def case_id(case):
    script, kind, args, _, sub = case
    args = " ".join(a.replace(ROOT, "ROOT") for a in args if a != "{out}")
    return f"{script}-{kind}-{args}" + ("-subprocess" if sub else "")


def argv_of(script, args, out):
    """train.py gets the reference run's flags, then the case's (argparse: the last one wins). {file},
    {gsm8k} and {gsm8k_bad} are prepare's files beside OUT."""
    here = os.path.dirname(out)
    return [a.replace("{out}", out).replace("{file}", os.path.join(here, "a_file"))
            .replace("{gsm8k}", os.path.join(here, "gsm8k.jsonl"))
            .replace("{gsm8k_bad}", os.path.join(here, "gsm8k_bad.jsonl"))
            for a in (TRAIN if script == "train" else []) + args]


def finished(started, key):
    """(returncode, stdout, stderr, seconds it ran, snapshot before, snapshot after) of a subprocess case."""
    thread, result, out, before = started[key]
    thread.join()
    return result["returncode"], result["stdout"], result["stderr"], result["seconds"], before, snapshot(out)


@pytest.mark.parametrize("case", BAD_INPUT, ids=case_id)
def test_bad_input_fails_fast_in_one_line_and_writes_nothing(case, reference, started, tmp_path, capfd):
    script, kind, args, flag, sub = case
    if sub:
        code, stdout, stderr, seconds, before, after = finished(started, case_id(case))
        if sub == "hub":  # compare with a case started with it that fails in argparse: mostly Python start-up
            baseline = finished(started, case_id(BAD_INPUT[0]))[3]
            assert seconds < baseline + 15, (seconds, baseline)
    else:
        out = prepare(kind, reference, tmp_path)
        before = snapshot(out)
        main = train.main if script == "train" else evaluate.main
        with pytest.raises(SystemExit) as exc:
            main(argv_of(script, args, out))
        code, after = exc.value.code, snapshot(out)
        stdout, stderr = capfd.readouterr()
    lines = stderr.strip().splitlines()
    assert code == 2, stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-2000:]
    assert flag in lines[0], lines[0]
    assert after == before  # nothing created, overwritten or half-written in --out


@pytest.mark.parametrize("script", ["conductor", "rlae"])
def test_a_neighbours_evaluate_refuses_a_train_py_run_in_one_line(script, reference, capfd):
    """A neighbour's `evaluate --run` of a train.py run built it as its own and died in an AttributeError
    traceback (no max_workflow_steps): it names the script that evaluates it instead."""
    import importlib
    neighbour = importlib.import_module(f"neighbours.{script}")
    with pytest.raises(SystemExit) as exc:
        neighbour.main(["evaluate", "--run", reference, "--n", "2"])
    err = capfd.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "python evaluate.py --run" in err[0], err


def test_help_still_works(capsys):
    with pytest.raises(SystemExit) as exc:
        train.main(["--help"])
    assert exc.value.code == 0 and "--max-bad-steps" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------------
# 2. Crashes


def test_killed_runs_resume_to_the_numbers_of_an_uninterrupted_run(started, reference):
    proc, out = started["crash"]
    ckpt = os.path.join(out, "checkpoint.pt")
    # Killed while sampling step 3: the checkpoint of step 2 and two metric lines survive.
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL, stderr[-2000:]
    assert checkpoint_step(ckpt) == 2 and len(read_metrics(out)) == 2
    with open(os.path.join(out, "config.json")) as f:
        config_first = json.load(f)
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('{"step": 3, "reward": 0.1')  # what a kill in the middle of a write would leave
    # Killed while saving step 4: written to the temporary file, not yet renamed. checkpoint.pt is the old
    # one, whole; the new one is whole in the temporary file; the metrics are ahead of the checkpoint.
    proc = start_training(out, "--resume", kill_at="checkpoint:4")
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL, stderr[-2000:]
    assert checkpoint_step(ckpt) == 2
    tmp = [n for n in os.listdir(out) if n.startswith("checkpoint.pt.tmp")]
    assert len(tmp) == 1 and checkpoint_step(os.path.join(out, tmp[0])) == 4
    assert len(read_metrics(out)) == 4  # the torn line is gone, steps 3 and 4 were logged once
    # Resumed to the end: steps 3 and 4 again, from the checkpoint of step 2.
    proc = start_training(out, "--resume")
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-2000:]
    assert checkpoint_step(ckpt) == STEPS and not [n for n in os.listdir(out) if ".tmp" in n]
    got, want = read_metrics(out), read_metrics(reference)
    assert len(got) == len(want) == STEPS
    for g, w in zip(got, want):
        for k in ("reward", "loss", "kl", "entropy", "grad_norm", "completion_length"):
            assert g[k] == pytest.approx(w[k], rel=1e-6, abs=1e-9), (k, g["step"])
    assert any(w["kl"] > 0 for w in want) and len({w["grad_norm"] for w in want}) > 1  # the numbers moved
    with open(os.path.join(out, "config.json")) as f:
        config_last = json.load(f)
    with open(os.path.join(reference, "config.json")) as f:
        config_reference = json.load(f)
    assert same_math(config_first, config_last) and same_math(config_last, config_reference)
    # Samples were truncated with the metrics: no step twice.
    with open(os.path.join(out, "samples.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == sorted(steps) and len(steps) == 4 * STEPS


def test_a_run_killed_before_its_first_checkpoint_resumes_from_step_0(reference, tmp_path):
    out = str(tmp_path / "early")
    shutil.copytree(reference, out)
    os.remove(os.path.join(out, "checkpoint.pt"))  # as if killed in step 2, before the first save
    with open(os.path.join(out, "metrics.jsonl"), "r+") as f:
        f.truncate(len(f.readline()) + 7)  # step 1, and a torn line
    train.main(FLAGS + ["--steps", "1", "--out", out, "--resume"], score_batch=letter_reward)
    (got,), want = read_metrics(out), read_metrics(reference)[0]
    assert all(got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-9) for k in ("reward", "loss", "kl", "entropy"))
    assert checkpoint_step(os.path.join(out, "checkpoint.pt")) == 1


# ----------------------------------------------------------------------------------------------------------
# 3. Numerical faults, injected into grpo.grpo_loss: a NaN loss, or a finite loss whose gradient is NaN.


def inject_faults(monkeypatch, faults):
    """faults: {step: "loss" | "grad"}. Also records the trainable weights at every checkpoint."""
    import grpo
    from lora import lora_state_dict
    from support.harness import run
    real_loss, real_save, calls, saved = grpo.grpo_loss, run.save_checkpoint, [0], {}

    def grpo_loss(logp, *args, **kwargs):  # one call per step here: --grad-accum 1, --inner-epochs 1
        calls[0] += 1
        fault = faults.get(calls[0])
        if fault == "grad":
            logp = logp + 0  # a fresh node, so the hook sees only this step's gradient
            logp.register_hook(lambda g: torch.full_like(g, float("nan")))
        loss, metrics = real_loss(logp, *args, **kwargs)
        return (loss * float("nan"), metrics) if fault == "loss" else (loss, metrics)

    def save_checkpoint(path, step, policy, method, optimizer, pool):
        saved[step] = {**lora_state_dict(policy), **{k: v.clone() for k, v in method.state_dict().items()}}
        real_save(path, step, policy, method, optimizer, pool)

    monkeypatch.setattr(grpo, "grpo_loss", grpo_loss)
    monkeypatch.setattr(run, "save_checkpoint", save_checkpoint)
    return saved


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_non_finite_step_is_skipped_counted_and_logged(monkeypatch, tmp_path, capfd):
    saved = inject_faults(monkeypatch, {2: "loss", 3: "grad"})
    out = str(tmp_path / "nan")
    train.main(FLAGS + ["--steps", "4", "--save-every", "1", "--out", out], score_batch=letter_reward)
    rows = read_metrics(out)
    assert [r["skipped_update"] for r in rows] == [False, True, True, False]
    assert same_weights(saved[1], saved[2]) and same_weights(saved[2], saved[3])  # bit-identical
    assert not same_weights(saved[3], saved[4])  # and training goes on
    assert capfd.readouterr().out.count("update skipped: non-finite loss, gradient or weights") == 2  # step lines
    assert all(r["scorer_failures"] == 1 for r in rows)  # the timeout, not the two missing answers
    with open(os.path.join(out, "metrics.jsonl")) as f:  # strict JSON: the NaN loss is written as null
        assert all(json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl")) for line in f)
    assert rows[1]["loss"] is None


def test_max_bad_steps_stops_the_run_with_a_usable_checkpoint(monkeypatch, tmp_path, capfd):
    saved = inject_faults(monkeypatch, {s: "loss" for s in range(2, 10)})
    out = str(tmp_path / "nan")
    with pytest.raises(SystemExit) as exc:
        train.main(FLAGS + ["--steps", "6", "--max-bad-steps", "2", "--out", out], score_batch=letter_reward)
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error: ")]
    assert exc.value.code == 3 and len(err) == 1 and "--max-bad-steps" in err[0], err
    assert [r["skipped_update"] for r in read_metrics(out)] == [False, True, True]
    ckpt = os.path.join(out, "checkpoint.pt")
    assert checkpoint_step(ckpt) == 3 and same_weights(saved[3], saved[2])
    monkeypatch.undo()  # the fault is gone: the run resumes from its last good weights and finishes
    train.main(FLAGS + ["--steps", "4", "--max-bad-steps", "2", "--out", out, "--resume"], score_batch=letter_reward)
    assert [r["skipped_update"] for r in read_metrics(out)] == [False, True, True, False]
