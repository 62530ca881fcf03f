"""
Seed-level comparison of methods: every seed's validation score, the mean over seeds, and each method minus
`single` on the same seed (the same validation items), with an exact paired sign-flip test over seeds.

    python experiments/seeds.py results/pocket/runs --extra results/pocket/seeds_0-2.json --out results/pocket/seeds.md

Reads the eval.json of every run under the folders (as evaluate.py --summarize does; rows named by
report.method_key), plus, with --extra, per-seed scores recorded elsewhere ({"score": {row: {seed: percent}}}):
runs whose item-by-item records are gone can still enter at the seed level. evaluate.py --summarize gives the
item-level statistics (paired columns, two-level bootstrap) for the runs that have them. Writes Markdown.
"""
import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from report import load_runs, method_key  # noqa: E402
from stats import mean_std, sign_flip_p  # noqa: E402


def scores_by_row(folders, extra):
    """{row: {seed: score in percent}} from the runs' eval.json and the --extra file."""
    rows = {}
    for run in load_runs(folders):
        if "eval" in run:
            rows.setdefault(method_key(run["cfg"]), {})[int(run["cfg"]["seed"])] = 100 * run["eval"]["score"]
    for path in extra:
        with open(path) as f:
            for row, by_seed in json.load(f)["score"].items():
                for seed, v in by_seed.items():
                    if int(seed) in rows.get(row, {}):
                        raise SystemExit(f"error: {path}: {row} seed {seed} is also in the runs")
                    rows.setdefault(row, {})[int(seed)] = float(v)
    return rows


def table(rows):
    seeds = sorted({s for v in rows.values() for s in v})
    single = rows.get("single", {})
    lines = ["| method | " + " | ".join(f"s{s}" for s in seeds) + " | mean ± std | − single, same seeds "
             "(mean ± std) | better / worse seeds | sign-flip p | seeds |", "|---|" + "---|" * (len(seeds) + 5)]
    for row in sorted(rows):
        v = rows[row]
        m, sd = mean_std(list(v.values()))
        cells = [f"{v[s]:.1f}" if s in v else "–" for s in seeds]
        both = [s for s in v if s in single]
        if row != "single" and len(both) > 1:
            d = [v[s] - single[s] for s in both]
            dm, dsd = mean_std(d)
            vs = (f"{dm:+.1f} ± {dsd:.1f} | {sum(x > 0 for x in d)} / {sum(x < 0 for x in d)} | "
                  f"{sign_flip_p(d):.3g}")
        else:
            vs = "– | – | –"
        lines.append(f"| {row} | " + " | ".join(cells) + f" | {m:.1f} ± {sd:.1f} | {vs} | {len(v)} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", help="folders of runs (train.py outputs or their archived records)")
    p.add_argument("--extra", nargs="*", default=[], help="JSON files of per-seed scores without run records")
    p.add_argument("--out", default=None, help="write the Markdown table here too")
    a = p.parse_args()
    missing = [d for d in a.folders + a.extra if not os.path.exists(d)]
    if missing:
        p.error(f"no such file or folder: {missing[0]}")
    md = table(scores_by_row(a.folders, a.extra))
    print(md)
    if a.out:
        with open(a.out, "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
