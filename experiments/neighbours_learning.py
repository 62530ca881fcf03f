"""
Do the neighbours learn? The Conductor and RLAE trained per seed on a testbed, each beside the controls that could
produce its number without learning, scored on the same items: one resumable driver.

    # run (resumable: a run whose evaluation exists is skipped, a killed training continues with --resume):
    OMP_NUM_THREADS=1 taskset -c 1 python experiments/neighbours_learning.py --seeds 0 1 2 3 4 5
    # analyse only: results/neighbours/gcd/runs -> results/neighbours/gcd/{table.md, table.json, *.png}
    python experiments/neighbours_learning.py --analyse
    # the first test (lcm, the pocket team's workers, results/neighbours/):
    python experiments/neighbours_learning.py --testbed lcm --seeds 0 1 2
    # every part in a few minutes on one CPU core (the tiny random-init team; scores are 0):
    python experiments/neighbours_learning.py --team tiny --workers '' --task chain_sum --task-config '{}' \
        --seeds 0 1 --n-eval 4 --out runs/try-neighbours --results runs/try-neighbours/results --single '' \
        --train-flags="--steps 2 --batch-size 1 --group-size 2 --max-new-tokens 4 --dataset-size 16 \
        --system-prompt simple"

Testbeds (TESTBEDS; --testbed):
  gcd  (default) the second verdict's: gcd of 2 numbers from 1 to 100, its answer-only prompt and exact reward
       (experiments/verdict2.py TASK, PROMPT), the workers / members Qwen2.5-Coder-0.5B-Instruct and SmolLM2-135M
       (WORKERS: 35 and 0 % exact alone on seed 0's 100 items; Qwen2.5-Coder-1.5B 82 %, Gemma-3-270M 9 %: the
       0.5B is the cheapest worker 20 points above the weakest), G 4 x 4 prompts x 12 steps (GCD_HYPER)
  lcm  the first verdict's (experiments/verdict.py TESTBED_*, PROMPT, HYPER: G 4) with --team's generative
       models (pocket: Gemma-3-270M, SmolLM2-135M): results/neighbours/, where both workers solve ~8 %

Where the untrained structures stand (so that RL has to move them to favour the strong worker): the strong worker
is "Model 0" and the weak one "Model 1", so the worked example's workflow (Model 0 solves, Model 1 checks and
gives the answer) ends with the weak worker's answer; RLAE's agent starts at the uniform mixture, 1/2 each.

Parts, for each seed (PARTS; --parts picks some):
  conductor_controls  nothing trained (experiments/neighbour_controls.py): the worked example's workflow run by
                      the same workers; each worker alone
  conductor           neighbours/conductor.py trained (constrained workflow decoding, its default), then evaluated
  conductor_random    the conductor trained on a fair coin per workflow (--reward random): does its worker choice
                      move too?
  rlae_controls       nothing trained: the uniform mixture; each member alone (fixed weights, the same decoder)
  rlae                neighbours/rlae.py trained, then evaluated
  rlae_random         RLAE trained on a fair coin per trajectory (--reward random): do its weights move too?

Every training takes the testbed's task, prompt flags and protocol, without the verdicts' levers (format bonus,
dynamic sampling), which the neighbours' own steps refuse; --train-flags comes last and wins. The conductor's
workers and RLAE's members are --workers (the testbed's; '' for --team's generative models). Every evaluation is
greedy on the seed's first --n-eval validation items: the items the verdicts' `single` of that seed is scored on,
so any two rows pair item by item. A finished run's records (config.json, metrics.jsonl, eval.json, and
timing.json: the wall time of its training and evaluation processes, measured here) are copied into RESULTS/runs;
the table and plots come from those alone (experiments/neighbours_table.py says how each number is made). Every
input is checked before anything is written: one line, exit code 2. A run folder already in --out or
RESULTS/runs with another protocol (PROTOCOL) is refused, never skipped as done.

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
from lib.files import whole_write  # noqa: E402
from support.harness.config import COUNT, ArgumentParser, fail, number  # noqa: E402
import verdict  # noqa: E402
import verdict2  # noqa: E402

WORKERS = "pocket:qwen2.5-coder-0.5b-instruct,pocket:smollm2-135m-instruct"  # strong first: "Model 0"
GCD_HYPER = ["--batch-size", "4", "--grad-accum", "1", "--group-size", "4", "--lr", "1e-3", "--router-lr", "1e-3",
             "--steps", "12", "--save-every", "3", "--dataset-size", "2000"]
TESTBEDS = {  # name -> (task, task config, prompt flags, protocol flags, workers, results folder)
    "gcd": (verdict2.TASK[1], verdict2.TASK[3], verdict2.PROMPT, GCD_HYPER, WORKERS, "neighbours/gcd"),
    "lcm": (verdict.TESTBED_TASK, verdict.TESTBED_CONFIG, verdict.PROMPT, verdict.HYPER, "", "neighbours"),
}
PARTS = ["conductor_controls", "conductor", "conductor_random", "rlae_controls", "rlae", "rlae_random"]
TRAINED = {"conductor": ("neighbours/conductor.py", []), "rlae": ("neighbours/rlae.py", []),
           "conductor_random": ("neighbours/conductor.py", ["--reward", "random"]),
           "rlae_random": ("neighbours/rlae.py", ["--reward", "random"])}
RECORDS = ("config.json", "metrics.jsonl", "eval.json", "timing.json")
OWN_FLAGS = {"--task", "--task-config", "--team", "--experts", "--seed", "--out", "--resume", "--reward"}
# the config fields every run of one --out (and one --results) shares: items, prompt, team, protocol
PROTOCOL = ("task", "task_config", "team", "experts", "system_prompt", "worked_example", "response_prefix", "context_position",
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
        whole_write(timing_path, timing)
    timing["eval_seconds"] = runner([script, "evaluate", "--run", out, "--n", str(n_eval)], log)
    whole_write(timing_path, timing)


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
    from experts import team_models
    from support.harness.model_check import check_models
    from neighbours import conductor, rlae
    seed = ["--seed", str(a.seeds[0]), "--out", os.path.join(a.out, "check")]
    conductor.parse_args(base + seed)
    rlae.parse_args(base + seed + ["--reward", "random"])
    args = rlae.parse_args(base + seed)
    team = team_models(args)
    try:
        by = "--workers" if a.workers else f"--team {a.team}"
        check_models([(team["policy"], f"--team {a.team}"), *[(m, by) for m in team["experts"]],
                      (team["router"], f"--team {a.team}")])
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
    p.add_argument("--testbed", default="gcd", choices=sorted(TESTBEDS), help="task, prompt, protocol and workers "
                   "(TESTBEDS; the flags below override its task and workers)")
    p.add_argument("--task", default=None, help="the task (default: the testbed's)")
    p.add_argument("--task-config", default=None, help="its reasoning-gym config, JSON (default: the testbed's)")
    p.add_argument("--team", default="pocket", help="the policy and RLAE's encoder, and with --workers '' the "
                   "workers: the team's generative models (experts.py TEAMS)")
    p.add_argument("--workers", default=None, help="comma-separated models: the conductor's workers and RLAE's "
                   "members besides the policy (default: the testbed's; '': --team's generative experts)")
    p.add_argument("--seeds", nargs="+", type=number(int, 0), default=[0, 1, 2], help="seeds (each its own items)")
    p.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS, help="a subset of the parts (default: all)")
    p.add_argument("--n-eval", type=COUNT, default=100, help="validation items per seed (the verdicts': 100)")
    p.add_argument("--train-flags", default="", help="more flags for every training and control, after the "
                   "protocol's (the last of a flag wins), e.g. --train-flags='--steps 5'")
    p.add_argument("--out", default=None, help="folder for the runs (default: runs/neighbours-TESTBED)")
    p.add_argument("--results", default=None, help="folder for the table, plots and archived records "
                   "(RESULTS/runs; default: the testbed's, results/neighbours/gcd or results/neighbours)")
    p.add_argument("--single", default=None, help="archived runs of a verdict: its single-sN are compared with where "
                   "they share our items and prompt ('' : none; default: the first verdict's, for lcm)")
    p.add_argument("--analyse", action="store_true", help="only read RESULTS/runs and write the table and plots")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    task, task_config, prompt, hyper, workers, results = TESTBEDS[a.testbed]
    a.task, a.task_config = a.task or task, task_config if a.task_config is None else a.task_config
    a.workers = workers if a.workers is None else a.workers
    a.out = a.out or os.path.join(ROOT, "runs", f"neighbours-{a.testbed}")
    a.results = a.results or os.path.join(ROOT, "results", results)
    if a.single is None:
        a.single = os.path.join(ROOT, "results", "verdict", "runs") if a.testbed == "lcm" else ""
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
        base = ["--task", a.task, "--task-config", a.task_config, *prompt, *hyper, "--team", a.team,
                *(["--experts", a.workers] if a.workers else []), *shlex.split(a.train_flags)]
        check_input(a, base)
        run_parts(a, base, runner)
    print(analyse(a.results, a.single or None))


if __name__ == "__main__":
    main()
