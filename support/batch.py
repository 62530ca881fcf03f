"""
The rollout's micro-batch: what train.grpo_step builds for each of its --grad-accum micro-batches and what the
loss, support/metrics.step_metrics and the samples log read. A named contract instead of a dict of strings: each
field's shape is written beside it (B prompts, G samples each, N = B*G completions, P prompt tokens, T completion
tokens, m context tokens of width D).

Paper: the rollout of Eq. 3 (y ~ pi(. | [x || C])), the rewards and group advantages of GRPO, pi_ref of Eq. 4.
Deviations: logp_mu and is_weight exist only with a sampler that is not the scoring pass (--rollout-dtype,
--tis-cap); signal only matters with --dynamic-sampling. A leaf: imports no project file.

Try it on CPU:  python -m pytest tests/test_speedrun.py -q -k dynamic
"""
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class MicroBatch:
    items: list                 # B task items: {"question", "answer", "metadata"}
    questions: list             # B questions, the items' own
    ctx: object                 # g(x)'s output, a baselines.Context: C (B, m, D) or None, hints (B), ...
    ids: torch.Tensor           # (B, P) the policy's prompt tokens
    mask: torch.Tensor          # (B, P) bool, True on a prompt token
    comp: torch.Tensor          # (N, T) completions, G per prompt in prompt order
    comp_mask: torch.Tensor     # (N, T) bool, True up to and including EOS
    r: torch.Tensor             # (N,) reward: the task's scorer (+ --format-bonus), after --dynamic-sampling
    adv: torch.Tensor           # (N,) group-relative advantage
    logp_ref: torch.Tensor      # (N, T) log pi_ref(y_t): LoRA off, zero tokens where C was
    logp_mu: Optional[torch.Tensor]  # (N, T) the sampler's log-probs, or None when it is the scoring pass
    counts: dict                # the scorer's status counts ("no_answer", "refused", ...)
    texts: list                 # N decoded completions
    signal: torch.Tensor        # (B,) bool: the group's rewards differ (after --dynamic-sampling)
    task_r: torch.Tensor        # (N,) the first draw's task reward alone: what the log reports
    flat: torch.Tensor          # (B,) bool: the first draw's group had G equal rewards
    first_counts: dict          # the first draw's scorer counts
    logp_old: Optional[torch.Tensor] = None   # (N, T) log pi_old, detached: set by the first inner epoch
    is_weight: Optional[torch.Tensor] = None  # (N, T) --tis-cap's min(pi_old / pi_mu, cap), or None
