"""Behaviour is unchanged by a restructure: 3 steps of every method on the tiny team (the neighbours conductor
and rlae, every speedrun lever, the random-reward control and the task's own scorer included) give metrics
bit-identical to those recorded before it (tests/fixtures/metrics_tiny.json, recorded on commit a358f1f by
tests/fixtures/record_metrics.py; wall time aside). The pocket team's twin is run by hand:
    python tests/fixtures/record_metrics.py --pocket --check tests/fixtures/metrics_pocket.json"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_method_gives_the_recorded_metrics_bit_for_bit():
    script = os.path.join(ROOT, "tests", "fixtures", "record_metrics.py")
    fixture = os.path.join(ROOT, "tests", "fixtures", "metrics_tiny.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, script, "--check", fixture], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "bit-identical: 13 runs" in done.stdout
