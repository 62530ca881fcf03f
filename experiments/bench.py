"""
Speed benchmark: one GRPO optimiser step of this project vs TRL's GRPOTrainer vs the compute floor.

    pip install -r requirements-bench.txt                   # TRL + PEFT: benchmark-only, never needed to train
    HF_HUB_OFFLINE=1 python experiments/bench.py            # ~20 min on 2 CPU cores -> results/bench.{json,md}
    HF_HUB_OFFLINE=1 python experiments/bench.py --quick    # 1 measured step, no scaling runs: a fast check
    HF_HUB_OFFLINE=1 python experiments/bench.py --steps 3 --no-scaling \
        --contenders single,ours,ours_int8,ours_fast,trl_default     # results/bench.md as committed
    HF_HUB_OFFLINE=1 python experiments/bench.py --speedrun # time to 30 % and 45 % (experiments/speedrun.py)

A step, for every contender: SmolLM2-135M-Instruct (pocket policy, fp32, CPU) + LoRA r8 (alpha 16) on
q/k/v/o/gate/up/down_proj; --prompts (1) prompt x G = 8 completions of exactly 64 new tokens (T = 1, no top-k/p);
beta 0.04; one optimiser step per rollout. Step k uses the same chain_sum question and prompt tokens everywhere.
  single, ours   train.grpo_step as it is, timed around the call (ours: experts Gemma-3-270M, SmolLM2-135M, MiniLM;
                 their cache is cleared before every step, so they run on every step).
  ours_int8      ours with --rollout-dtype int8 --tis-cap 2, in the ours worker: the two
                 rollouts alternate in one process. Reported: its speed-up over ours (paired
                 rounds), its generation's, and the sampler-policy gap train.py logs
                 (rollout_logp_gap, is_weight_mean, is_weight_clipped_fraction).
  ours_fast      ours_int8 with --keep-activations too (the MLPs' activations kept for the backward pass instead
                 of recomputed: exact, ~1 GB more memory), in the same worker: every speed lever of train.py.
  trl_default    TRL GRPOTrainer + PEFT LoRA, GRPOConfig defaults (gradient checkpointing ON in TRL 1.16);
  trl_no_gc      the same with it off. Both bf16=False (fp32), no vLLM, logging/saving/shuffling off, batch =
                 prompts x G; timed by a callback from on_step_begin (before generation) to on_step_end.
  floor          HF generate of the same tokens + one forward/backward over the G sequences (completion log-probs,
                 LoRA) + AdamW; no reward, no reference pass.
Equal work: each implementation stops generating at EOS, so all are forced to 64 tokens: TRL and the floor with
min_new_tokens (EOS masked), ours by an EOS id that never occurs (-1), so the mask covers all 64 tokens too.
--natural-eos lifts this (then compare tokens/s).
Generation seconds of every contender: rollout.sample (ours), HF generate (TRL, floor), timed by a
wrapper.
Method: worker subprocesses load once, run --warmup uncounted steps, then --steps rounds of one step per contender
in turn (alternated: load drifts hit all alike). Reported: median, min/max, IQR, paired per-round ratios, peak RSS
per worker (ru_maxrss, incl. loading); a phase profile of one ours step (timers wrapped around
the functions grpo_step calls); ours vs G (4, 8, 16) and vs 1-3 experts (first k of the team, G = 8), each point
with the same phase timers, so the experts' own seconds are measured apart from the noisy step total.
Threads: --threads per worker (default 1). On this shared 2-core machine one forward took 1.9-10 s with two OpenMP
threads (stalls when another job holds a core) and 3.4-3.9 s with one; use --threads 2 on a quiet machine.
"""
import argparse, collections, contextlib, json, os, platform, resource, select, subprocess, sys, tempfile, time  # noqa: E401

import numpy as np

POLICY = "pocket:smollm2-135m-instruct"
EXPERTS = ["pocket:gemma3-270m", "pocket:smollm2-135m-instruct", "pocket:all-minilm-l6-v2"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # lora.DEFAULT_TARGETS here
GOALS = dict(ratio_vs_trl=0.33, ratio_vs_trl_best=0.5, ratio_vs_floor=1.15, overhead_ours_vs_single=1.05)
TIS_CAP = 2.0  # ours_int8: --rollout-dtype int8 --tis-cap 2, the pocket preset's cap
# support.harness.metrics.step_metrics' sampler-policy gap
GAP_FIELDS = ("rollout_logp_gap", "is_weight_mean", "is_weight_clipped_fraction")
CONTENDERS = ["single", "ours", "ours_int8", "ours_fast", "trl_default", "trl_no_gc", "floor"]
IN_OURS = {"ours_int8": dict(rollout_dtype="int8"), "ours_fast": dict(rollout_dtype="int8", keep_activations=True)}
DATASET_SIZE, SEED = 256, 0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: train.py, rewards.py, ...


def step_items(items, step, prompts):
    from rewards import batch_indices
    return [items[i] for i in batch_indices(step, 0, prompts, 1, len(items), SEED)]


# ---------------------------------------------------------------------------------------------------------------
# Worker side: load once, then answer one JSON command per line on the real stdout (library noise goes to a log).


@contextlib.contextmanager
def phase_timers(run, times):
    """Accumulate seconds per phase by wrapping what grpo_step calls; everything is restored on exit."""
    import torch
    import rewards
    import rollout
    from support.harness import metrics as run_module  # step_metrics, which calls the probes of C
    patched = []
    for owner, name, key in [
            (rollout, "sample", "rollout (generation)"), (torch.Tensor, "backward", "policy backward"),
            (rollout, "completion_logprobs", lambda: "policy forward" if torch.is_grad_enabled() else "reference forward"),
            (rewards, "score_batch", "reward scoring"), (rewards, "build_prompt", "prompt + tokenise"),
            (rollout, "encode_prompts", "prompt + tokenise"), (run.optimizer, "step", "optimizer step"),
            (torch.nn.utils, "clip_grad_norm_", "grad clip"), (run_module, "context_probes", "probes of C")] + (
            [] if run.pool is None else [
            (run.pool, "encode", "experts (frozen forwards)"), (run.method.adapter, "forward", "adapter")]):
        def timed(*a, _f=getattr(owner, name), _key=key, **k):
            t0 = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                times[_key() if callable(_key) else _key] += time.perf_counter() - t0
        patched.append((owner, name, getattr(owner, name), name in vars(owner)))
        setattr(owner, name, timed)
    try:
        yield
    finally:
        for owner, name, f, own in reversed(patched):
            setattr(owner, name, f) if own else delattr(owner, name)  # instance patches are removed again


def ours_worker(kind, o):
    import torch
    import rewards
    import rollout
    import train
    argv = ["--task", "chain_sum", "--team", "pocket", "--method", "single" if kind == "single" else "ours",
            "--batch-size", str(o["prompts"]), "--grad-accum", "1", "--group-size", str(o["G"]), "--max-new-tokens",
            str(o["T"]), "--lora-rank", "8", "--beta", "0.04", "--dataset-size", str(DATASET_SIZE), "--seed",
            str(SEED), "--device", "cpu", "--out", "unused"]
    args = train.parse_args(argv + ([] if kind == "single" else ["--experts", ",".join(EXPERTS[:o["n_experts"]])]))
    run = train.build_run(args, torch.device("cpu"))
    if not o["natural_eos"]:
        run.eos_ids = [-1]  # never sampled: every completion runs the full T tokens (equal work, see docstring)
    generation = timed(rollout, "sample")

    def step(cmd):
        args.group_size, times, t0 = cmd.get("G", o["G"]), collections.defaultdict(float), time.perf_counter()
        # --rollout-dtype per command: both rollouts alternate in one process; int8 with its TIS cap
        args.rollout_dtype = cmd.get("rollout_dtype", "float32")
        args.tis_cap = 0.0 if args.rollout_dtype == "float32" else TIS_CAP
        run.policy.recompute_mlps = not cmd.get("keep_activations", False)  # read by recompute.mlps_recomputed
        generation["seconds"] = 0.0
        if run.pool is not None:  # ours and ours_int8 share prompts: both pay the experts
            run.pool.cache.clear()
        with phase_timers(run, times) if cmd.get("profile") else contextlib.nullcontext():
            rec, _ = train.grpo_step(cmd["step"], run, args, rewards.score_batch)
        seconds = time.perf_counter() - t0
        if times:
            times["other (decode, advantage, loss, metrics)"] = seconds - sum(times.values())
        return dict(seconds=seconds, tokens=rec["completion_length"] * args.group_size * args.batch_size,
                    phases=dict(times), generation=generation["seconds"],
                    **{k: rec[k] for k in GAP_FIELDS if k in rec})
    return step


def timed(owner, name):
    """Replace owner.name by a wrapper that adds its seconds to the returned dict's "seconds"
    (for the worker's life: generation time of every step, whatever library calls it)."""
    clock, f = {"seconds": 0.0}, getattr(owner, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            clock["seconds"] += time.perf_counter() - t0
    setattr(owner, name, wrapper)
    return clock


def floor_worker(o):
    import torch
    import torch.nn.functional as F
    import rollout
    import rewards
    from experts import load_model
    from lora import apply_lora
    policy, tok = load_model(POLICY)
    apply_lora(policy, 8, 16.0, TARGETS)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-4)
    items, T = rewards.load_entries("chain_sum", "train", DATASET_SIZE, SEED), o["T"]

    generation = timed(policy, "generate")

    def step(cmd):
        G, t0 = cmd.get("G", o["G"]), time.perf_counter()
        generation["seconds"] = 0.0
        prompts = [rewards.build_prompt(tok, it["question"]) for it in step_items(items, cmd["step"], o["prompts"])]
        ids, mask = rollout.encode_prompts(tok, prompts, "cpu")
        ids, mask = ids.repeat_interleave(G, 0), mask.long().repeat_interleave(G, 0)
        with torch.no_grad():
            seq = policy.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                  top_p=1.0, max_new_tokens=T, min_new_tokens=T, pad_token_id=tok.pad_token_id)
        mask = torch.cat([mask, torch.ones_like(seq[:, ids.shape[1]:])], 1)
        logits = policy(input_ids=seq, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                        logits_to_keep=T + 1).logits[:, :-1]                              # (N, T, V)
        F.cross_entropy(logits.flatten(0, 1), seq[:, -T:].flatten()).backward()          # -mean log-prob
        opt.step(), opt.zero_grad(set_to_none=True)
        return dict(seconds=time.perf_counter() - t0, tokens=G * T * len(prompts),
                    generation=generation["seconds"])
    return step


def trl_worker(kind, o, reply, read):
    """TRL runs its own loop: a callback waits for our command in on_step_begin and replies in on_step_end.
    Options beyond this file's CPU benchmark (experiments/gpu_check.py's trl phase, on a GPU): policy, task,
    dataset_size, device, bf16, grad_accum (micro-batches per optimiser step: TRL then generates the whole
    step's completions at once, as train.py's one decode loop does), stand_in (shape: models tokenise with
    experiments/stand_in_tokenizer.py: real prompt lengths), memory_cap_gib (the process capped, as gpu_check is)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    import rewards
    from experts import load_model
    device, cuda = o.get("device", "cpu"), o.get("device", "cpu") == "cuda"
    if cuda and o.get("memory_cap_gib"):
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, o["memory_cap_gib"] * 2 ** 30 / total))
    if o.get("stand_in"):
        from lib import shape_models
        import stand_in_tokenizer  # experiments/, beside this script
        shape_models.tokenizer = stand_in_tokenizer.tokenizer
    policy, tok = load_model(o.get("policy", POLICY), device, torch.bfloat16 if o.get("bf16") else torch.float32)
    generation = timed(policy, "generate")  # PEFT's generate calls the wrapped model's
    items = rewards.load_entries(o.get("task", "chain_sum"), "train", o.get("dataset_size", DATASET_SIZE), SEED)
    rows = [it for k in range(o["n_steps"]) for it in step_items(items, k, o["prompts"])]
    data = Dataset.from_list([{"prompt": rewards.build_prompt(tok, it["question"]), "row": i}
                              for i, it in enumerate(rows)])

    def reward(prompts, completions, row, **_):
        return rewards.score_batch([rows[i] for i in row], completions)[0]
    accum = o.get("grad_accum", 1)
    config = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="bench-trl-"), per_device_train_batch_size=o["prompts"]
                        * o["G"] // accum, gradient_accumulation_steps=accum, num_generations=o["G"],
                        max_completion_length=o["T"], beta=0.04, learning_rate=1e-4,
                        max_steps=o["n_steps"], bf16=bool(o.get("bf16")), use_cpu=not cuda, report_to="none",
                        logging_strategy="no", save_strategy="no", disable_tqdm=True, shuffle_dataset=False,
                        seed=SEED, generation_kwargs={} if o["natural_eos"] else {"min_new_tokens": o["T"]},
                        **({} if kind == "trl_default" else {"gradient_checkpointing": False}))
    t0 = {}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            assert read()["step"] == state.global_step, "TRL runs its steps in order"
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t0["t"], generation["seconds"] = time.perf_counter(), 0.0

        def on_step_end(self, args, state, control, **kw):
            sync()
            seconds = time.perf_counter() - t0["t"]
            lengths = trainer._metrics["train"].get("completions/mean_length") or [float("nan")]
            memory = {} if not cuda else dict(
                peak_allocated_gib=torch.cuda.max_memory_allocated() / 2 ** 30,
                peak_reserved_gib=torch.cuda.max_memory_reserved() / 2 ** 30,
                alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0),
                ooms=torch.cuda.memory_stats().get("num_ooms", 0))
            reply(seconds=seconds, tokens=lengths[-1] * o["G"] * o["prompts"],
                  generation=generation["seconds"], **memory)
            release_memory()
    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=config, train_dataset=data, processing_class=tok,
                          peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS),
                          callbacks=[Clock()])
    reply(ready=True, gradient_checkpointing=bool(trainer.args.gradient_checkpointing), dtype=str(policy.dtype))
    trainer.train()


def release_memory():
    """Between steps, outside the timing: hand freed heap back to the OS. Otherwise every idle worker keeps its
    peak (4-6 GB after a G=8 step) and six of them filled this 24 GB machine. ru_maxrss still reports the peak."""
    import ctypes
    import gc
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def worker_main(kind, o):
    import torch
    torch.set_num_threads(o["threads"])
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # prints and warnings of the libraries go to the log file, not into the protocol

    def reply(**kw):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        proto.write(json.dumps({**kw, "rss_mb": rss, "threads": torch.get_num_threads(),
                                "load": os.getloadavg()[0]}) + "\n")

    def read():
        return json.loads(sys.stdin.readline() or '{"cmd": "quit"}')
    if kind.startswith("trl"):
        return trl_worker(kind, o, reply, read)
    step = floor_worker(o) if kind == "floor" else ours_worker(kind, o)
    reply(ready=True)
    while (cmd := read())["cmd"] != "quit":
        reply(**step(cmd))
        release_memory()


# ---------------------------------------------------------------------------------------------------------------
# Parent side: spawn, alternate, summarise.


class Worker:
    def __init__(self, name, kind, opts, log_dir):
        self.name, self.rss, self.log = name, 0.0, open(os.path.join(log_dir, f"{name}.log"), "w")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "OMP_NUM_THREADS": str(opts["threads"])}
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", kind, "--opts",
                                      json.dumps(opts)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, cwd=ROOT)

    def recv(self, timeout=None):
        """The worker's next reply (one JSON line). timeout: seconds to wait for it (None: for ever), then
        TimeoutError: a hung worker must not eat the caller's budget (experiments/gpu_check.py's TRL phase). The
        protocol is one line per request, so nothing waits in the pipe's buffer that select() would not see."""
        if timeout is not None and not select.select([self.proc.stdout], [], [], max(timeout, 0))[0]:
            raise TimeoutError(f"worker {self.name}: no reply within {timeout:.0f} s; see {self.log.name}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} died; see {self.log.name}")
        r = json.loads(line)
        self.rss = max(self.rss, r["rss_mb"])
        return r

    def run(self, timeout=None, **cmd):
        self.proc.stdin.write(json.dumps({"cmd": "step", **cmd}) + "\n")
        self.proc.stdin.flush()
        return self.recv(timeout)

    def close(self, timeout=300):
        with contextlib.suppress(OSError):
            self.proc.stdin.write('{"cmd": "quit"}\n'), self.proc.stdin.flush()
        self.proc.wait(timeout=timeout)


def alternate(plan, n_warm, n_meas, log):
    """plan: {label: (worker, round -> command)}. One step of each in turn per round; returns label -> replies."""
    out = collections.defaultdict(list)
    for r in range(n_warm + n_meas):
        for label, (w, cmd) in plan.items():
            res = w.run(**cmd(r))
            out[label] += [res] if r >= n_warm else []
            log(f"{'warm-up' if r < n_warm else f'round {r - n_warm + 1}'} {label:12s} {res['seconds']:7.2f} s "
                f"(load avg {res['load']:.1f})")
    return out


def stats(replies, rss):
    t, tok = np.array([r["seconds"] for r in replies]), float(np.median([r["tokens"] for r in replies]))
    phases = {k: float(np.median([r["phases"].get(k, 0.0) for r in replies])) for k in replies[0].get("phases") or {}}
    return dict(seconds=[round(x, 2) for x in t], median=float(np.median(t)), min=float(t.min()), max=float(t.max()),
                iqr=[float(np.percentile(t, 25)), float(np.percentile(t, 75))], tokens_per_step=tok,
                tokens_per_second=tok / float(np.median(t)), peak_rss_mb=round(rss),
                generation_median=float(np.median([r.get("generation", np.nan) for r in replies])),
                **({"phases_median": phases} if phases else {}))


def environment(threads):
    import peft, torch, transformers, trl  # noqa: E401
    cpuinfo = [ln.split(":", 1) for ln in open("/proc/cpuinfo").read().split("\n\n")[0].splitlines() if ":" in ln]
    info = {k.strip(): v.strip() for k, v in cpuinfo}
    cpu, flags = info["model name"], info["flags"].split()
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT).stdout.strip()  # noqa: E731
    return dict(torch=torch.__version__, transformers=transformers.__version__, trl=trl.__version__,
                peft=peft.__version__, python=platform.python_version(), cpu=cpu, cores=os.cpu_count(),
                bf16_hardware=[f for f in ("avx512_bf16", "amx_bf16") if f in flags],
                threads_per_worker=threads, commit=git("rev-parse", "HEAD"),
                uncommitted=git("status", "--porcelain").splitlines())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="measured steps per contender, after the warm-up")
    p.add_argument("--warmup", type=int, default=1, help="uncounted warm-up steps per contender")
    p.add_argument("--scaling-steps", type=int, default=1, help="measured steps per point of the scaling runs")
    p.add_argument("--group-size", type=int, default=8, help="G: completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per completion (see --natural-eos)")
    p.add_argument("--prompts", type=int, default=1, help="prompts per optimiser step (batch = prompts x G)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (see the docstring)")
    p.add_argument("--natural-eos", action="store_true", help="let generation stop at EOS (unequal work)")
    p.add_argument("--no-scaling", action="store_true", help="skip the G and number-of-experts scaling runs")
    p.add_argument("--quick", action="store_true", help="--steps 1 --no-scaling: a fast check")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated, of "
                   f"{', '.join(CONTENDERS)} (ours_int8: ours with --rollout-dtype int8 "
                   f"--tis-cap {TIS_CAP}; ours_fast: ours_int8 with --keep-activations)")
    p.add_argument("--profile-only", action="store_true", help="only the phase profile of `ours` (loads one worker): "
                   "where a step's time goes, e.g. what the probes of C cost -> bench_profile.json beside --out")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "bench.json"),
                   help="JSON output; the Markdown table goes beside it")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--opts", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker_main(a.worker, json.loads(a.opts))
    a.steps, a.no_scaling = (1, True) if a.quick else (a.steps, a.no_scaling)
    a.contenders = a.contenders.split(",")
    unknown = set(a.contenders) - set(CONTENDERS)
    if unknown or "ours" not in a.contenders:
        p.error(f"--contenders: {'unknown ' + ', '.join(sorted(unknown)) if unknown else 'ours is needed'}; "
                f"choose from {', '.join(CONTENDERS)}")
    for flag in ("steps", "scaling_steps", "prompts", "threads", "max_new_tokens"):
        assert getattr(a, flag) >= 1, f"--{flag.replace('_', '-')} must be >= 1"
    assert a.group_size >= 2 and a.warmup >= 0, "--group-size must be >= 2 and --warmup >= 0"
    t_start, log_dir = time.time(), tempfile.mkdtemp(prefix="bench-logs-")
    log = lambda s: print(f"[{time.time() - t_start:5.0f} s] {s}", flush=True)  # noqa: E731
    o = dict(G=a.group_size, T=a.max_new_tokens, prompts=a.prompts, natural_eos=a.natural_eos, threads=a.threads,
             n_steps=a.warmup + a.steps, n_experts=3)
    log(f"worker logs in {log_dir}")
    env = environment(a.threads)  # at the start: the commit whose code the workers import

    if a.profile_only:  # one worker, a warm-up step, then profiled steps on prompts new to it
        w = Worker("ours", "ours", o, log_dir)
        w.recv()
        [w.run(step=DATASET_SIZE - 1 - k) for k in range(a.warmup)]
        steps = []
        for k in range(a.steps):
            v = w.run(step=k, profile=True)
            steps.append(v)
            log(f"profile ours {v['seconds']:.1f} s: " + ", ".join(f"{ph} {x:.3f}" for ph, x in sorted(
                v["phases"].items(), key=lambda x: -x[1])))
        w.close()
        share = [v["phases"].get("probes of C", 0.0) / v["seconds"] for v in steps]
        res = dict(environment=env, options=o, steps=steps, probes_share_median=float(np.median(share)),
                   probes_seconds_median=float(np.median([v["phases"].get("probes of C", 0.0) for v in steps])),
                   step_seconds_median=float(np.median([v["seconds"] for v in steps])))
        path = os.path.join(os.path.dirname(a.out), "bench_profile.json")  # never overwrites bench.json
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        return log(f"probes of C: {100 * res['probes_share_median']:.3f} % of a step (median of {a.steps}); {path}")

    # ---- 1. main comparison: all contenders loaded at once, alternated step by step ------------------------------
    # ours_int8 and ours_fast are commands to the ours worker (IN_OURS): they alternate with ours in one process
    W = {k: Worker(k, k, o, log_dir) for k in a.contenders if k not in IN_OURS}
    info = {k: w.recv() for k, w in W.items()}
    log("loaded: " + ", ".join(f"{k} {w.rss / 1024:.1f} GB" for k, w in W.items()))
    plan = {k: (W.get(k) or W["ours"], lambda r, k=k: dict(step=r, **IN_OURS.get(k, {}))) for k in a.contenders}
    runs = alternate(plan, a.warmup, a.steps, log)
    res = {k: {**stats(v, (W.get(k) or W["ours"]).rss),
               "threads": info["ours" if k in IN_OURS else k]["threads"]} for k, v in runs.items()}
    if "trl_default" in res:
        res["trl_default"]["gradient_checkpointing"] = info["trl_default"]["gradient_checkpointing"]
    pair = lambda x, y, key="seconds": float(np.median(  # noqa: E731
        [u[key] / v[key] for u, v in zip(runs[x], runs[y])]))
    paired = {f"{x}/{y}": pair(x, y) for x in ("ours", *IN_OURS) if x in runs for y in runs if y != x}
    int8 = {} if "ours_int8" not in runs else dict(
        step_speedup_paired=pair("ours", "ours_int8"),
        generation_speedup_paired=pair("ours", "ours_int8", "generation"),
        **{k: float(np.median([r[k] for r in runs["ours_int8"]])) for k in GAP_FIELDS})

    # ---- 2. profile: one step of ours on a prompt new to it, phase by phase ------------------------------------------
    profile = {}
    for k in [k for k in ("ours", "ours_int8") if k in a.contenders]:
        dtype = "int8" if k == "ours_int8" else "float32"
        v = W["ours"].run(step=DATASET_SIZE - 1, profile=True, rollout_dtype=dtype)
        profile[k] = dict(seconds=v["seconds"], phases=dict(sorted(v["phases"].items(), key=lambda x: -x[1])))
        log(f"profile {k} {v['seconds']:.1f} s: " + ", ".join(f"{ph} {x:.2f}" for ph, x in v["phases"].items()))
    [w.close() for k, w in W.items() if k != "ours" or a.no_scaling]

    # ---- 3. scaling: ours vs G (same worker, new prompts) and vs number of experts (same prompts as G = 8) -------
    scaling = {}
    if not a.no_scaling:
        E = {k: Worker(f"experts_{k}", "ours", {**o, "n_experts": k}, log_dir) for k in (1, 2)}
        [w.recv() for w in E.values()]
        [w.run(step=DATASET_SIZE - 2, G=8) for w in E.values() for _ in range(a.warmup)]  # ours is warm already
        plan = {f"G={g}": (W["ours"], lambda r, g=g, j=j: dict(step=100 + 4 * r + j, G=g, profile=True))
                for j, g in enumerate((4, 8, 16))}
        plan.update({f"experts={k}": (w, lambda r: dict(step=100 + 4 * r + 1, G=8, profile=True))
                     for k, w in E.items()})
        runs = alternate(plan, 0, a.scaling_steps, log)
        E[3] = W["ours"]
        scaling = dict(vs_group_size={g: stats(runs[f"G={g}"], W["ours"].rss) for g in (4, 8, 16)},
                       vs_num_experts={k: {**stats(runs[f"experts={k}" if k < 3 else "G=8"], E[k].rss),
                                           "experts": EXPERTS[:k]} for k in (1, 2, 3)})
        [w.close() for w in E.values()]
        W["ours"].close()

    # ---- 4. results ----------------------------------------------------------------------------------------------
    med = {k: v["median"] for k, v in res.items()}
    best = min((k for k in ("trl_default", "trl_no_gc") if k in med), key=med.get, default=None)
    against = dict(ratio_vs_trl="trl_default", ratio_vs_trl_best=best, ratio_vs_floor="floor",
                   overhead_ours_vs_single="single")
    ratios = lambda x: {k: med[x] / med[y] for k, y in against.items() if y in med}  # noqa: E731
    report = dict(**ratios("ours"), trl_best_config=best, targets=GOALS, paired_round_ratios=paired,
                  targets_met={k: v <= GOALS[k] for k, v in ratios("ours").items()},
                  int8=dict(**int8, **ratios("ours_int8")) if int8 else {},
                  fast=dict(step_speedup_paired=pair("ours", "ours_fast"), **ratios("ours_fast"))
                  if "ours_fast" in runs else {},
                  contenders=res, profile=profile, scaling=scaling,
                  setup=dict(policy=POLICY, experts=EXPERTS, task="chain_sum", G=a.group_size, prompts=a.prompts,
                             new_tokens=a.max_new_tokens, forced_length=not a.natural_eos, lora_rank=8, beta=0.04,
                             mu=1, warmup=a.warmup, steps=a.steps, scaling_steps=a.scaling_steps),
                  environment=env, wall_seconds=round(time.time() - t_start))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
        f.write(markdown(report))
    print(markdown(report))


def experts_s(v):
    return sum(x for ph, x in v.get("phases_median", {}).items() if ph.startswith(("experts", "adapter")))


def markdown(r):
    s, env = r["setup"], r["environment"]
    out = [f"One GRPO step, SmolLM2-135M-Instruct + LoRA r8, {s['prompts']} prompt x G={s['G']} x {s['new_tokens']} "
           f"tokens, beta {s['beta']}; {env['cpu']}, {env['cores']} cores, {env['threads_per_worker']} thread(s) per "
           f"process; torch {env['torch']}, transformers {env['transformers']}, TRL {env['trl']}, PEFT {env['peft']}. "
           f"Median of {s['steps']} alternated steps after {s['warmup']} warm-up (`python experiments/bench.py`).", "",
           "| contender | s/step (median) | min – max | of which generation | tokens/s | peak RSS |",
           "|---|---|---|---|---|---|"]
    out += [f"| {k} | {v['median']:.1f} | {v['min']:.1f} – {v['max']:.1f} | "
            f"{v['generation_median']:.1f} | {v['tokens_per_second']:.1f} | "
            f"{v['peak_rss_mb'] / 1024:.1f} GB |" for k, v in r["contenders"].items()]
    out += ["", "| ratio | ours | target | met |", "|---|---|---|---|"]
    out += [f"| {k} | {r[k]:.2f} | ≤ {t} | {'yes' if r['targets_met'][k] else 'no'} |"
            for k, t in r["targets"].items() if k in r]
    if r["int8"]:
        i = r["int8"]
        out += ["", f"`ours_int8` (`--rollout-dtype int8 --tis-cap {TIS_CAP}`, alternated with "
                f"`ours` in one process): step {i['step_speedup_paired']:.2f}x and generation "
                f"{i['generation_speedup_paired']:.2f}x faster than `ours` (median of the paired "
                f"rounds); ours_int8 / TRL defaults {i.get('ratio_vs_trl', float('nan')):.2f}. "
                f"Sampler-policy gap (median over steps): mean |log pi_old - log mu| "
                f"{i['rollout_logp_gap']:.3f} nats per token, TIS weights at the cap "
                f"{100 * i['is_weight_clipped_fraction']:.1f} %, mean weight "
                f"{i['is_weight_mean']:.3f}."]
    if r.get("fast"):
        f = r["fast"]
        out += ["", f"`ours_fast` (`ours_int8` with `--keep-activations`, the same worker): step "
                f"{f['step_speedup_paired']:.2f}x faster than `ours` (paired rounds); ours_fast / TRL defaults "
                f"{f.get('ratio_vs_trl', float('nan')):.2f}."]
    out += ["", *(f"Profile of one `{k}` step ({v['seconds']:.1f} s): " + ", ".join(
        f"{ph} {t:.1f} s" for ph, t in v["phases"].items()) for k, v in r["profile"].items())]
    if r["scaling"]:
        cols = [(f"G={g}", v) for g, v in r["scaling"]["vs_group_size"].items()]
        cols += [(f"{k} expert(s), G=8", v) for k, v in r["scaling"]["vs_num_experts"].items()]
        out += ["", "| ours | " + " | ".join(c for c, _ in cols) + " |", "|---" * (len(cols) + 1) + "|",
                "| s/step (median) | " + " | ".join(f"{v['median']:.1f}" for _, v in cols) + " |",
                "| of which experts + adapter | " + " | ".join(f"{experts_s(v):.2f}" for _, v in cols) + " |"]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.path.insert(0, ROOT)  # the project's modules, imported by the workers (this file is the worker's script too)
    if sys.argv[1:2] == ["--speedrun"]:  # time-to-score rather than time-per-step: its own file
        import speedrun
        speedrun.main()
    else:
        main()
