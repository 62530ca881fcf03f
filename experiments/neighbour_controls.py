"""
The neighbours' controls, nothing trained: what the structure of each method scores by itself, item by item.

    python experiments/neighbour_controls.py rlae --n 4 --runs runs/try-controls --team tiny --task chain_sum \
        --system-prompt simple --max-new-tokens 8 --ensemble-span 4        # seconds, on any CPU
    python experiments/neighbour_controls.py conductor --n 4 --runs runs/try-controls --team tiny \
        --task chain_sum --system-prompt simple --max-new-tokens 8

Every flag but --n, --runs and --eval-batch-size is the neighbour's own (neighbours/conductor.py or neighbours/rlae.py:
train.py's flags and theirs), so a control reads the same prompt, workers or members and token budget as the
trained run it is paired with. The controls of a method (CONTROLS), all greedy:

  conductor_example        the worked example's workflow (conductor.EXAMPLE_WORKFLOW: worker 0 "Solve the
                           problem.", then worker 1 "Check the answer and give it." reading step 0) run by the same
                           workers for every item: the structure an untrained conductor copies (at pocket scale the
                           greedy untrained conductor wrote exactly this workflow for 83 of 100 items)
  conductor_alone_NAME     each worker alone: a one-step workflow whose worker reads the question itself (no
                           subtask), with the task's prompt flags: what that worker scores on these items
  rlae_uniform             the uniform mixture, weights 1/K, the agent never consulted (rlae.RLAE.fixed_weights)
  rlae_alone_NAME          each member alone, weight 1 on it, through the same union-vocabulary decoder

Each is scored on the first --n validation items of --seed, the items every run of that seed is scored on
(evaluate.py), and written as a run would be: RUNS/<control>-s<seed>/ with config.json (the neighbour's flags
and {"control": ...}), eval.json (evaluate.py's fields: score, solve_rate, n, per_item) and timing.json (the
seconds its scoring took, and its share of the process's model loading). A control whose eval.json exists is
not scored again. Last, RUNS/controls-<method>-s<seed>.json lists the folders: experiments/neighbours_learning.py runs
this script for a method and seed until that file exists. experiments/rlae_members.py is the older pocket-only
form of the RLAE controls.
"""
import os
import re
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import evaluate  # noqa: E402
import rewards  # noqa: E402
from experts import pick_device, team_models  # noqa: E402
from support.harness.model_check import check_models  # noqa: E402
from neighbours import conductor, rlae  # noqa: E402
from lib.files import whole_write  # noqa: E402
from support.harness.config import COUNT, ArgumentParser, fail  # noqa: E402

NEIGHBOURS = {"conductor": conductor, "rlae": rlae}  # each script loads its own runs (load_trained)


def slug(spec):
    """A model spec as a folder-name part: "pocket:gemma3-270m" -> "gemma3-270m", "Qwen/Qwen2.5-3B" -> "Qwen2.5-3B"."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", spec.rsplit(":", 1)[-1].rsplit("/", 1)[-1])


def conductor_controls(cond):
    """[(name, description, plan)]: the worked example's workflow, then each worker alone."""
    example = conductor.parse_workflow(conductor.EXAMPLE_WORKFLOW, len(cond.workers), cond.max_steps)
    if example is None:
        raise ValueError(f"the worked example's workflow needs 2 workers and --max-workflow-steps >= 2; the team "
                         f"has {len(cond.workers)} workers ({', '.join(cond.names)}), {cond.max_steps} steps")
    return [("conductor_example", {"workflow": conductor.EXAMPLE_WORKFLOW}, example)] + \
        [(f"conductor_alone_{slug(name)}", {"worker": name}, ([k], [None], [[]])) for k, name in enumerate(cond.names)]


def rlae_controls(ens):
    """[(name, description, weights [K])]: the uniform mixture, then each member alone."""
    K = len(ens.members)
    return [("rlae_uniform", {"weights": [1 / K] * K}, torch.full((K,), 1 / K))] + \
        [(f"rlae_alone_{slug(name)}", {"member": name}, torch.eye(K)[k]) for k, name in enumerate(ens.names)]


CONTROLS = {"conductor": (conductor_controls, "fixed_plan"), "rlae": (rlae_controls, "fixed_weights")}


def main(argv=None):
    p = ArgumentParser(description=__doc__.strip().splitlines()[0], allow_abbrev=False)  # the rest: the neighbour's
    p.add_argument("method", choices=sorted(NEIGHBOURS), help="whose controls")
    p.add_argument("--n", type=COUNT, default=100, help="validation items of --seed (the runs': 100)")
    p.add_argument("--runs", required=True, help="folder the control folders are written into")
    p.add_argument("--eval-batch-size", type=COUNT, default=16, help="items per batch (evaluate.py's default); "
                   "not --batch-size, which is the neighbour's training flag and stays in its config")
    a, flags = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    module = NEIGHBOURS[a.method]
    args = module.parse_args(flags)                      # the neighbour's flags, checked: one line, exit 2
    args.team_models = team_models(args)
    team = args.team_models
    t0 = time.time()
    try:
        check_models([(m, f"--team {args.team}") for m in [team["policy"], *team["experts"], team["router"]]])
        items = rewards.load_entries(args.task, "val", a.n, args.seed, args.data_path, args.task_config)
        items = [items[i] for i in range(min(a.n, len(items)))]
        policy, tok, method, eos_ids = module.load_trained(SimpleNamespace(**vars(args)),
                                                           device=pick_device(args.device))
        make, attr = CONTROLS[a.method]
        controls = make(method)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    load_seconds = time.time() - t0
    sources = [it.get("metadata", {}).get("source_dataset", args.task) for it in items]
    folders = []
    for name, description, value in controls:
        out = os.path.join(a.runs, f"{name}-s{args.seed}")
        folders.append(out)
        if os.path.exists(os.path.join(out, "eval.json")):
            continue
        setattr(method, attr, value)
        t0 = time.time()
        per_item, status = evaluate.score_items(policy, tok, method, eos_ids, items, args, batch_size=a.eval_batch_size)
        seconds = time.time() - t0
        scores = np.array(per_item["with_C"]["score"])
        result = {**evaluate.summary(scores, sources), "task": args.task, "method": name, "n": len(items),
                  "no_context": False, "scorer_status": status, "per_item": {"with_C": per_item["with_C"]}}
        whole_write(os.path.join(out, "config.json"),
                    {**vars(args), "out": out, "control": {"name": name, **description}})
        whole_write(os.path.join(out, "timing.json"), {"eval_seconds": seconds,
                                                       "load_seconds": load_seconds / len(controls)})
        whole_write(os.path.join(out, "eval.json"), result)         # last: its presence means the control is done
        print(f"{name} seed {args.seed}: score {100 * result['score']:.1f} | solved {100 * result['solve_rate']:.1f}"
              f" | n {len(items)} | {seconds:.0f} s -> {out}", flush=True)
    whole_write(os.path.join(a.runs, f"controls-{a.method}-s{args.seed}.json"), {"folders": folders})


if __name__ == "__main__":
    main()
