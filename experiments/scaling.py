"""
Training throughput with 1 and N processes (torchrun; gloo on CPU, NCCL on GPUs): the first rows of a scaling table.

    python experiments/scaling.py                          # pocket team, 1 and 2 processes -> results/scaling.json
    python experiments/scaling.py --team tiny --steps 3    # seconds, on any CPU
    python experiments/scaling.py --procs 1 2 4 8 --flags "--device cuda ..."     # a GPU node

Every setting runs train.py with the same flags: the same global batch (--batch-size x --grad-accum prompts, G
completions each) and seed, so every setting draws the same completions and does the same work; only who does it
changes. Reported per setting:
  tokens_per_s      completion tokens of a step (completion_length x prompts x G, from metrics.jsonl) / its seconds,
                    over the steps after the first (the first includes warm-up)
  step_seconds      mean wall time of those steps
  sync_seconds      per rank and step, the time spent in collectives (all-reduce of the gradients, gathering the
                    logs): with ranks of equal speed that is the communication itself, otherwise mostly waiting for
                    the slowest rank
  rollout share     each rank's own work per step = step_seconds - sync_seconds
It is measured through this file itself: under torchrun it is the program each rank runs (--worker), timing
lib/distributed.py's collectives around train.main.

The processes share whatever cores this script is given (e.g. `taskset -c 0 python experiments/scaling.py`: all
on one core, which measures the overhead of splitting, not a speed-up). The numbers, the CPU affinity and the
load average are written to results/scaling.json with the command.
"""
import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POCKET = ("--task chain_sum --task-config '{\"min_terms\": 2, \"max_terms\": 2, \"min_digits\": 1, \"max_digits\": 2}' "
          "--worked-example --response-prefix <think> --context-position before --device cpu "
          "--batch-size 2 --grad-accum 2 --group-size 4 --max-new-tokens 32 --save-every 1000")
TINY = ("--task chain_sum --device cpu --dataset-size 64 --system-prompt simple --batch-size 2 --grad-accum 4 "
        "--group-size 4 --max-new-tokens 16 --latent-dim 32 --num-heads 4 --save-every 1000")


def worker(argv):
    """One rank: train.main with lib/distributed.py's collectives timed; writes OUT/sync-rank{R}.json."""
    import torch
    sys.path.insert(0, ROOT)
    from lib import distributed
    import train
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    spent, real = [0.0], distributed._collective

    def timed(world, fn, *args):
        t0 = time.time()
        try:
            return real(world, fn, *args)
        finally:
            spent[0] += time.time() - t0

    distributed._collective = timed
    out = train.main(argv)
    rank = distributed.world_from_env().rank
    with open(os.path.join(out, f"sync-rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "sync_seconds": spent[0]}, f)


def run(procs, flags, steps, team, tmp):
    out = os.path.join(tmp, f"p{procs}")
    launcher = [sys.executable] if procs == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
    cmd = launcher + [os.path.abspath(__file__), "--worker", "--team", team, *shlex.split(flags),
                      "--steps", str(steps), "--out", out]
    t0 = time.time()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"error: {procs} process(es) failed: {res.stderr.strip().splitlines()[-1:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f][1:]  # after the first step
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    prompts = cfg["batch_size"] * cfg["grad_accum"]
    tokens = sum(r["completion_length"] * prompts * cfg["group_size"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    sync = [json.load(open(os.path.join(out, n)))["sync_seconds"] / steps for n in sorted(os.listdir(out))
            if n.startswith("sync-rank")]
    return {"processes": procs, "tokens_per_s": tokens / seconds, "step_seconds": seconds / len(rows),
            "sync_seconds_per_step": sync, "wall_seconds": time.time() - t0,
            "rewards": [r["reward"] for r in rows], "losses": [r["loss"] for r in rows]}


def main():
    if "--worker" in sys.argv:
        return worker([a for a in sys.argv[1:] if a != "--worker"])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--team", default="pocket", help="train.py --team (pocket: real models; tiny: seconds)")
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="process counts to run (torchrun)")
    p.add_argument("--steps", type=int, default=3, help="steps per setting (the first is not counted)")
    p.add_argument("--flags", default=None, help="train.py flags (default: a small pocket or tiny setting)")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "scaling.json"), help="where to write")
    a = p.parse_args()
    if a.steps < 2 or min(a.procs) < 1:
        sys.exit("error: --steps must be >= 2 (the first is warm-up) and --procs >= 1")
    flags = a.flags or (TINY if a.team == "tiny" else POCKET)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.procs:
            rows.append(run(n, flags, a.steps, a.team, tmp))
            print(json.dumps(rows[-1]))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    result = {"command": " ".join(map(shlex.quote, sys.argv)), "team": a.team, "flags": flags, "steps": a.steps,
              "rows": rows, "commit": commit.strip(), "cpu_affinity": sorted(os.sched_getaffinity(0)),
              "cpu_count": os.cpu_count(), "load_average_after": os.getloadavg(), "machine": platform.processor(),
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "torch": __import__("torch").__version__}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
