"""What a run reports while it runs: tokens_per_s in each step's record (the step's completion tokens over its
wall seconds), and --track (support/harness/track.py): TensorBoard's event file holds every scalar of metrics.jsonl, a
missing library is one line and exit code 2 before anything is written, the tracker is closed however the
run ends, and where trackio or wandb is installed, the real library keeps each step's scalars."""
import json
import math
import os
import sys
import types

import numpy as np
import pytest

import train
from support.harness import track

SMOKE = ["--preset", "smoke", "--eval-items", "0", "--steps", "2", "--device", "cpu"]


def letter_reward(items, completions):
    """1 if the completion starts with a lowercase ASCII letter: reward variance, so the numbers move."""
    return [1.0 if c[:1].isascii() and c[:1].islower() else 0.0 for c in completions], {"ok": len(completions)}


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_tokens_per_s_counts_the_completion_tokens_of_the_step(tmp_path, monkeypatch):
    """tokens_per_s x seconds = the step's completions x their mean length (EOS counted, padding not): the same
    count from completion_length, an independent field. The tiny random policy rarely samples its EOS, so here
    one token in five ends a completion: lengths differ, and counting the padding behind the short ones (the
    width of the batch times its rows) would give more."""
    real = train.build_run

    def early_stops(args, device):
        run = real(args, device)
        run.eos_ids = list(range(0, run.policy.config.vocab_size, 5))
        return run
    monkeypatch.setattr(train, "build_run", early_stops)
    out = str(tmp_path / "run")
    train.main(SMOKE + ["--out", out], score_batch=letter_reward)
    n = 2 * 4 * 1  # --batch-size 2 prompts x G = 4 x --grad-accum 1 (the smoke preset)
    ms = metrics(out)
    assert any(m["truncated_fraction"] < 1 for m in ms)  # some completions ended early: padding behind them
    for m in ms:
        assert m["tokens_per_s"] > 0
        assert m["tokens_per_s"] * m["seconds"] == pytest.approx(m["completion_length"] * n, rel=1e-9)


# ---- --track ----------------------------------------------------------------------------------------------

def flat(record):
    """A metrics.jsonl record as the scalars a tracker should get, by hand: numbers (a switch as 0 or 1) and
    lists of numbers (name/index); "step", nulls and text left out."""
    out = {}
    for k, v in record.items():
        for name, x in ([(f"{k}/{i}", x) for i, x in enumerate(v)] if isinstance(v, list) else [(k, v)]):
            if k != "step" and isinstance(x, (int, float)):
                out[name] = float(x)
    return out


def finite(scalars):
    """NaN is written to metrics.jsonl as null: leave it out to compare."""
    return {k: v for k, v in scalars.items() if not math.isnan(v)}


def test_scalars_flattens_lists_and_dicts_and_leaves_out_text_and_nulls():
    record = {"step": 3, "reward": 0.5, "skipped_update": True, "utilization": [0.25, 0.75], "c_varying": None,
              "utilization_names": ["a", "b"], "by_source": {"x": 1, "y": [2, None]}, "kl": float("nan")}
    got = track.scalars(record)
    assert math.isnan(got.pop("kl"))
    assert got == {"reward": 0.5, "skipped_update": 1.0, "utilization/0": 0.25, "utilization/1": 0.75,
                   "by_source/x": 1.0, "by_source/y/0": 2.0}


def test_tensorboard_holds_every_scalar_of_metrics_jsonl(tmp_path):
    """Two smoke steps with --track tensorboard; the event file, read back by TensorBoard's own reader, holds
    each step's scalars at that step, equal to metrics.jsonl's (as float32: TensorBoard stores scalars so)."""
    pytest.importorskip("tensorboard")  # requirements-dev.txt installs it: CI runs this
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = str(tmp_path / "run")
    train.main(SMOKE + ["--track", "tensorboard", "--out", out], score_batch=letter_reward)
    events = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    got = {}  # {step: {name: value}}
    for name in events.Tags()["scalars"]:
        for e in events.Scalars(name):
            got.setdefault(e.step, {})[name] = e.value
    ms = metrics(out)
    assert sorted(got) == [m["step"] for m in ms] == [1, 2]
    for m in ms:
        want = {k: float(np.float32(v)) for k, v in flat(m).items()}
        assert finite(got[m["step"]]) == want
        assert {"reward", "kl", "grad_norm", "tokens_per_s", "utilization/0"} <= set(want)


class FakeLibrary(types.ModuleType):
    """A stand-in for trackio and wandb, with the calls support/harness/track.py makes (their documented init, log and
    finish): it records them. wandb.init returns a run with log and finish: here the module itself."""

    def __init__(self, name):
        super().__init__(name)
        self.calls = []

    def init(self, project, name, config):
        self.calls.append(("init", project, name, config))
        return self

    def log(self, scalars, step):
        self.calls.append(("log", step, scalars))

    def finish(self):
        self.calls.append(("finish",))


@pytest.mark.parametrize("library", ["trackio", "wandb"])
@pytest.mark.parametrize("ending", ["finished", KeyboardInterrupt, RuntimeError])
def test_the_tracker_gets_each_step_and_is_closed_however_the_run_ends(library, ending, tmp_path, monkeypatch):
    """Each step's record goes to the tracker after its metrics.jsonl line, and the tracker is finished once:
    after the last step, or when the second step is interrupted (Ctrl-C) or fails."""
    fake = FakeLibrary(library)
    monkeypatch.setitem(sys.modules, library, fake)
    real = train.grpo_step

    def second_step_ends(step, *a):
        if step == 1 and ending != "finished":
            raise ending("in step 2")
        return real(step, *a)
    monkeypatch.setattr(train, "grpo_step", second_step_ends)
    out = str(tmp_path / "my-run")
    if ending == "finished":
        train.main(SMOKE + ["--track", library, "--out", out], score_batch=letter_reward)
    else:
        with pytest.raises(ending):
            train.main(SMOKE + ["--track", library, "--out", out], score_batch=letter_reward)
    (_, project, name, config), *logs, last = fake.calls
    assert (project, name, config["track"], config["out"]) == ("n-musketeers", "my-run", library, out)
    assert last == ("finish",)
    ms = metrics(out)
    assert len(ms) == (2 if ending == "finished" else 1)
    assert [(step, finite(scalars)) for _, step, scalars in logs] == [(m["step"], flat(m)) for m in ms]


def test_trackio_itself_stores_every_scalar_of_metrics_jsonl(tmp_path):
    """The real Trackio (not in requirements-dev.txt: skipped where it is not installed; passed with trackio
    0.43.0). Two smoke steps with --track trackio; its local database, read back with sqlite3, holds the run
    (named after --out, config included) and each step's scalars at that step, equal to metrics.jsonl's."""
    pytest.importorskip("trackio")
    import sqlite3
    import subprocess
    out = str(tmp_path / "my-run")  # a process of its own: Trackio reads TRACKIO_DIR (its database) when imported
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "train.py", *SMOKE, "--track", "trackio", "--out", out], env=env, check=True,
                   cwd=os.path.dirname(os.path.abspath(train.__file__)), capture_output=True)
    db = sqlite3.connect(tmp_path / "trackio" / f"{track.PROJECT}.db")
    rows = db.execute("SELECT run_name, step, metrics FROM metrics ORDER BY step").fetchall()
    (run_name, config), = db.execute("SELECT run_name, config FROM configs").fetchall()
    assert run_name == "my-run" and json.loads(config)["out"] == out
    ms = metrics(out)
    assert [(name, step) for name, step, _ in rows] == [("my-run", m["step"]) for m in ms] == [("my-run", 1),
                                                                                             ("my-run", 2)]
    for (_, _, stored), m in zip(rows, ms):
        got = {k: v for k, v in json.loads(stored).items() if isinstance(v, (int, float))}  # NaN is stored as text
        assert finite(got) == flat(m)


def test_wandb_itself_takes_each_step_offline(tmp_path, monkeypatch):
    """The real Weights & Biases in offline mode (no account; not in requirements-dev.txt: skipped where it is not
    installed; passed with wandb 0.31.0). Two smoke steps with --track wandb: the run is named after --out under
    the project, and just before finish its summary holds the scalars of step 1 (W&B commits a step's row when
    the next step begins; finish commits the last), equal to metrics.jsonl's."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    seen = {}
    real_init = wandb.init

    def init(**kw):  # the real wandb.init; its run's summary is read just before the real finish
        run = real_init(**kw)
        real_finish = run.finish
        run.finish = lambda: (seen.update(name=run.name, project=run.project, summary=dict(run.summary)),
                              real_finish())
        return run
    monkeypatch.setattr(wandb, "init", init)
    out = str(tmp_path / "my-run")
    train.main(SMOKE + ["--track", "wandb", "--out", out], score_batch=letter_reward)
    assert (seen["name"], seen["project"]) == ("my-run", track.PROJECT)
    summary = {k: v for k, v in seen["summary"].items() if not k.startswith("_")}  # W&B's own _step, _runtime
    assert seen["summary"]["_step"] == 1 and finite(summary) == flat(metrics(out)[0])
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # the run's record, for `wandb sync`


@pytest.mark.parametrize("library", ["tensorboard", "trackio", "wandb"])
def test_a_missing_tracking_library_is_one_line_and_exit_code_2_before_anything_is_written(library, tmp_path, capsys,
                                                                                          monkeypatch):
    monkeypatch.setitem(sys.modules, library, None)  # import fails, as when it is not installed
    monkeypatch.setattr(train, "build_run", lambda *a: pytest.fail("a model loaded"))
    out = str(tmp_path / "run")
    with pytest.raises(SystemExit) as e:
        train.main(SMOKE + ["--track", library, "--out", out])
    assert e.value.code == 2 and capsys.readouterr().err == f"error: --track {library}: pip install {library}\n"
    assert not os.path.exists(out)
