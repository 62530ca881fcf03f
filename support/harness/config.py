"""
The flags of a training run: every train.py flag in its group, its default (the paper's, unless the help says
otherwise) and its type check; the presets; and the one-line error every bad input gets (fail), with the folder
a flag names made or refused in that one line (create_folder). The checks between flags, and of the run they
describe, are support/harness/checks.py's: its parse_args parses train.py's flags with the parser built here.

    python train.py --help              # every flag with its default: the paper's settings, levers, the run
    python -c "from support.harness.checks import parse_args; print(vars(parse_args(['--preset', 'pocket'])))"

One flat argparse block, as nanochat's scripts have it: flags use dashes, variables underscores. Each number is
checked by its type (COUNT, NONNEG, POSITIVE, number(...)), so a bad value fails on its own line, naming its
flag, with exit code 2 and before anything is written; a JSON value (--task-config, --config's file) is read by
strict_json (finite numbers, MAX_JSON_DEPTH deep). train.py, evaluate.py, support/harness/plan.py, the
neighbours and the experiments all build their training flags here (build_parser), so a flag means the same
everywhere. A value may be negative ("--flag -1e-3" is a value, not an option); each flag's type says whether a
negative value makes sense.

A preset (PRESETS) is a plain dict of flag values: `--preset pocket` sets them, any flag given beside it wins,
and config.json records the resolved values with the preset's name. Nothing here is in the paper but the
defaults of its settings (--help's first group).

Try it on CPU:  python train.py --help
"""
import argparse
import json
import math
import os
import re
import shlex
import sys
import textwrap

import rewards
from baselines import METHODS
from experts import POOLINGS, TEAMS
from lib import distributed
from support.harness.track import BACKENDS

DESCRIPTION = "Train a LoRA policy with GRPO, conditioned on context tokens built from frozen experts."


FLOAT32_TINY, FLOAT32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38  # float32's smallest normal, largest


def number(kind, low, low_ok=True, high=None, why_high=""):
    """An argparse type: a finite `kind` (int or float) >= low (> low when not low_ok) and <= high. A float must
    also be a float32 number other than a tiny one: what trains and its AdamW state are float32, and there a
    value below float32's smallest normal number (an --adam-eps of 1e-50) acts as 0 and one above its largest
    (an --lr of 1e39) as infinity."""
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
        if not (math.isfinite(v) and (v >= low if low_ok else v > low)):  # `not`, so that NaN fails too
            raise argparse.ArgumentTypeError(f"must be {'>=' if low_ok else '>'} {low}, got {text}")
        if high is not None and v > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}{why_high}, got {text}")
        if kind is float and abs(v) > FLOAT32_MAX:
            raise argparse.ArgumentTypeError(f"{text} is infinite in float32 (the trainable weights' dtype; its "
                                             f"largest number is {FLOAT32_MAX:.3g})")
        if kind is float and 0 < abs(v) < FLOAT32_TINY:
            raise argparse.ArgumentTypeError(f"{text} is below float32's smallest normal number {FLOAT32_TINY:.3g} "
                                             "(the trainable weights' dtype): it would act as 0")
        return v
    return parse


COUNT, NONNEG, POSITIVE = number(int, 1), number(float, 0), number(float, 0, low_ok=False)
# items of one split: their reasoning-gym seeds must fit in the split's range (rewards.MAX_DATASET_SIZE)
SPLIT_SIZE = number(int, 1, high=rewards.MAX_DATASET_SIZE, why_high=" (the most items a split holds)")

MAX_JSON_DEPTH = 8  # nesting of a JSON flag value (--task-config: reasoning-gym's configs are flat; --config's file)


def strict_json(text, depth=MAX_JSON_DEPTH):
    """json.loads that holds a value to a flag's rules: finite numbers only (JSON's NaN, Infinity and 1e400 are
    refused), nesting at most `depth` deep. ValueError with a one-line reason."""
    def finite(v):
        v = float(v)
        if not math.isfinite(v):
            raise ValueError(f"{v} is not a finite number")
        return v

    def no_constant(name):
        raise ValueError(f"{name} is not a finite number")

    # nesting counted before parsing: json.loads recurses once per level and a deep text overflows the stack
    level, deepest, quoted, escaped = 0, 0, False, False
    for ch in text:
        if quoted:  # inside a string: brackets do not count
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "[{":
            level += 1
            deepest = max(deepest, level)
        elif ch in "]}":
            level -= 1
    if deepest > depth:
        raise ValueError(f"nested {deepest} deep, more than {depth}")
    return json.loads(text, parse_float=finite, parse_constant=no_constant)


# The README's first run: the pocket team on 2-term sums, 6 steps with the speedrun's levers, scored on 100
# validation items before and after (about 9 minutes on a 2-core CPU). `smoke`: the tiny random-init team,
# seconds on any CPU, to see every part run.
PRESETS = {
    "pocket": {"task": "chain_sum", "task_config": '{"min_terms": 2, "max_terms": 2, "min_digits": 1, '
               '"max_digits": 2}', "team": "pocket", "worked_example": True, "response_prefix": "<think>",
               "context_position": "before", "batch_size": 4, "grad_accum": 1, "group_size": 4,
               "max_new_tokens": 48, "lr": 1e-3, "router_lr": 1e-3, "rollout_dtype": "bfloat16",
               "tis_cap": 2.0, "dynamic_sampling": 1, "format_bonus": 0.1, "steps": 6, "save_every": 3,
               "eval_items": 100, "out": "runs/pocket-first"},
    "smoke": {"task": "chain_sum", "team": "tiny", "system_prompt": "simple", "dataset_size": 64,
              "batch_size": 2, "grad_accum": 1, "group_size": 4, "max_new_tokens": 16, "steps": 3,
              "eval_items": 8, "out": "runs/smoke"},
}
# a negative number, exponent and all, is a flag's value ("--lr -1e-3"), never an option
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.IGNORECASE)


HELP_WIDTH = 100  # columns of --help, whatever the terminal's width ($COLUMNS): the same text everywhere
USAGE = "%(prog)s [-h] [--preset NAME] [--FLAG VALUE ...]"  # the flags are listed below it, by group


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help in HELP_WIDTH columns: each flag's help wrapped, with its default, once: a help that already says
    its default ("(default 500; ...)") gets none appended, nor does an unset flag (None, "") or an off switch
    (False). The description, the groups' descriptions and the presets (the epilog) keep their lines."""

    def __init__(self, prog):
        super().__init__(prog, width=HELP_WIDTH)

    def _get_help_string(self, action):
        if "(default" in (action.help or "") or action.default in (None, False, ""):
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error that names the flag (no usage block), like every other bad-input error
    here, and negative numbers read as values."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER

    where = ""  # what the values came from, when not a command line (evaluate.py: "--run DIR: config.json")

    def error(self, message):
        message = re.sub(r"^argument ([-\w]+)(/[-\w]+)?: ", r"\1: ", message)
        fail(f"{self.where}: {message}" if self.where else message)


def presets_help():
    """--help's epilog: each preset as the flags it sets, its lines broken between two flags (never inside a
    quoted value) to fit HELP_WIDTH."""
    lines = ["presets (--preset NAME sets these flags; a flag given beside it wins):"]
    for name, values in PRESETS.items():
        line = f"  {name}:"
        for k, v in values.items():
            flag = f"--{k.replace('_', '-')}" + ("" if v is True else f" {shlex.quote(v)}" if isinstance(v, str)
                                                 else f" {v}")
            if len(line) + 1 + len(flag) > HELP_WIDTH:
                lines.append(line)
                line = "   "
            line += f" {flag}"
        lines.append(line)
    return "\n".join(lines)


def build_parser(methods=METHODS, description=DESCRIPTION):
    """Every training flag, in --help's three groups: the paper's settings, the levers that are not the paper's,
    the run. `methods`: --method's choices, the first the default (a neighbour script passes its own one, and
    adds its own flags in a group of its own)."""
    p = ArgumentParser(description=textwrap.fill(description, HELP_WIDTH), usage=USAGE,
                       formatter_class=HelpFormatter, epilog=presets_help())
    a = p.add_argument_group("the paper's settings", "the task, the team, the method and the hyper-parameters "
                             "the paper fixes, at its values").add_argument
    a("--task", default="arithmetic",
      help="a family (arithmetic, algorithmic, logic), gsm8k, or any reasoning-gym dataset name")
    a("--task-config", default=None, help="JSON overriding a single dataset's reasoning-gym config, e.g. "
      "'{\"min_terms\": 2, \"max_terms\": 2, \"max_digits\": 2}' with --task chain_sum")
    a("--dataset-size", type=SPLIT_SIZE, default=20000, help="reasoning-gym items per split (paper: 20000)")
    a("--system-prompt", default="DeepSeekZero", choices=rewards.SYSTEM_PROMPT_NAMES,
      help="reasoning-gym system prompt")
    a("--team", default="default", choices=sorted(TEAMS), help="expert team (experts.py TEAMS)")
    # the choices are in the help text, which argparse wraps, not inline: a fork's long name stays in 100 columns
    a("--method", default=list(methods)[0], choices=sorted(methods), metavar="NAME",
      help=f"how experts reach the policy (default: {list(methods)[0]}): {', '.join(sorted(methods))} (baselines.py)")
    a("--policy", default=None, help="policy model: hub id, local folder or .gguf (default: the team's)")
    a("--experts", default=None, help="comma-separated expert models, overriding the team's")
    a("--steps", type=COUNT, default=None, help="optimiser steps (default 500; 233 for gsm8k: one epoch)")
    a("--batch-size", type=COUNT, default=4, help="prompts per micro-batch")
    a("--grad-accum", type=COUNT, default=8, help="micro-batches per optimiser step (paper: 4 x 8 = 32 prompts)")
    a("--group-size", type=number(int, 2), default=8, help="GRPO group size G: completions per prompt (>= 2)")
    a("--max-new-tokens", type=COUNT, default=128, help="generation budget for the policy and expert hints")
    a("--temperature", type=POSITIVE, default=1.0, help="sampling temperature (log-probs use the same)")
    a("--lr", type=POSITIVE, default=1e-4, help="learning rate of the LoRA policy")
    a("--router-lr", type=POSITIVE, default=1e-4, help="learning rate of the adapter / router g_phi")
    a("--weight-decay", type=NONNEG, default=1e-2, help="AdamW weight decay")
    a("--adam-eps", type=POSITIVE, default=1e-6, help="AdamW epsilon")
    a("--grad-clip", type=POSITIVE, default=1.0, help="max global gradient norm")
    a("--beta", type=NONNEG, default=0.04, help="KL coefficient beta (Eq. 4)")
    a("--clip-eps", type=NONNEG, default=0.2, help="PPO clip epsilon, in [0, 1)")
    a("--inner-epochs", type=COUNT, default=1, help="mu: optimisation passes per rollout batch (paper: 1)")
    a("--loss-aggregation", default="sequence", choices=["sequence", "token"],
      help="sequence: each completion's token mean, then the mean over completions (GRPO's); token: one mean "
      "over a micro-batch's tokens (DAPO's, but per micro-batch: the step averages the --grad-accum "
      "micro-batches; grpo.py)")
    a("--lora-rank", type=COUNT, default=8, help="LoRA rank r")
    a("--lora-alpha", type=POSITIVE, default=16.0, help="LoRA alpha (scaling alpha / r)")
    a("--latent-dim", type=COUNT, default=512, help="adapter latent width d")
    a("--num-latents", type=COUNT, default=8, help="m: number of latent queries = context tokens")
    a("--num-heads", type=COUNT, default=8, help="cross-attention heads")
    a("--pooling", default="last", choices=POOLINGS, help="expert hidden-state pooling (paper Table 2)")
    a("--expert-depth", type=number(float, 0, low_ok=False), default=1.0, help="pool the output of the block at this "
      "fraction of each expert's depth, in (0, 1] (paper: 1, the final layer); e.g. 0.5 for a middle layer")
    a("--context-position", default="after", choices=["after", "before"],
      help="[x || C] (Eq. 3) or [x_0 || C || x_1..] (in front, behind the first token: rollout.policy_inputs)")
    a("--seed", type=number(int, 0, high=2**32 - 1, why_high=" (numpy's seeds are 32-bit)"), default=0,
      help="seed for data order, sampling and initialisation")
    a = p.add_argument_group("levers", "not the paper's, off by default: each changes the algorithm or how a step "
                             "computes it").add_argument
    a("--lr-schedule", default="constant", choices=["constant", "cosine"], help="constant (paper) or cosine "
      "decay to 0 at --steps; both after --warmup-steps of linear warm-up")
    a("--warmup-steps", type=number(int, 0), default=0, help="linear learning-rate warm-up, in optimiser steps")
    a("--clip-per-group", action="store_true", help="clip LoRA's and g_phi's gradients to --grad-clip each, not "
      "jointly: with one global norm, a large adapter gradient (W_out's) shrinks LoRA's step too")
    a("--no-scale-rewards", action="store_true", help="advantage = r - mean (no division by the group std)")
    a("--channel-weight", type=NONNEG, default=0.0, help="not the paper's: lambda of the channel-forcing term, "
      "which raises log pi(y | x, C(x)) above log pi(y | x, C(x')) on completions with A > 0 (grpo.py; 0: off)")
    a("--freeze-policy", action="store_true", help="train only g_phi (no LoRA): can C alone move the reward?")
    a("--reward", default="task", choices=["task", "exact", "random"], help="task: the task's own scorer; exact: 1 "
      "where that scorer gives full marks, else 0 (reasoning-gym pays partial credit on some tasks: gcd pays 0.5 "
      "for '12' when the answer is 2); random: a seeded fair coin per completion that ignores the text (a control: "
      "what any rising reward does to H)")
    a("--format-bonus", type=NONNEG, default=0.0, help="a deviation, for training only: add this to the reward "
      "of a completion with a non-empty <answer>...</answer> block; evaluation never sees it (0: off, the paper)")
    a("--format-bonus-strict", action="store_true", help="pay --format-bonus only when the completion ends with "
      "its answer block and, where the gold answer is a number, the answer is one (rewards.answer_shaped)")
    a("--dynamic-sampling", type=number(int, 0), default=0, help="re-draw a group whose G rewards are all equal "
      "up to N times; the surrogate then averages over the groups with reward variance, the KL over every group "
      "(DAPO's dynamic sampling, grpo.signal_scale; 0: off, the paper)")
    a("--state-norm", default="none", choices=["none", "standardize"], help="standardise each expert's pooled "
      "states per dimension, with statistics from --state-norm-prompts training prompts (ours, identical, no_xattn)")
    a("--state-norm-prompts", type=COUNT, default=256, help="training prompts the --state-norm statistics come from")
    a("--context-anchor", default="zero", choices=["zero", "newline"], help="what each context token starts "
      "from: zero (Eq. 11; a step-1 jump through the policy's RMSNorm) or the policy's embedding of a newline, "
      "around which a small C is a small change (adapter.py, deviation 4)")
    a("--context-split", default="", help="a deviation: C goes in front of this ending of --response-prefix "
      "instead of after the whole prompt, e.g. --response-prefix '<think></think>\\n<answer>' --context-split "
      "'</think>\\n<answer>' puts C inside the empty reasoning block (the mechanism test's slot); its tokens "
      "are encoded on their own, for every method alike (rollout.encode_prompts; '': off)")
    a("--worked-example", action="store_true", help="add one worked example to the system prompt (small policies)")
    a("--response-prefix", default="", help="text the response starts with, e.g. '<think>' (small policies); the "
      "scorers read it with the completion, so a prefix that ends by opening the answer block ('<answer>') "
      "makes answer-only completions (rewards.responses)")
    a("--rollout-dtype", default="float32", choices=["float32", "bfloat16", "int8"],
      help="the rollout's matmuls on a copy of the weights in this dtype "
      "(lib/low_precision.py; int8: CPU only); the scoring pass stays as it is")
    a("--tis-cap", type=NONNEG, default=0.0, help="truncated importance sampling: weight each token's surrogate "
      "by min(pi_old / pi_sampler, cap), for --rollout-dtype bfloat16 or int8 "
      "(grpo.truncated_is_weights; 0: off)")
    a("--rollout-batch", type=number(int, 0), default=0, help="micro-batches sampled in one decode loop (0: the "
      "whole step's, one loop; lower it if the rollout's KV cache does not fit: --plan counts it)")
    a("--keep-activations", action="store_true", help="keep the MLPs' activations for the backward pass "
      "instead of computing them again there (lib/recompute.py): the same numbers, ~10 %% faster steps "
      "and ~1.1 GB more peak memory on the pocket policy")
    a("--attention", default="auto", choices=["auto", "grouped", "sdpa"], help="the policy's attention: grouped "
      "(lib/attention.py: each key/value head read once by its group of query heads), sdpa (transformers' "
      "own, which copies keys and values once per query head whenever a mask is passed) or auto: grouped on CUDA "
      "for a policy with grouped key/value heads, else the model's own (on a CPU the numbers stay bit for bit)")
    a("--no-shared-prefix", action="store_true", help="run every prompt whole in every pass, instead of the "
      "beginning all of a step's prompts share once (rollout.prefill; the same function, another order of sums)")
    a = p.add_argument_group("the run", "where it runs, what it reads and writes, how it resumes; --preset and "
                             "--config fill in the flags").add_argument
    a("--preset", default=None, choices=sorted(PRESETS), help="a plain dict of flag values (below); flags "
      "given beside it override it")
    a("--config", default=None, metavar="RUN/config.json", help="replay a run: every flag value its config.json "
      "holds (checked as on the command line); a flag given beside it wins. Not replayed: --out (required: a "
      "new folder), --resume (add it to continue a run instead) and --config; a flag newer than the file takes "
      "its default; a switch the file turns on can only be turned off in the file. Not with --preset (the file "
      "holds its values)")
    a("--out", default=None, help="output folder (default runs/TASK-TEAM-METHOD-sSEED): new, empty, or a run of "
      "this project's (--resume continues it); a folder holding other files is refused (exit code 2), never "
      "written: a run replaces only files a run wrote")
    a("--resume", action="store_true", help="continue from OUT/checkpoint.pt (none there: start at step 1)")
    a("--save-every", type=COUNT, default=50, help="checkpoint every N steps (and at the end)")
    a("--sample-every", type=COUNT, default=10, help="write a few completions to OUT/samples.jsonl every N steps")
    a("--max-bad-steps", type=COUNT, default=5, help="stop (exit code 3) after this many non-finite steps in a row")
    a("--eval-items", type=number(int, 0, high=rewards.MAX_DATASET_SIZE), default=0, help="score N validation "
      "items (greedy, the task's scorer) before the first step and after the last, and print both on one line "
      "(0: off)")
    a("--track", default="none", choices=["none", *BACKENDS], help="live tracking of each step's metrics.jsonl "
      "record (support/harness/track.py): tensorboard writes OUT/tensorboard/; trackio and wandb log to the project "
      "n-musketeers, the run named after --out's folder. Its library is imported only when named here")
    a("--data-path", default=None, help="local GSM8K jsonl or folder (default: the hub's openai/gsm8k)")
    a("--device", default="auto", help="auto (cuda -> mps -> cpu), cuda[:N], mps or cpu (under torchrun: each "
      "process takes cuda:LOCAL_RANK)")
    a("--expert-device", default=None, help="where the frozen experts run, e.g. cuda:1 or cpu (default: --device); "
      "their pooled states move to the policy's device")
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="dtype of the frozen weights "
      "(auto: bfloat16 on CUDA, float32 elsewhere); LoRA, g_phi and their optimiser state are always float32")
    a("--deterministic", action="store_true", help="deterministic CUDA kernels (strict "
      "torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG): on a GPU, --resume and N processes then "
      "reach the same numbers as one uninterrupted process (without it the attention backward adds with atomics); "
      "slower. CPU runs are deterministic without it")
    a("--expert-cache", default=None, help="a folder where the frozen experts' pooled states are kept, one file per "
      "prompt: runs and evaluations that name the same folder compute each state once (lib/state_store.py). "
      "A state read back is the one computed in the batch that first filled it, which differs from one computed in "
      "another batch in its last bits: --resume keeps the run's own --expert-cache")
    a("--precompute-states", action="store_true", help="write the experts' pooled states of every prompt the run "
      "will read into --expert-cache and exit; the run then never loads its experts (their memory is free)")
    a("--random-weights", action="store_true", help="RANDOM weights at the real shapes of the team's hub models "
      "(lib/shape_models.py): the paper's code path at full size with no download, for memory and speed "
      "checks only (it learns nothing useful)")
    a("--plan", action="store_true", help="print the memory each device needs (weights on PyTorch's meta device: "
      "nothing downloaded or allocated) and exit without writing (support/harness/plan.py)")
    return p


# The folder a flag names (--out, --expert-cache), made or refused in one line: beside fail, since
# support/harness/validation.py makes evaluate's --out with them and checks.py reads validation's items.
def folder_problem(path, flag):
    """Why `path` cannot be the folder `flag` writes into (a file is there, or in its way, or its nearest
    existing folder is not writable), or None. Reads only; create_folder makes it."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            return f"{flag} {path} is a file, not a folder"
        return None if os.access(path, os.W_OK | os.X_OK) else f"{flag} {path} is not writable"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{flag} {path} cannot be created: {parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{flag} {path} cannot be created: {parent} is not writable"
    return None


def create_folder(path, flag):
    """Make `path` and the folders above it that are missing; returns those it made, deepest first (for
    remove_created). Fails (code 2) in one line naming the flag when the system refuses, as it does in places
    that look writable (a read-only file system, /proc, /sys)."""
    if msg := folder_problem(path, flag):
        fail(msg)
    made, p = [], os.path.abspath(path)
    while not os.path.exists(p):
        made.append(p)
        p = os.path.dirname(p)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        remove_created(made)
        fail(f"{flag} {path} cannot be created ({type(e).__name__}: {e.strerror})")
    return made


def remove_created(made):
    """Remove the folders create_folder made, if they are still empty."""
    for p in made:
        try:
            os.rmdir(p)
        except OSError:
            pass


def fail(msg, code=2):
    """One line on stderr, then exit: code 2 for bad input, before anything is written; code 3 when
    --max-bad-steps stops a run."""
    if distributed.world_from_env().rank == 0:  # under torchrun every rank fails alike: one line, from rank 0
        try:
            print(f"error: {msg}", file=sys.stderr, flush=True)
        except OSError:  # stderr closed too: the exit code says it
            pass
    sys.exit(code)
