"""
The control RLAE's pocket score needs: each ensemble member alone, through the *same* union-vocabulary decoder.

    python experiments/rlae_members.py --weights 1 0          # Gemma-3-270M alone (the pocket team's member 0)
    python experiments/rlae_members.py --weights 0 1          # SmolLM2-135M-Instruct alone
    python experiments/rlae_members.py --weights 0.5 0.5      # the uniform mixture, with no agent at all

RLAE's decoder (neighbours/rlae.py) does more than mix: it moves each member's distribution onto a union vocabulary and
re-tokenises every chosen token piece by piece for each member, which plain decoding does not. If a member alone
through this decoder scored like the mixture, the gain would come from the decoder, not from ensembling. With
fixed weights the agent is never consulted, so no trained run is needed. The items are the validation items of
--seed (100 by default): the same items as every pocket run of that seed, so the scores pair item by item with
them (--compare FILE: an eval.json with per_item scores, e.g. an RLAE run's). Writes
results/pocket/rlae_members_<weights>_s<seed>.json. Cost: one K-member greedy decoding of the items (3.5-5 min
for 100 pocket items on one shared CPU core).
"""
import argparse
import json
import os
import sys
from types import SimpleNamespace

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from support.harness import config  # noqa: E402
import evaluate  # noqa: E402
import rewards  # noqa: E402
from lib import stats  # noqa: E402
from lib.files import whole_write  # noqa: E402
from experts import pick_device, team_models  # noqa: E402
from neighbours import rlae  # noqa: E402

POCKET = ["--task", "chain_sum", "--task-config", '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}',
          "--worked-example", "--response-prefix", "<think>", "--context-position", "before", "--max-new-tokens", "48"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--weights", nargs="+", type=float, required=True, help="one weight per member, summing to 1")
    p.add_argument("--team", default="pocket", help="the team whose generative models are the members")
    p.add_argument("--seed", type=int, default=0, help="the validation items of this seed")
    p.add_argument("--n", type=int, default=100, help="validation items")
    p.add_argument("--compare", default=None, help="an eval.json with per_item scores on the same items")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "pocket"), help="folder for the result")
    a = p.parse_args()
    w = torch.tensor(a.weights)
    if (w < 0).any() or abs(float(w.sum()) - 1) > 1e-6:
        config.fail(f"--weights must be >= 0 and sum to 1, got {a.weights}")
    args = rlae.parse_args(POCKET + ["--team", a.team, "--seed", str(a.seed)])
    args.team_models = team_models(args)
    device = pick_device("auto")
    items = rewards.load_entries(args.task, "val", a.n, args.seed, args.data_path, args.task_config)
    items = [items[i] for i in range(min(a.n, len(items)))]
    policy, tok, method, eos_ids = rlae.load_trained(SimpleNamespace(**vars(args)), device=device)
    if len(method.members) != len(w):
        config.fail(f"--weights: the team has {len(method.members)} members ({', '.join(method.names)}), got {len(w)}")
    method.fixed_weights = w
    per_item, status = evaluate.score_items(policy, tok, method, eos_ids, items, args, batch_size=50)
    scores = per_item["with_C"]["score"]
    result = {"weights": dict(zip(method.names, a.weights)), "seed": a.seed, "n": len(items),
              "score": float(np.mean(scores)), "per_item": scores, "scorer_status": status}
    if a.compare:
        with open(a.compare) as f:
            other = json.load(f)["per_item"]["with_C"]["score"]
        result["compare"] = {"file": a.compare, **stats.paired_comparison(np.array(scores), np.array(other))}
    name = "rlae_members_" + "_".join(f"{x:g}" for x in a.weights) + f"_s{a.seed}.json"
    whole_write(os.path.join(a.out, name), result)
    print(json.dumps({k: v for k, v in result.items() if k != "per_item"}, indent=1))


if __name__ == "__main__":
    main()
