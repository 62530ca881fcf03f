"""
Seed-level comparison of methods: every seed's validation score, the mean over seeds, and each method minus
`single` (or --versus ROW) on the same seed (the same validation items), with an exact paired sign-flip test
over seeds (the primary figure), Holm-adjusted over a family of rows declared in advance (--family), and item
by item where both runs kept their items (a two-level bootstrap over seeds and items: descriptive only below
stats.MIN_SEEDS_FOR_BOOTSTRAP seeds, where its coverage is poor).

    python experiments/seeds.py results/pocket/runs --extra results/pocket/seeds_0-2.json --out results/pocket/seeds.md
    python experiments/seeds.py results/pocket/runs --versus "soft_prompt"     # e.g. the anchored soft prompt vs it
    python experiments/seeds.py RUNS --family "ours" "ours [state-norm]"        # the pre-registered family
    python experiments/seeds.py RUNS --split-by rollout_dtype --versus "single [rollout_dtype float32]"

Reads the eval.json of every run under the folders (as evaluate.py --summarize does; rows named by
report.method_key), plus, with --extra, per-seed scores recorded elsewhere ({"score": {row: {seed: percent}}}):
runs whose item-by-item records are gone can still enter at the seed level, and every such score is marked ‡ in
the table (no run record). Rows outside --family get no adjusted p: they are exploratory. Writes Markdown.
"""
import argparse
import json
import os
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from support.harness.report import load_runs, method_key, same_items_cell  # noqa: E402
from lib.stats import MIN_SEEDS_FOR_BOOTSTRAP, holm, mean_std, sign_flip_p  # noqa: E402


def scores_by_row(folders, extra, items=None, typed=None, split_by=()):
    """{row: {seed: score in percent}} from the runs' eval.json and the --extra file; `items`, if a dict, gets
    {row: {seed: [per-item score with C]}} for the runs that kept them; `typed`, if a set, gets the (row, seed)
    pairs that came from --extra (scores without a run record). `split_by`: config keys whose value joins the
    row's name (e.g. rollout_dtype: the same method with two samplers makes two rows)."""
    rows = {}
    for run in load_runs(folders):
        if "eval" in run:
            cfg = run["cfg"]
            row = method_key(cfg) + "".join(f" [{k} {cfg.get(k)}]" for k in split_by)
            seed = int(cfg["seed"])
            if seed in rows.get(row, {}):
                raise SystemExit(f"error: two runs of {row!r} with seed {seed} (one is {run['dir']}); "
                                 "--split-by a config key that tells them apart")
            rows.setdefault(row, {})[seed] = 100 * run["eval"]["score"]
            if items is not None and "per_item" in run["eval"]:
                items.setdefault(row, {})[seed] = run["eval"]["per_item"]["with_C"]["score"]
    for path in extra:
        with open(path) as f:
            for row, by_seed in json.load(f)["score"].items():
                for seed, v in by_seed.items():
                    if int(seed) in rows.get(row, {}):
                        raise SystemExit(f"error: {path}: {row} seed {seed} is also in the runs")
                    rows.setdefault(row, {})[int(seed)] = float(v)
                    if typed is not None:
                        typed.add((row, int(seed)))
    return rows


def same_items(mine, theirs):
    """Mean over seeds of (score - the other row's score) on the same items, with its 95 % two-level bootstrap
    interval (report.same_items_cell), and how many seeds had their items; '–' if none."""
    cell, n = same_items_cell(mine, theirs)
    return f"{cell} ({n})" if n else cell


def table(rows, items=None, versus="single", family=(), typed=()):
    """Markdown: one row per method. `family`: the rows whose difference to `versus` is a pre-declared test (Holm
    over them); `typed`: the (row, seed) scores without a run record, marked ‡."""
    items, typed = items or {}, set(typed)
    seeds = sorted({s for v in rows.values() for s in v})
    base = rows.get(versus, {})
    diffs = {row: [rows[row][s] - base[s] for s in rows[row] if s in base]
             for row in rows if row != versus}
    tested = [row for row in family if len(diffs.get(row, [])) > 1]
    adjusted = dict(zip(tested, holm([sign_flip_p(diffs[row]) for row in tested])))
    lines = ["| method | " + " | ".join(f"s{s}" for s in seeds) + f" | mean ± std | − {versus}, same seeds "
             "(mean ± std) | better / worse seeds | exact sign-flip p (primary) | Holm p (family) | "
             f"− {versus}, same items [two-level bootstrap 95 %] (seeds) | seeds |",
             "|---|" + "---|" * (len(seeds) + 7)]
    for row in sorted(rows):
        v = rows[row]
        m, sd = mean_std(list(v.values()))
        cells = [f"{v[s]:.1f}" + ("‡" if (row, s) in typed else "") if s in v else "–" for s in seeds]
        d = diffs.get(row, [])
        if len(d) > 1:
            dm, dsd = mean_std(d)
            holm_cell = f"{adjusted[row]:.3g}" if row in adjusted else "exploratory"
            vs = (f"{dm:+.1f} ± {dsd:.1f} | {sum(x > 0 for x in d)} / {sum(x < 0 for x in d)} | "
                  f"{sign_flip_p(d):.3g} | {holm_cell}")
        else:
            vs = "– | – | – | –"
        paired = same_items(items.get(row, {}), items.get(versus, {})) if row != versus else "–"
        lines.append(f"| {row} | " + " | ".join(cells) + f" | {m:.1f} ± {sd:.1f} | {vs} | {paired} | {len(v)} |")
    notes = [f"The exact sign-flip test over seeds is the primary figure; the item-level interval is descriptive "
             f"below {MIN_SEEDS_FOR_BOOTSTRAP} seeds (it resamples too few seeds to cover)."]
    if family:
        notes.append(f"Holm family (declared in advance): {', '.join(family)}; every other row is exploratory.")
    if typed:
        notes.append("‡ no run record: a score recorded from text (see its provenance file), not from an eval.json.")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", help="folders of runs (train.py outputs or their archived records)")
    p.add_argument("--extra", nargs="*", default=[], help="JSON files of per-seed scores without run records")
    p.add_argument("--versus", default="single", help="the row every other row is compared with, seed by seed")
    p.add_argument("--family", nargs="*", default=[], help="rows whose difference to --versus is a test declared "
                   "in advance: their sign-flip p are Holm-adjusted together; the other rows are exploratory")
    p.add_argument("--split-by", nargs="*", default=[], help="config keys whose value names a row too, e.g. "
                   "rollout_dtype: row 'single [rollout_dtype int8]' beside 'single [rollout_dtype float32]'")
    p.add_argument("--out", default=None, help="write the Markdown table here too")
    a = p.parse_args()
    missing = [d for d in a.folders + a.extra if not os.path.exists(d)]
    if missing:
        p.error(f"no such file or folder: {missing[0]}")
    items, typed = {}, set()
    rows = scores_by_row(a.folders, a.extra, items, typed, a.split_by)
    for row in [a.versus] + a.family:
        if row not in rows:
            p.error(f"{'--versus' if row == a.versus else '--family'} {row!r}: no such row; rows: {', '.join(sorted(rows))}")
    md = table(rows, items, a.versus, a.family, typed)
    print(md)
    if a.out:
        with open(a.out, "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
