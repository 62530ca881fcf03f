"""experiments/bench.py's phase profile wraps functions by name: each must exist where it is looked up (a function
moved to another module once made the profile die in its worker), and every wrapper is removed on exit."""
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import bench  # noqa: E402


def test_phase_timers_wrap_what_a_step_calls_and_restore_it():
    import rollout
    from support import run as run_module
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    before = (rollout.sample, run_module.context_probes, torch.Tensor.backward)
    times = defaultdict(float)
    with bench.phase_timers({"optimizer": optimizer, "pool": None}, times):
        assert run_module.context_probes is not before[1]  # wrapped: the module step_metrics reads it from
        optimizer.step()
    assert times["optimizer step"] > 0
    assert (rollout.sample, run_module.context_probes, torch.Tensor.backward) == before
    assert "step" not in vars(optimizer)  # the instance patch is removed, not left behind
