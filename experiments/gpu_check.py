"""
The device check: one command that says how the paper's setting runs on one CUDA GPU, with no network and only
this repository (the paper's models are built at their real shapes with RANDOM weights, support/shape_models.py).

    python experiments/gpu_check.py --out OUT/gpu_check.json          # on a GPU: ~8 min on an H200, every phase
    python experiments/gpu_check.py --tiny --out /tmp/gpu_check.json  # CPU, tiny models, seconds (the test suite)

Phases, in order; each appends its record to the one JSON file as soon as it ends, so a timeout keeps what
finished, and a phase that fails records its error and the next one runs:
  env           versions, the card, which SDPA backends are enabled                              (0.02 s)
  tiny_parity   the tiny team on CPU vs on the device: log-probs of the same completions, greedy samples, the
                LoRA gradient of one loss, and a 1-step smoke run in bfloat16 whose step-1 KL must be exactly 0
                                                                                                  (20 s)
  padded_rows   the 3B policy's shape (36 layers, bfloat16): a left-padded batch and the same batch with its
                padding behind the first token (rollout.padding_behind_first_token), under each SDPA backend
                alone: non-finite logits at real tokens, and the largest difference between the two layouts
                                                                                                  (2 s)
  writers       rollout.greedy_texts (output_collab's hints, the conductor's workers) of the tiny Qwen2 on CPU
                and on the device, prompts of different lengths: the same texts in float32        (0.2 s)
  decode        rollout.sample on the 3B shape at 32 and at 256 rows (64 new tokens, no EOS): tokens/s with
                synchronisation, and CUDA kernels launched per decoded token (torch.profiler)     (17 s)
  default_step  train.py --task arithmetic --team default --random-weights for 2 steps (the paper's settings:
                32 prompts x G 8, 128 new tokens): seconds and peak allocated / reserved memory per phase of the
                step (each phase timed with torch.cuda.synchronize), against --plan's figures     (90 s)
  default_step_per_micro  the same for 1 step with --rollout-batch 1: a decode loop per micro-batch, as the
                rollout ran before it sampled the whole step in one loop                           (75 s)
  default_step_cached  1 step on precomputed expert states (--precompute-states, then --expert-cache): the
                experts are never loaded, the peak is the policy's                                 (33 s)
  determinism   fresh processes of the smoke preset under coin rewards (so every step has a gradient), 4 steps:
                two with --deterministic, one with --deterministic stopped after 2 steps and resumed, two
                without the flag; each process's gradient norm and loss per step. ok = the three
                --deterministic processes agree to the bit (without the flag they may not: the attention
                backward adds with atomics on a GPU)                                              (2 min)
The times were measured on an H200 (results/gpu.md holds every run: 210 s for all phases but the last two at
c11c835, plus ~40 s to install the wheels).

A GPU machine of this project has no network: reasoning-gym and its dependencies (numpy included) travel as wheels
(--task arithmetic needs them), built here by experiments/gpu_wheels.sh into .whl/ and installed there with
`python -m pip install --no-index --find-links .whl reasoning-gym==0.1.25`; everything else this check imports
(torch, transformers, tqdm, safetensors, accelerate) is there.
"""
import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import rollout  # noqa: E402
from experts import load_model  # noqa: E402
from lora import apply_lora  # noqa: E402

POLICY_3B = "shape:Qwen/Qwen2.5-3B-Instruct"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Report:
    """The JSON file: {"phases": [record, ...]}, written whole (and atomically) after every phase."""

    def __init__(self, path):
        self.path, self.phases = path, []
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def run(self, name, fn, *args):
        t0 = time.time()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            rec = {"phase": name, "ok": True, **fn(*args)}
        except Exception as e:  # noqa: BLE001  a failed phase is a result: record it, go on
            rec = {"phase": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                   "traceback": traceback.format_exc()[-4000:]}
        rec["seconds"] = round(time.time() - t0, 2)
        self.phases.append(rec)
        with open(self.path + ".tmp", "w") as f:
            json.dump({"phases": self.phases}, f, indent=1, default=str)
        os.replace(self.path + ".tmp", self.path)
        print(f"[gpu_check] {name}: {'ok' if rec['ok'] else 'FAILED ' + rec['error']} ({rec['seconds']} s)",
              flush=True)
        return rec


# ---------------------------------------------------------------------------------------------------------------
# env


def env(device):
    import transformers
    rec = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": str(device), "cuda_available": torch.cuda.is_available()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        rec.update(card=p.name, memory_gib=round(p.total_memory / 2 ** 30, 1), capability=f"{p.major}.{p.minor}",
                   multiprocessors=p.multi_processor_count, cuda=torch.version.cuda,
                   sdpa_enabled={"flash": torch.backends.cuda.flash_sdp_enabled(),
                                 "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                                 "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                                 "math": torch.backends.cuda.math_sdp_enabled()})
    return rec


# ---------------------------------------------------------------------------------------------------------------
# tiny_parity


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


# ---------------------------------------------------------------------------------------------------------------
# decode


def decode(device, spec, rows_list, new_tokens):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tok = load_model(spec, device, dtype)
    apply_lora(model)
    res = {"model": spec, "new_tokens": new_tokens, "dtype": str(dtype)}
    for rows in rows_list:
        B, G = rows // 8, 8
        ids, mask = padded_batch(tok, model.config.vocab_size, device, B=B, T=200)
        ids, mask = rollout.padding_behind_first_token(ids, mask)
        rollout.sample(model, ids, mask, None, G, 4, 1.0, [-1], tok.pad_token_id)  # warm-up
        sync(device)
        t0 = time.perf_counter()
        comp = rollout.sample(model, ids, mask, None, G, new_tokens, 1.0, [-1], tok.pad_token_id)  # no EOS: all T
        sync(device)
        s = time.perf_counter() - t0
        res[f"rows_{rows}"] = {"seconds": round(s, 3), "tokens": int(comp.numel()),
                               "tokens_per_s": round(comp.numel() / s, 1),
                               "ms_per_decode_step": round(1000 * s / comp.shape[1], 2)}
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile
        ids, mask = padded_batch(tok, model.config.vocab_size, device, B=4, T=200)
        n = 8
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            rollout.sample(model, ids, mask, None, 8, n, 1.0, [-1], tok.pad_token_id)
            sync(device)
        kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        res["cuda_kernels_per_token"] = round(kernels / n, 1)  # the prefill's included, spread over n tokens
    del model
    _free(device)
    return res


# ---------------------------------------------------------------------------------------------------------------
# default_step


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


def default_step_cached(device, argv):
    """default_step on precomputed expert states (--precompute-states, then --expert-cache): the experts are
    never loaded, so the peak is the policy's alone."""
    import train
    t0 = time.perf_counter()
    train.main(argv + ["--precompute-states"])
    precompute = round(time.perf_counter() - t0, 2)
    _free(device)
    return {"precompute_seconds": precompute, **default_step(device, argv)}


def default_step(device, argv):
    import train
    from support import plan
    from support.config import parse_args
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
                                                          "skipped_update", "grad_norm", "rollout_logp_gap")}})
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
    res = {"argv": argv, "steps": steps, "plan": planned, "plan_info": {k: info[k] for k in (
        "prompt_tokens", "context_tokens", "dtype", "params")}}
    if device.type == "cuda":
        peak = max(run.get("peak_bytes", 0), torch.cuda.max_memory_allocated(device))
        res["peak_allocated_gib"] = round(peak / 2 ** 30, 2)
        reserved = max(run.get("reserved_bytes", 0), torch.cuda.max_memory_reserved(device))
        res["peak_reserved_gib"] = round(reserved / 2 ** 30, 2)
    _free(device)
    return res


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="gpu_check.json", help="the JSON file (rewritten after every phase)")
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny models, a few seconds: what the test suite runs")
    ap.add_argument("--phases", default="env,tiny_parity,padded_rows,writers,decode,default_step,"
                    "default_step_per_micro,default_step_cached,determinism",
                    help="comma-separated phases to run, in order")
    ap.add_argument("--steps", type=int, default=2, help="default_step: optimiser steps to run")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if not args.tiny and device.type != "cuda":
        print("error: no CUDA device here; run with --tiny for the CPU check", file=sys.stderr)
        return 2
    spec = "tiny:llama" if args.tiny else POLICY_3B
    run_dir = tempfile.mkdtemp(prefix="gpu_check_run_")
    if args.tiny:
        base = ["--preset", "smoke", "--eval-items", "0", "--device", "cpu"]
    else:
        base = ["--task", "arithmetic", "--team", "default", "--random-weights", "--eval-items", "0",
                "--save-every", "1000", "--device", "cuda"]
    out = lambda name: ["--out", os.path.join(run_dir, name)]  # noqa: E731
    phases = {"env": (env, device), "tiny_parity": (tiny_parity, device),
              "padded_rows": (padded_rows, device, spec), "writers": (writers, device),
              "decode": (decode, device, spec, (32, 256) if not args.tiny else (8, 16), 64 if not args.tiny else 8),
              "default_step": (default_step, device, base + ["--steps", str(args.steps)] + out("run")),
              "default_step_per_micro": (default_step, device,
                                         base + ["--steps", "1", "--rollout-batch", "1"] + out("per_micro")),
              "default_step_cached": (default_step_cached, device, base + [
                  "--steps", "1", "--expert-cache", os.path.join(run_dir, "states")] + out("cached")),
              "determinism": (determinism, device, ["--preset", "smoke", "--eval-items", "0", "--device",
                                                    device.type], run_dir)}
    report = Report(args.out)
    for name in args.phases.split(","):
        fn, *fn_args = phases[name]
        report.run(name, fn, *fn_args)
    failed = [r["phase"] for r in report.phases if not r["ok"]]
    print(f"[gpu_check] wrote {args.out}; failed phases: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
