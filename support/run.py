"""
A run's life around its steps: check and build, write config.json, resume, log each step, save, finish.

train.py's main, and the two neighbours' (neighbours/conductor.py, neighbours/rlae.py), each hold their own loop
and call these helpers around it; each helper takes values, none takes the algorithm:

    run = open_run(args, world)                 # checks, --out locked, Ctrl-C / SIGTERM handled, the device
    try:
        run.update(build_run(args, run["device"]))   # the script's own build
        start = resume_run(run, args, world)    # --resume's checkpoint, config.json, validation before
        for step in range(start, args.steps):
            rec, batches = grpo_step(step, run, args, score_batch)    # the script's own algorithm
            write_samples(run, args, step, question, answer, texts, rewards)  # of its first prompt
            bad_steps = after_step(run, args, step, rec, bar, bad_steps)   # log line, metrics, --track, checkpoint
        return finish_run(run, args)            # the PEFT export, the plot, validation after
    finally:
        release_folders(run)                    # the lock on --out, and --track's tracker closed

Nothing here is in the paper. What it guarantees (tests/test_hardening.py, tests/test_run_safety.py): bad input
exits with code 2 and one line on stderr before any model loads and before anything in --out is written; one
run at a time writes in a folder (support/lock.py), rank 0 alone; an update that leaves a trainable tensor
non-finite is undone and skipped (step_if_finite); --max-bad-steps skipped steps in a row exit with code 3, the
checkpoint holding the last good weights; Ctrl-C (exit code 130) and SIGTERM (143) end in one line that names
the checkpoint's step and the command that resumes, within seconds even inside a long forward (support/stop.py);
--resume continues to the very numbers and files of a run never killed (support/checkpoint.py,
tests/test_chaos.py); every file is written whole, never through a link, and a write the system refuses ends in
one line with exit code 4, nothing half-written left (support/files.py, tests/test_write_safety.py); every
prompt fits the policy's context before the first forward (check_prompt_lengths); --eval-items scores the policy
before and after training on the items evaluate.py scores for the seed.

Try it on CPU:  python -m pytest tests/test_hardening.py tests/test_run_safety.py tests/test_write_safety.py -q
"""
import contextlib
import ctypes
import json
import os
import shlex
import signal
import sys
import threading
import time

import numpy as np
import torch

import rewards
from adapter import context_probes
from experts import pick_device
from support import distributed
from support.checkpoint import checkpoint_step, keep_metrics_upto, load_checkpoint, read_log, save_checkpoint
from support.checkpoint import sigkill_hook, write_json
from support.config import check_run, create_folder, fail, folder_problem, holds_a_run, remove_created
from support.files import PENDING, UnsafePath, WriteFailed, append_lines, exclusive_temporary, remove_quietly
from support.files import link_in_run_folder, remove_stray_temporary_files, replaced_name
from support.export import export_run
from support.lock import LockHeld, release_lock, take_lock
from support.stop import answer_signals, restore_signals
from support.track import open_tracker
from support.validation import validation_scores


def hand_back_freed_memory():
    """Ask glibc's allocator to give every block of 1 MiB or more a mapping of its own, so that a
    freed tensor's memory goes back to the system at once. By default glibc raises that threshold
    as large blocks are freed (up to 32 MiB) and keeps freed blocks for reuse, and a run's RSS
    keeps what its largest moment needed: the first command's validation before training peaked
    at 3.70 GiB, with this setting at 3.08 GiB, the same 100 scores in the same time
    (results/performance.md). It changes no number. Nothing happens where the C library is not
    glibc (macOS, Windows)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_MMAP_THRESHOLD = -3  # glibc's malloc.h
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)


def open_run(args, world):
    """Check everything that reads only (bad input exits with code 2 and one line, before any model loads),
    take --out (support/lock.py) and --expert-cache, handle Ctrl-C and SIGTERM, and pick the device. Returns the
    run dict the script then builds into; release_folders(run) lets go of --out however the run ends."""
    hand_back_freed_memory()
    run = {"paths": run_paths(args.out), "claim": claim_folders(args, world)}
    stop_on_signals(run, args)
    try:
        try:
            check_run(args, world, run["paths"]["config"])
            run["device"] = distributed.rank_device(pick_device(args.device), world)  # --device cuda without one
        except (ValueError, FileNotFoundError) as e:  # loaders raise these with a one-line message
            fail(str(e))
        if world.rank == 0:
            print(f"run folder: {args.out}", flush=True)
        return run
    except BaseException:
        release_folders(run)
        raise


def resume_run(run, args, world):
    """After the build: with --resume the checkpoint loaded and the log lines after it dropped; then (rank 0)
    config.json and, with --eval-items, the validation score before training. Returns the first step."""
    paths = run["paths"]
    try:
        resuming = args.resume and os.path.exists(paths["checkpoint"])  # killed before its first: step 0
        parts = (run["policy"], run["method"], run["optimizer"], run["pool"])
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
    distributed.init(world, run["device"])
    run.update(world=world, writer=world.rank == 0, start=start)  # only rank 0 writes
    if not run["writer"]:
        return start
    # from here on we write: metrics after the checkpoint are dropped, each file replaced atomically
    remove_stray_temporary_files(args.out)  # left by a run killed while writing (SIGKILL, a power cut)
    with writes_or_fail(run, args):
        if args.resume:
            for name in ("metrics", "samples"):
                dropped = keep_metrics_upto(paths[name], start)
                if dropped and name == "metrics":
                    print(f"resume: from step {start}; {dropped} log line(s) after it dropped (those steps run "
                          "again)", file=sys.stderr, flush=True)
        else:  # what a run that failed before its first step may have left (check_run let it start again)
            for name in ("metrics", "samples", "validation"):
                if os.path.exists(paths[name]):
                    os.remove(paths[name])
        write_json(paths["config"], {**vars(args), "team_models": run["team"],
                                     "device_used": str(run["device"]), "processes": world.size})
    run["tracker"] = open_tracker(args, start)  # --track: each step's record, live (None without it)
    if args.eval_items and start == 0:  # the policy before training: B = 0 and W_out = 0, so C = 0
        before = validation_scores(run, args)
        sigkill_hook("validation", 0)  # tests: a kill after validating, before its file
        with writes_or_fail(run, args):
            write_json(paths["validation"], {"items": args.eval_items, "before": before})
    return start


@contextlib.contextmanager
def writes_or_fail(run, args):
    """A write the system refuses (a full disk, a read-only folder, a permission: support/checkpoint.WriteFailed,
    its temporary file already removed) ends the run in one line, exit code 4, saying what to free and how to
    continue; a link planted in --out while the run ran, in one line, exit code 2."""
    try:
        yield
    except (WriteFailed, UnsafePath) as e:
        from tqdm import tqdm
        if any(not bar.disable for bar in tqdm._instances):  # the line gets a line of its own
            print(file=sys.stderr)
        if isinstance(e, UnsafePath):
            fail(f"--out {args.out}: {e}")
        fail(write_failed_message(e, run, args), code=4)


def write_failed_message(e, run, args):
    """What a failed write says: which file and why, what is kept, what to free, the command that continues."""
    paths, folder = run["paths"], os.path.dirname(os.path.abspath(e.path))
    step = checkpoint_step(paths["checkpoint"])
    kept = f"{paths['checkpoint']} holds step {step}" if step is not None else "no checkpoint was written yet"
    again = (f"continue with: {resume_command(args)}" if os.path.exists(paths["config"]) and step is not None
             else "run the same command again")
    return (f"{e}; nothing half-written was left and {kept}. Free space on the disk that holds {folder} "
            f"(df -h {folder}) or make it writable, then {again}")


def check_prompt_lengths(run, args, start):
    """Every prompt the run will read, tokenised as the policy reads it (the question in the --system-prompt,
    --worked-example and --response-prefix, then the --num-latents context tokens and --max-new-tokens), must
    fit the policy's context (max_position_embeddings): one too long fails here, naming the item and the flags,
    before the first forward; a forward over a 1 MB question never ended and ignored SIGTERM. The experts read
    the question truncated to their own context (experts.ExpertPool), and output_collab's hints are bounded by
    --max-new-tokens but not counted here. Checks this run's training items (steps start..--steps) and its
    --eval-items validation items."""
    limit = getattr(run["policy"].config, "max_position_embeddings", None) or \
        getattr(run["policy"].config, "n_positions", None)
    if not limit:
        return
    items = run["train_items"]
    picks = sorted({i for step in range(start, args.steps) for micro in range(args.grad_accum)
                    for i in rewards.batch_indices(step, micro, args.batch_size, args.grad_accum, len(items),
                                                   args.seed)})
    checked = [("training item", i, items[i]["question"]) for i in picks]
    if args.eval_items:
        from support.validation import validation_items
        checked += [("validation item", i, it["question"])
                    for i, it in enumerate(validation_items(args, args.eval_items))]
    extra = (args.num_latents if args.method not in ("single", "output_collab") else 0) + args.max_new_tokens
    for s in range(0, len(checked), 256):
        chunk = checked[s:s + 256]
        prompts = rewards.policy_prompts(run["tok"], [q for _, _, q in chunk], [None] * len(chunk), args)
        lengths = [len(ids) for ids in run["tok"](prompts, add_special_tokens=False)["input_ids"]]
        for (kind, i, question), n in zip(chunk, lengths):
            if n + extra > limit:
                fail(f"the {kind} {i} ({len(question)} characters: {question[:40]!r}...) is {n} tokens in the "
                     f"policy's prompt; with --num-latents and --max-new-tokens {args.max_new_tokens} that is "
                     f"{n + extra}, above the policy's context of {limit} tokens: shorten it (--task-config, "
                     "--data-path, --response-prefix, --system-prompt) or lower --max-new-tokens")


def claim_folders(args, world):
    """--out made if missing and locked by this process (rank 0; another run there: exit code 2 at once), and
    --expert-cache made and written to, before any model loads. Returns what release_folders undoes."""
    if world.rank != 0:
        return {"lock": None, "made": []}
    if os.path.lexists(args.out) and (msg := link_in_run_folder(args.out)):  # before the lock is written there
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
            if msg := folder_problem(args.expert_cache, "--expert-cache"):
                raise ValueError(msg)
            os.makedirs(args.expert_cache, exist_ok=True)
            fd, probe = exclusive_temporary(os.path.join(args.expert_cache, ".probe"))  # a file made, removed
            os.close(fd)
            remove_quietly(probe)
            PENDING.discard(probe)
        except WriteFailed as e:
            release_folders({"claim": claim})
            fail(f"--expert-cache {args.expert_cache} cannot be written ({type(e.error).__name__}: "
                 f"{e.error.strerror})")
        except (OSError, ValueError) as e:
            release_folders({"claim": claim})
            fail(str(e) if isinstance(e, ValueError) else
                 f"--expert-cache {args.expert_cache} cannot be written ({type(e).__name__}: {e.strerror})")
    return claim


def release_folders(run):
    """Let go of --out: the --track tracker closed, the lock removed, and the folders claim_folders made removed
    again if still empty."""
    tracker = run.pop("tracker", None)
    if tracker:
        tracker.close()
    let_go_of_folders(run)
    restore_signals(run.pop("signal_handlers", None))


def let_go_of_folders(run):
    """The lock on --out removed, and the folders claim_folders made removed again if still empty."""
    claim = run.get("claim")
    if claim:
        release_lock(claim["lock"])
        remove_created(claim["made"])
        run["claim"] = None


def stop_on_signals(run, args):
    """Ctrl-C (SIGINT) and SIGTERM end the run with one line: the step the checkpoint on disk holds (it is
    written whole or not at all, so it is safe at any moment) and the command that continues from it; exit
    code 128 + the signal's number (130, 143), as a shell reports a process the signal ended. A step's log
    line, samples and checkpoint being written are finished first; nothing else is saved on the way out: what
    ran after the checkpoint is lost, and --resume runs it again. Within a few seconds even inside a forward
    that does not return for minutes (answer_signals). Under torchrun support/distributed.py turns SIGTERM
    (another rank failed) into its own line."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return
    run["signal_handlers"] = answer_signals(run, lambda name: stopped_message(name, run, args),
                                            cleanup=lambda: let_go_of_folders(run))


def stopped_message(name, run, args):
    paths = run["paths"]
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


def step_if_finite(optimizer):
    """optimizer.step(), undone when it leaves any trainable tensor non-finite: the weights and the optimiser's
    state (AdamW's moments and step counts) go back to copies taken before the step. Returns whether the update
    stayed. A finite loss and gradient can still make one (an Adam denominator that underflows, an overflow in
    the update): without this the run would go on from, and save, NaN weights."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    weights = [p.detach().clone() for p in params]
    states = [{k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
              if p in optimizer.state else None for p in params]
    optimizer.step()
    if bool(torch.stack([torch.isfinite(p).all() for p in params]).all()):
        return True
    with torch.no_grad():
        for p, w, state in zip(params, weights, states):
            p.copy_(w)
            if state is None:
                optimizer.state.pop(p, None)
            else:
                optimizer.state[p] = state
    return False


def run_paths(out):
    names = {"config": "config.json", "metrics": "metrics.jsonl", "samples": "samples.jsonl",
             "checkpoint": "checkpoint.pt", "validation": "validation.json"}
    return {k: os.path.join(out, v) for k, v in names.items()}


def progress_bar(start, args, writer=True):
    """The tqdm bar of steps start..--steps; the loop calls bar.update(1) after each step."""
    from tqdm import tqdm
    return tqdm(initial=start, total=args.steps, desc="train", dynamic_ncols=True, disable=not writer)


def step_metrics(step, batches, losses, stats, grad_norm, group_norms, skipped, run, args):
    """The step's record for metrics.jsonl from its micro-batches (support/batch.MicroBatch, every
    rank's); each field is defined in the README, "Metrics": the first draw's rewards, the loss terms averaged over micro-batches, gradient norms before
    clipping, what the completions looked like, and the context probes (adapter.context_probes)."""
    r_all = torch.cat([b.task_r for b in batches])
    eos = torch.tensor(run["eos_ids"], device=run["device"])
    trained = [b for b in batches if len(b.comp)]
    lengths = [b.comp_mask.sum(-1) for b in trained]
    truncated = [~torch.isin(b.comp, eos).any(-1) for b in trained]
    no_answer = sum(b.first_counts.get("no_answer", 0) for b in batches)
    failures = ("refused", "error", "timeout")  # "no_answer" is the model's fault, not the scorer's
    rec = {"step": step + 1, "reward": r_all.mean().item(), "reward_std": r_all.std().item(),
           "solve_rate": (r_all == 1).float().mean().item(), "loss": mean(losses),
           **{k: mean([m[k] for m in stats]) for k in LOSS_TERMS},
           **{k: mean([m[k] for m in stats if np.isfinite(m[k])])  # NaN: a batch with no A > 0
              for k in CHANNEL_TERMS if args.channel_weight},
           "grad_norm": grad_norm, **{f"grad_norm_{k}": v for k, v in group_norms.items()},
           "completion_length": mean(torch.cat(lengths).float().tolist() if trained else []),
           "truncated_fraction": mean(torch.cat(truncated).float().tolist() if trained else []),
           "zero_std_fraction": torch.cat([b.flat for b in batches]).float().mean().item(),
           "scorer_failures": sum(b.counts.get(k, 0) for b in batches for k in failures),
           "answer_rate": 1 - no_answer / len(r_all),
           "lr": run["optimizer"].param_groups[0]["lr"], "skipped_update": skipped,
           **context_probes([b.ctx for b in batches], run["embed_rms"])}
    if args.dynamic_sampling:  # the groups whose surrogate is trained (every group's KL is)
        signal = torch.cat([b.signal for b in batches])
        rec["trained_group_fraction"] = signal.float().mean().item()
    # --rollout-dtype: the sampler's gap to pi_old
    if trained and trained[0].logp_mu is not None:
        gaps = [(b.logp_old - b.logp_mu).abs()[b.comp_mask] for b in trained]
        rec["rollout_logp_gap"] = torch.cat(gaps).mean().item()
        if args.tis_cap:
            weights = torch.cat([b.is_weight[b.comp_mask] for b in trained])
            rec["is_weight_mean"] = weights.mean().item()
            rec["is_weight_clipped_fraction"] = (weights >= args.tis_cap).float().mean().item()
    return rec


def wall_clock(t0, tokens):
    """The step's wall-clock fields, the two that differ between two runs of the same numbers (the fixtures
    of tests/test_same_metrics.py leave them out): seconds since t0, and tokens_per_s = `tokens` (the
    completion tokens the step trains on, EOS included, padding not: every process's) per second of the step,
    rollout, scoring, loss and update together."""
    seconds = time.time() - t0
    return {"seconds": seconds, "tokens_per_s": tokens / seconds}


LOSS_TERMS = ("pg_loss", "kl", "clip_fraction", "ratio_mean")  # grpo_loss's metrics, logged
CHANNEL_TERMS = ("cf_loss", "cf_margin", "cf_fraction")  # grpo.channel_forcing_loss's


def mean(xs):
    """The mean of a list, NaN for an empty one (written as null)."""
    return float(np.mean(xs)) if len(xs) else float("nan")


def after_step(run, args, step, rec, bar, bad_steps):
    """Rank 0 writes the step's metrics, its log line and the checkpoint; every rank stops (exit
    code 3) after --max-bad-steps non-finite steps in a row. Returns the new count of those."""
    bad_steps = bad_steps + 1 if rec["skipped_update"] else 0
    stop = bad_steps >= args.max_bad_steps
    if not run["writer"]:  # the other ranks took their share of the step; rank 0 logs and saves it
        if stop:  # rank 0 saves the checkpoint, says why, and every rank stops together
            distributed.stop_together(run["world"], "", code=3)
        return bad_steps
    run["writing"] = True  # the step's line, samples and checkpoint are written whole: signals wait
    try:
        with writes_or_fail(run, args):  # a full disk: one line, exit code 4, the last good checkpoint kept
            append_lines(run["paths"]["metrics"], json.dumps({k: None if isinstance(v, float) and not np.isfinite(v)
                                                              else v for k, v in rec.items()}) + "\n")  # strict JSON
            if run.get("tracker"):  # --track: the same record, live
                run["tracker"].log(rec)
            bar.write(log_line(rec, args.steps))
            if (step + 1) % args.save_every == 0 or step + 1 == args.steps or stop:
                parts = (run["policy"], run["method"], run["optimizer"], run["pool"])
                save_checkpoint(run["paths"]["checkpoint"], step + 1, *parts)
    finally:
        run["writing"] = False
    if run.get("signal"):  # Ctrl-C or SIGTERM came while writing: now it stops the run
        signal.raise_signal(run.pop("signal"))
    if stop:  # the skipped steps left the weights as they were, and saved
        bar.close()  # so that the message gets a line of its own
        msg = (f"{bad_steps} steps in a row (--max-bad-steps) had a non-finite loss, gradient or update; stopped. "
               f"The last good weights are in {run['paths']['checkpoint']}; try a lower --lr / --router-lr")
        if run["world"].size > 1:  # the others stop with rank 0, not while it saves
            distributed.stop_together(run["world"], msg, code=3)
        fail(msg, code=3)
    return bad_steps


def log_line(rec, steps):
    """step 12/500 | reward 0.41 | kl 0.003 | len 38 | H 1.02 | 9.8 s | 310 tok/s"""
    parts = [f"step {rec['step']}/{steps}", f"reward {rec['reward']:.3f}", f"kl {rec['kl']:.4f}",
             f"len {rec['completion_length']:.0f}"]
    if "entropy" in rec:
        parts.append(f"H {rec['entropy']:.3f}")
    parts.append(f"{rec['seconds']:.1f} s")
    if "tokens_per_s" in rec:  # every trainer's steps have it; a record written before it existed may not
        parts.append(f"{rec['tokens_per_s']:.0f} tok/s")
    if rec["skipped_update"]:
        parts.append("update skipped: non-finite loss, gradient or weights")
    return " | ".join(parts)


def write_samples(run, args, step, question, answer, texts, rewards_trained):
    """Rank 0, every --sample-every steps, at the run's first and at its last: the first few completions of one
    prompt (texts [G], after --dynamic-sampling's re-draws) in samples.jsonl, with `reward` = the
    task's reward (what metrics.jsonl's reward averages) and, under --format-bonus,
    `reward_with_bonus` = rewards_trained [G], the reward GRPO trained on."""
    if not run["writer"] or not ((step + 1) % args.sample_every == 0 or step in (run["start"], args.steps - 1)):
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
    run["writing"] = True  # whole lines: a signal waits for them
    try:
        with writes_or_fail(run, args):
            append_lines(run["paths"]["samples"], "".join(lines))
    finally:
        run["writing"] = False
    if run.get("signal"):
        signal.raise_signal(run.pop("signal"))


def finish_run(run, args):
    """Rank 0, after the last step: the trained system (support/export.py: the LoRA as a PEFT adapter
    with its base and tokenizer, g_phi's weights), the plot of the run and,
    with --eval-items, the validation score after training beside the one before."""
    distributed.finish(run["world"])  # the other ranks are done; rank 0 writes the rest alone
    if not run["writer"]:
        return args.out
    with writes_or_fail(run, args):
        export_run(args.out, run["policy"], run["tok"], run["method"], args, run["team"])  # support/export.py
    from support.plot import plot_run
    print(f"run folder: {args.out} (metrics.jsonl, samples.jsonl, lora_peft/, g_phi.*, plot.png"
          f"{', validation.json' if args.eval_items else ''})", flush=True)
    if args.eval_items:
        with open(run["paths"]["validation"]) as f:
            before = json.load(f)["before"]
        after = validation_scores(run, args)
        sigkill_hook("validation", args.steps)  # tests: a kill after validating, before its file
        scores = {"items": args.eval_items, "before": before, "after": after}
        with writes_or_fail(run, args):
            write_json(run["paths"]["validation"], scores)
        print(validation_line(before, after), flush=True)
    with writes_or_fail(run, args), replaced_name(os.path.join(args.out, "plot.png"), ".png") as tmp:
        plot_run(args.out, name=os.path.basename(tmp))  # after the validation, whose scores it shows
    return args.out


def validation_line(before, after):
    better = sum(a > b for a, b in zip(after, before))
    worse = sum(a < b for a, b in zip(after, before))
    return (f"validation, {len(after)} items, greedy, the task's scorer: before training "
            f"{100 * np.mean(before):.1f} % -> after {100 * np.mean(after):.1f} % "
            f"({better} items better, {worse} worse)")
