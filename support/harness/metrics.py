"""
What a step logs: its record in metrics.jsonl (step_metrics, each field defined in the README's "Metrics") and
its line on the terminal (log_line). Nothing here changes a number the step trains on.

Try it on CPU:  python -m pytest tests/test_train.py -q -k metrics
"""
import time

import numpy as np
import torch

from adapter import context_probes
from lib.static_decode import decode_path


def step_metrics(step, batches, losses, stats, grad_norm, group_norms, skipped, run, args):
    """The step's record for metrics.jsonl from its micro-batches (train.MicroBatch, every
    rank's); each field is defined in the README, "Metrics": the first draw's rewards, the loss terms averaged over micro-batches, gradient norms before
    clipping, what the completions looked like, and the context probes (adapter.context_probes)."""
    r_all = torch.cat([b.task_r for b in batches])
    eos = torch.tensor(run.eos_ids, device=run.device)
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
           "lr": run.optimizer.param_groups[0]["lr"], "skipped_update": skipped,
           **context_probes([b.ctx for b in batches], run.embed_rms)}
    # which loop the rollout's decode ran (a captured graph that failed goes on as "static": why) and the attention
    rec["decode"], rec["decode_fallback"] = decode_path(run.policy)
    rec["attention"] = run.policy.config._attn_implementation
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
