"""A run killed at random moments and resumed each time ends bit-identical to a run never killed, with no stray
file: four kills (SIGKILL after a random delay, SIGKILL in the middle of a checkpoint write, SIGKILL after
validating and before its file, SIGTERM after a random delay), each followed by the next start with --resume.
experiments/bad_inputs.py runs the same with 20 kills of six kinds (SIGTERM in a checkpoint write and SIGKILL
after an update too) on the smoke preset (results/bad_inputs.md). The tiny team, 4 steps, a checkpoint every
step, 2 validation items."""
import os
import sys

from test_hardening import FLAGS, RUN_SCRIPT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
from bad_inputs import KILLS, chaos, differences  # noqa: E402

STEPS = 4
COMMAND = ["-c", RUN_SCRIPT, *FLAGS, "--steps", str(STEPS), "--save-every", "1", "--eval-items", "2"]


def test_a_run_killed_at_random_moments_resumes_to_the_uninterrupted_runs_files(tmp_path):
    import subprocess
    reference = str(tmp_path / "reference")
    done = subprocess.run([sys.executable, *COMMAND, "--out", reference], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    out = str(tmp_path / "chaos")
    log, (code, stderr) = chaos(COMMAND, out, STEPS, kills=4, seed=46, max_delay=8.0)
    assert code == 0, stderr[-2000:]
    killed = [kind for kind, _, exit_code in log if exit_code != 0]
    assert len(killed) == 4 and set(killed) == set(KILLS[:4]), log
    assert differences(out, reference) == [], log
