"""
A run's life around its steps: check and build, write config.json, resume, log each step, save, finish.

The helpers train.py's loop calls (and each neighbour's script, neighbours/conductor.py and neighbours/rlae.py,
in a copy of that loop with its own g and step); each takes values, none the algorithm:

    life = open_run(args, world)          # checks, --out locked, Ctrl-C / SIGTERM handled, the device
    run = build_run(args, life.device)    # the script's own: a train.Run with its g
    start = resume_run(run, args, world)  # --resume's checkpoint, config.json, validation before
    for step in range(start, args.steps):
        rec, batches = grpo_step(step, run, args, score_batch)    # the script's own
        bad_steps = after_step(run, args, step, rec, batches, bar, bad_steps)  # samples, log, checkpoint
    finish_run(run, args)                 # the PEFT export, the plot, validation after
    release_folders(life)                 # however it ends: the lock on --out, --track's tracker

Nothing here is in the paper. What it guarantees (tests/test_hardening.py, tests/test_run_safety.py): bad input
exits with code 2 and one line on stderr before any model loads and before anything in --out is written; one
run at a time writes in a folder (support/harness/lock.py), rank 0 alone; an update that leaves a trainable tensor
non-finite is undone and skipped (step_if_finite); --max-bad-steps skipped steps in a row exit with code 3, the
checkpoint holding the last good weights; Ctrl-C (exit code 130) and SIGTERM (143) end in one line that names
the checkpoint's step and the command that resumes, within seconds even inside a long forward (support/harness/stop.py);
--resume continues to the very numbers and files of a run never killed (support/harness/checkpoint.py,
tests/test_chaos.py); every file is written whole, never through a link, and a write the system refuses ends in
one line with exit code 4, nothing half-written left (lib/files.py, tests/test_write_safety.py), the
expert cache's states too; a folder the user already had is refused, never written, and a failed first step's
files are removed only when its config and their own form show the run wrote them (checks.user_files_problem);
a closed or full stdout stops the run as a signal does (say, tests/test_user_files.py); every
prompt fits the policy's context before the first forward (support/harness/checks.py); --eval-items scores the policy
before and after training on the items evaluate.py scores for the seed.

Try it on CPU:  python -m pytest tests/test_hardening.py tests/test_run_safety.py tests/test_write_safety.py -q
"""
import contextlib
import json
import os
import shlex
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

import rewards
from experts import pick_device
from lib import distributed
from support.harness.checkpoint import checkpoint_step, keep_metrics_upto, load_checkpoint, read_log, save_checkpoint
from support.harness.checkpoint import sigkill_hook, write_json
from support.harness.checks import check_prompt_lengths, check_run, holds_a_run, user_files_problem
from support.harness.config import create_folder, fail, remove_created
from lib.files import PENDING, UnsafePath, WriteFailed, append_lines, exclusive_temporary, remove_quietly
from lib.files import link_in_run_folder, remove_stray_temporary_files, replaced_name
from support.harness.export import export_run
from support.harness.lock import LockHeld, release_lock, take_lock
from support.harness.stop import SignalState, answer_signals, restore_signals
from support.harness.track import open_tracker
from support.harness.metrics import log_line
from lib.runtime import hand_back_freed_memory
from support.harness.validation import validation_scores


@dataclass
class Life(SignalState):
    """A run's folder and how it is kept (train.Run.life): made by open_run, let go by release_folders.
    With SignalState's writing / signal / stopping, what Ctrl-C and SIGTERM read."""
    paths: dict = field(default_factory=dict)   # config, metrics, samples, checkpoint, validation: files in --out
    claim: Optional[dict] = None        # the lock on --out and the folders this run made (claim_folders)
    device: Any = None                  # this process's device
    signal_handlers: Any = None         # what restore_signals puts back
    tracker: Any = None                 # --track's live tracker; None without it
    writer: bool = True                 # rank 0: the one process that writes
    start: int = 0                      # this process's first step (--resume: the checkpoint's)
    stdout_refused: Optional[OSError] = None  # a write to stdout failed (a closed pipe, a full device): say()


def open_run(args, world):
    """Check everything that reads only (bad input exits with code 2 and one line, before any model loads),
    take --out (support/harness/lock.py) and --expert-cache, handle Ctrl-C and SIGTERM, and pick the device. Returns the
    run's Life; release_folders(life) lets go of --out however the run ends."""
    hand_back_freed_memory()  # lib/runtime.py
    replace_unencodable()
    life = Life(paths=run_paths(args.out), claim=claim_folders(args, world))
    stop_on_signals(life, args)
    try:
        try:
            check_run(args, world, life.paths["config"])
            life.device = distributed.rank_device(pick_device(args.device), world)  # --device cuda without one
        except (ValueError, FileNotFoundError) as e:  # loaders raise these with a one-line message
            fail(str(e))
        if world.rank == 0:
            say(life, f"run folder: {args.out}")
            stop_if_stdout_refused(life, args)
        return life
    except BaseException:
        release_folders(life)
        raise


def resume_run(run, args, world):
    """After the build: with --resume the checkpoint loaded and the log lines after it dropped; then (rank 0)
    config.json and, with --eval-items, the validation score before training. Returns the first step."""
    life, paths = run.life, run.life.paths
    try:
        resuming = args.resume and os.path.exists(paths["checkpoint"])  # killed before its first: step 0
        parts = (run.policy, run.method, run.optimizer, run.pool)
        start = load_checkpoint(paths["checkpoint"], *parts) if resuming else 0
        if args.resume and world.rank == 0:
            for name in ("metrics", "samples"):
                read_log(paths[name])
    except (ValueError, FileNotFoundError) as e:  # a log line that is not JSON fails here
        fail(str(e))
    if start > args.steps:
        fail(f"--steps {args.steps} is below the step {start} of the checkpoint in --out {args.out}")
    check_prompt_lengths(run, args, start)  # before the first forward: every prompt fits the policy's context
    # every process has checked everything; joining waits for all, so rank 0 writes only after that
    distributed.init(world, run.device)
    run.world, life.writer, life.start = world, world.rank == 0, start  # only rank 0 writes
    if not life.writer:
        return start
    # from here on we write: metrics after the checkpoint are dropped, each file replaced atomically
    remove_stray_temporary_files(args.out)  # left by a run killed while writing (SIGKILL, a power cut)
    with writes_or_fail(args):
        if args.resume:
            dropped = [keep_metrics_upto(paths[name], start) for name in ("metrics", "samples")][0]
            print(resume_line(args, paths["checkpoint"], start=start, resuming=resuming, dropped=dropped),
                  file=sys.stderr, flush=True)
        else:  # what a run that failed before its first step left: the run's own (checks.user_files_problem read
            # its config.json and each file, this process holding the lock); the same command starts it again
            for name in ("metrics", "samples", "validation"):
                if os.path.exists(paths[name]):
                    os.remove(paths[name])
        write_json(paths["config"], {**vars(args), "team_models": run.team,
                                     "device_used": str(run.device), "processes": world.size})
    life.tracker = open_tracker(args, start)  # --track: each step's record, live (None without it)
    if args.eval_items and start == 0:  # the policy before training: B = 0 and W_out = 0, so C = 0
        before = validation_scores(run, args)
        sigkill_hook("validation", 0)  # tests: a kill after validating, before its file
        with writes_or_fail(args):
            write_json(paths["validation"], {"items": args.eval_items, "before": before})
    return start


def resume_line(args, checkpoint, start, resuming, dropped):
    """What --resume does, in one line. Without a checkpoint in --out (a run stopped before its first) it starts
    at step 1, as the command a stopped run prints asks it to, rather than refusing."""
    if not resuming:
        return f"--resume: no checkpoint in {args.out}: starting at step 1 of {args.steps}"
    line = f"resuming at step {start + 1} of {args.steps} from {checkpoint}" if start < args.steps else \
        f"resuming: {checkpoint} holds step {start} of {args.steps}, no step left to run"
    return line + (f"; {dropped} log line(s) after it dropped (those steps run again)" if dropped else "")


@contextlib.contextmanager
def writes_or_fail(args):
    """A write the system refuses (a full disk, a read-only folder, a permission: lib/files.WriteFailed,
    its temporary file already removed) ends the run in one line, exit code 4, saying what to free and how
    to continue; a link planted in --out while the run ran, in one line, exit code 2."""
    try:
        yield
    except (WriteFailed, UnsafePath) as e:
        from tqdm import tqdm
        if any(not bar.disable for bar in tqdm._instances):  # the line gets a line of its own
            print(file=sys.stderr)
        if isinstance(e, UnsafePath):
            fail(f"--out {args.out}: {e}")
        fail(write_failed_message(e, args), code=4)


def write_failed_message(e, args):
    """What a failed write says: which file and why (and the flag, for --expert-cache's), what is kept, what to
    free, the command that continues."""
    paths, folder = run_paths(args.out), os.path.dirname(os.path.abspath(e.path))
    step = checkpoint_step(paths["checkpoint"])
    kept = f"{paths['checkpoint']} holds step {step}" if step is not None else "no checkpoint was written yet"
    again = (f"continue with: {resume_command(args)}" if os.path.exists(paths["config"]) and step is not None
             else "run the same command again")
    cache = args.expert_cache and os.path.abspath(args.expert_cache)
    flag = f"--expert-cache {args.expert_cache}: " if cache and folder.startswith(cache) else ""
    return (f"{flag}{e}; nothing half-written was left and {kept}. Free space on the disk that holds {folder} "
            f"(df -h {folder}) or make it writable, then {again}")


def claim_folders(args, world):
    """--out made if missing and locked by this process (rank 0; another run there: exit code 2 at once), and
    --expert-cache made and written to, before any model loads. Returns what release_folders undoes."""
    if world.rank != 0:
        return {"lock": None, "made": []}
    if os.path.lexists(args.out) and (msg := link_in_run_folder(args.out)):  # before the lock is written there
        fail(msg)
    if not args.resume and (msg := user_files_problem(args.out)):  # a folder of the user's: never written
        fail(msg)
    made = create_folder(args.out, "--out")
    try:
        lock = take_lock(args.out)
    except LockHeld as e:
        fail(f"--out {args.out} is in use by process {e} (another run writes there; one run per folder). If no "
             f"such process runs, delete {os.path.join(args.out, '.lock')}")
    except ValueError as e:  # .lock is a link or not a plain file
        fail(f"--out {args.out}: {e}")
    except OSError as e:
        remove_created(made)
        fail(f"--out {args.out} cannot be written ({type(e).__name__}: {e.strerror})")
    claim = {"lock": lock, "made": made}
    if args.expert_cache:
        try:
            claim_expert_cache(args.expert_cache)
        except SystemExit:
            release_folders(Life(claim=claim))
            raise
    return claim


def claim_expert_cache(path):
    """--expert-cache made if missing, written to once (a file made and removed) and its width files read, before
    any model loads (train.py, --precompute-states, evaluate.py): a bad one fails in one line, exit code 2."""
    create_folder(path, "--expert-cache")  # a file there, or in its way: one line
    try:
        fd, probe = exclusive_temporary(os.path.join(path, ".probe"))  # a file made, removed
        os.close(fd)
        remove_quietly(probe)
        PENDING.discard(probe)
    except WriteFailed as e:
        fail(f"--expert-cache {path} cannot be written ({type(e.error).__name__}: {e.error.strerror})")
    from lib.state_store import cache_problem
    if msg := cache_problem(path, "--expert-cache"):
        fail(msg)


def release_folders(life):
    """Let go of --out: the --track tracker closed, the lock removed, and the folders claim_folders made removed
    again if still empty."""
    tracker, life.tracker = life.tracker, None
    if tracker:
        tracker.close()
    let_go_of_folders(life)
    handlers, life.signal_handlers = life.signal_handlers, None
    restore_signals(handlers)


def let_go_of_folders(life):
    """The lock on --out removed, and the folders claim_folders made removed again if still empty."""
    claim, life.claim = life.claim, None
    if claim:
        release_lock(claim["lock"])
        remove_created(claim["made"])


def stop_on_signals(life, args):
    """Ctrl-C (SIGINT) and SIGTERM end the run with one line: the step the checkpoint on disk holds (it is
    written whole or not at all, so it is safe at any moment) and the command that continues from it; exit
    code 128 + the signal's number (130, 143), as a shell reports a process the signal ended. A step's log
    line, samples and checkpoint being written are finished first; nothing else is saved on the way out: what
    ran after the checkpoint is lost, and --resume runs it again. Within a few seconds even inside a forward
    that does not return for minutes (answer_signals). Under torchrun lib/distributed.py turns SIGTERM
    (another rank failed) into its own line."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return
    life.signal_handlers = answer_signals(life, lambda name: stopped_message(name, life, args),
                                          cleanup=lambda: let_go_of_folders(life))


def stopped_message(name, life, args):
    paths = life.paths
    if not os.path.exists(paths["config"]):
        return f"stopped by {name} before the run wrote anything; to start it, run the same command again"
    step, command = checkpoint_step(paths["checkpoint"]), resume_command(args)
    if step is None and not holds_a_run(args.out):
        return f"stopped by {name} before its first step ended: nothing to keep; run the same command again"
    if step is None:
        return (f"stopped by {name} before the first checkpoint (--save-every {args.save_every}): the steps "
                f"that ran are lost; start again from step 0 with: {command}")
    return (f"stopped by {name}: {paths['checkpoint']} is safe and holds step {step} of {args.steps} (any step "
            f"after it is lost and runs again); continue with: {command}")


def resume_command(args):
    """This process's command line with --resume: exact for a script started as `python SCRIPT.py ...`; for a
    run started another way (python -c, a notebook, a script that calls main) a description."""
    argv = sys.argv
    if os.path.basename(argv[0]) not in ("train.py", "conductor.py", "rlae.py"):
        return f"the same flags and --resume (--out {args.out})"
    return shlex.join(["python", *argv, *([] if "--resume" in argv else ["--resume"])])


def run_paths(out):
    names = {"config": "config.json", "metrics": "metrics.jsonl", "samples": "samples.jsonl",
             "checkpoint": "checkpoint.pt", "validation": "validation.json"}
    return {k: os.path.join(out, v) for k, v in names.items()}


def progress_bar(start, args, writer=True):
    """The tqdm bar of steps start..--steps; the loop calls bar.update(1) after each step."""
    from tqdm import tqdm
    return tqdm(initial=start, total=args.steps, desc="train", dynamic_ncols=True, disable=not writer)


def after_step(run, args, step, rec, batches, bar, bad_steps):
    """After the update: rank 0 writes a few completions of the step's first prompt (samples.jsonl), the
    step's metrics, its log line and the checkpoint; every rank stops (exit code 3) after --max-bad-steps
    non-finite steps in a row. `batches`: the step's, each with .questions, .items, .texts and .r. Returns
    the new count of non-finite steps in a row."""
    sigkill_hook("step", step + 1)  # tests: a kill after the update, before its log and checkpoint
    b = batches[0]  # a few completions of the step's first prompt, with their rewards
    write_samples(run, args, step, b.questions[0], answer=b.items[0].get("answer"), texts=b.texts,
                  rewards_trained=b.r)
    bad_steps = bad_steps + 1 if rec["skipped_update"] else 0
    stop = bad_steps >= args.max_bad_steps
    life = run.life
    if not life.writer:  # the other ranks took their share of the step; rank 0 logs and saves it
        if stop:  # rank 0 saves the checkpoint, says why, and every rank stops together
            distributed.stop_together(run.world, "", code=3)
        return bad_steps
    life.writing = True  # the step's line, samples and checkpoint are written whole: signals wait
    try:
        with writes_or_fail(args):  # a full disk: one line, exit code 4, the last good checkpoint kept
            append_lines(life.paths["metrics"], json.dumps({k: None if isinstance(v, float) and not np.isfinite(v)
                                                              else v for k, v in rec.items()}) + "\n")  # strict JSON
            if life.tracker:  # --track: the same record, live
                life.tracker.log(rec)
            say(life, log_line(rec, args.steps), bar)
            if (step + 1) % args.save_every == 0 or step + 1 == args.steps or stop:
                parts = (run.policy, run.method, run.optimizer, run.pool)
                save_checkpoint(life.paths["checkpoint"], step + 1, *parts)
    finally:
        life.writing = False
    raise_held_signal(life)  # Ctrl-C or SIGTERM came while writing: now it stops the run
    stop_if_stdout_refused(life, args)  # likewise a stdout that refused the log line (| head, > /dev/full)
    if stop:  # the skipped steps left the weights as they were, and saved
        bar.close()  # so that the message gets a line of its own
        msg = (f"{bad_steps} steps in a row (--max-bad-steps) had a non-finite loss, gradient or update; stopped. "
               f"The last good weights are in {life.paths['checkpoint']}; try a lower --lr / --router-lr")
        if run.world.size > 1:  # the others stop with rank 0, not while it saves
            distributed.stop_together(run.world, msg, code=3)
        fail(msg, code=3)
    return bad_steps


def raise_held_signal(life):
    """A signal held while a write ran (Life.signal) raised again now that the write is whole."""
    if life.signal:
        signum, life.signal = life.signal, None
        signal.raise_signal(signum)


def write_samples(run, args, step, question, answer, texts, rewards_trained):
    """Rank 0, every --sample-every steps, at the run's first and at its last: the first few completions of one
    prompt (texts [G], after --dynamic-sampling's re-draws) in samples.jsonl, with `reward` = the
    task's reward (what metrics.jsonl's reward averages) and, under --format-bonus,
    `reward_with_bonus` = rewards_trained [G], the reward GRPO trained on."""
    life = run.life
    if not life.writer or not ((step + 1) % args.sample_every == 0 or step in (life.start, args.steps - 1)):
        return
    n = min(args.group_size, 4)
    golds = [answer] * n if args.format_bonus_strict else None
    bonus = rewards.format_bonus(texts[:n], args.format_bonus, golds) if args.format_bonus else [0.0] * n
    lines = []
    for k in range(n):
        rec = {"step": step + 1, "question": question, "answer": answer, "completion": texts[k],
               "reward": rewards_trained[k].item() - bonus[k]}
        if args.format_bonus:
            rec["reward_with_bonus"] = rewards_trained[k].item()
        lines.append(json.dumps(rec) + "\n")
    life.writing = True  # whole lines: a signal waits for them
    try:
        with writes_or_fail(args):
            append_lines(life.paths["samples"], "".join(lines))
    finally:
        life.writing = False
    raise_held_signal(life)


def finish_run(run, args):
    """Rank 0, after the last step: the trained system (support/harness/export.py: the LoRA as a PEFT adapter
    with its base and tokenizer, g_phi's weights), the plot of the run and,
    with --eval-items, the validation score after training beside the one before."""
    life = run.life
    distributed.finish(run.world)  # the other ranks are done; rank 0 writes the rest alone
    if not life.writer:
        return args.out
    with writes_or_fail(args):
        export_run(args.out, run.policy, run.tok, run.method, args=args,
                   team=run.team)  # support/harness/export.py
    from support.harness.plot import plot_run
    say(life, f"run folder: {args.out} (metrics.jsonl, samples.jsonl, lora_peft/, g_phi.*, plot.png"
        f"{', validation.json' if args.eval_items else ''})")
    if args.eval_items:
        with open(life.paths["validation"]) as f:
            before = json.load(f)["before"]
        after = validation_scores(run, args)
        sigkill_hook("validation", args.steps)  # tests: a kill after validating, before its file
        scores = {"items": args.eval_items, "before": before, "after": after}
        with writes_or_fail(args):
            write_json(life.paths["validation"], scores)
        say(life, validation_line(before, after))
    with writes_or_fail(args), replaced_name(os.path.join(args.out, "plot.png"), ".png") as tmp:
        plot_run(args.out, name=os.path.basename(tmp))  # after the validation, whose scores it shows
    stop_if_stdout_refused(life, args)
    return args.out


# --------------------------------------------------------------------------------------------------
# Streams: stdout may be a pipe whose reader ends (`train.py | head -1`), a full device, or ASCII only


def replace_unencodable():
    """Text stdout and stderr cannot encode (PYTHONIOENCODING=ascii and a non-ASCII --out) is written with a
    replacement character, not raised."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")


def say(life, text, bar=None):
    """A line on stdout (above the progress bar `bar`, when there is one), flushed. A stdout that refuses it (a
    closed pipe, a full device) is noted in life.stdout_refused and sent to os.devnull from then on, so that
    nothing more fails there, not even at exit; stop_if_stdout_refused then ends the run as a signal does."""
    if life.stdout_refused:
        return
    try:
        bar.write(text) if bar is not None else print(text)
        sys.stdout.flush()
    except OSError as e:
        life.stdout_refused = e
        with contextlib.suppress(OSError, ValueError):  # a stdout without a file descriptor (a test's)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)


def stop_if_stdout_refused(life, args):
    """After the writes of a step (or of the start, or the end): a stdout that refused a line ends the run as
    Ctrl-C does, one line on stderr with the checkpoint's step and the command that continues; exit code 141
    (128 + SIGPIPE, as a shell reports `| head`'s writer) for a closed pipe, 4 for any other refusal (a full
    device), as for a file."""
    e = life.stdout_refused
    if e is None:
        return
    closed = isinstance(e, BrokenPipeError)
    why = "stdout closing (a pipe whose reader ended)" if closed else f"stdout refusing a line ({e.strerror or e})"
    fail(stopped_message(why, life, args), code=128 + signal.SIGPIPE if closed else 4)


def validation_line(before, after):
    better = sum(a > b for a, b in zip(after, before))
    worse = sum(a < b for a, b in zip(after, before))
    return (f"validation, {len(after)} items, greedy, the task's scorer: before training "
            f"{100 * np.mean(before):.1f} % -> after {100 * np.mean(after):.1f} % "
            f"({better} items better, {worse} worse)")

