"""
The device check: one command that says how the paper's setting runs on one CUDA GPU, before and after each change
of issue 44, with no network and only this repository (the paper's models are built at their real shapes with
RANDOM weights, lib/shape_models.py; TRL's GRPOTrainer runs beside ours on the same card).

THE COMMAND for a GPU session (the run tool: carry [".whl"], timeout_s 480; the wheels are built here first by
`bash experiments/gpu_wheels.sh`, ~37 MB, so the tree travels whole under the 64 MiB a call may carry):

    nvidia-smi > $OUT/nvidia-smi.txt; PYTHONUNBUFFERED=1 python experiments/gpu_check.py --wheels .whl
        --budget-s 400 --out $OUT/gpu_check.json 2>&1 | tee $OUT/gpu_check.log

It leaves a trace whatever happens: a "<phase>.started" file under $OUT before each phase, $OUT/gpu_check.json after
every phase and after each variant of a long one (decode's, TRL's steps): a phase that the time limit kills keeps its
marker and the figures it had; a phase that fails records its error and those figures, and the next one runs; a
phase that would not end within --budget-s of the start, the wheels' installation included, is skipped and says so
(400 s leaves the last phase 80 s of the 480 to overrun its estimate); TRL's worker answers within the deadline or
its phase ends. The JSON holds "goals" (the issue's performance goals read from the phases so far) and
"next_commands", printed at the end too: THE SECOND COMMAND, prepared from what the first found (the phases the
budget skipped; the decode with the memory-efficient kernel forced where cuDNN's ran), for the same warm machine
with timeout_s 300, e.g.

    PYTHONUNBUFFERED=1 python experiments/gpu_check.py --wheels .whl --phases trl,default_step_before
        --budget-s 240 --out $OUT/gpu_check_2.json 2>&1 | tee $OUT/gpu_check_2.log

On a CPU, every phase at tiny scale (what the test suite runs; TRL's phase too where TRL is installed), and the GPU
run's own branches at one layer of the paper's shapes (the 3B policy, one expert, the arithmetic task, the stand-in
tokenizer, TRL on that policy; ~25 min on one core, a dry run for what --tiny does not reach):

    python experiments/gpu_check.py --tiny --out /tmp/gpu_check.json
    python experiments/gpu_check.py --shallow --steps 1 --out /tmp/gpu_check_shallow.json

Settings of the whole process: the card capped at --memory-cap-gib 76 (torch.cuda.set_per_process_memory_fraction:
any larger card answers for an 80 GB one, the flag's comment says why 76; every phase records the allocator's
retries and out-of-memory events), CUDA's allocator with expandable segments (as train.py sets it; --allocator
default for the old one), prompts of real length (--prompt-lengths real: experiments/stand_in_tokenizer.py,
within 1 % of Qwen2.5's token counts; the byte-level stand-in made them ~4.1x longer and stays as the stress case),
torch's choice of SDPA kernel (--sdpa-backend forces one: flash, efficient, cudnn or math), LoRA merged into buffers
the captured decode step reads (--graph-lora unmerged: read inside the graph, no merged copy kept).

"before" is today's path as it was before issue 44, kept behind switches so that it re-runs on the same card in
the same call: static_decode.DECODE "eager" (the token-by-token loop; "after": the static loop captured as a CUDA graph
once per run, lib/static_decode.py), train.py --attention sdpa (transformers' SDPA, K/V repeated; "after":
auto = grouped, lib/attention.py), rollout.PLAIN_HEADS () (the LM head over all completions at once;
"after": one completion at a time, grpo.head_logprobs). A switch this checkout lacks is recorded as absent, not
failed (SWITCHES).

Phases, in priority order (the default list; the seconds are estimates for an H200, the budget's guide):
  preflight     every module a phase imports, a matmul on the card, a one-op CUDA graph replayed     (10 s)
  env           versions, the card, the cap, the allocator, the wheels installed, SDPA backends         (1 s)
  tiny_parity   the tiny team on CPU vs on the device (log-probs, greedy tokens, LoRA gradient, a bf16 smoke
                step whose KL must be exactly 0), and the decode loops on the device: the eager loop vs the
                captured graph from the same uniforms (tokens equal, log-prob difference)            (25 s)
  decode        the 3B policy's decode at 32 and 256 rows (real prompts, 128 new tokens, no EOS): for each
                variant a first call (the capture in it, capture_seconds apart) and a steady call (the step
                replayed): ms per decode step (prefill timed apart), tokens/s, peak memory; before (eager loop,
                SDPA, LoRA merged), eager_grouped, after (graph, grouped, merged into the same buffers) and
                after_unmerged (no merged weight copy); the graph's tokens vs the eager loop's from the same
                uniforms; the SDPA backend that ran (profiler); CUDA kernels per token for before     (90 s)
  default_step  train.py --task arithmetic --team default --random-weights, the paper's settings (32 prompts
                x G 8, 128 new tokens), --steps steps (3; the first a warm-up): seconds and peak memory per phase
                of the step (synchronised), --plan's figures beside them, retries and OOMs, the decode loop
                and attention each step ran (metrics.jsonl's decode, decode_fallback, attention)      (75 s)
  default_step_cached   1 step on precomputed expert states (--precompute-states, then --expert-cache) (60 s)
  cuda_tests    pytest -m cuda on CUDA_TESTS: the graph vs the static loop, the GPU path, grouped attention
                vs SDPA in bf16 (tests/test_attention.py)                                            (90 s)
  default_step_single   --method single (no experts, no C): the like-for-like step for TRL            (50 s)
  trl           TRL 1.16's GRPOTrainer (HF generate, PEFT LoRA r 8 on the same modules, bf16, gradient
                checkpointing as its default, beta 0.04) on the same random-weight policy and prompts, 32 x G 8,
                128 new tokens forced (min_new_tokens), one optimiser step of 8 micro-batches a step, in a process
                of its own (experiments/bench.py's worker) capped alike: 1 warm-up + --trl-steps timed steps;
                ours / TRL per step for `single` and for `ours` (the default team)                   (120 s)
  default_step_before   the default step on before's path                                             (90 s)
  default_step_stress   the after path with the byte-level stand-in (prompts ~4.1x long)              (75 s)
  padded_rows   the 3B shape's left-padded rows under each SDPA backend (measured before, unchanged) (5 s)
  writers       rollout.greedy_texts on CPU and on the device (measured before)                        (3 s)
  default_step_stress_before   the stress case on before's path                                      (110 s)
With the 400 s budget the first call is expected to reach cuda_tests; the rest goes into the second command.
Not in the default list (measured before, their code unchanged): default_step_per_micro (--rollout-batch 1),
determinism (fresh processes with and without --deterministic).

Wheels (--wheels DIR): reasoning-gym 0.1.25 and what it needs that the card lacks (pip resolves against what is
installed), then TRL 1.16.0, datasets 4.8.4, dill, multiprocess and xxhash with --no-deps (TRL's other needs,
accelerate, peft, pandas, pyarrow, are on the card); experiments/gpu_wheels.sh builds DIR.
"""
import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import rollout  # noqa: E402
from experts import load_model  # noqa: E402
from lib import static_decode  # noqa: E402
from lora import apply_lora, lora_layers, lora_merged  # noqa: E402

POLICY_3B = "shape:Qwen/Qwen2.5-3B-Instruct"
# seconds on an H200 (estimates; the budget's guide): a phase that would end past --budget-s is skipped. decode: 4
# variants x 2 row counts x 2 calls of 128 tokens (the eager loop's ~80 ms a token at 256 rows: ~10 s a call);
# default_step: the 3B team loaded (~20 s) and 3 steps (7-11 s expected at real prompt lengths)
ESTIMATE_S = dict(preflight=10, env=1, tiny_parity=25, decode=90, default_step=75, default_step_cached=60,
                  cuda_tests=90, default_step_single=50, trl=120, default_step_before=90, default_step_stress=75,
                  padded_rows=5, writers=3, default_step_stress_before=110, default_step_per_micro=90, determinism=120)
# the order is the priority: what the goals read first (decode, the step, precomputed states), the CUDA
# tests, then the comparisons; what the budget skips goes into the second call (next_commands)
DEFAULT_PHASES = ["preflight", "env", "tiny_parity", "decode", "default_step", "default_step_cached", "cuda_tests",
                  "default_step_single", "trl", "default_step_before", "default_step_stress", "padded_rows", "writers",
                  "default_step_stress_before"]
# the goals (default team, the paper's settings, real prompt lengths, capped for an 80 GB card)
GOALS = dict(step_s=6.0, decode_ms_256_rows=8.0, peak_gib_experts=40.0, peak_gib_precomputed=20.0, ours_vs_trl=0.25)
TRL_WHEELS = ["trl==1.16.0", "datasets==4.8.4", "dill==0.4.1", "multiprocess==0.70.19", "xxhash==4.1.0"]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_events(device):
    """(allocator retries, out-of-memory events) so far: a retry is a cudaMalloc that failed, freed the cache
    and tried again (slow); an OOM is one that failed again."""
    if device.type != "cuda":
        return 0, 0
    stats = torch.cuda.memory_stats(device)
    return stats.get("num_alloc_retries", 0), stats.get("num_ooms", 0)


class Report:
    """The JSON file: {"phases": [record, ...], "goals": {...}, "next_commands": [...]}, written whole (and
    atomically) after every phase and whenever a phase reports its figures so far (progress). Before a phase runs, a
    "<phase>.started" file is written beside the JSON: a phase that the call's time limit kills leaves that trace. A
    phase that would end past the deadline (start + budget_s) is skipped and recorded as such."""

    def __init__(self, path, device, budget_s=0.0, estimates=None, start=None):
        self.path, self.device, self.phases, self.running = path, device, [], None
        self.start, self.budget_s, self.estimates = start or time.time(), budget_s, estimates or ESTIMATE_S
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def record(self, name):
        return next((r for r in self.phases if r["phase"] == name and r.get("ok")), None)

    def seconds_left(self):
        """Seconds to the deadline (None without one)."""
        return self.start + self.budget_s - time.time() if self.budget_s else None

    def run(self, name, fn, *args):
        elapsed = time.time() - self.start
        if self.budget_s and elapsed + self.estimates.get(name, 60) > self.budget_s:
            rec = {"phase": name, "ok": None, "skipped": f"budget: {elapsed:.0f} s spent, ~{self.estimates.get(name, 60)}"
                   f" s estimated, --budget-s {self.budget_s:.0f}"}
            print(f"[gpu_check] {name}: skipped ({rec['skipped']})", flush=True)
            return self.write(rec)
        with open(os.path.join(os.path.dirname(os.path.abspath(self.path)), f"{name}.started"), "w") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {elapsed:.1f} s after the start\n")
        t0 = time.time()
        retries, ooms = memory_events(self.device)
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            rec = {"phase": name, "ok": True, **fn(*args)}
        except (Exception, SystemExit) as e:  # noqa: BLE001  a failed phase is a result (train.py's flag errors
            # exit): record it, with what it had reported so far, and go on
            rec = {**(self.running or {}), "phase": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:3000],
                   "out_of_memory": isinstance(e, torch.OutOfMemoryError), "traceback": traceback.format_exc()[-4000:]}
            rec.pop("running", None)
            _free(self.device)
        self.running = None
        rec["seconds"] = round(time.time() - t0, 2)
        after = memory_events(self.device)
        rec["alloc_retries"], rec["ooms"] = after[0] - retries, after[1] - ooms
        print(f"[gpu_check] {name}: {'ok' if rec['ok'] else 'FAILED ' + rec['error']} ({rec['seconds']} s)",
              flush=True)
        return self.write(rec)

    def progress(self, name, figures):
        """A running phase's figures so far (each variant's as it finishes), written now: a phase killed later keeps
        them, and a phase that fails carries them into its record."""
        self.running = {"phase": name, "ok": None, "running": True, **figures}
        self.dump()

    def write(self, rec):
        self.phases.append(rec)
        self.dump()
        return rec

    def dump(self):
        with open(self.path + ".tmp", "w") as f:
            json.dump({"phases": self.phases + ([self.running] if self.running else []), "goals": goals(self),
                       "next_commands": next_commands(self), "wall_s": round(time.time() - self.start, 1)},
                      f, indent=1, default=str)
        os.replace(self.path + ".tmp", self.path)


def next_commands(report):
    """The second call, prepared from what this one found: the phases it skipped for the budget; where the decode
    phase saw cuDNN's attention kernel (torch's first choice on sm90 where it applies), the decode phase again with
    the memory-efficient kernel forced, to say which is faster on this card; where the default step peaked above the
    goal with the graph's merged copy kept, the step with LoRA unmerged inside the graph. Each for the run tool with
    timeout_s 300, on the same warm machine."""
    skipped = [r["phase"] for r in report.phases if r.get("ok") is None and "skipped" in r]
    head = "PYTHONUNBUFFERED=1 python experiments/gpu_check.py --wheels .whl"
    cmds = []
    if skipped:
        cmds.append(f"{head} --phases {','.join(skipped)} --budget-s 240 --out $OUT/gpu_check_2.json")
    decode = report.record("decode") or {}
    seen = {b for v in decode.values() if isinstance(v, dict) for b in v.get("sdpa_backend", {}).get("backends", [])}
    if "cudnn" in seen:
        cmds.append(f"{head} --phases decode --sdpa-backend efficient --budget-s 240 "
                    "--out $OUT/gpu_check_efficient.json")
    step = report.record("default_step") or {}
    if static_decode.GRAPH_MERGED and (step.get("peak_allocated_gib") or 0) > GOALS["peak_gib_experts"]:
        cmds.append(f"{head} --phases default_step --graph-lora unmerged --budget-s 240 "
                    "--out $OUT/gpu_check_unmerged.json")  # the merged copy the graph keeps is 5.2 GiB of the peak
    return cmds


def measured_steps(rec):
    """A default_step record's step seconds after the first (a warm-up: CUDA's and the graph's first costs)."""
    s = [x["seconds"] for x in (rec or {}).get("steps", [])]
    return s[1:] or s


def goals(report):
    """Each of the issue's performance goals, with the figure measured so far (None where its phase has not run)."""
    def median(x):
        return statistics.median(x) if x else None
    step, decode = report.record("default_step"), report.record("decode")
    cached, trl = report.record("default_step_cached"), report.record("trl")
    out = {"step_s": median(measured_steps(step)),
           "decode_ms_256_rows": ((decode or {}).get("after", {}).get("rows_256") or {}).get("ms_per_decode_step"),
           "peak_gib_experts": (step or {}).get("peak_allocated_gib"),
           "peak_gib_precomputed": (cached or {}).get("peak_allocated_gib"),
           "ours_vs_trl": (trl or {}).get("ours_vs_trl", {}).get("ours")}
    res = {k: {"measured": v, "goal": GOALS[k], "met": None if v is None else v <= GOALS[k]} for k, v in out.items()}
    ran = [r for r in report.phases if r.get("ok") is not None]
    res["no_oom_no_retry"] = {"alloc_retries": sum(r.get("alloc_retries", 0) for r in ran),
                              "ooms": sum(r.get("ooms", 0) for r in ran)
                              + sum(1 for r in ran if r.get("out_of_memory"))}
    res["no_oom_no_retry"]["met"] = not any(res["no_oom_no_retry"].values())
    return res


# ---------------------------------------------------------------------------------------------------------------
# The switches: prompt lengths, and today's path (before) against issue 44's (after)


@contextlib.contextmanager
def prompt_lengths(kind):
    """real: `shape:` models tokenise with experiments/stand_in_tokenizer.py (Qwen2.5's counts within 1 %); bytes:
    shape_models' own one-token-per-byte stand-in (~4.1x as many tokens: the stress case)."""
    from lib import shape_models
    import stand_in_tokenizer  # experiments/, beside this script
    own = shape_models.tokenizer

    def real(vocab_size, chat=True):
        try:
            return stand_in_tokenizer.tokenizer(vocab_size, chat)
        except ValueError:  # a vocabulary too small for the merges (none of the paper's models)
            return own(vocab_size, chat)
    if kind == "real":
        shape_models.tokenizer = real
    try:
        yield kind
    finally:
        shape_models.tokenizer = own


# today's path, module switches: (module, attribute, value before issue 44); absent ones are recorded as such
SWITCHES = [(static_decode, "DECODE", "eager"), (rollout, "PLAIN_HEADS", ())]
BEFORE_FLAGS = [["--attention", "sdpa"]]  # train.py flags of today's path, passed where train.py knows them


@contextlib.contextmanager
def path(kind, record):
    """kind "before": SWITCHES set to today's values for the phase (restored after); "after": as they are.
    record gets the switches applied and those this checkout lacks."""
    saved = []
    if kind == "before":
        for module, name, value in SWITCHES:
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, value)
        record["switches"] = {n: repr(v) for m, n, v in SWITCHES if hasattr(m, n)}
        record["switches_absent"] = [n for m, n, _ in SWITCHES if not hasattr(m, n)]
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def known_flags(argv, flags):
    """Those of `flags` (each [flag, value]) that train.py's parser accepts on top of argv."""
    from support.harness.checks import parse_args
    ok = []
    for flag in flags:
        try:
            with contextlib.redirect_stderr(open(os.devnull, "w")):
                parse_args(argv + flag)
            ok.append(flag)
        except SystemExit:
            pass
    return ok


def set_attention(model, name):
    """lib/attention.use where this checkout has it; returns what the model runs."""
    try:
        from lib import attention
    except ImportError:
        return model.config._attn_implementation
    attention.use(model, name)
    return model.config._attn_implementation


# ---------------------------------------------------------------------------------------------------------------
# env


def preflight(device):
    """Imports and the driver, before anything long: every module a phase imports (a missing one is recorded, and
    fails the check only where every phase needs it), a matmul on the device, and a one-op CUDA graph captured on a
    side stream and replayed twice (the mechanism the decode's graph needs, in a second)."""
    rec, needed = {}, ("train", "rewards", "evaluate", "transformers", "lib.static_decode")
    for name in (*needed, "reasoning_gym", "trl", "peft", "accelerate", "datasets"):
        try:
            module = __import__(name)
            rec[name] = getattr(module, "__version__", "imported")
        except Exception as e:  # noqa: BLE001  a missing extra is a fact to record
            rec[name] = f"absent ({type(e).__name__}: {e})"[:300]
    missing = [n for n in needed if rec[n].startswith("absent")]
    if missing:
        raise ImportError(f"the check cannot run without {', '.join(missing)}: {[rec[n] for n in missing]}")
    x = torch.full((64, 64), 0.5, device=device)
    rec["matmul_ok"] = (x @ x)[0, 0].item() == 16.0
    if device.type == "cuda":
        rec["driver"] = nvidia_smi()
        counter, side, graph = torch.zeros(1, device=device), torch.cuda.Stream(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):  # recorded, not run
            counter.add_(1)
        graph.replay()
        graph.replay()
        sync(device)
        rec["graph_ok"] = counter.item() == 2.0
    return rec


def nvidia_smi():
    """The driver and card as nvidia-smi names them ('' where it is absent)."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def env(device, args, installed):
    import transformers
    rec = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": str(device), "cuda_available": torch.cuda.is_available(), "prompt_lengths": args.prompt_lengths,
           "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"),
           "budget_s": args.budget_s, "wheels": installed, "sdpa_forced": args.sdpa_backend,
           "graph_lora": args.graph_lora, "commit": git("rev-parse", "HEAD"),
           "uncommitted": git("status", "--porcelain", "--untracked-files=no").splitlines()}
    for name in ("trl", "peft", "accelerate", "datasets", "reasoning_gym"):
        try:
            rec[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001  a missing extra is a fact to record
            rec[name] = f"absent ({type(e).__name__})"
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        rec.update(card=p.name, memory_gib=round(p.total_memory / 2 ** 30, 1), capability=f"{p.major}.{p.minor}",
                   multiprocessors=p.multi_processor_count, cuda=torch.version.cuda,
                   memory_cap_gib=args.memory_cap_gib or None,
                   sdpa_enabled={"flash": torch.backends.cuda.flash_sdp_enabled(),
                                 "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                                 "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                                 "math": torch.backends.cuda.math_sdp_enabled()})
    return rec


def git(*a):
    return subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def install_wheels(folder):
    """reasoning-gym from `folder` (pip resolves against what is installed), then TRL and the datasets library
    with --no-deps. Returns each pip call's exit code and last lines: a failure here is recorded, and the phases
    that need the package fail with its ImportError."""
    calls = {"reasoning_gym": ["reasoning-gym==0.1.25"], "trl": ["--no-deps", *TRL_WHEELS]}
    out = {}
    for name, extra in calls.items():
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", folder,
                            *extra], capture_output=True, text=True)
        out[name] = {"exit": r.returncode, "tail": (r.stdout + r.stderr).strip().splitlines()[-3:]}
        print(f"[gpu_check] wheels {name}: exit {r.returncode}", flush=True)
    return out


# ---------------------------------------------------------------------------------------------------------------
# tiny_parity, padded_rows, writers


def tiny_batch(tok, device, n=4):
    prompts = [f"What is {a} + {b}?" + " Think." * (3 * a % 7) for a, b in zip(range(3, 3 + n), range(11, 11 + n))]
    return rollout.encode_prompts(tok, prompts, device)


def tiny_parity(device):
    from grpo import completion_mask
    cpu = torch.device("cpu")
    res = {}
    policies = {}
    for where, dtype in ((cpu, torch.float32), (device, torch.float32), (device, torch.bfloat16)):
        torch.manual_seed(0)
        model, tok = load_model("tiny:llama", where, dtype)
        model = _fresh(model)
        apply_lora(model)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # a LoRA that is not a no-op, the same on every device (drawn on the CPU)
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=g))
        policies[(where.type, str(dtype))] = (model, tok)
    ref, tok = policies[("cpu", "torch.float32")]
    ids, mask = tiny_batch(tok, cpu)
    eos = rollout.eos_token_ids(ref, tok)
    comp = rollout.sample(ref, ids, mask, None, 2, 12, 1.0, eos, tok.pad_token_id, greedy=True)
    comp_mask = completion_mask(comp, eos)

    def logp_and_grad(model, where):
        model.zero_grad(set_to_none=True)
        logp = rollout.completion_logprobs(model, ids.to(where), mask.to(where), None, comp.to(where),
                                           comp_mask.to(where), 1.0)
        loss = -(logp * comp_mask.to(where)).sum() / comp_mask.sum()
        loss.backward()
        grad = torch.cat([p.grad.flatten().float().cpu() for n, p in model.named_parameters() if p.grad is not None])
        return logp.detach().float().cpu(), grad

    logp_ref, grad_ref = logp_and_grad(ref, cpu)
    for (kind, dtype), (model, _) in policies.items():
        if kind == "cpu":
            continue
        logp, grad = logp_and_grad(model, device)
        greedy = rollout.sample(model, ids.to(device), mask.to(device), None, 2, 12, 1.0, eos, tok.pad_token_id,
                                greedy=True).cpu()
        T = min(greedy.shape[1], comp.shape[1])
        key = f"{kind}_{dtype.split('.')[-1]}"
        res[key] = {"logp_max_abs_diff": (logp - logp_ref)[comp_mask].abs().max().item(),
                    "logp_finite": bool(torch.isfinite(logp).all()),
                    "greedy_tokens_equal": (greedy[:, :T] == comp[:, :T]).float().mean().item(),
                    "grad_rel_diff": ((grad - grad_ref).norm() / grad_ref.norm()).item(),
                    "grad_finite": bool(torch.isfinite(grad).all())}
    # the pipeline end to end: a 1-step smoke run in bfloat16 on the device; step 1 is the reference policy
    import train
    with tempfile.TemporaryDirectory() as out:
        train.main(["--preset", "smoke", "--steps", "1", "--device", device.type, "--dtype", "bfloat16",
                    "--eval-items", "0", "--out", os.path.join(out, "run")])
        rec = json.loads(open(os.path.join(out, "run", "metrics.jsonl")).readline())
    res["smoke_bf16_step1"] = {k: rec.get(k) for k in ("kl", "loss", "skipped_update", "reward", "grad_norm",
                                                        "rollout_logp_gap")}
    res["smoke_bf16_step1_kl_exactly_0"] = rec.get("kl") == 0.0
    return res


def _fresh(model):
    """tiny models are cached weight-sharing copies (experts.share_frozen_weights): a private copy to wrap."""
    import copy
    return copy.deepcopy(model)


# ---------------------------------------------------------------------------------------------------------------
# padded_rows


def padded_batch(tok, vocab, device, B=4, T=256):
    """B rows of random token ids, left-padded to T, the shortest T // 4."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(vocab, 250), (B, T), generator=g)  # byte tokens: any stand-in tokenizer has them
    lengths = torch.linspace(T // 4, T, B).long()
    mask = torch.arange(T)[None] >= (T - lengths)[:, None]
    ids = ids.masked_fill(~mask, tok.pad_token_id)
    return ids.to(device), mask.to(device)


def padded_rows(device, spec):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tok = load_model(spec, device, dtype)
    ids, mask = padded_batch(tok, model.config.vocab_size, device)
    moved_ids, moved_mask = rollout.padding_behind_first_token(ids, mask)
    backends = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH,
                "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    if device.type != "cuda":
        backends = {"math": SDPBackend.MATH}
    res = {"model": spec, "rows": ids.shape[0], "columns": ids.shape[1],
           "padding_positions": int((~mask).sum())}
    with torch.no_grad():
        for name, backend in backends.items():
            out = {}
            for layout, (i, m) in {"left": (ids, mask), "behind_first": (moved_ids, moved_mask)}.items():
                try:
                    with sdpa_kernel([backend]):
                        logits = model(input_ids=i, attention_mask=m, position_ids=rollout.position_ids(m),
                                       use_cache=False).logits.float()                         # (B, T, V)
                    sync(device)
                    bad = ~torch.isfinite(logits).all(-1)                                      # (B, T)
                    out[layout] = {"nonfinite_real_tokens": int((bad & m).sum()),
                                   "nonfinite_padding": int((bad & ~m).sum()),
                                   "last_logits": logits[:, -1].cpu()}
                except Exception as e:  # noqa: BLE001  a backend that refuses this mask is a result too
                    out[layout] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            if "last_logits" in out["left"] and "last_logits" in out["behind_first"]:
                diff = (out["left"]["last_logits"] - out["behind_first"]["last_logits"]).abs()
                out["last_token_logits_max_abs_diff"] = diff.nan_to_num(float("inf")).max().item()
            for v in out.values():
                if isinstance(v, dict):
                    v.pop("last_logits", None)
            res[name] = out
    del model
    _free(device)
    return res


def writers(device):
    """The frozen writers' greedy answers (rollout.greedy_texts: output_collab's hints, the conductor's workers;
    RLAE's members start from the same prefill) for prompts of different lengths, on CPU and on the device: the
    same texts in float32; in bfloat16, the share of texts equal to the CPU's (rounding may flip a near tie)."""
    prompts = [f"Question {k}: what is {k} + {3 * k}?" + " Explain." * k for k in range(1, 7)]
    texts = {}
    for name, where, dtype in (("cpu", torch.device("cpu"), torch.float32), ("device_float32", device, torch.float32),
                               ("device_bfloat16", device, torch.bfloat16)):
        model, tok = load_model("tiny:qwen2", where, dtype)
        texts[name] = rollout.greedy_texts(model, tok, prompts, 12)
    same = {k: sum(a == b for a, b in zip(t, texts["cpu"])) / len(prompts) for k, t in texts.items() if k != "cpu"}
    return {"prompts": len(prompts), "texts_equal_to_cpu": same, "float32_equal": same["device_float32"] == 1.0}


def _free(device):
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def loop_parity(device):
    """The decode loops on the device from the same uniforms: the eager loop (static_decode.decode's) vs the static one
    captured as a CUDA graph (on a CPU: the static loop run eagerly): the tiny policy with a LoRA that is not a
    no-op, float32, rows that run to the end (no EOS)."""
    torch.manual_seed(0)
    model, tok = load_model("tiny:llama", device, torch.float32)
    model = _fresh(model)
    apply_lora(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).to(device))
    ids, mask = tiny_batch(tok, device)
    G, T = 4, 40
    u = torch.rand(len(ids) * G, T, generator=torch.Generator().manual_seed(2)).to(device)
    out = {}
    for loop in ("eager", "graph" if device.type == "cuda" else "static"):
        with switched(static_decode, "DECODE", loop):
            out[loop] = rollout.sample(model, ids, mask, None, G, T, 1.0, [-1], tok.pad_token_id,
                                       return_logprobs=True, uniforms=u)
    (a, la), (b, lb) = out.values()
    return {"loops": list(out), "tokens_equal": (a == b).float().mean().item(),
            "logp_max_abs_diff": (la - lb).abs().max().item()}


@contextlib.contextmanager
def switched(module, name, value):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


# ---------------------------------------------------------------------------------------------------------------
# decode


def arithmetic_prompts(tok, n):
    """The first n training prompts of the arithmetic family as train.py builds them (DeepSeekZero system prompt,
    chat template), from reasoning-gym's generator (seed 0)."""
    import rewards
    return [rewards.build_prompt(tok, e["question"]) for e in rewards.load_entries("arithmetic", "train", n, 0)]


@torch.no_grad()
def sample_timed(model, device, *, ids, mask, u, G, T, loop, merged, pad_id):
    """rollout.sample's work (LoRA merged or not, prefill, decode with static_decode.DECODE = loop, no EOS) ->
    (completions, prefill seconds, decode seconds), each synchronised. On the graph path LoRA is merged as rollout.sample merges it
    there (into the same buffers each call), so a second call replays the step the first captured."""
    keep = loop == "graph"
    with switched(static_decode, "DECODE", loop), lora_merged(model, keep=keep) if merged else contextlib.nullcontext():
        sync(device)
        t0 = time.perf_counter()
        start = rollout.prefill(model, ids, mask, None, G, "after")
        sync(device)
        t1 = time.perf_counter()
        comp = rollout.decode(model, *start, T, 1.0, [-1], pad_id, uniforms=u[:, :T])
        sync(device)
    return comp, t1 - t0, time.perf_counter() - t1


DECODE_VARIANTS = {  # name: (static_decode.DECODE, attention, LoRA merged as rollout.sample merges it)
    "before": ("eager", "sdpa", True), "eager_grouped": ("eager", "grouped", True),
    "after": ("graph", "grouped", True), "after_unmerged": ("graph", "grouped", False)}
# the aten operator each SDPA backend dispatches to (what ran, whatever its CUDA kernels are named)
SDPA_OPS = {"aten::_scaled_dot_product_flash_attention": "flash",
            "aten::_scaled_dot_product_efficient_attention": "efficient",
            "aten::_scaled_dot_product_cudnn_attention": "cudnn",
            "aten::_scaled_dot_product_flash_attention_for_cpu": "flash_cpu",
            "aten::_scaled_dot_product_attention_math": "math"}
SDPA_FORCE = ("auto", "flash", "efficient", "cudnn", "math")  # --sdpa-backend


def sdpa_backends(names):
    """The SDPA backends that ran, from the profiler's event names (SDPA_OPS), and the attention kernels' own names
    (CUDA: flash's, cutlass's fmha, cuDNN's) as they were."""
    kernels = [n for n in dict.fromkeys(names) if not n.startswith("aten::")
               and any(k in n.lower() for k in ("flash", "fmha", "cudnn", "attention", "sdpa"))]
    return {"backends": sorted({SDPA_OPS[n] for n in names if n in SDPA_OPS}), "kernels": kernels[:8]}


def profiled_backends(model, device, run):
    """sdpa_backends of a short call (prefill and 3 decode steps, not captured: a step this short is run eagerly),
    under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        sample_timed(model, device, T=4, **run)
    return sdpa_backends([e.name for e in prof.events()])


def decode(device, spec, rows_list, new_tokens, progress=lambda res: None):
    """What rollout.sample does (LoRA merged or not, prefill, decode), timed apart: the prefill, then the decode
    loop, each synchronised; no EOS (every row writes new_tokens). Each variant and row count: a first call (where
    the graph is captured: its warm-up steps and the capture, `capture_seconds`, are in it) and a steady call (the
    captured step replayed, as every later step of a run), timed apart; the tokens of the graph beside the eager
    loop's from the same uniforms; the SDPA backend that ran (profiled). progress(res): the figures so far."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tok = load_model(spec, device, dtype)
    apply_lora(model)
    prompts = arithmetic_prompts(tok, max(rows_list) // 8)
    res = {"model": spec, "new_tokens": new_tokens, "dtype": str(dtype), "variants": DECODE_VARIANTS}
    tokens = {}
    for name, (loop, attention, merged) in DECODE_VARIANTS.items():
        if device.type != "cuda" and loop == "graph":
            loop = "static"  # a CPU runs the static loop eagerly
        res[name] = {"attention": set_attention(model, attention), "loop": loop}
        for rows in rows_list:
            B, G = rows // 8, 8
            ids, mask = rollout.encode_prompts(tok, prompts[:B], device)
            u = torch.rand(B * G, new_tokens, generator=torch.Generator().manual_seed(rows)).to(device)
            run = dict(ids=ids, mask=mask, u=u, G=G, loop=loop, merged=merged, pad_id=tok.pad_token_id)
            static_decode.HELD.pop(model, None)  # each variant and shape captures its own step
            _free(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _, _, first_s = sample_timed(model, device, T=new_tokens, **run)  # the capture is in this one
            held = static_decode.HELD.get(model)
            captures = held.captures if held else 0
            comp, prefill_s, decode_s = sample_timed(model, device, T=new_tokens, **run)
            res[name][f"rows_{rows}"] = {
                "prompt_columns": ids.shape[1], "prefill_seconds": round(prefill_s, 3),
                "first_call_decode_seconds": round(first_s, 3),
                "capture_seconds": round(held.capture_seconds, 3) if held and held.captures else None,
                "captured_again_in_steady_call": (held.captures if held else 0) - captures,
                "decode_path": list(static_decode.decode_path(model)),
                "decode_seconds": round(decode_s, 3), "tokens": int(comp.numel()),
                "tokens_per_s": round(comp.numel() / decode_s, 1),
                "ms_per_decode_step": round(1000 * decode_s / comp.shape[1], 2),
                **({"peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2)}
                   if device.type == "cuda" else {})}
            tokens[name, rows] = comp.cpu()
            del comp
        res[name]["sdpa_backend"] = profiled_backends(model, device, run)
        static_decode.HELD.pop(model, None)  # the variant's captured step and the merged copy it read go with it
        for _, layer in lora_layers(model):
            layer.merged_weight = None
        _free(device)
        progress(res)
    res["tokens_equal"] = {f"{a}_vs_{b}": {f"rows_{r}": (tokens[a, r] == tokens[b, r]).float().mean().item()
                                           for r in rows_list}
                           for a, b in (("after", "eager_grouped"), ("after_unmerged", "eager_grouped"),
                                        ("eager_grouped", "before"))}
    if device.type == "cuda":  # launches per token of the eager loop (the graph's are one replay a token)
        from torch.profiler import ProfilerActivity, profile
        set_attention(model, "sdpa")
        ids, mask = rollout.encode_prompts(tok, prompts[:4], device)
        n = 8
        with switched(static_decode, "DECODE", "eager"), profile(activities=[ProfilerActivity.CUDA]) as prof:
            rollout.sample(model, ids, mask, None, 8, n, 1.0, [-1], tok.pad_token_id)
            sync(device)
        kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        res["before"]["cuda_kernels_per_token"] = round(kernels / n, 1)  # the prefill's included, spread over n
    del model
    _free(device)
    return res


@contextlib.contextmanager
def phase_clock(device, times, run):
    """Seconds (synchronised) and peak allocated memory of each call to what a step calls, summed per phase.

    Each timed call resets the card's peak counter, so the counter alone would only remember the peak since the
    last call; run["peak_bytes"] (and "reserved_bytes") keep the whole run's peak by reading the counters before
    every reset."""
    import rewards
    from experts import ExpertPool
    targets = [(rollout, "sample", "rollout"), (ExpertPool, "encode", "experts"),
               (rollout, "completion_logprobs", lambda: "policy pass" if torch.is_grad_enabled() else "reference pass"),
               (torch.Tensor, "backward", "backward"), (torch.optim.AdamW, "step", "optimizer step"),
               (rewards, "score_batch", "reward")]
    saved = []
    for owner, name, key in targets:
        real = getattr(owner, name)
        saved.append((owner, name, real))

        def timed(*a, _real=real, _key=key, **kw):
            k = _key() if callable(_key) else _key
            sync(device)
            if device.type == "cuda":
                run["peak_bytes"] = max(run.get("peak_bytes", 0), torch.cuda.max_memory_allocated(device))
                run["reserved_bytes"] = max(run.get("reserved_bytes", 0), torch.cuda.max_memory_reserved(device))
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            out = _real(*a, **kw)
            sync(device)
            rec = times.setdefault(k, {"seconds": 0.0, "calls": 0, "peak_allocated_gib": 0.0})
            rec["seconds"] += time.perf_counter() - t0
            rec["calls"] += 1
            if device.type == "cuda":
                rec["peak_allocated_gib"] = max(rec["peak_allocated_gib"],
                                                torch.cuda.max_memory_allocated(device) / 2 ** 30)
            return out
        setattr(owner, name, timed)
    try:
        yield times
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)


def default_step_on(device, argv, kind, lengths):
    """default_step on `kind`'s path ("before" / "after", see path) with prompts of `lengths` ("real" / "bytes")."""
    rec = {"path": kind, "prompt_lengths": lengths}
    if kind == "before":
        flags = known_flags(argv, BEFORE_FLAGS)
        argv = argv + [x for f in flags for x in f]
        rec["flags_absent"] = [f[0] for f in BEFORE_FLAGS if f not in flags]
    with prompt_lengths(lengths), path(kind, rec):
        return {**rec, **default_step(device, argv)}


def default_step_cached(device, argv, lengths):
    """default_step on precomputed expert states (--precompute-states, then --expert-cache): the experts are
    never loaded, so the peak is the policy's alone."""
    import train
    with prompt_lengths(lengths):
        t0 = time.perf_counter()
        train.main(argv + ["--precompute-states"])
        precompute = round(time.perf_counter() - t0, 2)
        _free(device)
        return {"precompute_seconds": precompute, "prompt_lengths": lengths, **default_step(device, argv)}


def default_step(device, argv):
    import train
    from support.harness import plan
    from support.harness.checks import parse_args
    args = parse_args(argv)
    parts, info = plan.estimate(args)
    planned = {d: {"peak_gib": round(plan.peak(p) / 2 ** 30, 2), **{k: round(v / 2 ** 30, 3) for k, v in p.items()}}
               for d, p in parts.items()}
    times, steps, run = {}, [], {}
    real_step = train.grpo_step

    def counted_step(*a, **kw):  # the whole step, synchronised, and the phases inside it
        sync(device)
        t0 = time.perf_counter()
        rec, batches = real_step(*a, **kw)
        sync(device)
        steps.append({"seconds": round(time.perf_counter() - t0, 2),
                      "phases": {k: {**v, "seconds": round(v["seconds"], 2)} for k, v in times.items()},
                      "metrics": {k: rec.get(k) for k in ("reward", "kl", "loss", "completion_length",
                                                          "skipped_update", "grad_norm", "rollout_logp_gap",
                                                          "decode", "decode_fallback", "attention")}})
        times.clear()
        return rec, batches

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    train.grpo_step = counted_step
    try:
        with phase_clock(device, times, run):
            train.main(argv)
    finally:
        train.grpo_step = real_step
    res = {"argv": argv, "steps": steps, "measured_step_seconds": measured_steps({"steps": steps}),
           "plan": planned, "plan_info": {k: info[k] for k in ("prompt_tokens", "context_tokens", "dtype", "params")}}
    if device.type == "cuda":
        peak = max(run.get("peak_bytes", 0), torch.cuda.max_memory_allocated(device))
        res["peak_allocated_gib"] = round(peak / 2 ** 30, 2)
        reserved = max(run.get("reserved_bytes", 0), torch.cuda.max_memory_reserved(device))
        res["peak_reserved_gib"] = round(reserved / 2 ** 30, 2)
    _free(device)
    return res


# ---------------------------------------------------------------------------------------------------------------
# trl


def trl(device, report, opts, warmup, steps):
    """TRL's GRPOTrainer in a process of its own (experiments/bench.py's worker: its callback times each
    optimiser step, synchronised, from on_step_begin to on_step_end), then ours / TRL per step: `ours` from
    default_step, `single` from default_step_single, each the median of the steps after the first."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import bench
    log_dir = tempfile.mkdtemp(prefix="gpu_check_trl_")
    opts = {**opts, "n_steps": warmup + steps}
    w = bench.Worker("trl", "trl_default", opts, log_dir)
    replies = []
    try:  # every reply within the budget's deadline: a hung worker ends this phase, not the call
        info = w.recv(timeout=report.seconds_left())
        for k in range(warmup + steps):
            replies.append(w.run(step=k, timeout=report.seconds_left()))
            report.progress("trl", {"step_seconds_so_far": [r["seconds"] for r in replies]})
        w.close(timeout=60)
    except Exception as e:  # noqa: BLE001  the worker's own error is in its log: bring its end along
        w.proc.kill()
        tail = open(os.path.join(log_dir, "trl.log")).read()[-3000:]
        raise RuntimeError(f"{e}\n--- TRL worker log (end) ---\n{tail}") from e
    seconds = [r["seconds"] for r in replies[warmup:]]
    trl_s = statistics.median(seconds)
    ours = {name: statistics.median(s) if (s := measured_steps(report.record(phase))) else None
            for name, phase in (("ours", "default_step"), ("single", "default_step_single"))}
    return {"options": opts, "gradient_checkpointing": info.get("gradient_checkpointing"), "dtype": info.get("dtype"),
            "warmup_seconds": [r["seconds"] for r in replies[:warmup]], "step_seconds": seconds,
            "median_step_seconds": trl_s, "replies": replies,
            "ours_step_seconds": ours, "ours_vs_trl": {k: None if v is None else v / trl_s for k, v in ours.items()}}


# the CUDA-marked tests: the captured graph against the static loop, the GPU path, grouped attention vs SDPA in bf16
CUDA_TESTS = ["tests/test_static_decode.py", "tests/test_gpu_path.py", "tests/test_attention.py"]


def cuda_tests(device):
    """The CUDA-marked tests (CUDA_TESTS), in a process of their own."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *CUDA_TESTS],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = (r.stdout + r.stderr).strip().splitlines()
    if r.returncode:
        raise AssertionError(f"pytest -m cuda: exit {r.returncode}: " + "\n".join(lines[-30:]))
    return {"exit": r.returncode, "summary": lines[-1:]}


def determinism(device, base, run_dir):
    """Fresh `python train.py` processes (a process is what --resume and torchrun start): the same run with and
    without --deterministic, and one --deterministic run resumed after step 2."""
    import subprocess
    flags = base + ["--reward", "random", "--save-every", "1", "--steps", "4"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}

    def train_py(name, extra):
        folder = os.path.join(run_dir, "determinism", name)
        for more in extra:
            r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *flags, "--out", folder, *more],
                               capture_output=True, text=True, env=env)
            if r.returncode:
                raise RuntimeError(f"{name}: exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
        recs = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
        return {k: [r[k] for r in recs] for k in ("grad_norm", "loss", "kl")}

    det = ["--deterministic"]
    runs = {"deterministic_a": train_py("deterministic_a", [det]),
            "deterministic_b": train_py("deterministic_b", [det]),
            "deterministic_resumed": train_py("deterministic_resumed", [det + ["--steps", "2"], det + ["--resume"]]),
            "plain_a": train_py("plain_a", [[]]), "plain_b": train_py("plain_b", [[]])}
    same = lambda *names: all(runs[n] == runs[names[0]] for n in names)  # noqa: E731
    res = {"runs": runs, "deterministic_all_equal": same("deterministic_a", "deterministic_b",
                                                           "deterministic_resumed"),
           "plain_equal": same("plain_a", "plain_b")}
    if not res["deterministic_all_equal"]:
        raise AssertionError(f"--deterministic processes differ: {json.dumps(runs)}")
    return res


# ---------------------------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_check.json", help="the JSON file (rewritten after every phase)")
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny models, every phase in a few minutes: the dry run "
                    "the test suite does")
    ap.add_argument("--shallow", action="store_true", help="CPU, the GPU run's own branches at one layer: the 3B "
                    "policy's shape and one expert's (shape:...@1), the arithmetic task, the stand-in tokenizer, TRL on "
                    "that policy; 2 prompts x G 2 x 4 tokens (a dry run for typos, ~25 min on one core)")
    ap.add_argument("--phases", default=",".join(DEFAULT_PHASES), help="comma-separated phases to run, in order; "
                    f"known: {', '.join(ESTIMATE_S)}")
    ap.add_argument("--budget-s", type=float, default=0.0, help="deadline in seconds from the start (the wheels' "
                    "installation included): a phase whose estimate (ESTIMATE_S) would end past it is skipped (0: none)")
    # an 80 GB card (A100/H100 80GB) has 80 GiB of memory, of which CUDA reports ~79.2 GiB as total_memory (the rest
    # is the driver's); the CUDA context, cuBLAS's and cuDNN's workspaces and the loaded kernels take ~1-2 GiB more
    # outside torch's allocator (torch's own figure for a context is 0.3-1 GiB, more with cuDNN and NCCL loaded), and
    # the allocator's blocks leave a few hundred MiB unusable: ~76 GiB is what a run can allocate there. 78 (the
    # earlier cap) was 1-2 GiB generous: a run that fitted under it could still fail on a real 80 GB card
    ap.add_argument("--memory-cap-gib", type=float, default=76.0, help="cap this process (and TRL's) at this many "
                    "GiB of the card, what an 80 GB card leaves a run (0: no cap)")
    ap.add_argument("--graph-lora", default="merged", choices=["merged", "unmerged"], help="what the captured decode "
                    "step reads: LoRA merged into buffers kept for the run (static_decode.GRAPH_MERGED, the "
                    "default) or unmerged inside the graph (no merged copy: ~5.2 GiB less on the 3B policy, more "
                    "kernels a step)")
    ap.add_argument("--sdpa-backend", default="auto", choices=SDPA_FORCE, help="force torch's SDPA kernel for every "
                    "phase in this process (torch.nn.attention.sdpa_kernel; auto: torch chooses; TRL's and the tests' "
                    "processes choose their own)")
    ap.add_argument("--allocator", default="expandable", choices=["expandable", "default"],
                    help="CUDA's caching allocator: expandable segments (as train.py sets it) or the old default")
    ap.add_argument("--prompt-lengths", default="real", choices=["real", "bytes"], help="the `shape:` models' "
                    "tokenizer: real (Qwen2.5's counts) or bytes (~4.1x; the *_stress phases always use bytes)")
    ap.add_argument("--wheels", default="", help="install reasoning-gym and TRL from this folder of wheels first "
                    "(experiments/gpu_wheels.sh builds it)")
    ap.add_argument("--steps", type=int, default=3, help="default_step*: optimiser steps (the first a warm-up)")
    ap.add_argument("--trl-steps", type=int, default=2, help="trl: timed steps after one warm-up step")
    args = ap.parse_args(argv)
    start = time.time()  # the budget counts from here: the wheels' installation is part of it
    unknown = set(args.phases.split(",")) - set(ESTIMATE_S)
    if unknown:
        ap.error(f"--phases: unknown {', '.join(sorted(unknown))}; known: {', '.join(ESTIMATE_S)}")
    assert args.steps >= 1 and args.trl_steps >= 1, "--steps and --trl-steps must be >= 1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.allocator == "expandable" and not {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"} & set(os.environ):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # before CUDA starts: read once
    installed = install_wheels(args.wheels) if args.wheels else None
    assert not (args.tiny and args.shallow), "--tiny or --shallow, not both"
    cpu = args.tiny or args.shallow
    device = torch.device("cpu" if cpu or not torch.cuda.is_available() else "cuda")
    if not cpu and device.type != "cuda":
        print("error: no CUDA device here; run with --tiny or --shallow for the CPU checks", file=sys.stderr)
        return 2
    if device.type == "cuda" and args.memory_cap_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2 ** 30 / total), device)
    tiny, shallow = args.tiny, args.shallow
    spec = "tiny:llama" if tiny else POLICY_3B + "@1" if shallow else POLICY_3B
    run_dir = tempfile.mkdtemp(prefix="gpu_check_run_")
    if tiny:
        base = ["--preset", "smoke", "--eval-items", "0", "--device", "cpu"]
    else:
        base = ["--task", "arithmetic", "--team", "default", "--random-weights", "--eval-items", "0",
                "--save-every", "1000", "--device", device.type]
    experts = []
    if shallow:  # the paper's policy and its first expert at one layer, a small step
        base += ["--policy", spec, "--batch-size", "2", "--grad-accum", "2", "--group-size", "2",
                 "--max-new-tokens", "4", "--dataset-size", "64"]
        experts = ["--experts", "shape:Qwen/Qwen2.5-Math-1.5B-Instruct@1"]  # not for --method single
    out = lambda name: ["--out", os.path.join(run_dir, name)]  # noqa: E731
    steps = base + ["--steps", str(args.steps)]
    single = steps + ["--method", "single"]
    base, steps = base + experts, steps + experts
    lengths = args.prompt_lengths
    if cpu:
        trl_opts = dict(policy=spec, task="chain_sum" if tiny else "arithmetic", dataset_size=64, device="cpu",
                        bf16=False, prompts=2, G=2, T=8 if tiny else 4, grad_accum=1 if tiny else 2, threads=1)
    else:  # the paper's step: 32 prompts x G 8 as 8 micro-batches, 128 new tokens, bf16 on the card
        trl_opts = dict(policy=spec, task="arithmetic", dataset_size=20000, device="cuda", bf16=True, prompts=32,
                        G=8, T=128, grad_accum=8, threads=4, memory_cap_gib=args.memory_cap_gib)
    trl_opts.update(natural_eos=False, stand_in=lengths == "real" and not tiny)
    report = Report(args.out, device, args.budget_s, {k: (3 if cpu else v) for k, v in ESTIMATE_S.items()}, start)
    phases = {
        "preflight": (preflight, device),
        "env": (env, device, args, installed),
        "tiny_parity": (lambda: {**tiny_parity(device), "decode_loops": loop_parity(device)},),
        "decode": (lambda: decode_at(device, spec, (8, 16) if cpu else (32, 256), 4 if shallow else 8 if tiny else 128,
                                     lengths, lambda res: report.progress("decode", res)),),
        "default_step": (default_step_on, device, steps + out("run"), "after", lengths),
        "default_step_before": (default_step_on, device, steps + out("before"), "before", lengths),
        "default_step_single": (default_step_on, device, single + out("single"), "after", lengths),
        "trl": (trl, device, report, trl_opts, 1, 1 if cpu else args.trl_steps),
        "default_step_stress": (default_step_on, device, steps + out("stress"), "after", "bytes"),
        "default_step_stress_before": (default_step_on, device, steps + out("stress_before"), "before", "bytes"),
        "default_step_cached": (default_step_cached, device, base + [
            "--steps", "1", "--expert-cache", os.path.join(run_dir, "states")] + out("cached"), lengths),
        "default_step_per_micro": (default_step_on, device, base + ["--steps", "1", "--rollout-batch", "1"]
                                   + out("per_micro"), "after", lengths),
        "cuda_tests": (cuda_tests, device),
        "padded_rows": (padded_rows, device, spec), "writers": (writers, device),
        "determinism": (determinism, device, ["--preset", "smoke", "--eval-items", "0", "--device",
                                              device.type], run_dir)}
    static_decode.GRAPH_MERGED = args.graph_lora == "merged"
    forced = contextlib.nullcontext()
    if args.sdpa_backend != "auto":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        forced = sdpa_kernel([getattr(SDPBackend, {"efficient": "EFFICIENT_ATTENTION", "flash": "FLASH_ATTENTION",
                                                   "cudnn": "CUDNN_ATTENTION", "math": "MATH"}[args.sdpa_backend])])
    with forced:
        for name in args.phases.split(","):
            fn, *fn_args = phases[name]
            report.run(name, fn, *fn_args)
    failed = [r["phase"] for r in report.phases if r["ok"] is False]
    skipped = [r["phase"] for r in report.phases if r["ok"] is None]
    print(f"[gpu_check] wrote {args.out}; failed phases: {failed or 'none'}; skipped: {skipped or 'none'}")
    print("[gpu_check] goals: " + json.dumps(goals(report)))
    for cmd in next_commands(report):
        print(f"[gpu_check] next: {cmd}")
    return 1 if failed else 0


def decode_at(device, spec, rows, new_tokens, lengths, progress):
    with prompt_lengths(lengths):
        return {"prompt_lengths": lengths, "sdpa_forced": forced_sdpa(),
                **decode(device, spec, rows, new_tokens, progress)}


def forced_sdpa():
    """The --sdpa-backend in force ('auto' where torch chooses): read from torch's switches, which sdpa_kernel sets."""
    on = {"flash": torch.backends.cuda.flash_sdp_enabled(), "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
          "cudnn": torch.backends.cuda.cudnn_sdp_enabled(), "math": torch.backends.cuda.math_sdp_enabled()}
    return next(iter(k for k, v in on.items() if v)) if sum(on.values()) == 1 else "auto"


if __name__ == "__main__":
    sys.exit(main())
