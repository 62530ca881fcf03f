"""
The checks of a run before it costs anything: train.py's flags parsed and checked between themselves (parse_args,
check_args), the run they describe checked before any model loads (check_run: --out, --resume's checkpoint,
every model, --expert-device), and its prompts before the first forward (check_prompt_lengths). A bad input
ends in one line naming its flag and exit code 2 (support/harness/config.py fail), with nothing written; the
flags themselves, their types and the presets are support/harness/config.py's.

    args = parse_args(argv)                     # train.py main: --preset / --config, then check_args
    check_run(args, world, config_path)         # support/harness/run.py open_run: before any model loads
    check_prompt_lengths(run, args, start)      # support/harness/run.py resume_run: before the first forward

`--config RUN/config.json --out NEW` replays a run as --preset does: the file's values are the defaults (each
read by the same parser from its flag's text), flags beside it win. Nothing here is in the paper.

Try it on CPU:  python -m pytest tests/test_config.py tests/test_hardening.py -q
"""
import argparse
import json
import os

import torch

import rewards
from baselines import NEIGHBOURS, kind
from experts import team_models
from support.harness.checkpoint import MAX_CONFIG_BYTES, check_checkpoint, check_resume, read_checkpoint, read_log
from support.harness.config import PRESETS, ArgumentParser, build_parser, fail, strict_json
from support.harness.model_check import check_models
from support.harness.track import check_library
from lib.files import RUN_FILES, is_temporary, link_in_run_folder


def parse_args(argv=None):
    """train.py's flags, checked."""
    return parse(build_parser(), argv)


def parse(p, argv=None, where=""):
    """Parse with `p` (build_parser's): --preset's values, or --config's (a run's config.json), become the
    defaults, so that a flag given beside them wins; then the checks between flags. `where`: what a bad value's
    line names first when the values are a run's, not a command line's (run_config)."""
    p.where = where
    pre = ArgumentParser(add_help=False)
    pre.add_argument("--preset", default=None, choices=sorted(PRESETS))
    pre.add_argument("--method", default=None)
    pre.add_argument("--config", default=None)
    pre.add_argument("--out", default=None)
    first = pre.parse_known_args(argv)[0]
    if first.method in NEIGHBOURS and first.method != p.get_default("method"):
        fail(f"--method {first.method}: a system of its own, with its own loop and train.py's flags: "
             f"python neighbours/{first.method}.py")
    if first.preset and first.config:
        fail(f"--config {first.config} holds every flag's value already: drop --preset {first.preset} and give "
             "the flags to change beside --config")
    if first.config and first.out is None:
        fail(f"--config {first.config}: give --out, a new folder for the replay (the run's own holds that run)")
    if first.preset:
        p.set_defaults(**PRESETS[first.preset])
    if first.config:
        p.set_defaults(**replayed_values(p, first.config))
    return check_args(p, p.parse_args(argv))


# --config: the keys of a config.json that are not flags (support/harness/run.py resume_run records them beside the
# flags), and the flags a replay takes from its own command line only: --out (the run's own folder already
# holds that run), --resume (a replay starts afresh unless it says --resume) and --config itself.
RECORDED, NOT_REPLAYED = {"team_models", "device_used", "processes"}, {"out", "resume", "config"}


def replayed_values(p, path):
    """--config PATH: the flag values a run's config.json holds, as {dest: value} for p.set_defaults (a flag given
    beside --config wins), each read by `p` itself from its command-line text (replay_text): a bad one fails with
    the line that text gets on a command line, after p.where or --config. A flag the file lacks is newer than the
    run, which ran as its default behaves (as --resume reads it). A file that cannot be read, is not a JSON object,
    names a key that is no flag of `p` or holds a value no command line gives fails in one line (exit code 2)."""
    where = p.where or f"--config {path}"
    try:
        if os.path.exists(path) and not os.path.isfile(path):  # a folder, or a pipe that would block the read
            fail(f"{where}: not a file (a run's config.json)")
        if os.path.isfile(path) and os.path.getsize(path) > MAX_CONFIG_BYTES:
            fail(f"{where}: {os.path.getsize(path)} bytes, more than a config.json's {MAX_CONFIG_BYTES}")
        with open(path) as f:
            saved = strict_json(f.read(MAX_CONFIG_BYTES + 1))
    except OSError as e:
        fail(f"{where}: cannot read it ({type(e).__name__}: {e.strerror})")
    except ValueError as e:  # json.JSONDecodeError: "Expecting value: line 1 column 1 (char 0)"
        fail(f"{where}: not JSON of flag values ({e})")
    if not isinstance(saved, dict):
        fail(f"{where}: not a JSON object of flag values")
    flags = {a.dest: a for a in p._actions if a.default is not argparse.SUPPRESS}  # --help has no value
    unknown = sorted(set(saved) - set(flags) - RECORDED)
    if unknown:
        fail(f"{where}: {', '.join(unknown)}: not a flag of this script")
    replayed, argv = {k: v for k, v in saved.items() if k in flags and k not in NOT_REPLAYED}, []
    for k, v in replayed.items():
        if (text := replay_text(flags[k], v)) is None:
            fail(f"{where}: {flags[k].option_strings[0]}: {json.dumps(v)} is not a value of this flag")
        argv += text
    command_line, p.where = p.where, where
    values = vars(p.parse_args(argv))  # the flag's type and choices; a bad value: p.error's line, after `where`
    p.where = command_line
    return {k: values[k] for k in replayed}


def replay_text(action, value):
    """A config.json value as the command line gives it to the flag `action`: [] (unset: a null where the default
    is null, a switch off), [--switch], [--flag=TEXT] (str(value): a float's str is its exact repr; a text that
    begins with a dash is still the value); None for a value no command line gives (a switch not true or false,
    null for a flag with a value, a number for a text flag)."""
    flag = action.option_strings[0]
    if action.nargs == 0:  # a switch (store_true)
        return ([flag] if value != action.default else []) if isinstance(value, bool) else None
    if value is None:
        return [] if action.default is None else None
    text_kinds = str if action.type is None else (int, float, str)
    return [f"{flag}={value}"] if isinstance(value, text_kinds) and not isinstance(value, bool) else None


def check_args(p, args):
    """The checks between flags; a bad value exits (code 2) with one line naming its flag. What the method is
    comes from its declaration (baselines.Kind), so a method registered in METHODS is checked as the paper's are."""
    if (declared := kind(args.method)) is None:
        p.error(f"--method {args.method}: its builder declares nothing; give it `.kind = baselines.Kind(...)`")
    checks = [(args.expert_depth <= 1, f"--expert-depth must be in (0, 1], got {args.expert_depth}"),
              (args.latent_dim % args.num_heads == 0,
               f"--latent-dim {args.latent_dim} must be divisible by --num-heads {args.num_heads}"),
              (args.clip_eps < 1, f"--clip-eps must be in [0, 1), got {args.clip_eps}"),
              (not args.channel_weight or declared.tokens,
               f"--channel-weight: --method {args.method} has no context tokens to contrast"),
              (not args.channel_weight or args.batch_size >= 2,
               "--channel-weight contrasts a prompt's C with another prompt's: --batch-size must be >= 2"),
              (args.reward != "random" or not args.format_bonus,
               "--format-bonus with --reward random: the random-reward control pays a coin and nothing else; "
               "use --format-bonus 0"),
              (args.format_bonus or not args.format_bonus_strict,
               "--format-bonus-strict shapes the format bonus: give --format-bonus > 0 too"),
              (not args.tis_cap or args.rollout_dtype != "float32" or low_precision_frozen(args),
               "--tis-cap corrects a sampler that is not the scoring pass (--rollout-dtype bfloat16 or int8, "
               "or bfloat16 frozen weights); with float32 everywhere there is nothing to correct"),
              (args.rollout_dtype != "int8" or args.device == "cpu" or
               (args.device == "auto" and not torch.cuda.is_available()),
               f"--rollout-dtype int8 runs on CPU only (PyTorch's int8 kernels), and --device {args.device} "
               f"{'picks cuda here' if args.device == 'auto' else 'is not the CPU'}: add --device cpu or use "
               "--rollout-dtype bfloat16"),
              (args.device in ("auto", "cpu", "cuda", "mps") or args.device.startswith("cuda:"),
               f"--device must be auto, cpu, cuda[:N] or mps, got {args.device!r}"),
              (args.expert_device in (None, "cpu", "cuda", "mps") or args.expert_device.startswith("cuda:"),
               f"--expert-device must be cpu, cuda[:N] or mps, got {args.expert_device!r}"),
              (args.data_path is None or args.task in rewards.TASKS,
               f"--data-path is only read by a task with its own data ({', '.join(rewards.TASKS)})"),
              (args.data_path is None or os.path.exists(args.data_path),
               f"--data-path {args.data_path}: no such file or folder"),
              # one file is the training split: validating on it would score training items
              (args.data_path is None or not args.eval_items or (
                  os.path.isdir(args.data_path) and os.path.isfile(os.path.join(args.data_path, "test.jsonl"))),
               f"--data-path {args.data_path} holds no test.jsonl, and --eval-items would score training items; "
               "pass a folder with train.jsonl and test.jsonl, or --eval-items 0"),
              (args.experts is None or all(name.strip() for name in args.experts.split(",")),
               f"--experts {args.experts!r} has an empty model name (a stray comma?)"),
              (not args.context_split or (args.context_position == "after"
                                          and args.response_prefix.endswith(args.context_split)),
               f"--context-split {args.context_split!r} must be how --response-prefix ends "
               f"({args.response_prefix!r}), with --context-position after"),
              (args.out != "", "--out needs a folder, got ''"),
              (args.expert_cache != "", "--expert-cache needs a folder, got ''"),
              (args.expert_cache or not args.precompute_states,
               "--precompute-states writes the experts' states into --expert-cache DIR: give one"),
              (not args.experts or declared.experts == "team", f"--experts is not used by --method {args.method}"),
              (args.state_norm == "none" or declared.state_norm,
               f"--state-norm {args.state_norm}: --method {args.method} has no expert states to standardise"),
              (args.context_anchor == "zero" or declared.tokens,
               f"--context-anchor newline: --method {args.method} has no context tokens to anchor")]
    for ok, msg in checks:
        if not ok:
            p.error(msg)
    if msg := text_problem(args) or (args.task_config and json_problem(args.task_config, "--task-config")):
        p.error(msg)
    if msg := check_library(args.track):  # --track's library, imported here: before any model loads
        p.error(msg)
    if args.steps is None:
        args.steps = 233 if args.task == "gsm8k" else 500
    args.out = args.out or f"runs/{args.task}-{args.team}-{args.method}-s{args.seed}"
    return args


MAX_TEXT = 100_000  # characters in a text flag's value: a prompt part far beyond any model's context


def text_problem(args):
    """A text flag (from the command line or a --config file) longer than MAX_TEXT characters, or holding a NUL:
    one line naming it, or None. A 2 MB --response-prefix used to be accepted and died allocating 4 TB after the
    models loaded; what a prompt part must fit is checked in tokens once the tokenizer is there
    (check_prompt_lengths, below)."""
    for k, v in vars(args).items():
        if isinstance(v, str) and (len(v) > MAX_TEXT or "\0" in v):
            why = ("holds a NUL character, which no prompt or path may hold" if "\0" in v else
                   f"is {len(v)} characters, above {MAX_TEXT}: far beyond any model's context")
            return f"--{k.replace('_', '-')} {why}"
    return None


def json_problem(text, flag):
    """--task-config's JSON held to a flag's rules: an object, finite numbers, MAX_JSON_DEPTH deep; one line or
    None (reasoning-gym then checks the values themselves)."""
    try:
        value = strict_json(text)
    except ValueError as e:
        return f"{flag} {text[:60]!r} is not a JSON object of finite values: {e}"
    if not isinstance(value, dict):
        return f"{flag} {text[:60]!r} is not a JSON object (a {type(value).__name__})"
    return None


def low_precision_frozen(args):
    """The frozen weights will be below float32: --dtype bfloat16, or auto on a CUDA machine."""
    return args.dtype == "bfloat16" or (args.dtype == "auto" and args.device != "cpu" and torch.cuda.is_available())


def run_config(folder):
    """evaluate.py's reading of a run: its config.json checked as train.py checks it, with training's own
    functions and before any model loads: each value as its flag's (replayed_values: bounded, finite, a flag of
    train.py), then the checks between flags and of texts (check_args). A run of a neighbour's script is sent
    to that script. Returns {flag: value, "team_models": the models the run used}; fails in one line that
    begins `--run FOLDER: config.json`."""
    path, where = os.path.join(folder, "config.json"), f"--run {folder}: config.json"
    if not os.path.isfile(path):
        fail(f"--run {folder} has no config.json (is it a folder train.py wrote?)")
    saved = written_by_a_run(path)
    if isinstance(saved, dict) and saved.get("method") in NEIGHBOURS:
        fail(f"--run {folder} is a {saved['method']} run: python neighbours/{saved['method']}.py evaluate "
             f"--run {folder}")
    # --out: the run's own folder (a replay needs one); --track: a tracker evaluate.py never opens
    args = parse(build_parser(), ["--config", path, "--out", folder, "--track", "none"], where=where)
    team = (saved or {}).get("team_models")
    if not (isinstance(team, dict) and isinstance(team.get("policy"), str) and isinstance(team.get("experts"), list)
            and all(isinstance(e, str) for e in team["experts"])):
        fail(f"{where} records no team_models (the models the run used): not a config.json train.py wrote")
    return {**vars(args), "team_models": team}


def written_by_a_run(path):
    """The JSON object a run's config.json holds, when train.py (or a neighbour's script) wrote it: bounded, and
    with the keys resume_run records beside the flags (RECORDED). None for anything else."""
    try:
        if not os.path.isfile(path) or os.path.islink(path) or os.path.getsize(path) > MAX_CONFIG_BYTES:
            return None
        with open(path) as f:
            saved = strict_json(f.read())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) and RECORDED <= set(saved) else None


def user_files_problem(out):
    """A new run (no --resume) in a folder that exists: the one-line refusal, or None. What the run writes there
    replaces files of the same name, and a run that failed before its first step has its metrics, samples and
    validation removed; so a folder that is not empty must hold a run of this project (a config.json that
    train.py wrote: written_by_a_run), and each file the new run would remove or replace must be one that run
    wrote: its logs records with a step (read_log), its validation the scores before training. The user's own
    files are never deleted or overwritten. (The lock, .lock, and a killed run's temporary files are the
    project's.)"""
    if not os.path.isdir(out):
        return None
    names = sorted(n for n in os.listdir(out) if n != ".lock" and not is_temporary(n))
    if not names:
        return None
    if not written_by_a_run(os.path.join(out, "config.json")):
        return (f"--out {out} holds files ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) and no run "
                "of this project (no config.json that train.py wrote): they are not a run's to replace; choose a "
                "new or empty folder")
    if holds_a_run(out):  # a run to resume, or to refuse: check_run says which
        return None
    for name in names:
        if not from_its_run(os.path.join(out, name)):
            return (f"--out {out}: {name} is not a file its run wrote (that run never ended a step), and a new run "
                    "would replace it: move it away or choose another --out")
    return None


def from_its_run(path):
    """Whether a file in the folder of a run that never ended a step may be replaced or removed by the next run:
    its config, its logs (records with a step: read_log) and its validation before training ({items, before});
    a name the run never writes is not the run's to touch, so it may stay."""
    name = os.path.basename(path)
    try:
        if name in ("metrics.jsonl", "samples.jsonl"):
            read_log(path, flag=f"--out {os.path.dirname(path)}")  # ValueError for a line that is not a record
            return True
        if name == "validation.json":
            with open(path) as f:
                scores = strict_json(f.read(MAX_CONFIG_BYTES + 1))
            return isinstance(scores, dict) and set(scores) == {"items", "before"}
    except (OSError, ValueError):
        return False
    return name == "config.json" or name not in RUN_FILES


def holds_a_run(out):
    """Whether `out` holds a run that finished a step: a checkpoint or a line in metrics.jsonl."""
    metrics = os.path.join(out, "metrics.jsonl")
    return os.path.exists(os.path.join(out, "checkpoint.pt")) or (
        os.path.isfile(metrics) and os.path.getsize(metrics) > 0)


def finished_run(out, steps, eval_items):
    """Whether `out` holds a run that ended at `steps`: its checkpoint at that step, its export (lora_peft/,
    written after the last step) and, with eval_items, its validation after training. Reads only. (--resume of
    such a run still finishes it again, export and validation: a run killed in its export or validation needs
    exactly that, and the chaos test kills runs there.)"""
    checkpoint, validation = os.path.join(out, "checkpoint.pt"), os.path.join(out, "validation.json")
    if not (os.path.isfile(checkpoint) and os.path.isfile(os.path.join(out, "lora_peft", "adapter_config.json"))):
        return False
    try:
        state = read_checkpoint(checkpoint, "--out", mmap=True)
        if not isinstance(state, dict) or state.get("step") != steps:
            return False
        if eval_items:
            with open(validation) as f:
                return "after" in json.load(f)
    except (ValueError, OSError):  # unreadable: not this function's to judge (check_checkpoint says why)
        return False
    return True


def check_run(args, world, config_path):
    """What parse_args cannot see: the --out folder (a new run, or one that --resume can continue), every model
    the run will load (present, or one line saying how to get it) and --expert-device. Fails with exit code 2,
    or raises ValueError / FileNotFoundError with a one-line message; writes nothing. A folder whose run never
    finished a step (it failed while loading, or ran out of memory in its first step: a config.json, no
    checkpoint, no metrics) is no run to keep: the same command may start it again."""
    if os.path.lexists(args.out) and (msg := link_in_run_folder(args.out)):  # a shared folder's planted link
        fail(msg)
    if args.resume and (msg := check_resume(args, config_path, build_parser().get_default)):
        fail(msg)
    elif not args.resume and holds_a_run(args.out):
        if finished_run(args.out, args.steps, args.eval_items):
            fail(f"--out {args.out} holds a finished run ({args.steps} of {args.steps} steps): nothing to do; "
                 "choose another --out to train again")
        fail(f"--out {args.out} already holds a run; pass --resume to continue it or choose another --out")
    checkpoint = os.path.join(args.out, "checkpoint.pt")
    if args.resume and os.path.exists(checkpoint) and (msg := check_checkpoint(checkpoint, args)):
        fail(msg)  # before any model loads: minutes and gigabytes on the paper's team
    if args.expert_cache and os.path.isdir(args.expert_cache):
        from lib.state_store import cache_problem
        if msg := cache_problem(args.expert_cache, "--expert-cache"):
            fail(msg)
    if args.data_path and os.path.isdir(args.data_path) and not os.path.isfile(os.path.join(args.data_path,
                                                                                              "train.jsonl")):
        fail(f"--data-path {args.data_path}: a folder to train on must hold train.jsonl")
    if args.task == "gsm8k" and args.data_path and args.eval_items:  # read test.jsonl before the models load
        rewards.load_entries("gsm8k", "val", args.eval_items, args.seed, data_path=args.data_path)
    team, by_team = team_models(args), f"--team {args.team}"  # each model with the flag that chose it
    models = [(team["policy"], "--policy" if args.policy else by_team)]
    if kind(args.method).experts == "team":  # identical's only expert is the policy itself
        models += [(e, "--experts" if args.experts else by_team) for e in team["experts"]]
    if kind(args.method).router:  # hard routing's and RLAE's sentence encoder
        models.append((team["router"], by_team))
    check_models(models)
    if args.expert_device:
        if args.expert_device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--expert-device {args.expert_device}: CUDA is not available")
        if world.size > 1 and args.expert_device.startswith("cuda"):
            raise ValueError(f"--expert-device {args.expert_device}: under torchrun every process would load "
                             "its experts there; use --expert-device cpu, or one process")


def check_prompt_lengths(run, args, start):
    """Every prompt the run will read, tokenised as the policy reads it (the question in the --system-prompt,
    --worked-example and --response-prefix, then the method's context tokens and --max-new-tokens), must
    fit the policy's context (max_position_embeddings): one too long fails here, naming the item and the flags,
    before the first forward; a forward over a 1 MB question never ended and ignored SIGTERM. The experts read
    the question truncated to their own context (experts.ExpertPool), and output_collab's hints are bounded by
    --max-new-tokens but not counted here. Checks this run's training items (steps start..--steps) and its
    --eval-items validation items."""
    limit = getattr(run.policy.config, "max_position_embeddings", None) or \
        getattr(run.policy.config, "n_positions", None)
    if not limit:
        return
    items = run.train_items
    picks = sorted({i for step in range(start, args.steps) for micro in range(args.grad_accum)
                    for i in rewards.batch_indices(step, micro, args.batch_size, args.grad_accum,
                                                   n_items=len(items), seed=args.seed)})
    checked = [("training item", i, items[i]["question"]) for i in picks]
    if args.eval_items:
        from support.harness.validation import validation_items
        checked += [("validation item", i, it["question"])
                    for i, it in enumerate(validation_items(args, args.eval_items))]
    extra = run.method.context_tokens + args.max_new_tokens  # m: the method's own count (baselines.py)
    for s in range(0, len(checked), 256):
        chunk = checked[s:s + 256]
        prompts = rewards.policy_prompts(run.tok, [q for _, _, q in chunk], [None] * len(chunk), args)
        lengths = [len(ids) for ids in run.tok(prompts, add_special_tokens=False)["input_ids"]]
        for (what, i, question), n in zip(chunk, lengths):
            if n + extra > limit:
                fail(f"the {what} {i} ({len(question)} characters: {question[:40]!r}...) is {n} tokens in the "
                     f"policy's prompt; with {run.method.context_tokens} context tokens and --max-new-tokens "
                     f"{args.max_new_tokens} that is "
                     f"{n + extra}, above the policy's context of {limit} tokens: shorten it (--task-config, "
                     "--data-path, --response-prefix, --system-prompt) or lower --max-new-tokens")
