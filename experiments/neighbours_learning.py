"""
Do the neighbours learn? The Conductor and RLAE trained per seed on the verdict's testbed, each beside the controls
that could produce its number without learning, scored on the same items: one resumable driver.

    # run (resumable: a run whose evaluation exists is skipped, a killed training continues with --resume):
    OMP_NUM_THREADS=1 taskset -c 1 python experiments/neighbours_learning.py --team pocket --seeds 0 1 2
    # analyse only: results/neighbours/runs -> results/neighbours/{table.md, table.json, *.png}
    python experiments/neighbours_learning.py --analyse
    # every part in about 3 minutes on one CPU core (the tiny random-init team; scores are 0):
    python experiments/neighbours_learning.py --team tiny --task chain_sum --task-config '{}' --seeds 0 1 \
        --n-eval 4 --out runs/try-neighbours --results runs/try-neighbours/results --single '' \
        --train-flags="--steps 2 --batch-size 1 --group-size 2 --max-new-tokens 4 --dataset-size 16 \
        --system-prompt simple"

Parts, for each seed (PARTS; --parts picks some):
  conductor_controls  nothing trained (experiments/neighbour_controls.py): the worked example's workflow run by
                      the same workers; each worker alone
  conductor           neighbours/conductor.py trained (constrained workflow decoding, its default), then evaluated
  rlae_controls       nothing trained: the uniform mixture; each member alone (fixed weights, the same decoder)
  rlae                neighbours/rlae.py trained, then evaluated
  rlae_random         RLAE trained on a fair coin per trajectory (--reward random): do its weights move too?

Every training takes the verdict's testbed and prompt flags (verdict.PROMPT) and the pocket protocol
(verdict.HYPER: G 4, 4 prompts a step, 15 steps, lr 1e-3 for LoRA and for RLAE's agent), without the verdict's
levers (format bonus, dynamic sampling), which the neighbours' own steps refuse; --train-flags comes last and
wins. The conductor's workers and RLAE's members are --team's generative models. Every evaluation is greedy on
the seed's first --n-eval validation items: the items the verdict's `single` of that seed is scored on, so any
two rows pair item by item. A finished run's records (config.json, metrics.jsonl, eval.json, and timing.json:
the wall time of its training and evaluation processes, measured here) are copied into RESULTS/runs; the table
and plots come from those alone (experiments/neighbours_table.py says how each number is made). Every input is
checked before anything is written: one line, exit code 2. A run folder already in --out or RESULTS/runs with
another protocol (PROTOCOL) is refused, never skipped as done.

Not experiments/neighbours.py: a script's own folder comes first on its sys.path, so a file of that name in
experiments/ would hide the neighbours/ package from every script there (neighbour_controls.py, rlae_members.py).
"""
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))

from neighbours_table import analyse, protocol  # noqa: E402
from support.checkpoint import write_json  # noqa: E402
from support.config import COUNT, ArgumentParser, fail, number  # noqa: E402
from verdict import HYPER, PROMPT, TESTBED_CONFIG, TESTBED_TASK  # noqa: E402

TASK, TASK_CONFIG = TESTBED_TASK, TESTBED_CONFIG  # the verdict's
PARTS = ["conductor_controls", "conductor", "rlae_controls", "rlae", "rlae_random"]
TRAINED = {"conductor": ("neighbours/conductor.py", []), "rlae": ("neighbours/rlae.py", []),
           "rlae_random": ("neighbours/rlae.py", ["--reward", "random"])}
RECORDS = ("config.json", "metrics.jsonl", "eval.json", "timing.json")
OWN_FLAGS = {"--task", "--task-config", "--team", "--seed", "--out", "--resume", "--reward"}  # the driver sets them
# the config fields every run of one --out (and one --results) shares: items, prompt, team, protocol
PROTOCOL = ("task", "task_config", "team", "system_prompt", "worked_example", "response_prefix", "context_position",
            "max_new_tokens", "steps", "batch_size", "grad_accum", "group_size", "lr", "router_lr", "dataset_size")


# ----------------------------------------------------------------------------------------------------------
# Running the parts (each a process of its own; the records archived as they finish)


def run_process(cmd, log):
    """Run `python cmd...` from the repository, its output appended to `log`. Returns its wall time (s)."""
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    with open(log, "a") as f:
        done = subprocess.run([sys.executable, *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        fail(f"{cmd[0]} exited with code {done.returncode}; its output is at the end of {log}", code=1)
    print(f"  done in {time.time() - t0:.0f} s", flush=True)
    return time.time() - t0


def archive(run_dir, into):
    dest = os.path.join(into, os.path.basename(run_dir))
    os.makedirs(dest, exist_ok=True)
    for name in RECORDS:
        if os.path.exists(os.path.join(run_dir, name)):
            shutil.copy2(os.path.join(run_dir, name), dest)


def train_and_evaluate(part, flags, out, n_eval, log, runner):
    """A trained part of one seed: train (or resume) unless finished, then evaluate; timing.json keeps both."""
    script, extra = TRAINED[part]
    timing_path = os.path.join(out, "timing.json")
    timing = json.load(open(timing_path)) if os.path.exists(timing_path) else {"train_seconds": 0.0}
    if not os.path.exists(os.path.join(out, "lora_peft", "adapter_config.json")):  # its training has not finished
        resume = ["--resume"] if os.path.exists(os.path.join(out, "config.json")) else []
        timing["train_seconds"] += runner([script, *flags, *extra, "--out", out, *resume], log)
        write_json(timing_path, timing)
    timing["eval_seconds"] = runner([script, "evaluate", "--run", out, "--n", str(n_eval)], log)
    write_json(timing_path, timing)


def check_folder(folder, want, flag):
    """Every run already in `folder` must have the protocol asked for: a run of another is never skipped as done."""
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name, "config.json")
        if os.path.exists(path):
            got = protocol(json.load(open(path)), PROTOCOL)
            bad = [k for k in PROTOCOL if got[k] != want[k]]
            if bad:
                fail(f"{flag} {folder} holds {name}, a run with --{bad[0].replace('_', '-')} {got[bad[0]]!r}, not "
                     f"{want[bad[0]]!r}; choose another {flag}")


def check_input(a, base):
    """Every flag, checked before anything is written (one line, exit code 2): the neighbours' own parsers read
    the training flags, the team's models must exist, the task must load."""
    import rewards
    from experts import check_models, team_models
    from neighbours import conductor, rlae
    seed = ["--seed", str(a.seeds[0]), "--out", os.path.join(a.out, "check")]
    conductor.parse_args(base + seed)
    rlae.parse_args(base + seed + ["--reward", "random"])
    args = rlae.parse_args(base + seed)
    team = team_models(args)
    try:
        check_models([(m, f"--team {a.team}") for m in [team["policy"], *team["experts"], team["router"]]])
        rewards.load_entries(args.task, "val", 1, a.seeds[0], args.data_path, args.task_config)
    except ValueError as e:
        fail(str(e))
    want = protocol(vars(args), PROTOCOL)
    check_folder(a.out, want, "--out")
    check_folder(os.path.join(a.results, "runs"), want, "--results")


def run_parts(a, base, runner):
    os.makedirs(a.out, exist_ok=True)
    log, into = os.path.join(a.out, "log.txt"), os.path.join(a.results, "runs")
    for seed in a.seeds:
        flags = base + ["--seed", str(seed)]
        for part in a.parts:
            if part.endswith("_controls"):
                method = part[:-len("_controls")]
                manifest = os.path.join(a.out, f"controls-{method}-s{seed}.json")
                if not os.path.exists(manifest):
                    runner(["experiments/neighbour_controls.py", method, "--n", str(a.n_eval), "--runs", a.out,
                            *flags], log)
                for folder in json.load(open(manifest))["folders"]:
                    archive(folder, into)
                continue
            out = os.path.join(a.out, f"{part}-s{seed}")
            if not os.path.exists(os.path.join(out, "eval.json")):
                train_and_evaluate(part, flags, out, a.n_eval, log, runner)
            archive(out, into)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(a.results, "provenance.txt"), "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M')} seeds {a.seeds} parts {a.parts} team {a.team} ran at commit "
                f"{commit}: {' '.join(shlex.quote(x) for x in base)}\n")


# ----------------------------------------------------------------------------------------------------------


def main(argv=None, runner=run_process):
    """`runner(cmd, log) -> seconds` runs one part's process (tests pass one that runs it in-process)."""
    p = ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--task", default=TASK, help="the testbed (default: the verdict's)")
    p.add_argument("--task-config", default=TASK_CONFIG, help="its reasoning-gym config, JSON")
    p.add_argument("--team", default="pocket", help="whose generative models are the conductor's workers and "
                   "RLAE's members (experts.py TEAMS; pocket-strong adds Qwen2.5-Coder-1.5B)")
    p.add_argument("--seeds", nargs="+", type=number(int, 0), default=[0, 1, 2], help="seeds (each its own items)")
    p.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS, help="a subset of the parts (default: all)")
    p.add_argument("--n-eval", type=COUNT, default=100, help="validation items per seed (the verdict's: 100)")
    p.add_argument("--train-flags", default="", help="more flags for every training and control, after the "
                   "protocol's (the last of a flag wins), e.g. --train-flags='--steps 5'")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "neighbours"), help="folder for the runs")
    p.add_argument("--results", default=os.path.join(ROOT, "results", "neighbours"), help="folder for the table, "
                   "plots and archived records (RESULTS/runs)")
    p.add_argument("--single", default=os.path.join(ROOT, "results", "verdict", "runs"), help="archived runs of the "
                   "verdict: its single-sN are compared with where they share our items ('' : none)")
    p.add_argument("--analyse", action="store_true", help="only read RESULTS/runs and write the table and plots")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if len(set(a.seeds)) != len(a.seeds):
        p.error(f"--seeds: each seed once, got {a.seeds}")
    try:
        if not isinstance(json.loads(a.task_config), dict):
            raise ValueError
    except ValueError:
        p.error(f"--task-config must be a JSON object, got {a.task_config!r}")
    given = {f.split("=")[0] for f in shlex.split(a.train_flags)} & OWN_FLAGS
    if given:
        p.error(f"--train-flags: {sorted(given)[0]} is set by this driver (its own flag, or the part's)")
    if not a.analyse:
        base = ["--task", a.task, "--task-config", a.task_config, *PROMPT, *HYPER, "--team", a.team,
                *shlex.split(a.train_flags)]
        check_input(a, base)
        run_parts(a, base, runner)
    print(analyse(a.results, a.single or None))


if __name__ == "__main__":
    main()
