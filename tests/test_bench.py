"""experiments/bench.py's phase profile wraps functions by name: each must exist where it is looked up (a function
moved to another module once made the profile die in its worker), and every wrapper is removed on exit."""
import os
import sys
from collections import defaultdict
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import bench  # noqa: E402


def test_phase_timers_wrap_what_a_step_calls_and_restore_it():
    import rollout
    from support.harness import metrics as run_module
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    before = (rollout.sample, run_module.context_probes, torch.Tensor.backward)
    times = defaultdict(float)
    with bench.phase_timers(SimpleNamespace(optimizer=optimizer, pool=None), times):
        assert run_module.context_probes is not before[1]  # wrapped: the module step_metrics reads it from
        optimizer.step()
    assert times["optimizer step"] > 0
    assert (rollout.sample, run_module.context_probes, torch.Tensor.backward) == before
    assert "step" not in vars(optimizer)  # the instance patch is removed, not left behind


def test_the_report_names_every_lever_with_its_ratios():
    """bench.markdown on a synthetic report: the int8 and the all-levers lines carry their own ratios."""
    one = dict(median=10.0, min=9.0, max=11.0, generation_median=5.0, tokens_per_second=51.2, peak_rss_mb=2048)
    r = dict(setup=dict(prompts=1, G=8, new_tokens=64, beta=0.04, steps=3, warmup=1),
             environment=dict(cpu="x", cores=2, threads_per_worker=1, torch="t", transformers="tf", trl="trl", peft="p"),
             contenders={"ours": one, "ours_fast": {**one, "median": 8.0}, "trl_default": {**one, "median": 30.0}},
             targets=bench.GOALS, targets_met={"ratio_vs_trl": False}, ratio_vs_trl=10 / 30,
             int8=dict(step_speedup_paired=1.2, generation_speedup_paired=1.5, ratio_vs_trl=0.3, rollout_logp_gap=0.2,
                       is_weight_clipped_fraction=0.02, is_weight_mean=1.0),
             fast=dict(step_speedup_paired=1.25, ratio_vs_trl=8 / 30), profile={}, scaling={})
    md = bench.markdown(r)
    assert "| ours_fast | 8.0 | 9.0 – 11.0 |" in md
    assert "| ratio_vs_trl | 0.33 | ≤ 0.33 | no |" in md
    assert "step 1.25x faster than `ours` (paired rounds); ours_fast / TRL defaults 0.27." in md
