"""Shared fixtures: the hermetic `tiny` team (random-init models built from configs, no download)."""
import os
import sys

import pytest
import torch

# Hermetic: no request to a model hub ever leaves the machine (subprocesses inherit this).
os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Threads: OMP_NUM_THREADS when it is set (the suite holds at 1 and at 2, two orders of sums), else one per
# pytest-xdist worker (the workers already share the cores), else at most 2. A worker's one thread is also its
# subprocesses' (train.py runs, torchrun): with torch's default of one thread a core, each run two workers start
# would share the cores with the other worker's (the pocket step took 53 s so, 27 s alone).
if "OMP_NUM_THREADS" not in os.environ:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))


# The costliest test files first, costliest first (their share of the suite's 2,408 s of test time measured
# on 2026-11-29 with two workers on one core: 9.1 % down to 2.8 %). `--dist loadfile` hands each worker a whole
# file as it runs low; pytest-xdist would otherwise queue files by their number of tests, which sends the
# one-test chaos file and the few-test pocket, distributed and conversion files last, so one worker runs a long
# file alone at the end. Costliest first is the usual greedy (longest processing time first) schedule.
COSTLIEST_FIRST = ["test_user_files", "test_methods", "test_write_safety", "test_hardening", "test_gpu_path",
                   "test_conductor", "test_chaos", "test_same_metrics", "test_conversion", "test_train",
                   "test_distributed", "test_pocket_models", "test_collaboration", "test_newcomer", "test_run_safety"]


def pytest_configure(config):
    config.addinivalue_line("markers", "pocket: needs the pocket team's PyPI packages (README set-up)")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order pytest_collection_modifyitems sets
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(COSTLIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: each file keeps its own order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_policy():
    from experts import load_model
    return load_model("tiny:llama")


@pytest.fixture(scope="session")
def tiny_pool():
    from experts import TEAMS, ExpertPool
    return ExpertPool(TEAMS["tiny"]["experts"])


def with_lora64(model):
    """`model` in float64, in eval mode, with LoRA (rank 4, alpha 8) whose B is random: a no-op LoRA (B = 0) would
    hide its gradient path from a parity test."""
    from lora import apply_lora
    apply_lora(model, 4, 8)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model.double().eval()


@pytest.fixture(scope="module")
def policy64():
    """The tiny llama policy through with_lora64, and its tokenizer: (model, tok), one per test module."""
    from lib.tiny_models import load as tiny_model
    model, tok = tiny_model("llama")
    return with_lora64(model), tok
