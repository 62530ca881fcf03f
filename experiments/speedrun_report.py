"""
The speedrun's report (experiments/speedrun.py runs the races): from each run's (step, clock, score) trace, the
training seconds to each target; per contender and target the median over seeds with how many reached; ours
against single and against TRL seed by seed; the table (.md) and the plot (.png) beside the JSON.

    python experiments/speedrun_report.py results/speedrun.json         # the .md and .png again from the JSON

A run that never reached a target has time null. The median counts "not reached" as slower than any time, so it is
null when at least half the seeds did not reach, and the table says so in words. The paired comparison of a
against b uses the seeds both ran: the ratio of the medians; each seed's ratio and the exact sign-flip test of the
paired differences in seconds over the seeds where both reached (lib/stats.py; with 5 seeds p >= 0.0625);
and the exact sign test of which reached first (a seed where only one reached counts for it, where neither did it
is dropped).
"""
import contextlib
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lib import stats  # noqa: E402

ORDER = ("single", "ours", "trl")  # the contenders, first in every table; ablations after them


def key(target):
    return f"{target:g}"  # 0.30 -> "0.3": a target's name in the JSON


def times_to_targets(evals, targets):
    """{target: {seconds, step} of the first evaluation scoring >= target, or None when none did}."""
    out = {}
    for t in targets:
        first = next((e for e in evals if e["score"] >= t), None)
        out[key(t)] = first and {"seconds": first["seconds"], "step": first["step"]}
    return out


def median_or_null(times):
    """The median of times to a target over seeds (None: not reached), "not reached" counted as slower than any
    time: None when at least half the seeds did not reach (the middle one, or one of the middle two)."""
    times = list(times)
    m = statistics.median([math.inf if t is None else t for t in times]) if times else math.inf
    return None if math.isinf(m) else m


def summarise(runs, targets):
    """{label: {seconds_per_step, targets: {target: {median_seconds, reached, seeds, seconds, steps}}}}."""
    out = {}
    for label, by_seed in runs.items():
        seeds = sorted(by_seed, key=int)
        per_step = [by_seed[s]["seconds_per_step"] for s in seeds if by_seed[s]["seconds_per_step"]]
        out[label] = {"seconds_per_step": statistics.median(per_step) if per_step else None, "targets": {}}
        for t in map(key, targets):
            hit = {s: by_seed[s]["targets"][t] for s in seeds}
            out[label]["targets"][t] = dict(
                median_seconds=median_or_null(h and h["seconds"] for h in hit.values()),
                reached=sum(h is not None for h in hit.values()), seeds=len(seeds),
                seconds={s: h and h["seconds"] for s, h in hit.items()},
                steps={s: h and h["step"] for s, h in hit.items()})
    return out


def paired(a_runs, b_runs, target):
    """a against b on the seeds both ran: the ratio of medians, each seed's ratio and the sign-flip p of the
    paired differences (seeds both reached), the sign test of which reached first."""
    seeds = sorted(set(a_runs) & set(b_runs), key=int)
    ta = {s: (a_runs[s]["targets"][target] or {}).get("seconds") for s in seeds}
    tb = {s: (b_runs[s]["targets"][target] or {}).get("seconds") for s in seeds}
    both = [s for s in seeds if ta[s] is not None and tb[s] is not None]
    diffs = [ta[s] - tb[s] for s in both]
    faster = sum(ta[s] is not None and (tb[s] is None or ta[s] < tb[s]) for s in seeds)
    slower = sum(tb[s] is not None and (ta[s] is None or tb[s] < ta[s]) for s in seeds)
    ma, mb = median_or_null(ta.values()), median_or_null(tb.values())
    return dict(seeds=len(seeds), both_reached=len(both),
                ratio_of_medians=None if ma is None or mb is None else ma / mb, ratios={s: ta[s] / tb[s] for s in both},
                mean_difference_seconds=statistics.mean(diffs) if diffs else None,
                p_sign_flip=stats.sign_flip_p(diffs) if diffs else None, faster=faster, slower=slower,
                p_sign=stats.sign_test_p(faster, slower))


def analyse(runs, targets):
    """{contenders: summarise's, paired: ours vs single and ours vs trl per target} of {label: {seed: run}}."""
    return dict(contenders=summarise(runs, targets),
                paired={f"ours vs {b}": {key(t): paired(runs["ours"], runs[b], key(t)) for t in targets}
                        for b in ("single", "trl") if "ours" in runs and b in runs})


def ordered(runs):
    """The runs with the contenders first, in ORDER, then the ablations by name."""
    return {label: runs[label] for label in sorted(runs, key=lambda x: (ORDER.index(x) if x in ORDER else 3, x))}


def versions():
    """The installed versions of the packages a run's speed depends on."""
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for pkg in ("torch", "transformers", "trl", "peft"):
        with contextlib.suppress(PackageNotFoundError):
            out[pkg] = version(pkg)
    return out


def save(path, report):
    """The JSON, atomically, then the table and the plot beside it."""
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(markdown(report))
    plot(report, os.path.splitext(path)[0] + ".png")


def machine():
    """The CPU's model name, cores, and whether it has bf16 instructions (else bfloat16 is emulated)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return {"cores": os.cpu_count()}
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), None)
    return {"cpu": name, "cores": os.cpu_count(), "avx2": " avx2" in info,
            "bf16_instructions": "avx512_bf16" in info or "amx_bf16" in info}


def markdown(report):
    """One table per target: seconds (steps) per seed, the median with how many seeds reached, s/step; then the
    paired comparisons; a null median said in words."""
    m, runs = report["setup"]["measure"], report["runs"]
    seeds = sorted({s for r in runs.values() for s in r}, key=int)
    commits = sorted({r["commit"] for by_seed in runs.values() for r in by_seed.values()})
    cpu = report["setup"]["machine"]
    machine = (f"{cpu.get('cpu')}, {cpu.get('cores')} cores, "
               + ("bf16 instructions" if cpu.get("bf16_instructions") else "no bf16 instructions (bfloat16 emulated)")
               + "; " + ", ".join(f"{k} {v}" for k, v in report["setup"]["versions"].items()))
    out = [f"# Speedrun: training seconds to {' and '.join(f'{100 * t:g} %' for t in m['targets'])}", "",
           f"Greedy score on {m['items']} validation items; each run up to {m['max_steps']} steps or "
           f"{m['max_seconds']:g} training seconds; one thread; strict format bonus for every contender; rollout "
           f"{m['rollout_dtype']} for single and ours, float32 for TRL; team {m['team']}. Machine: {machine}; "
           f"commit(s) {', '.join(commits)}.",
           "`python experiments/bench.py --speedrun` (experiments/speedrun.py says how it measures).", ""]
    for t in map(key, m["targets"]):
        out += [f"## {100 * float(t):g} %", "",
                "| run | " + " | ".join(f"seed {s}" for s in seeds) + " | median s (reached) | s/step |",
                "|---" * (len(seeds) + 3) + "|"]
        nulls = []
        for label, by_seed in runs.items():
            c = report["contenders"][label]
            ct = c["targets"][t]
            cell = lambda h: "not reached" if h is None else f"{h['seconds']:.0f} s ({h['step']})"  # noqa: E731
            med = "null" if ct["median_seconds"] is None else f"{ct['median_seconds']:.0f}"
            out.append(f"| {label} | " + " | ".join(cell(by_seed[s]["targets"][t]) if s in by_seed else "–"
                                                   for s in seeds)
                       + f" | {med} ({ct['reached']}/{ct['seeds']}) | {c['seconds_per_step'] or 0:.1f} |")
            if ct["median_seconds"] is None:
                nulls.append(f"{label}: the median is null because {ct['seeds'] - ct['reached']} of {ct['seeds']} "
                             f"seeds did not reach {100 * float(t):g} %.")
        out += ["", *nulls] if nulls else []
        for name, by_target in report["paired"].items():
            p = by_target[t]
            ratio = "null" if p["ratio_of_medians"] is None else f"{p['ratio_of_medians']:.2f}"
            flip = "–" if p["p_sign_flip"] is None else f"{p['p_sign_flip']:.3g}"
            out += ["", f"{name}: ratio of medians {ratio}; per seed (both reached, {p['both_reached']} of "
                    f"{p['seeds']}) " + (", ".join(f"s{s} {r:.2f}" for s, r in p["ratios"].items()) or "none")
                    + f", sign-flip p {flip}; ours first on {p['faster']} seeds, {name.split()[-1]} on "
                    f"{p['slower']}, sign test p {p['p_sign']:.3g}."]
        out.append("")
    return "\n".join(out)


def plot(report, path):
    """Score against training seconds for every run, both targets as dashed lines (skipped without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        return print("matplotlib is not installed: no plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    colours, ablations = {"ours": "C0", "single": "C1", "trl": "C2"}, iter(f"C{k}" for k in range(3, 10))
    for label, runs in report["runs"].items():
        colour = colours.get(label) or next(ablations)
        for seed, r in runs.items():
            ax.plot([e["seconds"] for e in r["evals"]], [100 * e["score"] for e in r["evals"]],
                    "o-" if label in colours else "o:", color=colour, alpha=0.7, markersize=3,
                    label=label if seed == min(runs, key=int) else None)
    for t in report["setup"]["measure"]["targets"]:
        ax.axhline(100 * t, color="k", lw=0.8, ls="--")
        ax.annotate(f"{100 * t:g} %", (0, 100 * t), textcoords="offset points", xytext=(2, 2), fontsize=8)
    ax.set_xlabel("training seconds (one core; loading and evaluation excluded)")
    ax.set_ylabel(f"greedy validation score, % ({report['setup']['measure']['items']} items)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        saved = json.load(f)
    save(sys.argv[1], saved)
