"""
The screen: find a task where collaboration is possible, i.e. where an expert knows more than the policy.

    OMP_NUM_THREADS=1 taskset -c 1 python experiments/screen.py      # results/screen/{results.json, table.md}

(the one command that regenerates results/screen/; it is resumable: every finished part of a row is kept in
results/screen/results.json and skipped on the next call; --only TASK ... restricts it to some candidates,
--table-only rebuilds table.md from results.json.)

What it measures, for each candidate task (CANDIDATES: Reasoning Gym datasets with short integer answers, and
harder configurations of chain_sum / basic_arithmetic) and each model of the pocket-strong team (the policy's own
base SmolLM2-135M-Instruct, Gemma-3-270M, all-MiniLM-L6-v2, Qwen2.5-Coder-1.5B-Instruct):
  (a) alone: each decoder answers the first --n-eval validation items (seed 0) greedily, scored by the task's
      scorer (rewards.score_batch). Prompt: rewards.build_prompt with the pocket protocol's system prompt
      (DeepSeekZero + the worked example), the response PRE-FILLED with "<answer>" for every model alike, at most
      --alone-tokens new tokens; the completion is "<answer>" + the generated text, closed with "</answer>" at
      the first newline / EOS if the model did not close it (deviation 1). MiniLM is an encoder: probe only.
  (b) probe: a question-only ridge probe of the answer (experiments/channel.py's `ridge_probe`: one-hot ridge per
      answer position on standardised states, alpha picked on the last fifth of train) on the LAST-TOKEN state
      of the question read through each model's chat template (experts.expert_text; MiniLM: the raw question,
      last token = [SEP]) at three depths, hidden-state index round(L/3), round(2L/3) and L (L = the final
      state, after the final norm). Answer positions: sign and W digits, W = the longest |answer| (>= 3).
      --probe-train training items (train split, seed 0) and --probe-test held-out items (val split, seed 0).
      Baselines: the majority answer (the most frequent training answer, its exact rate on the test items) and
      the per-position majority (channel.py's "chance").
  (c) single: the policy with LoRA and no experts (`python train.py --method single ...`) with the pocket
      protocol's flags (experiments/pocket.py: the worked example, "<think>", 48 new tokens, batch 4 x G 4,
      lr 1e-3, 15 steps, the speedrun's levers but a float32 rollout: deviation 5), seed 0, then
      `evaluate.py --run ... --n N_EVAL`: the same first --n-eval validation items of seed 0 as (a).

The RULE that picks the testbed is `pick_testbed` (its docstring). The first rule, committed before the screen ran,
took the best probe of any expert at any depth and mean scores (partial credit), and chose lcm for MiniLM's probe,
an expert the verdict's arms do not read. The corrected rule (2026-11-26, written after the screen's numbers were
known; it re-reads the stored results, nothing was measured again) reads only the arms' expert (ARMS_EXPERT,
Qwen2.5-Coder-1.5B) at the arms' depth (ARMS_DEPTH, the final state), on exact solve rates: among the tasks whose
probe gap (expert - policy, both at that depth) is > 0, whose `single` <= 60 % and whose expert alone is at least
`single` + 20 points, the largest probe gap wins; ties go to the larger alone margin. A task whose missing parts
could still make it the testbed is marked open, with the core-hours to measure them (`rerun_seconds`). If no
task qualifies, the table says "none met the rule".

Order of the work (so that a partial screen is still a useful table): phase 1 runs (a) and (b) for every task,
task by task in CANDIDATES order; phase 2 runs (c), most promising task first (`single_order`: the largest
expert-alone minus policy-alone margin, or with --single-by gap the largest probe gap, the rule's own criterion, so
that the first eligible task met is the one the rule picks; the screen's singles ran under the first rule, by its
gap, see the table's notes); a task the rule rules out without a single (the expert alone below 20 %, or a probe
gap <= 0) gets no single ("cannot meet the rule"). With --deadline HH:MM (UTC) nothing new starts after it and
the rows not reached read "not run (time)".

Deviations / choices (numbered):
  1. Alone scores use the "<answer>" pre-fill (a direct answer, no reasoning), so they measure what a model knows
     without thinking, like the probe; `single` is evaluated with the pocket protocol ("<think>", 48 tokens). The
     policy's own base alone is therefore reported with the same pre-fill as the experts, not as `single`'s
     untrained baseline.
  2. Speed: all prompts of one (task, model) share a token prefix (system prompt, worked example, question
     stem); it is run once and its KV cache reused for every batch (`prefix_split`, `suffix_forward`). The ids
     are those of the whole prompt, cut at the common prefix, so the model reads exactly the same tokens at the
     same positions; tests/test_screen.py checks states and greedy outputs against a plain forward.
  3. One seed, --n-eval items per task (default 64) for (a) and (c); the probe's items are separate from (c)'s
     training items only by split (train / val), like channel.py.
  4. Only integer answers are probed (sign + digits); every candidate here has integer answers.
  5. `single` uses the pocket protocol's flags except --rollout-dtype float32 (pocket.py: bfloat16). This
     machine's CPU has AVX2 but no AVX-512 / bf16 instructions, and the first single run with the bf16 rollout
     copy took 91 s for its first step (the pocket table's steps: 12-28 s), which would have left time for two
     singles. With a float32 rollout the rollout policy is the trained policy, so the truncated importance
     weight would be 1 (train.py refuses --tis-cap with it, so it is dropped): GRPO with the other two levers
     (format bonus 0.1, one re-draw of flat groups). Steps then took 29-49 s on this core.
"""
import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timedelta, timezone

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import rewards  # noqa: E402
from experts import ENCODER_TYPES, expert_text, load_model  # noqa: E402
from channel import ridge_probe  # noqa: E402
from lib import kv_cache  # noqa: E402

OUT = os.path.join(ROOT, "results", "screen")
RUNS = os.path.join(ROOT, "runs", "screen")

# name -> (reasoning-gym dataset, --task-config JSON). Short integer answers, where a 1.5B coder should beat a
# 135M chat model: harder chain_sum / basic_arithmetic, then other datasets; the pocket task (the reference, known
# from results/pocket and results/channel) late. Phase 1 runs them in this order.
CANDIDATES = {
    "chain_sum-3t-2d": ("chain_sum", {"min_terms": 3, "max_terms": 3, "min_digits": 2, "max_digits": 2}),
    "chain_sum-2t-3d": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 3, "max_digits": 3}),
    "basic_arithmetic-2to3t-1to2d": ("basic_arithmetic", {
        "min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2, "operators": ["+", "-", "*"],
        "allow_parentheses": False, "allow_negation": False}),
    "products-2t-1to2d": ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    "simple_equations-2t-to20": ("simple_equations", {"min_terms": 2, "max_terms": 2, "min_value": 1,
                                                      "max_value": 20}),
    "gcd-2n-to100": ("gcd", {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 100}),
    "lcm-2n-to20": ("lcm", {"min_numbers": 2, "max_numbers": 2, "min_value": 2, "max_value": 20}),
    "leg_counting-1to3a-to5": ("leg_counting", {"min_animals": 1, "max_animals": 3, "min_instances": 1,
                                                "max_instances": 5}),
    "count_bits-to255": ("count_bits", {"min_n": 1, "max_n": 255}),
    "chain_sum-2t-1to2d": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    "letter_counting-3to6w": ("letter_counting", {"min_words": 3, "max_words": 6}),
    "number_sequence-default": ("number_sequence", {}),
}

POCKET_MODELS = {  # short name -> experts.load_model spec; the policy's own base first
    "smollm2": "pocket:smollm2-135m-instruct",
    "gemma3": "pocket:gemma3-270m",
    "minilm": "pocket:all-minilm-l6-v2",
    "qwen1.5b": "pocket:qwen2.5-coder-1.5b-instruct",
}
TINY_MODELS = {"llama": "tiny:llama", "qwen2": "tiny:qwen2", "bert": "tiny:bert"}  # tests: random-init

SYSTEM = dict(system_prompt="DeepSeekZero", worked_example=True)
ALONE_PREFIX = "<answer>"  # deviation 1
# the pocket protocol (experiments/pocket.py: TASK replaced, PROMPT, hyper, LEVERS), seed 0
POCKET_PROMPT = ["--worked-example", "--response-prefix", "<think>", "--context-position", "before",
                 "--max-new-tokens", "48"]
POCKET_HYPER = ["--batch-size", "4", "--grad-accum", "1", "--group-size", "4", "--lr", "1e-3", "--router-lr", "1e-3",
                "--steps", "15", "--save-every", "5", "--dataset-size", "2000"]
# pocket.py's levers, but the rollout copy in float32, not bfloat16 (deviation 5): this CPU has AVX2 only (no
# AVX-512 / bf16 instructions) and a bf16 rollout ran at 91 s per step instead of the pocket table's 12-28 s
POCKET_LEVERS = ["--format-bonus", "0.1", "--dynamic-sampling", "1", "--rollout-dtype", "float32"]

MAX_SINGLE, MIN_MARGIN = 0.60, 0.20
# the expert the verdict's arms read (experiments/verdict.py --strong-expert) and the depth they read it at
# (--expert-depth, a fraction of the model's blocks; 1.0 = the final state, after the final norm)
ARMS_EXPERT, ARMS_DEPTH = "qwen1.5b", 1.0


# ----------------------------------------------------------------------------------------------------------
# The rule


def exact_rate(part):
    """The exact solve rate of an alone / single result: the fraction of its items scored 1 (the scorers give
    partial credit, e.g. for a wrong answer that contains the gold one). None if it did not run."""
    if not part or not part.get("per_item"):
        return None
    return sum(s == 1 for s in part["per_item"]) / len(part["per_item"])


def probe_at(row, model, depth):
    """The model's probe exact rate at hidden-state index max(1, round(depth * L)) (experts.py's --expert-depth),
    or None if that probe did not run or did not read that index."""
    p = (row.get("probe") or {}).get(model)
    if not p or not p.get("exact") or not p.get("layers"):
        return None
    return p["exact"].get(str(max(1, round(depth * p["layers"]))))


def pick_testbed(rows, expert=ARMS_EXPERT, depth=ARMS_DEPTH, policy="smollm2", max_single=MAX_SINGLE,
                 min_margin=MIN_MARGIN):
    """THE RULE, corrected after the first verdict (the first rule took the best probe of any expert at any depth,
    and partial credit; it chose lcm-2n-to20 for MiniLM's probe, an expert the arms do not read). rows: {task: row}
    as in results.json (scores are fractions in [0, 1]); `expert` is the expert the arms read, at `depth`.

    Every score is the exact solve rate (the fraction of items scored 1), not the mean score. A task is eligible
    when all of these hold:
      - the probe gap = (the expert's probe exact) - (the policy's probe exact), both at `depth` (hidden-state
        index round(depth * L) of each model), is > 0: the expert's question-only state, where the arms read it,
        holds the answer more often than the policy's own state at that depth;
      - the expert alone >= single + min_margin (20 points): the expert answers, without training, far more items
        than the trained policy (so an expert alone below min_margin cannot qualify whatever single is);
      - its `single` ran and single <= max_single (60 %): room for help.
    Among the eligible tasks, the testbed is the one with the largest probe gap; ties: the larger alone margin
    (expert alone - single), then the task name. A task whose missing parts could still make it the testbed is
    marked `open` (its gap, where known, is at least the chosen one's).
    Returns (task or None, {task: {"eligible", "open", "why", "probe_gap", "expert_alone", "single", ...}}).
    """
    verdicts, best = {}, None
    for task, row in sorted(rows.items()):
        single = exact_rate(row.get("single"))
        alone = exact_rate((row.get("alone") or {}).get(expert))
        e_probe, p_probe = probe_at(row, expert, depth), probe_at(row, policy, depth)
        gap = None if e_probe is None or p_probe is None else e_probe - p_probe
        margin = None if alone is None or single is None else alone - single
        v = {"single": single, "expert_alone": alone, "alone_margin": margin, "expert_probe": e_probe,
             "policy_probe": p_probe, "probe_gap": gap, "eligible": False, "missing": []}
        if gap is None:
            v["missing"].append("probes")
        if alone is None:
            v["missing"].append(f"{expert} alone")
        if single is None:
            v["missing"].append("single")
        if gap is not None and gap <= 1e-9:  # probe rates are float32 fractions of 100 items
            v["why"] = f"{expert}'s probe {100 * e_probe:.0f} <= the policy's {100 * p_probe:.0f}"
        elif alone is not None and alone < min_margin - 1e-9:
            v["why"] = f"{expert} alone {100 * alone:.1f} < 20: cannot reach single + 20 points"
        elif v["missing"]:
            v["why"] = "undecided: " + ", ".join(v["missing"]) + " not run"
        elif single > max_single + 1e-9:
            v["why"] = f"single {100 * single:.1f} > {100 * max_single:.0f} %"
        elif margin < min_margin - 1e-9:
            v["why"] = f"{expert} alone {100 * alone:.1f} < single {100 * single:.1f} + {100 * min_margin:.0f} points"
        else:
            v.update(eligible=True, why="eligible")
            key = (gap, margin, task)
            if best is None or key > best[0]:
                best = (key, task)
        verdicts[task] = v
    chosen_gap = None if best is None else best[0][0]
    for v in verdicts.values():
        v["open"] = v["why"].startswith("undecided") and (
            v["probe_gap"] is None or chosen_gap is None or v["probe_gap"] >= chosen_gap)
    return (None if best is None else best[1]), verdicts


# ----------------------------------------------------------------------------------------------------------
# Forward passes that share the prompts' common prefix (deviation 2)


def is_decoder(model):
    return model.config.model_type not in ENCODER_TYPES


def tokenize(tok, texts):
    """Token ids of whole texts, as rollout.encode_prompts / channel.encode read them (a chat template writes
    its own special tokens; a model without one gets its tokenizer's, e.g. Gemma's <bos>)."""
    add = not tok.chat_template
    return [tok(t, add_special_tokens=add)["input_ids"] for t in texts]


def prefix_split(ids):
    """Length P of the longest common token prefix of all rows, leaving every row at least one token."""
    P = min(len(r) for r in ids) - 1
    first = ids[0]
    for r in ids[1:]:
        k = 0
        while k < P and r[k] == first[k]:
            k += 1
        P = k
    return max(P, 0)


@torch.no_grad()
def prefix_cache(model, prefix):
    """KV cache of the shared prefix (batch 1), or None when there is none."""
    if not prefix:
        return None
    return kv_cache.cache_of(model(input_ids=torch.tensor([prefix]), use_cache=True, logits_to_keep=1))


@torch.no_grad()
def suffix_forward(model, cache, P, suffixes, pad_id, hidden=False):
    """One forward of left-padded suffixes behind the cached prefix of length P. Returns (model output, the
    cache of this batch, full attention mask, next positions [B]). Positions count real tokens only, so each
    row sees exactly its whole prompt at positions 0..len-1."""
    B, S = len(suffixes), max(len(s) for s in suffixes)
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    smask = torch.zeros(B, S, dtype=torch.long)
    for i, s in enumerate(suffixes):
        ids[i, S - len(s):], smask[i, S - len(s):] = torch.tensor(s), 1
    mask = torch.cat([torch.ones(B, P, dtype=torch.long), smask], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    kv = None
    if cache is not None:
        kv = copy.deepcopy(cache)
        kv.batch_repeat_interleave(B)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos[:, P:], **kv_cache.cache_kwargs(model, kv),
                use_cache=True, output_hidden_states=hidden, logits_to_keep=1)
    return out, kv_cache.cache_of(out), mask, pos[:, -1] + 1


@torch.no_grad()
def greedy_answers(model, tok, prompts, max_new, batch=16):
    """Greedy continuations (text) of prompts, shared-prefix forward, stopping a row at EOS or "</answer>"."""
    ids = tokenize(tok, prompts)
    P = prefix_split(ids)
    cache = prefix_cache(model, ids[0][:P])
    eos = {tok.eos_token_id, *([model.generation_config.eos_token_id] if isinstance(
        model.generation_config.eos_token_id, int) else (model.generation_config.eos_token_id or []))} - {None}
    texts = []
    for s in range(0, len(ids), batch):
        suff = [r[P:] for r in ids[s:s + batch]]
        out, kv, mask, pos = suffix_forward(model, cache, P, suff, tok.pad_token_id)
        B = len(suff)
        gen = [[] for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool)
        nxt = out.logits[:, -1].argmax(-1)
        for t in range(max_new):
            for i in range(B):
                if not done[i]:
                    if int(nxt[i]) in eos:
                        done[i] = True
                    else:
                        gen[i].append(int(nxt[i]))
                        if "</answer>" in tok.decode(gen[i][-6:]):
                            done[i] = True
            if bool(done.all()) or t == max_new - 1:
                break
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], 1)
            out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos[:, None],
                        **kv_cache.cache_kwargs(model, kv), use_cache=True, logits_to_keep=1)
            kv, pos = kv_cache.cache_of(out), pos + 1
            nxt = out.logits[:, -1].argmax(-1)
        texts += [tok.decode(g, skip_special_tokens=True) for g in gen]
    return texts


def close_answer(generated):
    """Deviation 1: "<answer>" + the generated text, closed at the first newline if the model did not close it."""
    if "</answer>" in generated:
        return ALONE_PREFIX + generated
    return ALONE_PREFIX + generated.split("\n")[0] + "</answer>"


def depths(L):
    """The three hidden-state indices read by the probe: about 1/3, 2/3 and the final state."""
    return sorted({max(1, round(L / 3)), max(1, round(2 * L / 3)), L})


@torch.no_grad()
def last_token_states(model, tok, questions, batch=32):
    """{depth index: [N, d]} last-token states of the questions read through the model's chat template."""
    texts = [expert_text(tok, q) for q in questions]
    ids = tokenize(tok, texts)
    base = getattr(model, "base_model", model) if is_decoder(model) else model
    L = model.config.num_hidden_layers
    keep = depths(L)
    rows = {k: [] for k in keep}
    if is_decoder(model):
        P = prefix_split(ids)
        cache = prefix_cache(base, ids[0][:P])
        for s in range(0, len(ids), batch):
            out, _, _, _ = suffix_forward(base, cache, P, [r[P:] for r in ids[s:s + batch]], tok.pad_token_id,
                                          hidden=True)
            for k in keep:
                rows[k].append(out.hidden_states[k][:, -1].float())
    else:  # an encoder reads the whole text bidirectionally: no prefix sharing; right padding, last real token
        tok.padding_side = "right"
        for s in range(0, len(texts), batch):
            enc = tok(texts[s:s + batch], return_tensors="pt", padding=True)
            hs = model(**enc, output_hidden_states=True).hidden_states
            last = enc["attention_mask"].sum(1) - 1
            for k in keep:
                rows[k].append(hs[k][torch.arange(len(last)), last].float())
    return {k: torch.cat(v) for k, v in rows.items()}, L


# ----------------------------------------------------------------------------------------------------------
# Items, probe targets


def items(task, split, n, seed=0):
    name, cfg = CANDIDATES[task]
    return list(rewards.load_entries(name, split, n, seed, None, json.dumps(cfg))[:n])


def answer_digits(answers, width):
    """Integer answers -> [N, 1 + width] labels: sign, then the digits of |a|, most significant first."""
    rows = []
    for a in answers:
        v = int(a)
        rows.append([int(v < 0)] + [int(c) for c in f"{abs(v):0{width}d}"])
    return torch.tensor(rows)


def probe_targets(train_answers, test_answers):
    """(ytr, yte, width) or None if an answer is not an integer (deviation 4)."""
    try:
        vals = [int(a) for a in list(train_answers) + list(test_answers)]
    except ValueError:
        return None
    width = max(3, max(len(str(abs(v))) for v in vals))
    return answer_digits(train_answers, width), answer_digits(test_answers, width), width


def majority_baselines(train_answers, test_answers, ytr, yte):
    """The majority answer's exact rate on test; the per-position majority (channel.py's chance)."""
    top = Counter(train_answers).most_common(1)[0][0]
    maj_answer = sum(a == top for a in test_answers) / len(test_answers)
    mode = torch.stack([ytr[:, j].mode().values for j in range(ytr.shape[1])])
    per_pos = (yte == mode).all(1).float().mean().item()
    return {"majority_answer": top, "majority_exact": maj_answer, "per_position_majority_exact": per_pos}


# ----------------------------------------------------------------------------------------------------------
# The parts of a row


class Models:
    """Loads each model once and keeps it (they fit: ~8 GB in fp32 together)."""

    def __init__(self, specs):
        self.specs, self.loaded = specs, {}

    def __call__(self, name):
        if name not in self.loaded:
            t0 = time.time()
            self.loaded[name] = load_model(self.specs[name])
            print(f"  loaded {name} in {time.time() - t0:.0f} s", flush=True)
        return self.loaded[name]


def run_alone(model, tok, entries, max_new):
    t0 = time.time()
    prompts = [rewards.build_prompt(tok, e["question"], response_prefix=ALONE_PREFIX, **SYSTEM) for e in entries]
    gen = greedy_answers(model, tok, prompts, max_new)
    comps = [close_answer(g) for g in gen]
    scores, counts = rewards.score_batch(entries, comps)
    return {"score": sum(scores) / len(scores), "n": len(scores), "per_item": scores, "counts": counts,
            "examples": [{"gold": e["answer"], "completion": c} for e, c in zip(entries[:5], comps[:5])],
            "seconds": time.time() - t0}


def run_probe(model, tok, train, test, targets):
    t0 = time.time()
    ytr, yte, width = targets
    Htr, L = last_token_states(model, tok, [e["question"] for e in train])
    Hte, _ = last_token_states(model, tok, [e["question"] for e in test])
    t_states = time.time() - t0
    exact, units, alphas = {}, {}, {}
    for k in Htr:
        exact[str(k)], units[str(k)], alphas[str(k)] = ridge_probe(Htr[k], ytr, Hte[k], yte)
    return {"exact": exact, "units_or_tens_digit": units, "alpha": alphas, "layers": L, "width": width,
            "seconds_states": t_states, "seconds": time.time() - t0}


def run_single(task, n_eval, log):
    """train.py --method single with the pocket protocol, then evaluate.py on the first n_eval val items."""
    name, cfg = CANDIDATES[task]
    out = os.path.join(RUNS, f"{task}-single-s0")
    t0 = time.time()
    task_flags = ["--task", name, "--task-config", json.dumps(cfg)]
    if not os.path.exists(os.path.join(out, "lora_peft", "adapter_config.json")):
        resume = ["--resume"] if os.path.exists(os.path.join(out, "config.json")) else []
        cmd = ["train.py", *task_flags, *POCKET_PROMPT, *POCKET_HYPER, *POCKET_LEVERS, "--team", "pocket",
               "--method", "single", "--seed", "0", "--out", out, *resume]
        _run(cmd, log)
    t_train = time.time() - t0
    _run(["evaluate.py", "--run", out, "--n", str(n_eval)], log)
    ev = json.load(open(os.path.join(out, "eval.json")))
    per_item = ev["per_item"]["with_C"]["score"]
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return {"score": ev["score"], "n": ev["n"], "per_item": per_item, "scorer_status": ev.get("scorer_status"),
            "train_reward_by_step": [m["reward"] for m in metrics], "seconds_train": t_train,
            "seconds": time.time() - t0, "run_dir": os.path.relpath(out, ROOT)}


def _run(cmd, log):
    print("  $", " ".join(cmd), flush=True)
    with open(log, "a") as f:
        subprocess.run([sys.executable, *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=True)


# ----------------------------------------------------------------------------------------------------------
# Results


def load(path):
    return json.load(open(path)) if os.path.exists(path) else {"rows": {}, "meta": {}}


def save(res, out):
    os.makedirs(out, exist_ok=True)
    tmp = os.path.join(out, "results.json.tmp")
    json.dump(res, open(tmp, "w"), indent=1)
    os.replace(tmp, os.path.join(out, "results.json"))
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(markdown(res))


def pct(x):
    return "–" if x is None else f"{100 * x:.1f}"


def median(xs):
    xs = sorted(xs)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


def rerun_seconds(rows, verdicts, expert=ARMS_EXPERT, policy="smollm2"):
    """{task: (missing parts, estimated seconds)} for the rows the rule lacks data for: each missing part costs the
    median of that part's stored wall times over the rows where it ran (one core; model loading not included)."""
    def med(get):
        return median([x for r in rows.values() if (x := get(r)) is not None])
    cost = {"alone": med(lambda r: ((r.get("alone") or {}).get(expert) or {}).get("seconds")),
            "expert probe": med(lambda r: ((r.get("probe") or {}).get(expert) or {}).get("seconds")),
            "policy probe": med(lambda r: ((r.get("probe") or {}).get(policy) or {}).get("seconds")),
            "single": med(lambda r: (r.get("single") or {}).get("seconds"))}
    out = {}
    for task, row in rows.items():
        v = verdicts[task]
        if not v["why"].startswith("undecided"):
            continue
        parts = [name for name, missing in (
            ("alone", v["expert_alone"] is None), ("expert probe", v["expert_probe"] is None),
            ("policy probe", v["policy_probe"] is None), ("single", v["single"] is None)) if missing]
        out[task] = (parts, sum(cost[p] or 0 for p in parts))
    return out, cost


def exact_and_mean(part):
    """'exact (mean score)' in %, or None."""
    if not part or part.get("score") is None:
        return None
    e = exact_rate(part)
    return f"{pct(e)} ({pct(part['score'])})" if e is not None else pct(part["score"])


def markdown(res, policy="smollm2", expert=ARMS_EXPERT, depth=ARMS_DEPTH):
    rows, meta = res["rows"], res.get("meta", {})
    models = meta.get("models", list(POCKET_MODELS))
    chosen, verdicts = pick_testbed(rows, expert, depth, policy)
    L = ["# The screen (experiments/screen.py): where does an expert know more than the policy?", "",
         "Regenerate: `" + meta.get("command", "OMP_NUM_THREADS=1 taskset -c 1 python experiments/screen.py") + "`"
         + " (`--table-only` rebuilds this table from results.json)",
         "", "## The rule (`pick_testbed`)", "",
         (pick_testbed.__doc__ or "").strip().replace("\n    ", "\n"), "",
         f"**Chosen testbed: {chosen if chosen else 'none met the rule'}**"
         + (f" ({json.dumps(CANDIDATES[chosen][1])})" if chosen in CANDIDATES else "")
         + f", by {expert}'s probe at depth {depth} (the arms' expert and depth).", ""]
    idx = {m: [str(k) for k in depths(p["layers"])]  # each model's three probed hidden-state indices
           for r in rows.values() for m, p in (r.get("probe") or {}).items() if p.get("layers")}
    L += [f"## The rule's table (exact solve rates in %; probe = exact answer from the last-token state at depth "
          f"1/3, 2/3, final; the rule reads depth {depth}; single = pocket protocol, 15 steps, seed 0)", "",
          f"| task | {expert} alone | single | margin | {expert} probe | {policy} probe | gap at depth {depth} "
          f"| gap vs {policy}'s best depth | rule |", "|---|---|---|---|---|---|---|---|---|"]
    for task, row in rows.items():
        v = verdicts[task]
        probes = []
        for m in (expert, policy):
            p = (row.get("probe") or {}).get(m)
            probes.append("/".join(pct(p["exact"].get(k)) for k in idx.get(m, [])) if p and p.get("exact") else "–")
        margin = v["alone_margin"]
        rule = (("**chosen**, " if task == chosen else "**eligible**, ") + f"gap {pct(v['probe_gap'])}"
                if v["eligible"] else v["why"] + (" (**open**: could change the choice)" if v["open"] else ""))
        p_best = (row.get("probe") or {}).get(policy)
        best_gap = (None if v["expert_probe"] is None or not p_best or not p_best.get("exact")
                    else v["expert_probe"] - max(p_best["exact"].values()))  # a reading the rule does not use
        L.append(f"| {task} | {pct(v['expert_alone'])} | {pct(v['single'])} | {pct(margin)} | {probes[0]} | "
                 f"{probes[1]} | {pct(v['probe_gap'])} | {pct(best_gap)} | {rule} |")
    need, cost = rerun_seconds(rows, verdicts, expert, policy)
    L += ["", "## What the stored data cannot decide", "",
          "Each missing part is costed at the median of its stored wall times on this core ("
          + ", ".join(f"{k} {v:.0f} s" for k, v in cost.items() if v is not None)
          + "; model loading not included).", ""]
    if need:
        L += ["| task | missing | estimate (core-hours) | could change the choice |", "|---|---|---|---|"]
        for task, (parts, secs) in need.items():
            L.append(f"| {task} | {', '.join(parts)} | {secs / 3600:.2f} | {'yes' if verdicts[task]['open'] else 'no'} |")
        opened = sum(secs for t, (_, secs) in need.items() if verdicts[t]["open"])
        L += ["", f"To settle the choice: {opened / 3600:.2f} core-hours (the open rows); to complete every row: "
              f"{sum(secs for _, secs in need.values()) / 3600:.2f} core-hours."]
    else:
        L.append("Nothing: every row is decided.")
    decoders = [m for m in models if m not in meta.get("encoders", ["minilm"])]
    L += ["", "## Every measurement (alone and single: exact % (mean score %); probe = exact answer at depth 1/3, 2/3,"
          " final)", "",
          "| task | config | " + " | ".join(f"{m} alone" for m in decoders) + " | "
          + " | ".join(f"{m} probe" for m in models) + " | majority | single |",
          "|---|---|" + "---|" * (len(decoders) + len(models) + 2)]
    for task, row in rows.items():
        cfg = json.dumps(CANDIDATES[task][1]) if task in CANDIDATES else row.get("config", "")
        al = [exact_and_mean((row.get("alone") or {}).get(m)) or (row.get("status", {}).get(f"alone:{m}") or "–")
              for m in decoders]
        pr = []
        for m in models:
            p = (row.get("probe") or {}).get(m)
            pr.append("/".join(pct(v) for v in p["exact"].values()) if p and p.get("exact")
                      else (row.get("status", {}).get(f"probe:{m}") or "–"))
        base = row.get("baselines") or {}
        maj = pct(base.get("majority_exact")) if base else "–"
        single = exact_and_mean(row.get("single")) or (row.get("status", {}).get("single") or "–")
        L.append(f"| {task} | `{cfg}` | " + " | ".join(al) + " | " + " | ".join(pr) + f" | {maj} | {single} |")
    L += ["", "## Wall times (s)", "", "| task | " + " | ".join(f"{m} alone" for m in decoders) + " | "
          + " | ".join(f"{m} probe" for m in models) + " | single |", "|---|" + "---|" * (len(decoders) + len(models) + 1)]
    def secs(part):
        return "–" if not part or part.get("seconds") is None else f"{part['seconds']:.0f}"

    for task, row in rows.items():
        al = [secs((row.get("alone") or {}).get(m)) for m in decoders]
        pr = [secs((row.get("probe") or {}).get(m)) for m in models]
        L.append(f"| {task} | " + " | ".join(al + pr) + f" | {secs(row.get('single'))} |")
    dev = (__doc__ or "").split("Deviations / choices (numbered):")[-1].strip("\n")
    L += ["", "## Deviations / choices (from the script's docstring)", "", "```", dev.rstrip(), "```"]
    L += ["", "## Set-up", ""]
    for k, v in meta.items():
        if k not in ("command", "notes"):
            L.append(f"- {k}: {v}")
    if meta.get("notes"):
        L += ["", "## Notes (what ran, and when)", ""] + [f"- {n}" for n in meta["notes"]]
    L.append("")
    return "\n".join(L)


# ----------------------------------------------------------------------------------------------------------


def deadline_passed(deadline):
    """deadline: a UNIX time or None."""
    return deadline is not None and time.time() >= deadline


def parse_deadline(hhmm):
    """--deadline HH:MM (UTC) -> the UNIX time of its next occurrence (tonight's or tomorrow's)."""
    if not hhmm:
        return None
    now = datetime.now(timezone.utc)
    h, m = map(int, hhmm.split(":"))
    t = now.replace(hour=h, minute=m, second=0, microsecond=0)
    return (t if t > now else t.replace(day=now.day) + timedelta(days=1)).timestamp()


def a_encoders(a, names):
    specs = POCKET_MODELS if a.team == "pocket" else TINY_MODELS
    return [m for m in names if "minilm" in specs[m] or "bert" in specs[m]]


def phase1(a, res, models, names, policy):
    for task in a.only or list(CANDIDATES):
        row = res["rows"].setdefault(task, {"task": CANDIDATES[task][0], "config": CANDIDATES[task][1]})
        row.setdefault("alone", {}), row.setdefault("probe", {}), row.setdefault("status", {})
        evals = items(task, "val", max(a.n_eval, a.probe_test))
        eval_items, test = evals[:a.n_eval], evals[:a.probe_test]
        train = items(task, "train", a.probe_train)
        targets = probe_targets([e["answer"] for e in train], [e["answer"] for e in test])
        if "baselines" not in row and targets is not None:
            row["baselines"] = majority_baselines([e["answer"] for e in train], [e["answer"] for e in test],
                                                  targets[0], targets[1])
            row["baselines"].update(n_train=len(train), n_test=len(test), width=targets[2])
        if deadline_passed(a.deadline):  # a task is started whole or not at all
            for m in names:
                if m not in row["alone"] and m not in a_encoders(a, names):
                    row["status"].setdefault(f"alone:{m}", "not run (time)")
                if m not in row["probe"]:
                    row["status"].setdefault(f"probe:{m}", "not run (time)")
            save(res, a.out)
            continue
        for m in names:
            model, tok = models(m)
            if is_decoder(model) and m not in row["alone"]:
                try:
                    row["alone"][m] = run_alone(model, tok, eval_items, a.alone_tokens)
                    row["status"].pop(f"alone:{m}", None)
                    print(f"{task:30s} {m:10s} alone {100 * row['alone'][m]['score']:5.1f} "
                          f"({row['alone'][m]['seconds']:.0f} s)", flush=True)
                except Exception as err:  # every row is reported, failures too
                    row["status"][f"alone:{m}"] = f"failed: {type(err).__name__}: {err}"[:200]
                save(res, a.out)
            if m not in row["probe"]:
                if targets is None:
                    row["status"][f"probe:{m}"] = "n/a (non-integer answers)"
                else:
                    try:
                        row["probe"][m] = run_probe(model, tok, train, test, targets)
                        row["status"].pop(f"probe:{m}", None)
                        print(f"{task:30s} {m:10s} probe {row['probe'][m]['exact']} "
                              f"({row['probe'][m]['seconds']:.0f} s)", flush=True)
                    except Exception as err:
                        row["status"][f"probe:{m}"] = f"failed: {type(err).__name__}: {err}"[:200]
                save(res, a.out)


def single_order(rows, policy="smollm2", by="margin", expert=ARMS_EXPERT, depth=ARMS_DEPTH):
    """Phase 2's order. by="margin": the largest expert-alone minus policy-alone margin (exact rates) first;
    by="gap": the largest probe gap (the rule's) first, so that the first eligible task met is the one the rule
    picks. Tasks the rule rules out without a single (pick_testbed: expert alone < MIN_MARGIN, or probe gap <= 0)
    come back apart, as {task: why}."""
    _, verdicts = pick_testbed(rows, expert, depth, policy)
    keyed, hopeless = [], {}
    for task, row in rows.items():
        v = verdicts[task]
        if v["expert_alone"] is None:
            hopeless[task] = "not run (time): phase 1 did not reach this task"
        elif not (v["eligible"] or v["why"].startswith("undecided")) and v["single"] is None:
            hopeless[task] = f"not run: cannot meet the rule ({v['why']})"
        else:
            policy_alone = exact_rate((row.get("alone") or {}).get(policy)) or 0.0
            gap = v["probe_gap"] if v["probe_gap"] is not None else -1.0
            keyed.append(((gap if by == "gap" else v["expert_alone"] - policy_alone), task))
    return [t for _, t in sorted(keyed, reverse=True)], hopeless


def phase2(a, res):
    log = os.path.join(RUNS, "log.txt")
    os.makedirs(RUNS, exist_ok=True)
    rows = {t: r for t, r in res["rows"].items() if not a.only or t in a.only}
    todo, hopeless = single_order(rows, by=a.single_by)
    for task, why in hopeless.items():
        if not res["rows"][task].get("single") and not a.single_all:
            res["rows"][task]["status"]["single"] = why
    if a.single_all:
        todo += list(hopeless)
    for task in todo:
        row = res["rows"][task]
        if row.get("single"):
            continue
        if deadline_passed(a.deadline):
            row["status"]["single"] = "not run (time)"
            continue
        try:
            row["single"] = run_single(task, a.n_eval, log)
            row["status"].pop("single", None)
            print(f"{task:30s} single {100 * row['single']['score']:5.1f} ({row['single']['seconds']:.0f} s)",
                  flush=True)
        except Exception as err:
            row["status"]["single"] = f"failed: {type(err).__name__}: {err}"[:200]
        save(res, a.out)
    save(res, a.out)


def cpu_name():
    try:
        line = next(x for x in open("/proc/cpuinfo") if x.startswith("model name"))
        flags = next(x for x in open("/proc/cpuinfo") if x.startswith("flags")).split()
        simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
        return f"{line.split(':', 1)[1].strip()} ({'/'.join(simd) or 'no AVX2'})"
    except (OSError, StopIteration):
        return platform.machine()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=list(CANDIDATES), help="these candidates only (default: all)")
    p.add_argument("--phases", nargs="+", type=int, default=[1, 2], help="1: alone + probe, 2: single")
    p.add_argument("--n-eval", type=int, default=64, help="validation items for alone and single")
    p.add_argument("--alone-tokens", type=int, default=16, help="greedy new tokens after the '<answer>' pre-fill")
    p.add_argument("--probe-train", type=int, default=256, help="probe training items (train split)")
    p.add_argument("--probe-test", type=int, default=100, help="probe held-out items (val split)")
    p.add_argument("--models", nargs="+", default=list(POCKET_MODELS), help="which pocket models (short names)")
    p.add_argument("--team", default="pocket", choices=["pocket", "tiny"], help="tiny: random-init models (tests)")
    p.add_argument("--single-by", default="margin", choices=["margin", "gap"], help="phase 2's order (single_order)")
    p.add_argument("--single-all", action="store_true", help="also run single where the rule cannot be met")
    p.add_argument("--deadline", default=None, help="HH:MM UTC: start nothing new after it")
    p.add_argument("--beside", default="", help="what else ran on the machine (written into the table)")
    p.add_argument("--note", default="", help="a line for the table's set-up notes")
    p.add_argument("--out", default=OUT)
    p.add_argument("--table-only", action="store_true", help="rebuild table.md from results.json")
    a = p.parse_args(argv)
    a.deadline = parse_deadline(a.deadline)
    specs = POCKET_MODELS if a.team == "pocket" else TINY_MODELS
    names = [m for m in a.models if m in specs] if a.team == "pocket" else list(TINY_MODELS)
    policy = names[0]
    encoders = [m for m in names if "minilm" in specs[m] or "bert" in specs[m]]
    res = load(os.path.join(a.out, "results.json"))
    meta = res.setdefault("meta", {})
    if a.beside:
        meta["beside"] = a.beside
    if a.note:
        meta.setdefault("notes", []).append(a.note)
    if a.table_only:
        save(res, a.out)
        print(open(os.path.join(a.out, "table.md")).read())
        return res
    meta.update(models=names, encoders=encoders, policy=policy, n_eval=a.n_eval, alone_tokens=a.alone_tokens,
                probe_train=a.probe_train, probe_test=a.probe_test, command=
                "OMP_NUM_THREADS=1 taskset -c 1 python experiments/screen.py")
    meta[f"machine_phases_{''.join(map(str, a.phases))}"] = (
        f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
        f"affinity {sorted(os.sched_getaffinity(0))}")
    t0 = time.time()
    if 1 in a.phases:
        phase1(a, res, Models(specs), names, policy)
    if 2 in a.phases and a.team == "pocket":
        phase2(a, res)
    meta[f"wall_seconds_last_call_phases_{''.join(map(str, a.phases))}"] = round(time.time() - t0)
    save(res, a.out)
    print(open(os.path.join(a.out, "table.md")).read())
    return res


if __name__ == "__main__":
    main()
