"""
The Conductor: the LoRA policy writes a workflow in text, frozen workers carry it out, GRPO trains the writer.

    python neighbours/conductor.py --task chain_sum --team tiny --steps 2 --batch-size 2 --grad-accum 1 \
        --group-size 2 --max-new-tokens 16 --out runs/try-conductor          # seconds, on any CPU
        # (constrained decoding, the default, needs `pip install -r requirements-conductor.txt`)
    python neighbours/conductor.py evaluate --run runs/try-conductor --n 20   # eval.json

Conductor (Nielsen et al., 2025): a language model trained with GRPO coordinates a pool of worker models by
writing, for each question, a workflow of three equal-length lists (neighbours/workflow.py: their parser, which
never evaluates model text, the reward and the grammar):

    model_id    = [0, 1]                                   which worker runs step j ("Model 0" .. "Model k-1")
    subtasks    = ["Solve the problem.", "Check and answer."] the instruction worker model_id[j] receives
    access_list = [[], [0]]                                which earlier answers step j may read: step
                                                           indices < j, "all" (every earlier answer) or []

The workers run in order; the last worker's answer is the workflow's output. Reward (no KL in the paper):
r = 0 if the three lists do not parse (or break the rules above), 0.5 if they parse and the output is wrong, 1 if
it is right. Here the conductor is the LoRA policy every method trains and the workers are the team's frozen
generative experts (an encoder has no words to give). The completion is the workflow text, so the GRPO pieces are
the ordinary ones (rollout.sample, grpo.group_advantages, grpo.grpo_loss); only the prompt and the reward differ.
grpo_step is train.py's step with the workflow in place of C, train_run train.py's loop over it (one process);
the rest is neighbours/plumbing.py.

Deviations from the paper (numbered):
  1. Up to --max-workflow-steps steps (default 2, for a 2-core CPU; the paper allows 5), and one worked example of
     a workflow as an earlier turn of the conversation (the paper uses 4 few-shot workflows). A longer workflow is
     malformed (reward 0), not cut.
  2. The response is pre-filled with "model_id = [" (CONDUCTOR_PREFIX): a 135M policy given 48 new tokens rarely
     starts a Python list by itself. The parser reads prefix + completion.
  3. Workers decode greedily (rollout.greedy_texts, as evaluate.py decodes the policy, not HF generate and its
     repetition penalty), each with its own chat template, train.py's prompt flags and --max-new-tokens; an
     answer is the response prefix and what follows it (rewards.responses). Greedy workers make the output a
     function of the workflow's text: a group's reward variance is the conductor's own, and a (worker, prompt)
     pair seen before is not run again (a cache).
  4. Scored by the task's scorer: r = 0.5 + 0.5 * score for a parsed workflow (1 exactly when right); with
     --reward exact the score is full marks or 0 (rewards.full_marks), so r is 0, 0.5 or 1.
  5. --beta defaults to 0 (the paper has no KL); a user's --beta adds the k3 KL to the policy with LoRA off.
  6. Worker ids may be integers (0) or names ("Model 0"). The conductor is not a worker (the paper's recursive
     variant lets it pick itself).
  7. Constrained decoding (--workflow-decoding constrained, the default; `free` is the paper's plain sampling): our
     135M conductor at temperature 1 derailed into code or prose (0 of 80 workflows parsed in a 5-step pocket run;
     every reward 0), so the workflow is sampled under its grammar (llguidance) and always parses. Forced tokens
     get log-prob 0 and no gradient; the ratio and the KL read the masked distribution the tokens were drawn from
     (WorkflowMasks). The rollout's budget is the longest workflow (134 tokens for the defaults); --max-new-tokens
     is the workers'. Evaluation writes the greedy workflow under the same grammar.
  8. --reward random (a control, not in the paper): a fair coin per workflow (rewards.coin_rewards); no worker runs.
     A conductor that learns to pick a worker should move away from this one's choice.

Logged per step beside train.py's fields: parse_rate, mean_steps (over parsed workflows), and each parsed
workflow's share of steps per worker as the routing distribution A [N, 1, K], so `utilization` and `entropy` mean
what they mean for the other methods.
"""
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's core

import grpo  # noqa: E402
import rewards  # noqa: E402
import rollout  # noqa: E402
from adapter import routing_stats  # noqa: E402
from baselines import Context  # noqa: E402
from experts import is_encoder, load_model  # noqa: E402
from lora import lora_disabled  # noqa: E402
from support.harness.build import load_policy_and_data, run_around  # noqa: E402
from support.harness.checks import parse  # noqa: E402
from support.harness.config import COUNT, build_parser  # noqa: E402
from support.harness.metrics import wall_clock  # noqa: E402
from support.harness.run import after_step, finish_run, progress_bar, resume_run  # noqa: E402
from support.harness.validation import restore_trained  # noqa: E402
from lib.optim import set_learning_rates  # noqa: E402
from neighbours import plumbing  # noqa: E402
from neighbours.workflow import (CONDUCTOR_PREFIX, MAX_STRING, NO_LIBRARY, WorkflowMasks, have_llguidance,  # noqa: E402
                                 longest_workflow, parse_workflow, workflow_grammar, workflow_reward)

CONDUCTOR_SYSTEM = (
    "You are a conductor. You solve a problem by giving subtasks to worker models. Write three Python lists of "
    "equal length, at most {max_steps} entries each:\n"
    "model_id: the worker of each step (a number from 0 to {last});\n"
    "subtasks: the instruction for each step;\n"
    "access_list: the earlier answers each step may read: a list of earlier step numbers, \"all\" or [].\n"
    "The answer of the last step is the final answer.")
EXAMPLE_PROBLEM = "What is 3 + 4?"  # the worked example: one earlier turn of the conversation, then the question
# its subtasks name no operation: a conductor that copies them, and the untrained control that runs them, ask the
# workers to solve and check whatever the task is (an earlier "Add the numbers." asked them to add on lcm)
EXAMPLE_WORKFLOW = ('model_id = [0, 1]\nsubtasks = ["Solve the problem.", "Check the answer and give it."]\n'
                    'access_list = [[], [0]]')
WORKER_MESSAGE = "{subtask}\n\nProblem: {question}"


# ----------------------------------------------------------------------------------------------------------
# The conductor's prompt and the workers


def conductor_prompt(tok, question, n_workers, max_steps):
    """The conductor's input: its system prompt, the worked example as an earlier user/assistant turn (a few-shot
    example; greedy, SmolLM2-135M copied a turn 8 of 8 times and an example inside the system prompt 6 of 8), then
    the anonymised workers and the question, through the policy's chat template, then CONDUCTOR_PREFIX."""
    system = CONDUCTOR_SYSTEM.format(max_steps=max_steps, last=n_workers - 1)
    workers = f"Workers: {', '.join(f'Model {k}' for k in range(n_workers))}.\nProblem: "
    turns = [("system", system), ("user", workers + EXAMPLE_PROBLEM), ("assistant", EXAMPLE_WORKFLOW),
             ("user", workers + question)]
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": r, "content": c} for r, c in turns], tokenize=False,
                                       add_generation_prompt=True)
    else:
        text = "".join(f"{r.capitalize()}: {c}\n" for r, c in turns) + "Assistant: "
    return text + CONDUCTOR_PREFIX


def worker_message(question, subtask, earlier):
    """What worker j reads: its subtask, the problem, and the earlier answers it was given access to. A subtask
    of None (a control's plan: a worker alone) gives the problem as it is, as the task's prompt would."""
    if subtask is None and not earlier:
        return question
    msg = WORKER_MESSAGE.format(subtask=subtask, question=question)
    if earlier:
        msg += "\n\nEarlier answers:\n" + "\n".join(f"Step {k}: {a.strip()}" for k, a in earlier)
    return msg


class Conductor(nn.Module):
    """No trainable parameters of its own (the conductor is the LoRA policy); holds the frozen workers."""
    context_tokens = 0  # no C: the policy reads no context tokens

    def __init__(self, workers, names, max_steps, max_new_tokens, prompt_args, decoding="free",
                 max_subtask_chars=40):
        super().__init__()
        self.workers, self.names = workers, names   # [(model, tokenizer)], not submodules: never trained or saved
        self.max_steps, self.max_new_tokens, self.prompt_args = max_steps, max_new_tokens, prompt_args
        self.decoding, self.max_subtask_chars = decoding, max_subtask_chars    # --workflow-decoding
        self.cache = {}                                 # (worker, prompt) -> answer: greedy workers repeat themselves
        self.grammar_tok = (None, None)                 # (policy tokenizer, llguidance's view of it: ~1 s)
        self.fixed_plan = None  # a parsed workflow run for every question in evaluation, the policy unread (a control)

    def forward(self, questions, answers=None, reuse=None):  # the interface of baselines.py: no context tokens
        return Context(None, None, [None] * len(questions))

    @torch.no_grad()
    def run_workflows(self, questions, plans):
        """Carry out one workflow per question (None: nothing runs). Step j of every workflow runs together,
        one batched generate call per worker. Returns the last worker's answer per question ("" for None)."""
        answers = [[] for _ in questions]
        for j in range(self.max_steps):
            for k, (model, tok) in enumerate(self.workers):
                rows = [r for r, p in enumerate(plans) if p is not None and len(p[0]) > j and p[0][j] == k]
                if not rows:
                    continue
                msgs = [worker_message(questions[r], plans[r][1][j], [(a, answers[r][a]) for a in plans[r][2][j]])
                        for r in rows]
                for r, text in zip(rows, self.generate(k, msgs)):
                    answers[r].append(text)
        return [a[-1] if a else "" for a in answers]

    def generate(self, k, messages):
        """Worker k's greedy answers to `messages`. Prompts it answered before come from the cache; the rest run
        as one batch (rollout.greedy_texts: their common beginning, system prompt and worked example, once)."""
        model, tok = self.workers[k]
        sp, we, rp = self.prompt_args
        prompts = [rewards.build_prompt(tok, m, sp, we, response_prefix=rp) for m in messages]
        todo = list(dict.fromkeys(p for p in prompts if (k, p) not in self.cache))
        if todo:
            said = rollout.greedy_texts(model, tok, todo, self.max_new_tokens)
            if len(self.cache) > 100_000:
                self.cache.clear()
            self.cache.update(zip([(k, p) for p in todo], rewards.responses(rp, said)))  # the pre-filled words too
        return [self.cache[(k, p)] for p in prompts]

    def usage(self, plans):
        """A [N, 1, K]: each parsed workflow's share of steps per worker (the routing distribution of Eq. 15)."""
        rows = [torch.bincount(torch.tensor(p[0]), minlength=len(self.workers)).float() / len(p[0])
                for p in plans if p is not None]
        return torch.stack(rows).unsqueeze(1) if rows else None

    # ------------------------------------------------------------------------------------------------------
    # Writing the workflows, and evaluation

    def write(self, policy, tok, questions, G, temperature, eos_ids, max_new_tokens, greedy=False):
        """G workflows per question from the policy (after CONDUCTOR_PREFIX): w.ids, w.mask [B, P] the prompts,
        w.comp [B*G, T] the completions, w.comp_mask [B*G, T], w.allowed_mask: None with --workflow-decoding free
        (rollout.sample as it is, max_new_tokens tokens), else the grammar's masks [B*G, T, V] (WorkflowMasks; its
        own token budget, longest_workflow), w.texts [B*G] and w.plans [B*G] (parse_workflow's, None: malformed)."""
        K, S, L = len(self.workers), self.max_steps, self.max_subtask_chars
        ids, mask = rollout.encode_prompts(tok, [conductor_prompt(tok, q, K, S) for q in questions], policy.device)
        allowed, budget = None, max_new_tokens  # free: rollout.sample as it is
        if self.decoding == "constrained":
            V = policy.get_output_embeddings().weight.shape[0]
            if self.grammar_tok[0] is not tok:
                import llguidance.hf
                self.grammar_tok = (tok, llguidance.hf.from_tokenizer(tok, n_vocab=V, eos_token=list(eos_ids)))
            allowed = WorkflowMasks(self.grammar_tok[1], workflow_grammar(K, S, L), ids.shape[0] * G, V,
                                    eos_ids=eos_ids, device=ids.device)
            budget = len(longest_workflow(K, S, L)) + 1
        comp = rollout.sample(policy, ids, mask, None, G=G, max_new_tokens=budget, temperature=temperature,
                              eos_ids=eos_ids, pad_id=tok.pad_token_id, greedy=greedy, allowed=allowed)
        comp_mask = grpo.completion_mask(comp, eos_ids)
        texts = tok.batch_decode(comp.masked_fill(~comp_mask, tok.pad_token_id), skip_special_tokens=True)
        allowed_mask = None if allowed is None else allowed.allowed_mask(comp.shape[1], comp.device)
        return SimpleNamespace(ids=ids, mask=mask, comp=comp, comp_mask=comp_mask, allowed_mask=allowed_mask,
                               texts=texts, plans=[parse_workflow(CONDUCTOR_PREFIX + t, K, S) for t in texts])

    @torch.no_grad()
    def answer(self, policy, tok, questions, args):
        """Greedy workflow, greedy workers: the output text per question (evaluate.py). With fixed_plan set
        (experiments/neighbour_controls.py), that workflow for every question: the policy writes nothing."""
        if self.fixed_plan is not None:
            return self.run_workflows(questions, [self.fixed_plan] * len(questions))
        w = self.write(policy, tok, questions, 1, 1.0, rollout.eos_token_ids(policy, tok), args.max_new_tokens,
                       greedy=True)
        return self.run_workflows(questions, w.plans)


def conductor(team, out_dim, args, device, dtype):
    """baselines.py's signature. Workers: the team's experts that can write (decoders), "Model 0..k-1" in order."""
    workers, names = [], []
    for name in team["experts"]:
        model, tok = load_model(name, device, dtype)
        if not is_encoder(model):
            workers.append((model, tok)), names.append(name)
    if not workers:
        raise ValueError(f"--method conductor: team {team['experts']} has no generative expert to be a worker")
    decoding = getattr(args, "workflow_decoding", "free")    # a run saved before the flag existed: free
    if decoding == "constrained" and not have_llguidance():
        raise ImportError(NO_LIBRARY)
    return Conductor(workers, names, args.max_workflow_steps, args.max_new_tokens,
                     prompt_args=(args.system_prompt, args.worked_example, args.response_prefix),
                     decoding=decoding, max_subtask_chars=getattr(args, "max_subtask_chars", 40))


def load_trained(args, lora_state=None, method_state=None, device="cpu"):
    """A run of this script (its config `args`), loaded: (policy, tokenizer, method, eos_ids)."""
    policy, tok, dtype = plumbing.frozen_policy(args, device)
    g = conductor(args.team_models, policy.config.hidden_size, args, torch.device(device), dtype=dtype)
    return restore_trained(policy, tok, g, args, lora_state=lora_state, method_state=method_state)


def build_run(args, life):
    """A Run (support/harness/build.py) with this script's g, in build_run's seeded order: the frozen policy
    (seeded), conductor(...), LoRA on the policy and the optimiser, for the run `life` (plumbing.opened)."""
    with plumbing.one_line_errors():  # loaders raise ValueError / FileNotFoundError with a one-line message
        parts = load_policy_and_data(args, life.device)
        g = conductor(parts.team, parts.policy.config.hidden_size, args, life.device, dtype=parts.dtype)
        run = run_around(parts, g, args, life.device)
    run.life = life
    return run


# ----------------------------------------------------------------------------------------------------------
# One GRPO step, and the loop over them


def grpo_step(step, run, args, score_batch):
    """rollout (workflow text) -> workers -> reward -> advantage -> (reference) -> loss -> step -> log."""
    cond, policy, tok, optimizer = run.method, run.policy, run.tok, run.optimizer
    G, device, eos_ids, t0 = args.group_size, run.device, run.eos_ids, time.time()
    set_learning_rates(optimizer, step, args)                     # --lr-schedule, --warmup-steps
    batches = []
    for micro in range(args.grad_accum):
        items = plumbing.micro_batch_items(run, args, step, micro)
        questions = [it["question"] for it in items]
        # ---- rollout: G workflows per question, written by the policy (w.allowed_mask None: free decoding) --
        w = cond.write(policy, tok, questions, G, args.temperature, eos_ids, args.max_new_tokens)
        # ---- the workers carry the workflows out; the last answer is scored -------------------------------
        parsed = [n for n, p in enumerate(w.plans) if p is not None]
        if args.reward == "random":  # the control: a coin per workflow, nothing runs or is read (deviation 8)
            r = torch.tensor(rewards.coin_rewards(args.seed, step, micro, 0, n=len(w.plans)), device=device)
            outputs, counts = [""] * len(w.plans), {}
        else:
            outputs = cond.run_workflows([q for q in questions for _ in range(G)], w.plans)
            item_rows = [it for it in items for _ in range(G)]
            scores, counts = score_batch([item_rows[n] for n in parsed], [outputs[n] for n in parsed]) \
                if parsed else ([], {})
            if args.reward == "exact":  # full marks or nothing: partial credit pays no reward
                scores = rewards.full_marks(scores)
            score_of = dict(zip(parsed, scores))
            r = torch.tensor([workflow_reward(p, score_of.get(n, 0.0)) for n, p in enumerate(w.plans)],
                             device=device)
        adv = grpo.group_advantages(r, G, scale=not args.no_scale_rewards)
        logp_ref = None
        if args.beta > 0:  # the paper has no KL; with --beta, pi_ref = the policy with LoRA off
            with torch.no_grad(), lora_disabled(policy):
                logp_ref = rollout.completion_logprobs(policy, w.ids, w.mask, None, completion_ids=w.comp,
                                                       completion_mask=w.comp_mask, temperature=args.temperature,
                                                       allowed_mask=w.allowed_mask)
        w.questions, w.items, w.r, w.adv, w.logp_ref, w.counts = questions, items, r, adv, logp_ref, counts
        w.texts = [f"{CONDUCTOR_PREFIX}{t}\n--> {o}" for t, o in zip(w.texts, outputs)]  # as samples.jsonl shows them
        batches.append(w)
    # ---- loss and step (mu = 1: logp_old = logp, detached) ----------------------------------------------------
    optimizer.zero_grad(set_to_none=True)
    losses, stats = [], []
    for b in batches:
        logp = rollout.completion_logprobs(policy, b.ids, b.mask, None, completion_ids=b.comp,
                                           completion_mask=b.comp_mask, temperature=args.temperature,
                                           allowed_mask=b.allowed_mask)
        logp_ref = logp.detach() if b.logp_ref is None else b.logp_ref
        loss, m = grpo.grpo_loss(logp=logp, logp_old=logp.detach(), logp_ref=logp_ref, advantages=b.adv,
                                 mask=b.comp_mask, clip_eps=args.clip_eps, beta=args.beta,
                                 aggregation=args.loss_aggregation)
        (loss / args.grad_accum).backward()
        losses.append(loss.item()), stats.append(m)
    grads = plumbing.update(optimizer, args, losses)
    # ---- log ----------------------------------------------------------------------------------------------------
    plans = [p for b in batches for p in b.plans]
    n_parsed = sum(p is not None for p in plans)
    own = {"answer_rate": (n_parsed - sum(b.counts.get("no_answer", 0) for b in batches)) / len(plans),
           "parse_rate": n_parsed / len(plans),
           "mean_steps": sum(len(p[0]) for p in plans if p) / n_parsed if n_parsed else 0.0}
    eos = torch.tensor(eos_ids, device=device)
    truncated = torch.cat([~torch.isin(b.comp, eos).any(-1) for b in batches])         # (N,) no EOS written
    rec = plumbing.step_record(step, batches, G, losses=losses, stats=stats, grads=grads, own=own,
                               lengths=[b.comp_mask.sum(-1) for b in batches],
                               truncated_fraction=truncated.float().mean().item())
    A = cond.usage(plans)
    if A is not None:
        rec["entropy"], rec["utilization"] = routing_stats(A)
        rec["utilization_names"] = cond.names
    # seconds, and tokens_per_s over the workflow tokens the policy wrote (the workers' answers not counted)
    rec.update(wall_clock(t0, sum(int(b.comp_mask.sum()) for b in batches)))
    return rec, batches  # after_step reads .questions, .items, .texts, ...


def train_run(args, score_batch):
    """One run, as train.train runs one: opened, built, resumed, its steps, finished. Returns --out."""
    with plumbing.opened(args) as life:  # checks (bad input: exit 2), --out locked, Ctrl-C / SIGTERM, the device
        run = build_run(args, life)
        start = resume_run(run, args, run.world)  # --resume's checkpoint, config.json, validation before
        bar, bad_steps = progress_bar(start, args, life.writer), 0
        for step in range(start, args.steps):
            rec, batches = grpo_step(step, run, args, score_batch)
            # samples.jsonl, metrics.jsonl, the log line, checkpoint.pt; --max-bad-steps
            bad_steps = after_step(run, args, step, rec, batches=batches, bar=bar, bad_steps=bad_steps)
            bar.update(1)
        bar.close()
        return finish_run(run, args)  # lora_peft/, g_phi, the plot, validation after training


# ----------------------------------------------------------------------------------------------------------
# The command line: train, or `evaluate` a saved run (load_trained, above)


def parse_args(argv=None):
    """train.py's flags (support/harness/config.py), --method conductor, and the conductor's own."""
    p = build_parser(methods=["conductor"], description=__doc__.strip().splitlines()[0])
    p.set_defaults(beta=0.0)  # the paper trains without KL (deviation 5)
    a = p.add_argument_group("the conductor's own", "the workflow it writes: how many steps, how it is "
                             "decoded").add_argument
    a("--max-workflow-steps", type=COUNT, default=2, help="most steps a workflow may have "
      "(paper: 5; 2 keeps a CPU step affordable)")
    a("--workflow-decoding", default="constrained", choices=["constrained", "free"],
      help="constrained: the workflow is sampled under its grammar (llguidance, "
      "requirements-conductor.txt), so every workflow parses; free: plain sampling (the paper's)")
    a("--max-subtask-chars", type=COUNT, default=40, help="longest subtask string, in characters, "
      f"under constrained decoding (at most {MAX_STRING}, the parser's limit)")
    args = parse(p, argv)
    if args.max_subtask_chars > MAX_STRING:
        p.error(f"--max-subtask-chars {args.max_subtask_chars} is above the parser's limit of {MAX_STRING}")
    if args.workflow_decoding == "constrained" and not have_llguidance():
        p.error(NO_LIBRARY)
    return plumbing.refuse_train_levers(p, args, rewards=("task", "exact", "random"))


def main(argv=None, score_batch=None):
    """Train the conductor (train.py's flags), or `evaluate --run DIR --n N` a run of it (eval.json)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["evaluate"]:
        return train_run(parse_args(argv), score_batch or rewards.score_batch)
    with plumbing.evaluation(argv[1:], "neighbours/conductor.py") as ev:  # one line on failure, nothing half-written
        loaded = load_trained(ev.cfg, ev.state["lora"], method_state=ev.state["method"], device=ev.device)
        ev.result = plumbing.score_run(*loaded, ev.cfg, ev.n, ev.batch_size)  # greedy, evaluate.py's result


if __name__ == "__main__":
    main()
