"""experiments/step_walk.py reads which files one optimiser step visits: the paper's path of train.grpo_step (levers
and torchrun's no-ops skipped) stays in the concept files, and leaves train.py for no support/ file but the
optimiser's and the log's."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import step_walk  # noqa: E402


def test_the_papers_step_visits_the_concept_files_and_two_support_files():
    visits = step_walk.walk(ROOT, paper=True)
    files = set(visits)
    assert {"baselines.py", "rewards.py", "rollout.py", "grpo.py", "lora.py", "adapter.py"} <= files
    assert files - {"baselines.py", "rewards.py", "rollout.py", "grpo.py", "lora.py", "adapter.py"} == {
        "lib/optim.py", "support/harness/metrics.py"}
    assert visits[0] == "rewards.py" and visits[-1] == "support/harness/metrics.py"  # the items first, the log last


def test_a_lever_line_is_off_the_papers_path(tmp_path):
    """A call on a `# lever:` line, or inside an `if ...:  # lever:` block, is not on the paper's path."""
    (tmp_path / "train.py").write_text(
        "import grpo\nimport rollout\n\n\ndef grpo_step(run):\n    rollout.sample()\n"
        "    if run:  # lever: off by default\n        grpo.signal_scale()\n    grpo.grpo_loss()  # lever: x\n")
    (tmp_path / "grpo.py").write_text("")
    (tmp_path / "rollout.py").write_text("")
    assert step_walk.walk(str(tmp_path)) == ["rollout.py", "grpo.py"]
    assert step_walk.walk(str(tmp_path), paper=True) == ["rollout.py"]
