"""
A run killed at a chosen point, from outside the code it runs: the fault injector of experiments/bad_inputs.py's
chaos run and of the tests (test_hardening, test_run_safety, test_distributed, test_chaos). Nothing in train.py or
support/ knows of it: it wraps their functions in its own process, then runs the script there.

    python experiments/kill_at.py POINT:STEP[:SIGNAL] train.py FLAGS...     (or: ... POINT:STEP -c CODE ARGS...)

  step:N          after step N's update, before its samples, log line and checkpoint (the start of run.after_step)
  checkpoint:N    inside the write of step N's checkpoint: its temporary file written and flushed, not yet renamed
                  over checkpoint.pt (lib/files.replaced, under run.save_checkpoint)
  validation:N    after validating, before validation.json is written: N = 0 before training, N = --steps after

SIGNAL is SIGKILL unless given (SIGTERM, SIGINT): a SIGKILL is a power cut or the out-of-memory killer, the others
are what a scheduler or a user sends. The script runs in this process (runpy, as `python SCRIPT` runs it: sys.argv,
sys.path[0], __main__), so the run's process id, exit code and printed resume command are its own. arm(spec) wraps
the functions alone, for a script that arms itself (test_distributed's driver arms one rank). Nothing here is in
the paper.

Try it on CPU:  python experiments/kill_at.py step:2 train.py --preset smoke --eval-items 0 --out /tmp/k; echo $?
"""
import contextlib
import json
import os
import runpy
import signal
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POINTS = ("step", "checkpoint", "validation")


def arm(spec):
    """Wrap the functions at POINT so that the process sends itself SIGNAL there at STEP (spec POINT:STEP[:SIGNAL]).
    The wrapped names are those a script imports after this call (train.py and the neighbours import them at
    their start)."""
    point, step, name = (spec.split(":") + ["SIGKILL"])[:3]
    if point not in POINTS or not step.isdigit() or not hasattr(signal, name):
        sys.exit(f"kill_at: {spec!r} is not POINT:STEP[:SIGNAL] with POINT in {', '.join(POINTS)}")
    step, signum = int(step), getattr(signal, name)
    if ROOT not in sys.path:  # last: the script's own folder comes first, as without this launcher
        sys.path.append(ROOT)
    from lib import files
    from support.harness import run

    def kill():
        os.kill(os.getpid(), signum)

    if point == "step":
        after_step = run.after_step

        def killed_after_step(run_, args, at, *rest, **kw):  # `at`: the 0-based step whose update just ran
            if at + 1 == step:
                kill()
            return after_step(run_, args, at, *rest, **kw)
        run.after_step = killed_after_step
    elif point == "validation":
        whole_write = run.whole_write

        def killed_whole_write(path, obj):
            if os.path.basename(path) == "validation.json" and validated_at(path, obj) == step:
                kill()
            return whole_write(path, obj)
        run.whole_write = killed_whole_write
    else:
        save_checkpoint, replaced, saving = run.save_checkpoint, files.replaced, []

        def noted_save_checkpoint(path, at, *rest, **kw):
            saving[:] = [at]
            return save_checkpoint(path, at, *rest, **kw)

        @contextlib.contextmanager
        def killed_replaced(path, *rest, **kw):
            with replaced(path, *rest, **kw) as f:
                yield f
                if os.path.basename(path) == "checkpoint.pt" and saving == [step]:
                    f.flush()
                    kill()
        run.save_checkpoint, files.replaced = noted_save_checkpoint, killed_replaced


def validated_at(path, scores):
    """The step a validation.json write belongs to: 0 for the scores before training, else the run's --steps
    (its config.json, written before either)."""
    if "after" not in scores:
        return 0
    with open(os.path.join(os.path.dirname(path), "config.json")) as f:
        return json.load(f)["steps"]


def main(argv):
    if len(argv) < 2 or (argv[1] == "-c" and len(argv) < 3):
        sys.exit("usage: python experiments/kill_at.py POINT:STEP[:SIGNAL] SCRIPT.py ARGS... | -c CODE ARGS...")
    # sys.path[0], this launcher's folder, becomes what python gives the script: its folder, or "" for -c
    sys.path[0] = "" if argv[1] == "-c" else os.path.dirname(os.path.abspath(argv[1]))
    arm(argv[0])
    if argv[1] == "-c":  # as `python -c CODE ARGS...`: sys.argv[0] is "-c", the code runs in a module __main__
        sys.argv, main_module = ["-c", *argv[3:]], types.ModuleType("__main__")
        sys.modules["__main__"] = main_module
        exec(compile(argv[2], "<string>", "exec"), main_module.__dict__)
    else:  # as `python SCRIPT ARGS...`
        sys.argv = argv[1:]
        runpy.run_path(argv[1], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
