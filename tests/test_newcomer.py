"""What a newcomer's first runs met (each failed before its fix): the run folder is named at the start and the end,
samples.jsonl holds the last step too, and the same command run again says the run is finished (it suggested
--resume, which validates again) without training or validating again."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def train(out, *extra):
    return subprocess.run([sys.executable, "train.py", "--preset", "smoke", "--steps", "3", "--eval-items", "2",
                           "--sample-every", "100", "--out", out, *extra], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=600)


def test_a_finished_run_is_named_sampled_to_its_last_step_and_not_run_again(tmp_path):
    out = str(tmp_path / "run")
    first = train(out)
    assert first.returncode == 0, first.stderr[-2000:]
    named = [line for line in first.stdout.splitlines() if line.startswith(f"run folder: {out}")]
    assert len(named) == 2                                        # at the start and at the end
    with open(os.path.join(out, "samples.jsonl")) as f:
        steps = sorted({json.loads(line)["step"] for line in f})
    assert steps == [1, 3]                                        # the first step and the last
    validated = os.stat(os.path.join(out, "validation.json")).st_mtime_ns

    again = train(out)                                            # the same command twice
    assert again.returncode == 2 and "holds a finished run" in again.stderr and "--resume" not in again.stderr
    assert os.stat(os.path.join(out, "validation.json")).st_mtime_ns == validated   # nothing ran again

    longer = train(out, "--resume", "--steps", "4")               # a finished run can still be extended
    assert longer.returncode == 0, longer.stderr[-2000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4]


def test_the_readmes_test_command_is_the_one_ci_runs_and_uses_every_core():
    """The README's test command spreads the suite over the cores (pytest-xdist, in requirements-dev.txt) with each
    file on one worker, so that a module's costly set-up runs once; CI runs that very command (before: one core,
    12.5 minutes where two were there)."""
    import re
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = re.search(r"pip install -r requirements-dev.txt && python -m (pytest[^\n]*)", f.read()).group(1)
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = [line.split("python3 -m ", 1)[1].strip() for line in f if line.startswith("python3 -m pytest")]
    with open(os.path.join(ROOT, "requirements-dev.txt")) as f:
        dev = f.read()
    assert ci == [readme] and "-n auto" in readme and "--dist loadfile" in readme
    assert re.search(r"^pytest-xdist\b", dev, re.MULTILINE)


def test_the_readmes_first_result_is_a_band_that_holds_every_machine_measured():
    """The first command's last line differs by CPU and thread count (each sums in its own order), so the README
    gives the band over the machines measured, not one machine's digits (before: one AVX2 line, presented as what a
    user sees, which an Intel machine with AMX did not print). Checked: the example is in the very format
    support/harness/run.validation_line writes, and the example and every measured row lie inside the band."""
    import re
    from support.harness.run import validation_line
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    line_form = re.sub(r"\d+(?:\\\.\d+)?", lambda m: r"[\d.]+", re.escape(validation_line([0.0, 1.0], [1.0, 1.0])))
    example = re.search(r"^validation, 100 items, greedy, the task's scorer: .*$", readme, re.MULTILINE).group(0)
    assert re.fullmatch(line_form, example), example
    before, after, better, worse = (float(x) for x in re.search(
        r"before training ([\d.]+) % -> after ([\d.]+) % \((\d+) items better, (\d+) worse\)", example).groups())
    band = re.search(r"expect \*\*before ([\d.]+) %, after (\d+)–(\d+) %, (\d+)–(\d+) items better and at most "
                     r"(\d+) worse\*\*", " ".join(readme.split()))
    b0, lo, hi, n_lo, n_hi, w = (float(x) for x in band.groups())
    rows = re.findall(r"^\| [^|]+, \d[^|]* \| ([\d.]+) % \| (\d+) / (\d+) \|", readme, re.MULTILINE)
    assert len(rows) >= 3, rows                                   # several machines or thread counts measured
    for a, n, bad in [(after, better, worse)] + [tuple(map(float, r)) for r in rows]:
        assert lo <= a <= hi and n_lo <= n <= n_hi and bad <= w, (a, n, bad)
    assert before == b0 and min(float(r[0]) for r in rows) == lo and max(float(r[0]) for r in rows) == hi
