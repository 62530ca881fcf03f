"""
Memory: the peak resident set size (RSS) of a command, and which phase of a run reaches it.

    python experiments/memory.py -- train.py --preset pocket --out runs/mem     # peak RSS only
    python experiments/memory.py --phases -- train.py --preset pocket --out runs/mem   # per phase

Nothing here is in the paper. Peak RSS is what decides whether a run fits on a laptop: the pages
of the process that sit in RAM at the worst moment, whoever allocated them (torch, the tokenizers,
a memory-mapped safetensors file, Python).

Two ways of measuring, both read from the kernel, neither sampled:
  1. Plain: the command runs as a child process; the kernel's high-water mark of its RSS comes back
     as resource.getrusage(RUSAGE_CHILDREN).ru_maxrss when it ends (kB on Linux).
  2. --phases: the child is this script again, which imports the command's script (it must have
     a main(), as train.py has), wraps the functions a training run calls (PHASES: loading each
     model, the state-norm fit, each validation, the rollout, the reference and policy passes,
     the backward pass, ...) and calls main(). At every
     phase boundary it reads VmHWM (the high-water mark) from /proc/self/status and resets it
     (writing 5 to /proc/self/clear_refs, Linux >= 4.0), so each phase's row is its own peak and
     "between phases" holds the peak of the code outside them. The run's peak is the largest
     row. A phase that runs inside another (the rollout inside a validation) counts in the outer
     one. Linux only.
The RSS of the child alone: a command that starts processes of its own is not summed.

Try it on CPU:  python experiments/memory.py --phases -- train.py --preset smoke --out /tmp/smoke
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
# (module, attribute, label): the functions metered as phases, in the order a run meets them. The
# first run's GGUF conversion runs in a process of its own (lib/pocket_models.py): its peak is
# the row "processes it started".
PHASES = [
    ("experts", "load_model", "load {0}"),
    ("support.harness.build", "load_model", "load {0}"),
    ("support.harness.build", "fit_state_norm", "state-norm fit (experts on the calibration prompts)"),
    ("adapter", "anchor_context", "anchor of C"),
    ("support.harness.run", "validation_scores", "validation"),
    ("train", "context_and_prompts", "experts + adapter: C of the batch"),
    ("rollout", "sample", "rollout (sampling)"),
    ("train", "reference_logprobs", "reference pass (no grad)"),
    ("rollout", "completion_logprobs", "policy pass (with grad)"),  # the reference wraps its own call
    ("torch", "Tensor.backward", "backward"),
    ("torch.optim", "AdamW.step", "optimizer step"),
    ("support.harness.run", "save_checkpoint", "checkpoint"),
    ("support.harness.export", "save_peft", "LoRA saved"),
]


def kib(field):
    """A field of /proc/self/status in kB (VmRSS: now, VmHWM: the high-water mark)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


class PhaseMeter:
    """Peak RSS per phase: read VmHWM at each boundary, then reset it to the current RSS."""

    def __init__(self):
        self.rows, self.depth, self.other = {}, 0, "between phases (start-up, logging, ...)"
        self.reset()

    def reset(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS

    def close(self, label):
        """Charge the high-water mark since the last boundary to `label`, and reset it."""
        row = self.rows.setdefault(label, {"peak_kb": 0, "calls": 0, "rss_after_kb": 0})
        row["peak_kb"] = max(row["peak_kb"], kib("VmHWM"))
        row["rss_after_kb"] = kib("VmRSS")
        self.reset()
        return row

    def wrap(self, f, label):
        def timed(*args, **kwargs):
            if self.depth:  # inside another phase: that one counts
                return f(*args, **kwargs)
            self.close(self.other)
            self.depth += 1
            try:
                return f(*args, **kwargs)
            finally:
                self.depth -= 1
                name = label.format(*args) if "{0}" in label else label
                if label == "validation":  # before and after training: two rows
                    seen = "validation before training" in self.rows
                    name = f"validation {'after' if seen else 'before'} training"
                self.close(name)["calls"] += 1
        return timed

    def install(self):
        import importlib
        for module, attr, label in PHASES:
            try:
                owner = importlib.import_module(module)
            except ImportError:
                continue
            *path, name = attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            setattr(owner, name, self.wrap(getattr(owner, name), label))


def child(report, command):
    """Import the script `command[0]` under its own module name (so that the phases wrapped in it
    are the ones its main() calls), wrap the phases and call its main() with `command` as
    sys.argv; write the rows to `report` (JSON) when it ends, however it ends."""
    import importlib.util
    sys.path.insert(0, ROOT)
    path = os.path.abspath(command[0])
    sys.path.insert(0, os.path.dirname(path))
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    script = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    meter = PhaseMeter()
    meter.install()
    sys.argv = command
    try:
        script.main()
    finally:
        meter.close(meter.other)
        # a process of its own that the run started and waited for (the first run's conversion)
        own = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        if own:
            meter.rows["processes it started (largest), e.g. the conversion"] = {
                "peak_kb": own, "calls": 0, "rss_after_kb": 0}
        with open(report, "w") as f:
            json.dump(meter.rows, f, indent=1)


def run(command, phases):
    """Run the command as a child; return (exit code, peak RSS kB, wall s, phase rows or None)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "phases.json")
        argv = [sys.executable, *command]
        if phases:
            argv = [sys.executable, os.path.abspath(__file__), "--child", report, "--", *command]
        t0 = time.time()
        code = subprocess.call(argv)
        wall = time.time() - t0
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # kB on Linux
        rows = None
        if phases and os.path.exists(report):
            with open(report) as f:
                rows = json.load(f)
            # the resets lower the kernel's own mark: the run's peak is its largest phase
            peak = max(r["peak_kb"] for r in rows.values())
    return code, peak, wall, rows


def table(rows):
    lines = [f"{'phase':58s} {'peak RSS':>10s} {'RSS after':>10s} {'calls':>6s}"]
    for name, r in rows.items():
        peak, after = r["peak_kb"] / 2**20, r["rss_after_kb"] / 2**20
        lines.append(f"{name[:58]:58s} {peak:6.2f} GiB {after:6.2f} GiB {r['calls']:6d}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description="Peak RSS of a command, optionally per phase.")
    ap.add_argument("--phases", action="store_true",
                    help="run the command under phase meters (a Python script) and print a table")
    ap.add_argument("--json", default=None, help="also write the result to this JSON file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: the metered child
    ap.add_argument("command", nargs="+", help="a Python script and its arguments, after --")
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.command)
    code, peak, wall, rows = run(args.command, args.phases)
    if rows:
        print(table(rows))
    print(f"peak RSS {peak} kB = {peak / 2**20:.2f} GiB | wall {wall:.0f} s | exit code {code}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": args.command, "peak_rss_kb": peak, "wall_s": round(wall, 1),
                       "exit_code": code, "phases": rows}, f, indent=1)
    sys.exit(code)


if __name__ == "__main__":
    main()
