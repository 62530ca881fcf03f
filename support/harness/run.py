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
run at a time writes in a folder (support/harness/folder.py), rank 0 alone; an update that leaves a trainable tensor
non-finite is undone and skipped (step_if_finite); --max-bad-steps skipped steps in a row exit with code 3, the
checkpoint holding the last good weights; Ctrl-C (exit code 130) and SIGTERM (143) end in one line that names
the checkpoint's step and the command that resumes, within seconds even inside a long forward (folder.py);
--resume continues to the very numbers and files of a run never killed (support/harness/checkpoint.py,
tests/test_chaos.py); every file is written whole, never through a link, and a write the system refuses ends in
one line with exit code 4, nothing half-written left (lib/files.py, folder.py, tests/test_write_safety.py), the
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
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

import rewards
from experts import pick_device
from lib import distributed
from support.harness.checkpoint import keep_metrics_upto, load_checkpoint, read_log, save_checkpoint
from support.harness.checks import check_prompt_lengths, check_run
from support.harness.config import fail
from lib.files import append_lines, remove_stray_temporary_files, replaced_name, whole_write
from support.harness.export import export_run
from support.harness.folder import SignalState, claim_folders, let_go, restore_signals, run_paths, stop_on_signals
from support.harness.folder import stopped_message, writes_or_fail, writing_whole
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
    take --out and --expert-cache (folder.claim_folders), handle Ctrl-C and SIGTERM, and pick the device. Returns
    the run's Life; release_folders(life) lets go of --out however the run ends."""
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
        whole_write(paths["config"], {**vars(args), "team_models": run.team,
                                      "device_used": str(run.device), "processes": world.size})
        life.tracker = open_tracker(args, start)  # --track: each step's record, live (None without it)
        if args.eval_items and start == 0:  # the policy before training: B = 0 and W_out = 0, so C = 0
            before = validation_scores(run, args)
            whole_write(paths["validation"], {"items": args.eval_items, "before": before})
    return start


def resume_line(args, checkpoint, start, resuming, dropped):
    """What --resume does, in one line. Without a checkpoint in --out (a run stopped before its first) it starts
    at step 1, as the command a stopped run prints asks it to, rather than refusing."""
    if not resuming:
        return f"--resume: no checkpoint in {args.out}: starting at step 1 of {args.steps}"
    line = f"resuming at step {start + 1} of {args.steps} from {checkpoint}" if start < args.steps else \
        f"resuming: {checkpoint} holds step {start} of {args.steps}, no step left to run"
    return line + (f"; {dropped} log line(s) after it dropped (those steps run again)" if dropped else "")


def release_folders(life):
    """Let go of --out: the --track tracker closed, the lock removed, and the folders claim_folders made removed
    again if still empty."""
    tracker, life.tracker = life.tracker, None
    if tracker:
        tracker.close()
    let_go(life)
    handlers, life.signal_handlers = life.signal_handlers, None
    restore_signals(handlers)


def progress_bar(start, args, writer=True):
    """The tqdm bar of steps start..--steps; the loop calls bar.update(1) after each step."""
    from tqdm import tqdm
    return tqdm(initial=start, total=args.steps, desc="train", dynamic_ncols=True, disable=not writer)


def after_step(run, args, step, rec, batches, bar, bad_steps):
    """After the update: rank 0 writes a few completions of the step's first prompt (samples.jsonl), the
    step's metrics, its log line and the checkpoint; every rank stops (exit code 3) after --max-bad-steps
    non-finite steps in a row. `batches`: the step's, each with .questions, .items, .texts and .r. Returns
    the new count of non-finite steps in a row."""
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
    # the step's line and checkpoint are written whole (signals wait for them); a full disk: one line, exit
    # code 4, the last good checkpoint kept
    with writing_whole(life, args):
        append_lines(life.paths["metrics"], json.dumps({k: None if isinstance(v, float) and not np.isfinite(v)
                                                          else v for k, v in rec.items()}) + "\n")  # strict JSON
        if life.tracker:  # --track: the same record, live
            life.tracker.log(rec)
        say(life, log_line(rec, args.steps), bar)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps or stop:
            parts = (run.policy, run.method, run.optimizer, run.pool)
            save_checkpoint(life.paths["checkpoint"], step + 1, *parts)
    stop_if_stdout_refused(life, args)  # a stdout that refused the log line (| head, > /dev/full) stops it too
    if stop:  # the skipped steps left the weights as they were, and saved
        bar.close()  # so that the message gets a line of its own
        msg = (f"{bad_steps} steps in a row (--max-bad-steps) had a non-finite loss, gradient or update; stopped. "
               f"The last good weights are in {life.paths['checkpoint']}; try a lower --lr / --router-lr")
        if run.world.size > 1:  # the others stop with rank 0, not while it saves
            distributed.stop_together(run.world, msg, code=3)
        fail(msg, code=3)
    return bad_steps


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
    with writing_whole(life, args):  # whole lines: a signal waits for them
        append_lines(life.paths["samples"], "".join(lines))


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
            whole_write(life.paths["validation"], {"items": args.eval_items, "before": before, "after": after})
            say(life, validation_line(before, after))
        with replaced_name(os.path.join(args.out, "plot.png"), ".png") as tmp:
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

