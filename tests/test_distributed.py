"""Data parallelism (lib/distributed.py) on CPU with gloo, tiny team: `torchrun --nproc_per_node 2 train.py` trains
as one process does; a rank that dies stops the job in one line and --resume continues it; bad input is refused.

The runs are subprocesses (torchrun starts its own); they are started together by one fixture, as in
test_hardening.py, because each is mostly Python start-up. Each process uses one torch thread."""
import json
import os
import subprocess
import sys

import pytest
import torch

from lib import distributed
from test_hardening import read_metrics as metrics  # whole lines, steps 1, 2, ... once each

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 4 micro-batches of 1 prompt, so that 2 ranks sum (g0 + g1) + (g2 + g3) where one process sums
# ((g0 + g1) + g2) + g3: the float rounding differs, and the tolerances below must absorb it.
FLAGS = ["--team", "tiny", "--task", "chain_sum", "--device", "cpu", "--dataset-size", "64", "--system-prompt",
         "simple", "--batch-size", "1", "--grad-accum", "4", "--group-size", "4", "--max-new-tokens", "6",
         "--latent-dim", "32", "--num-heads", "4", "--num-latents", "4", "--lr", "3e-2", "--router-lr", "3e-2",
         "--save-every", "2", "--steps", "4"]
# train.main with the synthetic reward of test_train.py; KILL_RANK / KILL_AT kill one rank only, at a point
# experiments/kill_at.py names (armed before train imports the functions it wraps).
DRIVER = """import os, sys, torch
sys.path[:0] = [{root!r}, {tests!r}, {experiments!r}]
torch.set_num_threads(1)
if os.environ.get("KILL_RANK") and os.environ.get("RANK") == os.environ["KILL_RANK"]:
    import kill_at
    kill_at.arm(os.environ["KILL_AT"])
import grpo, train, test_train
if os.environ.get("NAN_LOSS"):  # every loss NaN: every update is skipped
    real = grpo.grpo_loss
    grpo.grpo_loss = lambda *a, **k: (lambda loss, m: (loss * float("nan"), m))(*real(*a, **k))
train.main(sys.argv[1:], score_batch=test_train.letter_reward)
"""


def start(driver, out, *extra, nproc=None, env=None):
    launcher = [sys.executable] if nproc is None else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return subprocess.Popen(launcher + [driver, *FLAGS, "--out", out, *extra], cwd=ROOT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc):
    out, err = proc.communicate(timeout=600)
    return proc.returncode, out, err


def checkpoint(out):
    return torch.load(os.path.join(out, "checkpoint.pt"), map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"one", "two", "one-ds", "two-ds", "killed", "bad", "nan": (returncode, stdout, stderr, out)}, all started
    at once ("-ds": with --dynamic-sampling 2)."""
    tmp = tmp_path_factory.mktemp("distributed")
    driver = str(tmp / "driver.py")
    with open(driver, "w") as f:
        f.write(DRIVER.format(root=ROOT, tests=os.path.join(ROOT, "tests"),
                              experiments=os.path.join(ROOT, "experiments")))
    outs = {k: str(tmp / k) for k in ("one", "two", "one-ds", "two-ds", "killed", "bad", "nan")}
    ds = ["--dynamic-sampling", "2", "--batch-size", "2"]
    procs = {"one": start(driver, outs["one"]),
             "two": start(driver, outs["two"], nproc=2),
             "one-ds": start(driver, outs["one-ds"], *ds),
             "two-ds": start(driver, outs["two-ds"], *ds, nproc=2),
             # rank 1 dies (SIGKILL, as the OOM killer would) after its update of step 3; rank 0 saved step 2
             "killed": start(driver, outs["killed"], nproc=2, env={"KILL_RANK": "1", "KILL_AT": "step:3"}),
             "bad": start(driver, outs["bad"], "--grad-accum", "1", nproc=2),
             "nan": start(driver, outs["nan"], "--max-bad-steps", "2", nproc=2, env={"NAN_LOSS": "1"})}
    done = {k: (*finish(p), outs[k]) for k, p in procs.items()}
    done["driver"] = driver
    return done


def assert_same_training(got, want, rel=1e-4, atol=1e-4):
    """Rewards and completion lengths exactly (the same completions were drawn); losses, KL and gradient norms
    to 1e-4 relative; trained LoRA and g_phi weights to 1e-4 absolute. Why these tolerances: the summed gradient
    is the one-process sum in another order, a float32 rounding difference of ~1e-7 relative, which AdamW's
    normalisation and 3 steps of feedback grow (measured: 1e-6 relative on the losses, 6e-6 absolute on the
    weights after 4 steps). One update at lr 3e-2 moves a weight by ~3e-2, so a micro-batch lost or counted twice
    would differ by ~1e-2: far outside 1e-4."""
    ga, wa = metrics(got), metrics(want)
    assert len(ga) == len(wa) == 4
    for g, w in zip(ga, wa):
        for k in ("reward", "reward_std", "solve_rate", "completion_length", "zero_std_fraction", "skipped_update"):
            assert g[k] == w[k], (k, g["step"])
        for k in ("loss", "kl", "pg_loss", "grad_norm", "grad_norm_lora", "grad_norm_g_phi", "c_rms", "entropy"):
            assert g[k] == pytest.approx(w[k], rel=rel, abs=1e-7), (k, g["step"])
    assert len({w["reward"] for w in wa}) > 1 and wa[-1]["kl"] > 0.01  # training moved: the check has teeth
    cg, cw = checkpoint(got), checkpoint(want)
    assert cg["step"] == cw["step"] == 4
    for part in ("lora", "method"):
        assert cg[part].keys() == cw[part].keys()
        for k in cw[part]:
            assert torch.allclose(cg[part][k], cw[part][k], rtol=0, atol=atol), (part, k)
    moved = max((cw["lora"][k].abs().max().item() for k in cw["lora"] if k.endswith("lora_B")))
    assert moved > 1e-2  # LoRA B starts at 0


def test_micro_batches_split_in_contiguous_blocks_in_order():
    for grad_accum in range(1, 9):
        for size in range(1, grad_accum + 1):
            blocks = [list(distributed.my_micro_batches(distributed.World(r, size), grad_accum)) for r in range(size)]
            assert sum(blocks, []) == list(range(grad_accum))  # every micro-batch once, rank order = step order
            assert max(map(len, blocks)) - min(map(len, blocks)) <= 1 and min(map(len, blocks)) >= 1


def test_two_processes_train_as_one(runs):
    for k in ("one", "two"):
        code, _, err, _ = runs[k]
        assert code == 0, err[-3000:]
    assert_same_training(runs["two"][3], runs["one"][3])
    with open(os.path.join(runs["two"][3], "config.json")) as f:
        assert json.load(f)["processes"] == 2
    assert "step 4/4" in runs["two"][2] + runs["two"][1]


def test_two_processes_train_as_one_with_dynamic_sampling(runs):
    """--dynamic-sampling weighs each completion's surrogate by 1 / (completions in groups with signal in the
    step): that count must be the step's, over every rank. Re-drawn groups are the same (same seeds), so rewards
    are equal again; the re-drawing and the clipping of g_phi's larger gradient grow the rounding differences to
    1.9e-5 (weights) and 1e-5 relative (losses, norms) here, so the tolerances are 10x the plain run's. Were each
    rank to count only its own completions, the micro-batches would mix in other proportions (tried: gradient
    norms 43 % and weights 0.19 apart; this test fails)."""
    for k in ("one-ds", "two-ds"):
        code, _, err, _ = runs[k]
        assert code == 0, err[-3000:]
    assert_same_training(runs["two-ds"][3], runs["one-ds"][3], rel=1e-3, atol=1e-3)
    assert any(m["trained_group_fraction"] < 1 for m in metrics(runs["one-ds"][3]))  # some groups flat


def test_a_dead_rank_stops_the_job_in_one_line_and_resume_continues(runs):
    code, _, err, out = runs["killed"]
    assert code != 0
    ours = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and "rank 0 of 2" in ours[0] and "--resume" in ours[0], err[-3000:]
    assert "exitcode  : 3" in err and "exitcode  : -9" in err  # torchrun's summary: the survivor 3, the dead -9
    # nothing half-written: the checkpoint of step 2, whole; no temporary file; whole metric lines
    assert checkpoint(out)["step"] == 2 and not [n for n in os.listdir(out) if ".tmp" in n]
    assert 2 <= len(metrics(out)) <= 3
    proc = start(runs["driver"], out, "--resume", nproc=2)
    code, _, err = finish(proc)
    assert code == 0, err[-3000:]
    assert_same_training(out, runs["one"][3])


def test_more_processes_than_micro_batches_is_refused_before_writing(runs):
    code, _, err, out = runs["bad"]
    ours = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and "--grad-accum" in ours[0] and "--nproc_per_node" in ours[0], err[-3000:]
    # rank 0 exits with 2; torchrun then stops the other rank (if it is not done already) and exits 1 itself
    assert "exitcode  : 2" in err and code != 0
    assert not os.path.exists(out)


def test_max_bad_steps_stops_every_rank_after_rank_0_saved(runs):
    """Both ranks skip the same updates (the losses are gathered before deciding) and stop together with code 3;
    the other rank waits for rank 0's checkpoint, so torchrun does not end rank 0 while it writes."""
    code, _, err, out = runs["nan"]
    ours = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and "--max-bad-steps" in ours[0], err[-3000:]
    assert err.count("exitcode  : 3") >= 1 and "exitcode  : -" not in err and code != 0
    assert [r["skipped_update"] for r in metrics(out)] == [True, True]
    assert checkpoint(out)["step"] == 2 and not [n for n in os.listdir(out) if ".tmp" in n]


# torchrun's SIGTERM arrives at a rank in the middle of stop_together (here: inside the barrier); it must
# leave with the stop's code and say nothing, where Python's default handler would end it with -15.
STOPPER = """import os, signal, sys, time
sys.path[:0] = [{root!r}]
from lib import distributed
distributed.barrier = lambda world: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(30))
distributed.stop_together(distributed.World(rank=1, size=2), "", code=3)
"""


def test_a_sigterm_while_stopping_together_exits_with_the_stops_code_silently(tmp_path):
    script = tmp_path / "stopper.py"
    script.write_text(STOPPER.format(root=ROOT))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (3, "")
