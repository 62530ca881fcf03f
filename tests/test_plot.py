"""support/harness/plot.py, the plot train.py writes into a run's folder: a run of two steps still shows every point
(no moving average longer than the run), the routing panel appears only for methods with experts, and
without matplotlib one line says so and nothing breaks."""
import json
import os
import sys

import pytest

from support.harness.plot import plot_run, series


def write_run(folder, rows):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def test_two_steps_two_points_and_the_routing_panel(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure
    rows = [{"step": s, "reward": s / 4, "solve_rate": 0.0, "answer_rate": 0.5, "kl": None if s == 1 else 0.01,
             "entropy": 1.0, "utilization": [0.5, 0.3, 0.2]} for s in (1, 2)]
    write_run(tmp_path / "r", rows)
    seen = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, path, **k: seen.append([len(ax.lines) for ax in self.axes]))
    plot_run(str(tmp_path / "r"))
    # reward + solve rate, answer rate, KL, 3 experts + the 1/n line, entropy H + the log n line
    assert seen == [[2, 1, 1, 4, 2]]
    assert series(rows, "kl") == ([2], [0.01]) and series(rows, "reward") == ([1, 2], [0.25, 0.5])


def test_no_routing_panel_without_experts(tmp_path):
    pytest.importorskip("matplotlib")
    write_run(tmp_path / "s", [{"step": 1, "reward": 0.0, "answer_rate": 0.0, "kl": 0.0}])
    assert os.path.getsize(plot_run(str(tmp_path / "s"))) > 1000


def test_without_matplotlib_one_line_and_no_crash(tmp_path, monkeypatch, capsys):
    write_run(tmp_path / "m", [{"step": 1, "reward": 0.0, "kl": 0.0}])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert plot_run(str(tmp_path / "m")) is None
    assert capsys.readouterr().out == "no plot: matplotlib is not installed (pip install matplotlib)\n"


def test_routing_panels_show_their_whole_range(tmp_path, monkeypatch):
    """Utilisation on 0..1 and the entropy on 0..log n (before: matplotlib zoomed onto the data, so a drift of
    0.001 in H = 1.0985 filled the panel like a swing)."""
    pytest.importorskip("matplotlib")
    import math
    import matplotlib.figure
    rows = [{"step": s, "reward": 0.0, "kl": 0.0, "entropy": 1.0985 - s / 1000, "utilization": [0.333, 0.334, 0.333]}
            for s in (1, 2, 3)]
    write_run(tmp_path / "r", rows)
    limits = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, path, **k: limits.extend(ax.get_ylim() for ax in self.axes[3:]))
    plot_run(str(tmp_path / "r"))
    (use_low, use_high), (h_low, h_high) = limits
    assert use_low <= 0 and 1 <= use_high < 1.1
    assert h_low <= 0 and math.log(3) <= h_high < 1.1 * math.log(3)
