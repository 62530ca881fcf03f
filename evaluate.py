"""
Evaluate a policy on the validation split: one run, the untrained policy, or one run three ways
(paired).

    python evaluate.py --run runs/pocket-first --n 200        # validation score of one run
    python evaluate.py --run runs/pocket-first --no-context   # zero context (Fig. 5)
    python evaluate.py --run runs/pocket-first --paired       # with C, C = 0, shuffled C
    python evaluate.py --untrained --task chain_sum --team pocket   # before training
    python evaluate.py --summarize runs/ --out results/       # table, rho (report.py), figures (plot.py)

Paper: the validation accuracy of Table 1 and Fig. 5 (with vs without context tokens).

Choices the paper leaves open:
  1. Validation decodes greedily (one completion per item), with the training prompt and generation
     budget.
  2. Accuracy is the mean reasoning-gym score (partial credit: reasoning-gym's score_answer is not
     binary); the exact-solve rate (score == 1) is reported beside it.
  3. "Without C" feeds zero tokens at the positions of C: exactly what the reference policy sees.
  4. --paired (not in the paper) asks whether C carries anything about *this* item: the same items
     with C, with C = 0 and with another item's C; paired differences with an exact sign test and a
     bootstrap interval over items, on the task score and on the log-probability of the gold answer.

A run's config.json is read with train.py's own checks (support/harness/checks.run_config) before any model
loads, and the --expert-cache it records is used only when named again here (evaluate.py writes where it is told).

Try it on CPU:  python -m pytest tests/test_collaboration.py -q -k paired
"""
import os
import textwrap
from types import SimpleNamespace

import numpy as np
import torch

from baselines import METHODS, kind
from experts import frozen_dtype, load_model, pick_device, team_models
from lib.files import UnsafePath, WriteFailed, link_in_run_folder, whole_write
from support.harness.checks import parse_args, run_config
from support.harness.config import (COUNT, HELP_WIDTH, SPLIT_SIZE, ArgumentParser, HelpFormatter, create_folder,
                                    fail, remove_created)
from support.harness.model_check import check_models
from support.harness.folder import claim_expert_cache, stopping_on_signals
from support.harness.plot import plot_runs
from support.harness.report import load_runs, summarize
from support.harness.run import replace_unencodable
from lib.stats import paired_comparison
from support.harness.validation import read_run, restore_trained, score_items, scored, summary, validation_items

# --------------------------------------------------------------------------------------------------
# Scoring a policy on the validation split


def load_policy(args, lora_state=None, method_state=None, untrained=False, device="cpu"):
    """The policy and the context builder g of a run (its config `args`: g is the --method's of
    baselines.py; a neighbour script loads its own run), with the trained weights loaded, in eval
    mode. Returns (policy, tokenizer, method, eos_ids)."""
    device = torch.device(device)
    dtype = frozen_dtype(getattr(args, "dtype", "auto"), device)
    team = args.team_models
    policy, tok = load_model(team["policy"], device, dtype)
    method = METHODS["single" if untrained else args.method](team, policy.config.hidden_size, args,
                                                             device, dtype)
    return restore_trained(policy, tok, method, args, lora_state=lora_state,
                           method_state=method_state, anchor=not untrained)


CONDITIONS = ("with_C", "zero_C", "shuffled_C")


@torch.no_grad()
def evaluate(args, n, batch_size=50, lora_state=None, method_state=None, no_context=False,
             untrained=False, device="cpu", conditions=None, share_prefix=True):
    """Score the policy described by `args` (a run's config) on n validation items, greedy. Returns
    a dict.

    `conditions` (a subset of CONDITIONS) scores the *same* items several ways and keeps every
    item's score and gold-answer log-prob, for paired comparisons: with_C (C as trained), zero_C
    (zero tokens at C's positions, what the reference policy sees) and shuffled_C (each item gets
    the C of another item, a seeded derangement over the n items: the same distribution of C, no
    information about this item)."""
    items = validation_items(args, n)
    policy, tok, method, eos_ids = load_policy(args, lora_state, method_state, untrained, device=device)
    conditions = conditions or ("zero_C" if no_context else "with_C",)
    per_item, status = score_items(policy, tok, method, eos_ids, items=items, args=args,
                                   conditions=conditions, batch_size=batch_size, share_prefix=share_prefix)
    result = scored(per_item, status, items, args, method_name="untrained" if untrained else args.method,
                    condition=conditions[0], no_context=no_context)
    sources = [it.get("metadata", {}).get("source_dataset", args.task) for it in items]
    if len(conditions) > 1:
        result["conditions"] = {c: {**summary(np.array(v["score"]), sources, per_dataset=False),
                                    "gold_logprob": float(np.mean(v["gold_logprob"]))}
                                for c, v in per_item.items() if "n/a" not in v}
        result["paired"] = paired_comparisons(per_item)
    return result


# --------------------------------------------------------------------------------------------------
# Paired statistics: the same items under two conditions


def paired_comparisons(per_item):
    """with_C against each other condition, for the task score and the gold answer's log-prob."""
    out = {}
    for other in ("zero_C", "shuffled_C"):
        if "with_C" in per_item and "n/a" in per_item.get(other, {}):
            out[f"with_C - {other}"] = {"n/a": per_item[other]["n/a"]}
        elif "with_C" in per_item and other in per_item:
            out[f"with_C - {other}"] = {
                k: paired_comparison(per_item["with_C"][k], per_item[other][k])
                for k in ("score", "gold_logprob")}
    return out


def paired_table(result):
    """The paired evaluation as Markdown: one row per condition, then the paired differences."""
    lines = ["| condition | score | solved | gold answer log-prob |", "|---|---|---|---|"]
    for c, v in result["conditions"].items():
        lines.append(f"| {c} | {100 * v['score']:.1f} | {100 * v['solve_rate']:.1f} | "
                     f"{v['gold_logprob']:.3f} |")
    lines += ["", "| paired difference | score (points) [95 % CI] | sign test p (better/worse) | "
              "gold log-prob [95 % CI] | sign test p |", "|---|---|---|---|---|"]
    for name, v in result["paired"].items():
        if "n/a" in v:
            lines.append(f"| {name} | {v['n/a']} | – | – | – |")
            continue
        s, g = v["score"], v["gold_logprob"]
        lines.append(f"| {name} | {100 * s['diff']:+.1f} [{100 * s['ci95'][0]:+.1f}, "
                     f"{100 * s['ci95'][1]:+.1f}] | {s['p_sign']:.3g} "
                     f"({s['better']}/{s['worse']}) | "
                     f"{g['diff']:+.3f} [{g['ci95'][0]:+.3f}, {g['ci95'][1]:+.3f}] | "
                     f"{g['p_sign']:.3g} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------


def main(argv=None):
    """evaluate.py's command line (a neighbour's run: its own script's `evaluate`)."""
    p = ArgumentParser(description=textwrap.fill(
        "Score runs on the validation split; summarise and plot folders of runs. With --untrained, any train.py "
        "flag (--task, --team, --policy, --task-config, prompt and generation flags) describes the policy to "
        "score.", HELP_WIDTH), formatter_class=HelpFormatter)  # train.py's --help: each default shown, once
    p.add_argument("--run", help="a run folder written by train.py")
    p.add_argument("--untrained", action="store_true", help="score the policy before training, as "
                   "train.py's flags describe it (e.g. --task chain_sum --team pocket "
                   "--worked-example)")
    p.add_argument("--n", type=SPLIT_SIZE, default=4000,
                   help="validation items (paper: 4000; GSM8K: its 1319 test items)")
    p.add_argument("--batch-size", type=COUNT, default=50, help="prompts per generation batch (on a "
                   "CPU, 50 decode a third faster per item than 16: one read of the weights serves "
                   "more rows)")
    p.add_argument("--no-context", action="store_true",
                   help="feed zero context tokens instead of C (Fig. 5)")
    p.add_argument("--paired", action="store_true", help="score the same items with C, with C = 0 "
                   "and with C shuffled across items; paired differences, sign tests and bootstrap "
                   "intervals -> eval_paired.json")
    p.add_argument("--summarize", nargs="+", metavar="FOLDER",
                   help="folders of runs -> table, Spearman rho, plots")
    p.add_argument("--out", default=None,
                   help="where to write (default: the run folder, or results/)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or mps")
    p.add_argument("--expert-cache", default=None, help="a folder of the experts' pooled states to read and "
                   "fill, as train.py's flag (default: none; the one a run's config.json records is not used "
                   "unless named here: evaluate.py writes only where it is told)")
    p.add_argument("--no-shared-prefix", action="store_true", help="run every item's whole prompt "
                   "(the evaluation before prefix sharing, bit for bit); by default the items' "
                   "common beginning runs once per batch")
    replace_unencodable()  # a non-ASCII path on an ASCII stdout: written with replacement characters
    a, train_flags = p.parse_known_args(argv)
    if sum(map(bool, (a.run, a.untrained, a.summarize))) != 1:
        p.error("give exactly one of --run DIR, --untrained or --summarize FOLDER...")
    if a.paired and a.no_context:
        p.error("--paired already scores C = 0 beside C; drop --no-context")
    if a.paired and not a.run:
        p.error("--paired needs --run DIR (a run with context tokens)")
    if train_flags and not a.untrained:
        p.error(f"unrecognized arguments: {' '.join(train_flags)} (train.py flags go with "
                "--untrained only)")
    if a.summarize:
        missing = [d for d in a.summarize if not os.path.isdir(d)]
        if missing:
            p.error(f"--summarize: no such folder {missing[0]}")
        try:
            if not load_runs(a.summarize):  # a run folder: config.json and metrics.jsonl together
                fail(f"--summarize: no run found under {', '.join(a.summarize)} (a run's folder holds config.json "
                     "and metrics.jsonl)")
        except ValueError as e:  # a metrics line that is not JSON (a torn last one is left out)
            fail(str(e))
        out = a.out or "results"
        create_folder(out, "--out")
        table, rho = summarize(a.summarize, out)
        print(table + f"\nSpearman rho(reward, entropy): mean {rho['mean']} over "
              f"{len(rho['per_run'])} runs")
        for path in plot_runs(a.summarize, out):
            print("wrote", path)
        return
    if a.untrained:
        targs = parse_args([*train_flags, "--method", "single"])
        cfg, state = {**vars(targs), "team_models": team_models(targs), "expert_cache": a.expert_cache}, {}
        flag = "--policy" if targs.policy else f"--team {targs.team}"
        models = [(cfg["team_models"]["policy"], flag)]
        path = os.path.join(a.out or "results", f"untrained-{targs.task}-{targs.team}.json")
    else:
        if os.path.lexists(a.run) and (msg := link_in_run_folder(a.run, "--run")):  # a link planted there
            fail(msg)
        # config.json through train.py's own checks (a neighbour's run: its own script), the checkpoint after
        cfg = {**run_config(a.run), "expert_cache": a.expert_cache}  # the recorded cache only if named here
        state = read_run(a.run)[1]
        experts = cfg["team_models"]["experts"] if kind(cfg["method"]).experts == "team" else []
        models = [(m, f"--run {a.run}") for m in [cfg["team_models"]["policy"]] + experts]
        name = "eval_paired.json" if a.paired else \
            "eval_no_context.json" if a.no_context else "eval.json"
        path = os.path.join(a.out or a.run, name)
    # where the result goes, checked (and made) before the evaluation runs, so that none is lost
    if a.expert_cache:  # checked (and made) as train.py checks it, before any folder is made for the result
        claim_expert_cache(a.expert_cache)
    flag = "--run" if a.run and not a.out else "--out"
    made = create_folder(os.path.dirname(path), flag)
    if os.path.isdir(path):
        fail(f"{flag}: {path} is a folder; the result is written to that file name")
    # Ctrl-C / SIGTERM: one line, exit code 130 / 143, within seconds, nothing half-written
    with stopping_on_signals(lambda name: f"stopped by {name}: nothing written (the result is written at the "
                             "end); run the same command again", cleanup=lambda: remove_created(made)):
        try:
            check_models(models)
            result = evaluate(SimpleNamespace(**cfg), a.n, a.batch_size, state.get("lora"),
                              method_state=state.get("method"), no_context=a.no_context,
                              untrained=a.untrained,
                              device=pick_device(a.device),
                              conditions=CONDITIONS if a.paired else None,
                              share_prefix=not a.no_shared_prefix)
        except (ValueError, FileNotFoundError) as e:  # unknown task, missing data or model, no CUDA
            remove_created(made)
            fail(str(e))
        except WriteFailed as e:  # --expert-cache on a full disk
            remove_created(made)
            fail(f"--expert-cache {a.expert_cache}: {e}; nothing half-written was left. Free space there (or make "
                 "it writable), then run the same command again", code=4)
        except SystemExit:  # a signal's line
            remove_created(made)
            raise
        if "step" in state:
            result["step"] = int(state["step"])
        try:
            whole_write(path, result)
            if a.paired:  # eval.json too: the with-C scores are the run's validation score
                whole_write(os.path.join(os.path.dirname(path), "eval.json"),
                            {**{k: v for k, v in result.items()
                                if k not in ("conditions", "paired", "per_item")},
                             "per_item": {"with_C": result["per_item"]["with_C"]}})
        except (WriteFailed, UnsafePath) as e:  # a full disk, a link planted in the run folder
            fail(f"{e}; nothing half-written was left. Free space there (or make it writable), then run "
                 "the same command again", code=4 if isinstance(e, WriteFailed) else 2)
    print(f"{result['method']} on {result['task']}: score {100 * result['score']:.1f} | "
          f"solved {100 * result['solve_rate']:.1f} | n {result['n']} -> {path}")
    if "paired" in result:
        print(paired_table(result))


if __name__ == "__main__":
    main()
