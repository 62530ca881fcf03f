"""
How the policy reacts to the size of C: is a small C a small change? (It is not, for a pre-norm policy.)

    python experiments/scale_probe.py        # 8 x 32 teacher-forced passes, minutes on one CPU core -> results/pocket/scale_probe.json
    python experiments/scale_probe.py --anchor newline   # the same around --context-anchor newline's tokens
                                             # -> results/pocket/scale_probe_anchor.json

The untrained pocket policy (SmolLM2-135M-Instruct, no LoRA) reads the pocket prompt with m = 8 context tokens
C = eps * u behind its first token (--context-position before), u a fixed random direction with rms 1, for eps
from 0 to the token embeddings' rms; we measure the summed log-prob of the gold answer on the same 32 validation
items and its mean absolute change from C = 0. Why it matters: g_phi starts at C = 0 (W_out = 0, Eq. 11) so
that step 0 is the reference policy, and the KL anchor (Eq. 4) feeds zeros at C's positions. But the first
thing a pre-norm decoder does to a position is RMSNorm, x / sqrt(mean(x^2) + eps_norm), which maps every
vector much larger than sqrt(eps_norm) to the same length: a C of rms 0.01 is, to the first layer, as loud as
a real token, while C = 0 stays 0. So the change from C = 0 is not small when C is small. With --anchor newline,
C = a + eps * u, a the policy's embedding of "\n" (train.py --context-anchor newline), and changes are measured
from C = a; the log-prob without any context tokens is recorded too.
"""
import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from support.harness import checks  # noqa: E402
import rewards  # noqa: E402
from lib.files import whole_write  # noqa: E402
from support.harness.gold import gold_logprobs  # noqa: E402
from experts import load_model, team_models  # noqa: E402

POCKET = ["--task", "chain_sum", "--task-config", '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}',
          "--worked-example", "--response-prefix", "<think>", "--context-position", "before", "--team", "pocket"]
EPS = [0.0, 1e-5, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.136]


@torch.no_grad()
def main(n=32, m=8):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--anchor", default="zero", choices=["zero", "newline"], help="what C = anchor + eps * u starts from")
    anchor_kind = p.parse_args().anchor
    args = checks.parse_args(POCKET)
    policy, tok = load_model(team_models(args)["policy"], torch.device("cpu"), torch.float32)
    policy.eval()
    items = rewards.load_entries(args.task, "val", n, 0, None, args.task_config)[:n]
    prompts = rewards.policy_prompts(tok, [it["question"] for it in items], [None] * n, args)
    golds = [it["answer"] for it in items]
    u = torch.randn(m, policy.config.hidden_size, generator=torch.Generator().manual_seed(0))
    u = (u / u.pow(2).mean().sqrt()).expand(n, m, -1)                       # (n, m, D), rms 1
    anchor = torch.zeros(policy.config.hidden_size)
    if anchor_kind == "newline":
        anchor = policy.get_input_embeddings().weight[tok.encode("\n", add_special_tokens=False)[-1]]
    no_context = torch.tensor(gold_logprobs(policy, tok, prompts, golds, None, args, "cpu"))
    rows = []
    for eps in EPS:
        lp = torch.tensor(gold_logprobs(policy, tok, prompts, golds, anchor + eps * u, args, "cpu"))
        rows.append({"eps": eps, "gold_logprob": lp.mean().item(), "per_item": lp.tolist()})
    base = torch.tensor(rows[0]["per_item"])
    for r in rows:
        r["mean_abs_change_from_zero"] = (torch.tensor(r["per_item"]) - base).abs().mean().item()
    embed_rms = policy.get_input_embeddings().weight.pow(2).mean().sqrt().item()
    out = {"rms_norm_eps": policy.config.rms_norm_eps, "embed_rms": embed_rms, "n": n, "m": m, "anchor": anchor_kind,
           "anchor_rms": anchor.pow(2).mean().sqrt().item(), "no_context_gold_logprob": no_context.mean().item(),
           "anchor_vs_no_context": (base - no_context).abs().mean().item(), "rows": rows}
    name = "scale_probe.json" if anchor_kind == "zero" else "scale_probe_anchor.json"
    whole_write(os.path.join(ROOT, "results", "pocket", name), out)
    print(f"RMSNorm eps {policy.config.rms_norm_eps:g} (sqrt {policy.config.rms_norm_eps ** 0.5:.4f}); "
          f"token embeddings' rms {embed_rms:.3f}; anchor {anchor_kind}: mean |change from no context tokens| "
          f"{out['anchor_vs_no_context']:.3f}")
    for r in rows:
        print(f"rms(C) {r['eps']:<8g} gold log-prob {r['gold_logprob']:8.3f}   mean |change from C = anchor| "
              f"{r['mean_abs_change_from_zero']:.3f}")
    print(json.dumps({"done": True}))


if __name__ == "__main__":
    main()
