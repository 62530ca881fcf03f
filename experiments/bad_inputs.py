"""
Bad inputs and faults, tried as a new user and a hostile one would, on the tiny team: each case's command, exit
code, first line on stderr, what it left in --out and its time, as a Markdown table; then the chaos run.

    OMP_NUM_THREADS=1 taskset -c 1 python experiments/bad_inputs.py --out results/bad_inputs.md   # ~40 min, 1 core

What a case must show (README, "When things go wrong"): bad input exits with code 2 and one line `error: ...` that
names the flag, before any model loads, and --out is as it was; a write the system refuses (a full tmpfs) exits
with code 4 in one line, no temporary file or lock left; a link planted in a run folder is never written through
(a file outside keeps its text); Ctrl-C exits with 130 and SIGTERM with 143 (train.py, evaluate.py, the
neighbours), in one line whose command, run as printed, finishes the run; a run folder has one writer at a time.
The `ok` column checks exactly that for each case. The chaos run (--chaos N): a smoke run killed N times at random
moments (SIGKILL, SIGTERM, in checkpoint writes, in validation) and resumed each time must end bit-identical to an
uninterrupted run with no stray file (chaos, differences; tests/test_chaos.py runs 4 kills). The table is the
record; tests/test_hardening.py, tests/test_run_safety.py and tests/test_write_safety.py are the tests.

Nothing here is in the paper. Every case runs in a scratch folder (--work, deleted first) with HF_HUB_OFFLINE=1;
the full-disk cases mount a tmpfs in a user namespace (unshare), as an unprivileged user may.
"""
import argparse
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILL_AT = os.path.join(ROOT, "experiments", "kill_at.py")  # a run killed at a chosen point (step, checkpoint, ...)
SMOKE = ["--preset", "smoke", "--eval-items", "0", "--steps", "1"]
GSM8K_ROW = {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2 + 3 = 5\n#### 5"}


def fixtures(work):
    """The files and folders the cases point at: a plain file, a finished tiny run, GSM8K files."""
    os.makedirs(work)
    paths = {"file": os.path.join(work, "a_file"), "run": os.path.join(work, "finished_run"),
             "gsm8k_file": os.path.join(work, "gsm8k.jsonl"), "gsm8k_dir": os.path.join(work, "gsm8k"),
             "gsm8k_bad": os.path.join(work, "gsm8k_bad.jsonl"), "gsm8k_keys": os.path.join(work, "keys.jsonl")}
    with open(paths["file"], "w") as f:
        f.write("not a folder\n")
    rows = "".join(json.dumps(GSM8K_ROW) + "\n" for _ in range(8))
    with open(paths["gsm8k_file"], "w") as f:
        f.write(rows)
    os.makedirs(paths["gsm8k_dir"])
    with open(os.path.join(paths["gsm8k_dir"], "test.jsonl"), "w") as f:
        f.write(rows)  # a folder without train.jsonl
    with open(paths["gsm8k_bad"], "w") as f:
        f.write(rows + "{not json\n" + rows)
    with open(paths["gsm8k_keys"], "w") as f:
        f.write('{"question": "1 + 1?"}\n')
    subprocess.run([sys.executable, "train.py", *SMOKE, "--steps", "2", "--save-every", "1", "--out", paths["run"]],
                   cwd=ROOT, capture_output=True, check=True)
    # the cases of the write-safety round: a file outside every run folder, data and configs too large
    paths["victim"] = os.path.join(work, "victim.txt")
    for name, question in (("gsm8k_1mb", "1 + " * 250_000 + "1?"), ("gsm8k_5k", "1 + " * 1250 + "1?")):
        paths[name] = os.path.join(work, name)
        os.makedirs(paths[name])
        for split in ("train", "test"):
            with open(os.path.join(paths[name], f"{split}.jsonl"), "w") as f:
                f.write((json.dumps({"question": question, "answer": "#### 5"}) + "\n") * 4)
    configs = {"config_2mb": {"response_prefix": "x" * 2_000_000}, "config_nan": {"lr": float("nan")},
               "config_nul": {"response_prefix": "a\u0000b"}}
    for name, value in configs.items():
        paths[name] = os.path.join(work, name + ".json")
        with open(paths[name], "w") as f:
            json.dump(value, f)
    paths["config_deep"] = os.path.join(work, "config_deep.json")
    with open(paths["config_deep"], "w") as f:
        f.write('{"team": ' + "[" * 100_000 + "]" * 100_000 + "}")
    paths["config_spaces"] = os.path.join(work, "config_spaces.json")
    with open(paths["config_spaces"], "w") as f:
        f.write(" " * 2_000_000 + "{}")
    for name in ("fifo", "fifo_data"):
        paths[name] = os.path.join(work, name)
        os.mkfifo(paths[name])
    paths["cache"] = os.path.join(work, "cache")  # an --expert-cache the finished run's flags filled
    subprocess.run([sys.executable, "train.py", *SMOKE, "--out", os.path.join(work, "cache_run"), "--expert-cache",
                    paths["cache"]], cwd=ROOT, capture_output=True, check=True)
    return paths


def users_folder(p, name, files):
    """A folder of the user's own, never a run: {file name: text}."""
    out = os.path.join(os.path.dirname(p["run"]), name)
    os.makedirs(out)
    for file, text in files.items():
        with open(os.path.join(out, file), "w") as f:
            f.write(text)
    return out


USERS = {"validation.json": '{"my": "own scores"}\n', "samples.jsonl": "my own samples\n", "plot.png": "my plot"}


def failed_first_step(p, name, validation=None):
    """What a run that failed before its first step leaves: its config.json and the samples of step 1 (and,
    with `validation`, a validation.json of that text)."""
    out = os.path.join(os.path.dirname(p["run"]), name)
    os.makedirs(out)
    shutil.copy(os.path.join(p["run"], "config.json"), out)
    with open(os.path.join(p["run"], "samples.jsonl")) as f, open(os.path.join(out, "samples.jsonl"), "w") as g:
        g.write(f.readline())
    if validation is not None:
        with open(os.path.join(out, "validation.json"), "w") as f:
            f.write(validation)
    return out


def edited_run(p, name, change=None, text=None):
    """A copy of the finished run whose config.json has `change` (a dict merged in), or is `text`."""
    out = copy_run(p, name)
    path = os.path.join(out, "config.json")
    if change is not None:
        with open(path) as f:
            cfg = json.load(f)
        with open(path, "w") as f:
            json.dump({**cfg, **change}, f)
    else:
        with open(path, "w") as f:
            f.write(text)
    return out


def torn_runs(p, name, torn=True, glob_name=False):
    """A folder of runs for --summarize: a copy of the finished run whose metrics.jsonl ends in a torn line (or,
    torn=False, holds a line that is not JSON in the middle), in a folder whose name holds glob characters."""
    top = os.path.join(os.path.dirname(p["run"]), name + ("[1]*" if glob_name else ""))
    shutil.copytree(p["run"], os.path.join(top, "run"))
    path = os.path.join(top, "run", "metrics.jsonl")
    with open(path) as f:
        lines = f.readlines()
    with open(path, "w") as f:
        f.writelines(lines + ['{"step": 3, "rew'] if torn else ["{oops\n"] + lines)
    return top


def victim(p):
    """(Re)write the file outside every run folder that no case may change."""
    with open(p["victim"], "w") as f:
        f.write("precious\n")
    return p["victim"]


def planted(p, name, kind, what="link"):
    """A copy of the finished run (or, for kind "fresh", an empty folder) with `what` planted under `name`: a
    symbolic link to the victim file (or to a folder outside), a hard link to it, a named pipe."""
    out = os.path.join(os.path.dirname(p["run"]), f"planted-{name.strip('.')}-{what}-{kind}")
    if kind == "fresh":
        os.makedirs(out)
    else:
        shutil.copytree(p["run"], out)
    path = os.path.join(out, name)
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)
    if what == "link":
        os.symlink(victim(p) if name != "lora_peft" else os.path.dirname(p["victim"]), path)
    elif what == "hardlink":
        os.link(victim(p), path)
    else:
        os.mkfifo(path)
    return out


def damaged_checkpoint(p, kind):
    """A copy of the finished run whose checkpoint is damaged as `kind` says."""
    import torch
    out = copy_run(p, f"ckpt-{kind.replace(' ', '_')}")
    ckpt = os.path.join(out, "checkpoint.pt")
    if kind == "empty":
        open(ckpt, "wb").close()
    elif kind == "truncated":
        with open(ckpt, "rb") as f:
            data = f.read()
        with open(ckpt, "wb") as f:
            f.write(data[:len(data) // 3])
    elif kind == "a folder":
        os.remove(ckpt)
        os.mkdir(ckpt)
    else:
        state = torch.load(ckpt, weights_only=True)
        if kind == "newer format":
            state["format"] = 99
        elif kind == "foreign":
            state = {"model": torch.zeros(3), "epoch": 7}
        elif kind == "rank 4":
            state["lora"] = {k: v[:4] if k.endswith("lora_A") else v[:, :4] for k, v in state["lora"].items()}
        torch.save(state, ckpt)
    return out


def damaged_cache(p, kind):
    """A copy of the expert cache: a width file that is not a number, or every state file truncated."""
    out = os.path.join(os.path.dirname(p["cache"]), f"cache-{kind}")
    shutil.copytree(p["cache"], out)
    for name in os.listdir(out):
        path = os.path.join(out, name)
        if kind.startswith("width") and name.endswith(".width"):
            with open(path, "w") as f:
                f.write("lots")
        elif kind == "states" and name.endswith(".pt"):
            with open(path, "r+b") as f:
                f.truncate(10)
    return out


# A run on a small tmpfs (mounted in a user namespace, as a user may): `python -c TMPFS ...` runs train.py there
# and exits with its code, or 99 when the run left a temporary file or its lock behind.
TMPFS = r"""
import os, subprocess, sys
mnt, size, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
os.makedirs(mnt, exist_ok=True)
placed = any("@MNT" in x for x in rest)  # a path on the tmpfs given in the flags (else --out is there)
rest = [x.replace("@MNT", mnt) for x in rest]
script = (f'mount -t tmpfs -o size={size} tmpfs {mnt} && "$0" train.py "$@" {"" if placed else f"--out {mnt}/run"}; '
          f'code=$?; ls -aR {mnt} | grep -q -e "\.tmp" -e "^\.lock$" && exit 99; exit $code')
sys.exit(subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, sys.executable,
                         *rest]).returncode)
"""


# train.py with its stdout a pipe whose reader ends after the first line (`| head -1`), or the full device
# (`> /dev/full`); exits with the run's code.
STREAM = r"""
import subprocess, sys
how, rest = sys.argv[1], sys.argv[2:]
if how == "head":
    proc = subprocess.Popen([sys.executable, *rest], stdout=subprocess.PIPE)
    print(proc.stdout.readline().decode().strip(), file=sys.stderr)
    proc.stdout.close()
    sys.exit(proc.wait())
with open("/dev/full", "w") as f:
    sys.exit(subprocess.run([sys.executable, *rest], stdout=f).returncode)
"""


def copy_run(p, name, damage=None):
    """A copy of the finished run, damaged: a middle line of metrics.jsonl that is not JSON, or a checkpoint
    that is a pickle which runs code when loaded with weights_only=False."""
    out = os.path.join(os.path.dirname(p["run"]), name)
    shutil.copytree(p["run"], out)
    if damage == "metrics_line":
        with open(os.path.join(out, "metrics.jsonl")) as f:
            lines = f.readlines()
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.writelines(["{oops\n"] + lines)
    elif damage == "pickle":
        marker = os.path.join(os.path.dirname(out), "PWNED")
        code = f"import os; os.system('touch {marker}')"
        with open(os.path.join(out, "checkpoint.pt"), "wb") as f:
            f.write(b"cbuiltins\nexec\n(V" + code.encode() + b"\ntR.")  # pickle protocol 0: exec(code)
    return out


def cases(p, work):
    """(name, argv after `python`, the flag the error must name or None, --out to watch, expected exit code).
    OUT is a fresh folder name in each case."""
    out = os.path.join(work, "out-OUT")
    T = ["train.py", *SMOKE]
    return [
        ("--out inside a file", T + ["--out", p["file"] + "/x"], "--out", p["file"] + "/x", 2),
        ("--out is a file", T + ["--out", p["file"]], "--out", p["file"], 2),
        ("--out cannot be created", T + ["--out", "/proc/nmusk/x"], "--out", "/proc/nmusk/x", 2),
        ("--out in a read-only place", T + ["--out", "/sys/nmusk"], "--out", "/sys/nmusk", 2),
        ("--out empty", T + ["--out", ""], "--out", out, 2),
        ("--expert-cache is a file", T + ["--out", out, "--expert-cache", p["file"]], "--expert-cache", out, 2),
        ("--expert-cache cannot be created", T + ["--out", out, "--expert-cache", "/sys/nmusk"], "--expert-cache",
         out, 2),
        ("--dataset-size too large", T + ["--out", out, "--dataset-size", "100000000"], "--dataset-size", out, 2),
        ("--seed too large for numpy", T + ["--out", out, "--seed", "99999999999"], "--seed", out, 2),
        ("--experts with an empty name", T + ["--out", out, "--experts", "tiny:qwen2,"], "--experts", out, 2),
        ("--experts only commas", T + ["--out", out, "--experts", ","], "--experts", out, 2),
        ("--policy is a file, not a model", T + ["--out", out, "--policy", p["file"]], "--policy", out, 2),
        ("--policy unknown tiny name", T + ["--out", out, "--policy", "tiny:nope"], "--policy", out, 2),
        ("--adam-eps rounds to 0 in float32", T + ["--out", out, "--adam-eps", "1e-50"], "--adam-eps", out, 2),
        ("--lr overflows float32", T + ["--out", out, "--lr", "1e39"], "--lr", out, 2),
        ("--temperature rounds to 0 in float32", T + ["--out", out, "--temperature", "1e-46"], "--temperature",
         out, 2),
        ("--task-config not JSON", T + ["--out", out, "--task-config", "{oops"], "--task-config", out, 2),
        ("--task-config a list", T + ["--out", out, "--task-config", "[1]"], "--task-config", out, 2),
        ("--resume where no run is", T + ["--out", out, "--resume"], "--resume", out, 2),
        ("--eval-items above a split's size", T + ["--out", out, "--eval-items", "100000000"], "--eval-items", out, 2),
        ("gsm8k: one .jsonl file with --eval-items", T + ["--out", out, "--task", "gsm8k", "--data-path",
                                                          p["gsm8k_file"], "--eval-items", "2"], "--data-path", out, 2),
        ("gsm8k: folder without train.jsonl", T + ["--out", out, "--task", "gsm8k", "--data-path", p["gsm8k_dir"]],
         "--data-path", out, 2),
        ("gsm8k: a line that is not JSON", T + ["--out", out, "--task", "gsm8k", "--data-path", p["gsm8k_bad"]],
         "--data-path", out, 2),
        ("gsm8k: a row without answer", T + ["--out", out, "--task", "gsm8k", "--data-path", p["gsm8k_keys"]],
         "--data-path", out, 2),
        ("--resume: a metrics line that is not JSON", T + ["--steps", "3", "--resume", "--out",
                                                           copy_run(p, "bad_metrics", "metrics_line")], "metrics.jsonl",
         os.path.join(work, "bad_metrics"), 2),
        ("--resume: a checkpoint that is a code-running pickle", T + ["--steps", "3", "--resume", "--out",
                                                                      copy_run(p, "pickle", "pickle")], "--resume",
         os.path.join(work, "pickle"), 2),
        ("--out held by a live run's lock", T + ["--out", os.path.join(work, "locked")], "--out",
         os.path.join(work, "locked"), 2),
        ("evaluate.py --out is a file", ["evaluate.py", "--run", p["run"], "--n", "2", "--out", p["file"]], "--out",
         p["run"], 2),
        ("evaluate.py --out inside a file", ["evaluate.py", "--run", p["run"], "--n", "2", "--out",
                                             p["file"] + "/x"], "--out", p["run"], 2),
        ("evaluate.py --run is a file", ["evaluate.py", "--run", p["file"], "--n", "2"], "--run", out, 2),
        ("evaluate.py --untrained, --out a file", ["evaluate.py", "--untrained", "--team", "tiny", "--task",
                                                   "chain_sum", "--n", "2", "--out", p["file"]], "--out", out, 2),
        ("evaluate.py --summarize, --out a file", ["evaluate.py", "--summarize", p["run"], "--out", p["file"]],
         "--out", out, 2),
        ("evaluate.py --run with a code-running pickle", ["evaluate.py", "--run", copy_run(p, "pickle2", "pickle"),
                                                          "--n", "2"], "--run", os.path.join(work, "pickle2"), 2),
        ("conductor: --out inside a file", ["neighbours/conductor.py", *SMOKE, "--out", p["file"] + "/x"], "--out",
         p["file"] + "/x", 2),
        ("rlae: --expert-cache is a file", ["neighbours/rlae.py", *SMOKE, "--out", out, "--expert-cache", p["file"]],
         "--expert-cache", out, 2),
        ("conductor evaluate: --run of a train.py run", ["neighbours/conductor.py", "evaluate", "--run", p["run"],
                                                         "--n", "2"], "--run", p["run"], 2),
        ("SIGINT (Ctrl-C) during training", T + ["--steps", "40", "--save-every", "2", "--out",
                                                 os.path.join(work, "sigint")], "--resume", None, 130),
        ("SIGTERM during training", T + ["--steps", "40", "--save-every", "2", "--out", os.path.join(work, "sigterm")],
         "--resume", None, 143),
    ] + write_safety_cases(p, work, T, out) + user_files_cases(p, work, T, out)


def write_safety_cases(p, work, T, out):
    """The write-safety round's cases (links, full disks, inputs too large, damaged checkpoints and caches,
    signals everywhere): as cases() has them, with a sixth element of options: `victim` (a file outside that must
    keep its text), `exit0` (a run that must finish: exit 0, no `error:` line), `signal` ((signal, the stdout
    line that triggers it) or a kill point (POINT:STEP:SIGNAL, experiments/kill_at.py)), `show` (the command as the
    table shows it)."""
    R = T + ["--steps", "3", "--resume", "--out"]
    V = {"victim": p["victim"]}
    fresh = os.path.join(work, "fresh-OUT")
    tmpfs = os.path.join(work, "tmpfs-OUT")
    cases = [
        # writes stay in the run folder: a link planted under each name a run writes
        *[(f"--resume: {name} is a symbolic link out of the folder", R + [planted(p, name, "run")], "--out",
           os.path.join(work, f"planted-{name.strip('.')}-link-run"), 2, V)
          for name in ("config.json", "metrics.jsonl", "samples.jsonl", "checkpoint.pt", "validation.json",
                       "g_phi.safetensors", "plot.png", ".lock", "lora_peft")],
        ("a fresh --out holding .lock as a link to a file outside", T + ["--out", planted(p, ".lock", "fresh")],
         "--out", os.path.join(work, "planted-lock-link-fresh"), 2, V),
        ("a fresh --out holding config.json.tmp as a link (the old temporary name)",
         T + ["--out", planted(p, "config.json.tmp", "fresh")], None, None, 0, {**V, "exit0": True}),
        ("--resume: metrics.jsonl is a hard link to a file outside", R + [planted(p, "metrics.jsonl", "run", "hardlink")],
         "metrics.jsonl", os.path.join(work, "planted-metrics.jsonl-hardlink-run"), 2, V),
        ("--resume: samples.jsonl is a named pipe", R + [planted(p, "samples.jsonl", "run", "fifo")], "--out",
         os.path.join(work, "planted-samples.jsonl-fifo-run"), 2),
        ("--out is a symbolic link to another folder", T + ["--out", os.path.join(work, "out-link")], "--out",
         os.path.join(work, "out-link"), 2),
        ("evaluate.py --run: eval.json.tmp planted as a link (the issue's case)",
         ["evaluate.py", "--run", planted(p, "eval.json.tmp", "run"), "--n", "2"], None, None, 0, {**V, "exit0": True}),
        ("evaluate.py --run: eval.json is a link to a file outside",
         ["evaluate.py", "--run", planted(p, "eval.json", "run"), "--n", "2"], "--run",
         os.path.join(work, "planted-eval.json-link-run"), 2, V),
        # a full disk: a real one, a tmpfs in a user namespace
        ("a full disk at the second checkpoint (tmpfs 20 MB, checkpoints 14 MB)",
         ["-c", TMPFS, tmpfs, "20m", *SMOKE[:-2], "--steps", "3", "--save-every", "1"], "--resume", None, 4,
         {"show": "train.py --preset smoke --eval-items 0 --steps 3 --save-every 1 --out TMPFS(20m)"}),
        ("a full disk at the first checkpoint (tmpfs 5 MB)",
         ["-c", TMPFS, tmpfs, "5m", *SMOKE], "run the same command again", None, 4,
         {"show": "train.py --preset smoke --eval-items 0 --steps 1 --out TMPFS(5m)"}),
        # inputs too large
        ("gsm8k: a 1 MB question", T + ["--out", out, "--task", "gsm8k", "--data-path", p["gsm8k_1mb"]],
         "--data-path", out, 2),
        ("gsm8k: a question longer than the policy's context", T + ["--out", out, "--task", "gsm8k", "--data-path",
                                                                    p["gsm8k_5k"]], "--data-path", out, 2),
        ("gsm8k: --data-path is a named pipe", T + ["--out", out, "--task", "gsm8k", "--data-path", p["fifo_data"]],
         "--data-path", out, 2),
        ("--response-prefix of 120,000 characters", T + ["--out", out, "--response-prefix", "x" * 120_000],
         "--response-prefix", out, 2, {"show": "train.py --preset smoke ... --response-prefix 'x' * 120000"}),
        ("--response-prefix longer than the policy's context", T + ["--out", out, "--response-prefix", "x" * 5000],
         "--response-prefix", out, 2, {"show": "train.py --preset smoke ... --response-prefix 'x' * 5000"}),
        ("--max-new-tokens above the policy's context", T + ["--out", out, "--max-new-tokens", "5000"],
         "--max-new-tokens", out, 2),
        ("--task-config with NaN", T + ["--out", out, "--task-config", '{"min_terms": NaN}'], "--task-config", out, 2),
        ("--task-config with 1e400", T + ["--out", out, "--task-config", '{"min_terms": 1e400}'], "--task-config",
         out, 2),
        ("--task-config nested 5,000 deep", T + ["--out", out, "--task-config", "[" * 5000 + "]" * 5000],
         "--task-config", out, 2, {"show": "train.py --preset smoke ... --task-config '[' * 5000 + ']' * 5000"}),
        ("--task-config whose questions outgrow the context", T + ["--out", out, "--task-config",
                                                                   '{"min_terms": 1500, "max_terms": 1500}'],
         "--task-config", out, 2),
        ("--config with a 2 MB response prefix", ["train.py", "--config", p["config_2mb"], "--out", out], "--config",
         out, 2),
        ("--config nested 100,000 deep", ["train.py", "--config", p["config_deep"], "--out", out], "--config", out, 2),
        ("--config with NaN for --lr", ["train.py", "--config", p["config_nan"], "--out", out], "--config", out, 2),
        ("--config of 2 MB of spaces", ["train.py", "--config", p["config_spaces"], "--out", out], "--config", out, 2),
        ("--config is a named pipe", ["train.py", "--config", p["fifo"], "--out", out], "--config", out, 2),
        ("--config with a NUL character in a text", ["train.py", "--config", p["config_nul"], "--out", out],
         "--response-prefix", out, 2),
        # what --resume reads, checked before any model loads
        *[(f"--resume: checkpoint.pt {kind}", R + [damaged_checkpoint(p, kind)], "--resume",
           os.path.join(work, f"ckpt-{kind.replace(' ', '_')}"), 2)
          for kind in ("empty", "truncated", "newer format", "foreign", "rank 4", "a folder")],
        ("--expert-cache: a width file that is not a number", T + ["--out", out, "--expert-cache",
                                                                    damaged_cache(p, "width")], "--expert-cache",
         out, 2),
        ("--expert-cache: every state file truncated (computed again)", T + ["--out", fresh, "--expert-cache",
                                                                             damaged_cache(p, "states")],
         None, None, 0, {"exit0": True}),
        # signals everywhere
        ("SIGTERM during validation before training", T + ["--eval-items", "8", "--steps", "2", "--out",
                                                            os.path.join(work, "sig-validation")], "stopped by", None,
         143, {"signal": "validation:0:SIGTERM"}),
        ("SIGTERM in the middle of a checkpoint write", T + ["--steps", "4", "--save-every", "1", "--out",
                                                              os.path.join(work, "sig-checkpoint")], "--resume", None,
         143, {"signal": "checkpoint:2:SIGTERM"}),
        ("evaluate.py: SIGTERM while scoring", ["evaluate.py", "--run", copy_run(p, "sig-eval"), "--n", "64",
                                                 "--batch-size", "1"], "stopped by", None, 143,
         {"signal": (signal.SIGTERM, "stderr:validation (with_C)")}),
        ("conductor: SIGTERM during training", ["neighbours/conductor.py", *SMOKE, "--steps", "40", "--save-every",
                                                 "2", "--out", os.path.join(work, "sig-conductor")], "--resume", None,
         143, {"signal": (signal.SIGTERM, "step 2/")}),
        ("rlae: Ctrl-C during training", ["neighbours/rlae.py", *SMOKE, "--steps", "40", "--save-every", "2", "--out",
                                          os.path.join(work, "sig-rlae")], "--resume", None, 130,
         {"signal": (signal.SIGINT, "step 2/")}),
    ]
    os.symlink(os.path.join(work, "gsm8k"), os.path.join(work, "out-link"))
    return cases


def user_files_cases(p, work, T, out):
    """The user's files round (a folder the user already had, evaluation, summaries, the expert cache's writes,
    streams): as write_safety_cases has them, with the options `absent` (a path that must not exist afterwards),
    `made` (a path that must exist afterwards: what shows the run was read), `env` (variables set for the command)
    and `resumes` (the command in the line must finish the run)."""
    E = ["evaluate.py", "--n", "2", "--run"]
    S = ["evaluate.py", "--summarize"]
    V = {"victim": p["victim"]}
    gone = os.path.join(work, "gone", "cache")  # a recorded --expert-cache that no longer exists
    tmpfs = os.path.join(work, "tmpfs-OUT")
    folder = {name: users_folder(p, f"users-{name}", files) for name, files in (
        ("scores", USERS), ("notes", {"notes.txt": "mine\n"}),
        ("config", {"config.json": '{"name": "my own config"}\n', "samples.jsonl": "mine\n"}),
        ("conductor", USERS), ("rlae", USERS), ("cache-inside", USERS))}
    cases = [
        # a folder the user already had is never a run's to clean up
        ("--out: the user's folder (validation.json, samples.jsonl, plot.png)", T + ["--out", folder["scores"]],
         "--out", folder["scores"], 2),
        ("--out: the user's folder holding notes.txt", T + ["--out", folder["notes"]], "--out", folder["notes"], 2),
        ("--out: the user's folder with a config.json of their own", T + ["--out", folder["config"]], "--out",
         folder["config"], 2),
        ("--out: the user's folder, --expert-cache inside it", T + ["--out", folder["cache-inside"], "--expert-cache",
                                                                   os.path.join(folder["cache-inside"], "cache")],
         "--out", folder["cache-inside"], 2),
        ("conductor: --out the user's folder", ["neighbours/conductor.py", *SMOKE, "--out", folder["conductor"]],
         "--out", folder["conductor"], 2),
        ("rlae: --out the user's folder", ["neighbours/rlae.py", *SMOKE, "--out", folder["rlae"]], "--out",
         folder["rlae"], 2),
        ("--out: a failed first step whose validation.json is not the run's",
         T + ["--out", failed_first_step(p, "failed-foreign", validation='{"my": "own"}')], "validation.json",
         os.path.join(work, "failed-foreign"), 2),
        ("--out: an empty folder", T + ["--out", users_folder(p, "users-empty", {})], None, None, 0, {"exit0": True}),
        ("--out: a run that failed before its first step starts again",
         T + ["--out", failed_first_step(p, "failed-own")], None, None, 0, {"exit0": True}),
        # evaluate.py reads the run's config.json through train.py's own checks, before any model loads
        ("evaluate.py --run: config.json with --max-new-tokens -1",
         E + [edited_run(p, "cfg-neg", {"max_new_tokens": -1})],
         "--max-new-tokens", os.path.join(work, "cfg-neg"), 2),
        ("evaluate.py --run: config.json with a 200,000-character prefix",
         E + [edited_run(p, "cfg-long", {"response_prefix": "x" * 200_000})], "--response-prefix",
         os.path.join(work, "cfg-long"), 2),
        ("evaluate.py --run: config.json nested 100,000 deep",
         E + [edited_run(p, "cfg-deep", text='{"team": ' + "[" * 100_000 + "]" * 100_000 + "}")], "config.json",
         os.path.join(work, "cfg-deep"), 2),
        ("evaluate.py --run: config.json with NaN for --lr", E + [edited_run(p, "cfg-nan", {"lr": float("nan")})],
         "config.json", os.path.join(work, "cfg-nan"), 2),
        ("evaluate.py --run: config.json is a list", E + [edited_run(p, "cfg-list", text="[1, 2]")], "config.json",
         os.path.join(work, "cfg-list"), 2),
        ("evaluate.py --run: config.json names an unknown flag", E + [edited_run(p, "cfg-key", {"warp_drive": 9})],
         "warp_drive", os.path.join(work, "cfg-key"), 2),
        ("evaluate.py --run: config.json --team unknown", E + [edited_run(p, "cfg-team", {"team": "galactic"})],
         "--team", os.path.join(work, "cfg-team"), 2),
        ("evaluate.py --run: config.json without team_models", E + [edited_run(p, "cfg-models", text='{"lr": 0.1}')],
         "config.json", os.path.join(work, "cfg-models"), 2),
        ("evaluate.py --run: the recorded --expert-cache is now a file",
         E + [edited_run(p, "cfg-cache-file", {"expert_cache": p["victim"]})], None, None, 0, {**V, "exit0": True}),
        ("evaluate.py --run: the recorded --expert-cache no longer exists (not made again)",
         E + [edited_run(p, "cfg-cache-gone", {"expert_cache": gone})], None, None, 0,
         {"exit0": True, "absent": os.path.dirname(gone)}),
        ("evaluate.py --run --expert-cache is a file", E + [copy_run(p, "eval-cache-file"), "--expert-cache",
                                                         p["victim"]], "--expert-cache",
         os.path.join(work, "eval-cache-file"), 2, V),
        ("evaluate.py --untrained --expert-cache is a file", ["evaluate.py", "--untrained", "--team", "tiny", "--task",
                                                              "chain_sum", "--n", "2", "--out", out,
                                                              "--expert-cache", p["victim"]], "--expert-cache", out,
         2, V),
        # --summarize reads run folders: config.json and metrics.jsonl together
        ("evaluate.py --summarize: a smoke run (its base_model/config.json is no run)", S + [p["run"], "--out",
                                                                                          out], None, None, 0,
         {"exit0": True}),
        ("evaluate.py --summarize: a folder with no run", S + [p["gsm8k_dir"], "--out", out], "no run found",
         out, 2),
        ("evaluate.py --summarize: a run whose last metrics line is torn", S + [torn_runs(p, "torn"), "--out", out],
         None, None, 0, {"exit0": True}),
        ("evaluate.py --summarize: a folder named with glob characters", S + [torn_runs(p, "globbed", glob_name=True),
                                                                            "--out", out], None, None, 0,
         {"exit0": True, "made": os.path.join(out, "reward_chain_sum.png")}),
        ("evaluate.py --summarize: a metrics line that is not JSON", S + [torn_runs(p, "bad-line", torn=False),
                                                                        "--out", out], "metrics.jsonl", out, 2),
        # every path flag checked on every code path; every write through one discipline
        ("--precompute-states: --expert-cache is a file", T + ["--out", out, "--precompute-states", "--expert-cache",
                                                              p["victim"]], "--expert-cache", out, 2, V),
        ("--precompute-states: --expert-cache cannot be created", T + ["--out", out, "--precompute-states",
                                                                      "--expert-cache", "/sys/nmusk"],
         "--expert-cache", out, 2),
        ("--precompute-states: a width file that is not a number", T + ["--out", out, "--precompute-states",
                                                                       "--expert-cache", damaged_cache(p, "width2")],
         "--expert-cache", out, 2),
        ("a full disk under --expert-cache (tmpfs 4 kB)", ["-c", TMPFS, tmpfs, "4k", *SMOKE, "--out",
                                                            os.path.join(work, "fullcache-OUT"), "--expert-cache",
                                                            "@MNT/cache"], "--expert-cache", None, 4,
         {"show": "train.py --preset smoke --eval-items 0 --steps 1 --out W/fullcache --expert-cache TMPFS(4k)"}),
        ("--precompute-states on a full disk (tmpfs 4 kB)", ["-c", TMPFS, tmpfs, "4k", *SMOKE, "--out",
                                                              os.path.join(work, "fullpre-OUT"),
                                                              "--precompute-states", "--expert-cache", "@MNT/cache"],
         "--expert-cache", None, 4,
         {"show": "train.py --preset smoke --eval-items 0 --steps 1 --precompute-states --expert-cache TMPFS(4k)"}),
        ("--resume adding an --expert-cache (its states differ in their last bits)",
         T + ["--steps", "3", "--resume", "--out", copy_run(p, "resume-cache"), "--expert-cache", p["cache"]],
         "--expert-cache", os.path.join(work, "resume-cache"), 2),
        # streams
        ("stdout a pipe closed after one line (piped to head -1)", ["-c", STREAM, "head", *T, "--steps", "3", "--save-every",
                                                              "1", "--out", os.path.join(work, "head")],
         "--resume", None, 141, {"resumes": True,
                                 "show": "train.py --preset smoke --eval-items 0 --steps 3 --save-every 1 "
                                         "--out W/head, piped to head -1"}),
        ("stdout on a full device (> /dev/full)", ["-c", STREAM, "full", *T, "--steps", "3", "--out",
                                                   os.path.join(work, "devfull")], "stdout", None, 4,
         {"absent": os.path.join(work, "devfull"),
          "show": "train.py --preset smoke --eval-items 0 --steps 3 --out W/devfull > /dev/full"}),
        ("PYTHONIOENCODING=ascii with a non-ASCII --out", T + ["--out", os.path.join(work, "r\u00e9sum\u00e9-OUT")],
         None, None, 0, {"exit0": True, "env": {"PYTHONIOENCODING": "ascii"}}),
        ("evaluate.py, PYTHONIOENCODING=ascii, a non-ASCII --out", E + [p["run"], "--out",
                                                                       os.path.join(work, "\u00e9val-OUT")],
         None, None, 0, {"exit0": True, "env": {"PYTHONIOENCODING": "ascii"}}),
    ]
    return cases


# ----------------------------------------------------------------------------------------------------------
# Chaos: a run killed at random moments and resumed each time must end where an uninterrupted run ends

KILLS = ("SIGKILL", "checkpoint", "validation", "SIGTERM", "checkpoint:SIGTERM", "step")  # the suite takes 4
WALL_CLOCK = ("seconds", "tokens_per_s")  # the two fields that differ between two runs of the same numbers


def chaos(command, out, steps, kills, seed=0, max_delay=10.0, env=None):
    """Run `python *command --out OUT` to its end through `kills` interruptions, each kind of KILLS in turn (a
    start that ends before its kill lands tries the same kind again) at a random moment: SIGKILL or SIGTERM after a random delay (in start-up, a step, a checkpoint write, validation,
    the export: wherever it falls), or at a chosen point, the run started by experiments/kill_at.py (KILL_AT):
    in the middle of a checkpoint write (SIGKILL, or SIGTERM, which waits for the write), after validating and
    before its file, after an update and before its log line. Each next start adds --resume once config.json is
    there. Returns [(kind, where, exit code)] of the interrupted starts and the final start's (exit code, stderr)."""
    rng, env = random.Random(seed), {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    log, killed = [], 0
    while killed < kills and len(log) < 5 * kills:  # a start that ends before its kill tries that kind again
        kind = KILLS[killed % len(KILLS)]
        done = checkpoint_step(os.path.join(out, "checkpoint.pt")) or 0
        hook, where = "", f"{rng.uniform(0.5, max_delay):.2f} s"
        if kind.startswith("checkpoint") and done < steps:
            hook = where = f"checkpoint:{rng.randint(done + 1, steps)}" + kind[len("checkpoint"):]
        elif kind == "validation":
            hook = where = f"validation:{0 if done == 0 and rng.random() < 0.5 else steps}"
        elif kind == "step" and done < steps:
            hook = where = f"step:{rng.randint(done + 1, steps)}"
        resume = ["--resume"] if os.path.exists(os.path.join(out, "config.json")) else []
        launcher = [KILL_AT, hook] if hook else []
        proc = subprocess.Popen([sys.executable, *launcher, *command, "--out", out, *resume], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        if not hook:
            try:
                proc.wait(timeout=float(where.split()[0]))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL if kind in ("SIGKILL", "checkpoint", "step") else signal.SIGTERM)
        _, stderr = proc.communicate(timeout=600)
        if proc.returncode not in (0, -9, -15, 143):
            raise RuntimeError(f"chaos: {kind} at {where} ended with {proc.returncode}: {stderr[-2000:]}")
        log.append((kind, where, proc.returncode))
        killed += proc.returncode != 0
    resume = ["--resume"] if os.path.exists(os.path.join(out, "config.json")) else []
    final = subprocess.run([sys.executable, *command, "--out", out, *resume], cwd=ROOT, capture_output=True, text=True,
                           env=env)
    return log, (final.returncode, final.stderr)


def differences(got, want):
    """What differs between two finished run folders, as lines (none: bit-identical): the file names, every
    metrics.jsonl record but its wall clock, the samples of samples.jsonl's steps in `want` (a resumed run adds
    those of its first step), validation.json, every tensor of the checkpoint, and the exported g_phi, LoRA and
    base model byte for byte; any temporary file or lock left is a difference."""
    import torch
    names = {path: sorted(os.path.relpath(os.path.join(d, n), path) for d, ds, ns in os.walk(path) for n in ns)
             for path in (got, want)}
    diffs = [f"stray file {n}" for n in names[got] if ".tmp" in n or n.endswith(".lock")]
    if names[got] != names[want]:
        diffs.append(f"files differ: {sorted(set(names[got]) ^ set(names[want]))}")

    def lines(path, name):
        with open(os.path.join(path, name)) as f:
            return [json.loads(line) for line in f]

    for name in ("metrics.jsonl", "samples.jsonl"):
        a, b = ([{k: v for k, v in r.items() if k not in WALL_CLOCK} for r in lines(p, name)] for p in (got, want))
        if name == "samples.jsonl":  # a resumed run also shows the samples of its first step (run.write_samples)
            a = [r for r in a if r["step"] in {r["step"] for r in b}]
        if a != b:
            diffs.append(f"{name}: {len(a)} vs {len(b)} records, first difference at record "
                         f"{next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) + 1}")
    for name in ("validation.json", "g_phi.safetensors", "lora_peft/adapter_model.safetensors",
                 "base_model/model.safetensors"):
        if os.path.exists(os.path.join(want, name)):
            with open(os.path.join(got, name), "rb") as f, open(os.path.join(want, name), "rb") as g:
                if f.read() != g.read():
                    diffs.append(f"{name} differs")
    a, b = (torch.load(os.path.join(p, "checkpoint.pt"), weights_only=True) for p in (got, want))

    def same(x, y):
        if torch.is_tensor(x):
            return torch.is_tensor(y) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return type(x) is type(y) and len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
        return x == y

    diffs += [f"checkpoint.pt: {k} differs" for k in a if not same(a[k], b.get(k))]
    return diffs


def chaos_rows(work, kills):
    """The chaos run as a table row: a smoke run (4 steps, a checkpoint each, 8 validation items) killed `kills`
    times at random moments and resumed each time, against the same run never killed."""
    command = ["train.py", "--preset", "smoke", "--steps", "4", "--save-every", "1"]
    t0 = time.time()
    reference, out = os.path.join(work, "chaos-reference"), os.path.join(work, "chaos")
    subprocess.run([sys.executable, *command, "--out", reference], cwd=ROOT, capture_output=True, check=True)
    log, (code, stderr) = chaos(command, out, 4, kills, seed=46)
    diffs = differences(out, reference) if code == 0 else [stderr.strip().splitlines()[-1:]]
    killed = [x for x in log if x[2] != 0]
    kinds = ", ".join(f"{k} {sum(x[0] == k for x in killed)}" for k in KILLS)
    codes = ", ".join(f"{c}: {sum(x[2] == c for x in killed)}" for c in sorted({x[2] for x in killed}))
    ok = code == 0 and not diffs and len(killed) == kills
    same = ("bit-identical to the uninterrupted run (metrics but wall clock, samples, validation, checkpoint, "
            "exports), no stray file") if not diffs else "; ".join(map(str, diffs))
    return [f"| chaos: {kills} kills at random moments, each resumed | `{' '.join(command)} --out W/chaos` "
            f"(killed and resumed; then compared with an uninterrupted run) | {code} | {len(killed)} starts "
            f"interrupted ({kinds}; exit codes {codes}), {len(log) - len(killed)} that ended on their own, then "
            f"one that finished | {same} | {time.time() - t0:.1f} | {'OK' if ok else 'NO'} |"]


def checkpoint_step(path):
    """The step a checkpoint holds, or None."""
    sys.path.insert(0, ROOT)
    from support.harness.checkpoint import checkpoint_step as step
    return step(path)


def listing(path):
    """{relative file: (size, mtime_ns)} under path; None when it does not exist."""
    if not os.path.exists(path):
        return None
    if os.path.isfile(path):
        return {".": (os.path.getsize(path), os.stat(path).st_mtime_ns)}
    return {os.path.relpath(os.path.join(d, n), path): (os.path.getsize(os.path.join(d, n)),
                                                       os.stat(os.path.join(d, n)).st_mtime_ns)
            for d, _, names in os.walk(path) for n in names}


def run_case(name, argv, watch, work, trigger=None, extra_env=None):
    """(exit code, stderr, seconds) of one case. trigger: (signal, the line that fires it: "step 2/" on stdout,
    or "stderr:TEXT"), or a kill point POINT:STEP:SIGNAL (the run started by experiments/kill_at.py), or None."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           **(extra_env or {})}
    holder = None
    if name.startswith("--out held"):  # another process that holds the run folder's lock
        holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, '.'); "
                                   "from support.harness.folder import take_lock; take_lock(sys.argv[1]); "
                                   "print('held', flush=True); time.sleep(600)", watch], cwd=ROOT,
                                  stdout=subprocess.PIPE, text=True)
        holder.stdout.readline()
    t0 = time.time()
    launcher = [KILL_AT, trigger] if isinstance(trigger, str) else []
    proc = subprocess.Popen([sys.executable, *launcher, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,  # Ctrl-C's default, as at a terminal
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    head = ""
    if isinstance(trigger, tuple) and trigger[1].startswith("stderr:"):  # a progress bar: no newline to wait for
        while trigger[1][7:] not in head and proc.poll() is None:
            head += os.read(proc.stderr.fileno(), 4096).decode(errors="replace")
        proc.send_signal(trigger[0])
    elif isinstance(trigger, tuple):
        for line in proc.stdout:
            if line.startswith(trigger[1]):
                proc.send_signal(trigger[0])
                break
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        stderr += "\nerror: (bad_inputs.py) still running after 600 s, killed"
    if holder is not None:
        holder.kill()
        holder.wait()
    return proc.returncode, head + stderr, time.time() - t0


def first_line(stderr):
    """The `error:` line, else the last line of a traceback, else the first line; progress bars left out."""
    lines = [ln.split("\r")[-1].strip() for ln in stderr.splitlines()]
    lines = [ln for ln in lines if ln and "it/s]" not in ln and "item/s]" not in ln]
    errors = [ln for ln in lines if ln.startswith("error:")]
    if errors:
        return errors[0], len(errors), lines
    return (lines[-1] if lines else ""), 0, lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--work", default="/tmp/nmusk-bad-inputs", help="scratch folder (deleted first)")
    ap.add_argument("--out", default=None, help="write the Markdown table here (default: print it)")
    ap.add_argument("--only", default=None, help="run only the cases whose name contains this text")
    ap.add_argument("--chaos", type=int, default=20, help="kills of the chaos run (0: none)")
    ap.add_argument("--start", type=int, default=0, help="run the cases from this index on")
    a = ap.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    p = fixtures(a.work)
    rows = ["| case | command | exit | first line | --out afterwards | s | ok |", "|---|---|---|---|---|---|---|"]
    for i, (name, argv, flag, watch, want, *more) in enumerate(cases(p, a.work)):
        if (a.only and a.only not in name) or i < a.start:
            continue
        opts = more[0] if more else {}
        argv = [x.replace("-OUT", f"-{i}") for x in argv]
        watch = watch and watch.replace("-OUT", f"-{i}")
        if name.startswith("--out held"):
            os.makedirs(watch, exist_ok=True)
        trigger = opts.get("signal") or ((signal.SIGINT if name.startswith("SIGINT") else signal.SIGTERM, "step 2/")
                                         if name.startswith("SIG") else None)
        before = listing(watch) if watch else None
        code, stderr, seconds = run_case(name, argv, watch, a.work, trigger, opts.get("env"))
        line, n_errors, lines = first_line(stderr)
        after = listing(watch) if watch else None
        if name.startswith("--out held"):
            after = {k: v for k, v in (after or {}).items() if k != ".lock"}
            before = {k: v for k, v in (before or {}).items() if k != ".lock"}
        written = "unchanged" if before == after else f"changed: {sorted(set(after or {}) ^ set(before or {}))}"
        resumed, kept = True, True
        if "victim" in opts:
            with open(opts["victim"]) as f:
                kept = f.read() == "precious\n"
        if opts.get("exit0"):  # a run that must finish, its target untouched
            written = "the run finished" + ("; the file outside untouched" if "victim" in opts else "")
        elif trigger is not None or opts.get("resumes"):  # the command in the line must finish the run
            resume = line.partition("with: ")[2] or (argv if "run the same command again" in line else "")
            command = shlex.split(resume)[1:] if isinstance(resume, str) else resume
            done = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"}, text=True) if command else None
            resumed = done is not None and done.returncode == 0
            written = f"the command in the line finished it: exit {done and done.returncode}"
        elif watch is None:  # a tmpfs: gone with its namespace; 99 would say a temporary file or the lock was left
            written = "no temporary file, no lock" if code != 99 else "a temporary file or the lock left behind"
        if "victim" in opts:
            written += "; the file outside untouched" if kept else "; THE FILE OUTSIDE CHANGED"
        if "absent" in opts:  # a path outside that the command must not make
            kept = kept and not os.path.exists(opts["absent"])
            written += f"; {'no' if kept else 'MADE'} {opts['absent'].replace(a.work, 'W')}"
        if "made" in opts:  # a file only a run read makes (a summary's figure)
            made = opts["made"].replace("-OUT", f"-{i}")
            kept = kept and os.path.exists(made)
            written += f"; {'wrote' if kept else 'NOT written:'} {made.replace(a.work, 'W')}"
        traceback = any(ln.startswith("Traceback") for ln in lines)
        ok = code == want and n_errors == (0 if opts.get("exit0") else 1) and not traceback and kept and \
            (flag is None or flag in line) and resumed and (watch is None or before == after) and \
            not os.path.exists(os.path.join(a.work, "PWNED"))
        command = opts.get("show") or " ".join(x.replace(a.work, "W").replace(ROOT + "/", "") for x in argv)
        shown = line[:300].replace('|', '/').replace(a.work, 'W') if n_errors else "(no error line)"
        rows.append(f"| {name} | `{command}` | {code} | {shown} | {written} | {seconds:.1f} | {'OK' if ok else 'NO'} |")
        print(rows[-1], flush=True)
    if a.chaos:  # the chaos run: a smoke run killed a.chaos times at random moments, resumed each time
        rows += chaos_rows(a.work, a.chaos)
        print("\n".join(rows[-1:]), flush=True)
    table = "\n".join(rows) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(table)
    shutil.rmtree(a.work, ignore_errors=True)


if __name__ == "__main__":
    main()
