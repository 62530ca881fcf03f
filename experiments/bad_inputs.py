"""
Bad inputs and faults, tried as a new user would, on the tiny team: each case's command, exit code, first line on
stderr and what it left in --out, as a Markdown table.

    python experiments/bad_inputs.py --out results/bad_inputs.md      # ~8 minutes on one CPU core

What a case must show (README, "When things go wrong"): bad input exits with code 2 and one line `error: ...` that
names the flag, before any model loads, and --out is as it was; Ctrl-C exits with 130 and SIGTERM with 143, in one
line naming the checkpoint's step and the command that resumes; a run folder has one writer at a time. The
`ok` column checks exactly that for each case (exit code, one `error:` line naming the flag, --out unchanged or
a run that continues); the table is the record, tests/test_hardening.py and tests/test_run_safety.py the tests.

Nothing here is in the paper. Every case runs in a scratch folder (--work, deleted first) with HF_HUB_OFFLINE=1.
"""
import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    return paths


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
    ]


def listing(path):
    """{relative file: (size, mtime_ns)} under path; None when it does not exist."""
    if not os.path.exists(path):
        return None
    if os.path.isfile(path):
        return {".": (os.path.getsize(path), os.stat(path).st_mtime_ns)}
    return {os.path.relpath(os.path.join(d, n), path): (os.path.getsize(os.path.join(d, n)),
                                                       os.stat(os.path.join(d, n)).st_mtime_ns)
            for d, _, names in os.walk(path) for n in names}


def run_case(name, argv, watch, work):
    """(exit code, stderr, seconds) of one case; the signal cases are stopped after their second step's line."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    holder = None
    if name.startswith("--out held"):  # another process that holds the run folder's lock
        holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, '.'); "
                                   "from support.lock import take_lock; take_lock(sys.argv[1]); print('held', "
                                   "flush=True); time.sleep(600)", watch], cwd=ROOT, stdout=subprocess.PIPE,
                                  text=True)
        holder.stdout.readline()
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,  # Ctrl-C's default, as at a terminal
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    if name.startswith("SIG"):
        for line in proc.stdout:
            if line.startswith("step 2/"):
                proc.send_signal(signal.SIGINT if name.startswith("SIGINT") else signal.SIGTERM)
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
    return proc.returncode, stderr, time.time() - t0


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
    a = ap.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    p = fixtures(a.work)
    rows = ["| case | command | exit | first line | --out afterwards | ok |", "|---|---|---|---|---|---|"]
    for i, (name, argv, flag, watch, want) in enumerate(cases(p, a.work)):
        if a.only and a.only not in name:
            continue
        argv = [x.replace("out-OUT", f"out-{i}") for x in argv]
        watch = watch and watch.replace("out-OUT", f"out-{i}")
        if name.startswith("--out held"):
            os.makedirs(watch, exist_ok=True)
        before = listing(watch) if watch else None
        code, stderr, seconds = run_case(name, argv, watch, a.work)
        line, n_errors, lines = first_line(stderr)
        after = listing(watch) if watch else None
        if name.startswith("--out held"):
            after = {k: v for k, v in (after or {}).items() if k != ".lock"}
            before = {k: v for k, v in (before or {}).items() if k != ".lock"}
        written = "unchanged" if before == after else f"changed: {sorted(set(after or {}) ^ set(before or {}))}"
        resumed = True
        if watch is None:  # a signal: run the command the line names, which must continue the run to its end
            resume = line.partition("continue with: ")[2]
            done = subprocess.run([sys.executable, *shlex.split(resume)[1:]], cwd=ROOT, capture_output=True,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"}, text=True) if resume else None
            resumed = done is not None and done.returncode == 0
            written = f"the checkpoint; the command in the line resumed it: exit {done and done.returncode}"
        traceback = any(ln.startswith("Traceback") for ln in lines)
        ok = code == want and n_errors == 1 and not traceback and (flag is None or flag in line) and resumed and \
            (watch is None or before == after) and not os.path.exists(os.path.join(a.work, "PWNED"))
        command = " ".join(x.replace(a.work, "W").replace(ROOT + "/", "") for x in argv)
        rows.append(f"| {name} | `{command}` | {code} | {line[:300].replace('|', '/').replace(a.work, 'W')} | {written} | "
                    f"{'OK' if ok else 'NO'} |")
        print(rows[-1], f"({seconds:.0f} s)", flush=True)
    table = "\n".join(rows) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(table)
    shutil.rmtree(a.work, ignore_errors=True)


if __name__ == "__main__":
    main()
