"""
Checkpoints and resume for train.py: a killed run continues to the very numbers of a run never killed.

Nothing here is in the paper; it is what makes a 500-step run on a shared GPU safe to stop. What a checkpoint
holds: the step, LoRA's tensors, g_phi's state, the optimiser's state and every random generator (torch, numpy,
python, CUDA, the experts' draws for random pooling). Together with the data order, which is a pure function of
(seed, step) (rewards.batch_indices), that is all a step depends on.

  save_checkpoint    one file, written to a temporary name and renamed: it is the old one or the new one
  load_checkpoint    refuses a file that does not fit the run, in one line that says why
  check_resume       --resume refuses flags that would change the maths of the run it continues
  keep_metrics_upto  drops the log lines written after the checkpoint
  write_json         a JSON file written the same way (config.json, validation.json, evaluate.py's results)

Try it on CPU:  python -m pytest tests/test_hardening.py -q -k resume
"""
import json
import os
import random
import signal

import numpy as np
import torch

from lora import load_lora_state_dict, lora_state_dict

# Flags a resumed run may change: none of them changes the maths of a step. (Neither does the number of torchrun
# processes: a run may resume with another.)
RESUME_MAY_CHANGE = {"steps", "keep_activations", "device", "expert_device", "expert_cache", "plan", "out",
                     "resume", "save_every", "sample_every", "preset", "max_bad_steps"}


def sigkill_hook(point, step):
    """Inert unless NMUSK_TEST_SIGKILL=POINT:STEP is set (tests/test_hardening.py): die here, as a power cut
    or the OOM killer would, to show that --resume continues exactly."""
    if os.environ.get("NMUSK_TEST_SIGKILL") == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def save_checkpoint(path, step, policy, method, optimizer, pool):
    state = {"step": step, "lora": lora_state_dict(policy), "method": method.state_dict(),
             "optimizer": optimizer.state_dict(),
             "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                     "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                     "experts": pool.generator.get_state() if pool is not None else None}}
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    sigkill_hook("checkpoint", step)  # a kill here leaves the old checkpoint and a stray .tmp file
    os.replace(tmp, path)


def load_checkpoint(path, policy, method, optimizer, pool):
    """Load everything save_checkpoint wrote; returns the step. ValueError (one line) if it does not fit."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
        load_lora_state_dict(policy, state["lora"])
        method.load_state_dict(state["method"])
        optimizer.load_state_dict(state["optimizer"])
        rng, step = state["rng"], int(state["step"])
    except Exception as e:  # corrupt file, other model, other method: refuse, say which
        why = (str(e).splitlines() or [""])[0][:160]
        raise ValueError(f"--resume: checkpoint {path} is unreadable or does not fit this run "
                         f"({type(e).__name__}: {why})") from None
    torch.set_rng_state(rng["torch"]), np.random.set_state(rng["numpy"]), random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if pool is not None and rng["experts"] is not None:
        pool.generator.set_state(rng["experts"])
    return step


def check_resume(args, config_path, default=lambda flag: None):
    """--resume continues the run saved in --out. Returns an error message (naming the flag) or None: a flag
    outside RESUME_MAY_CHANGE that differs from the saved run would make it another run. A flag the saved
    config lacks is newer than the run, which ran as that flag's `default` (the parser's) behaves."""
    if not os.path.exists(config_path):
        return f"--resume: no run to resume in --out {args.out} (no config.json)"
    try:
        with open(config_path) as f:
            saved = json.load(f)
    except (ValueError, OSError) as e:
        return f"--resume: cannot read {config_path} ({type(e).__name__})"
    for k, v in vars(args).items():
        was = saved[k] if k in saved else default(k)
        if k not in RESUME_MAY_CHANGE and was != v:
            return (f"--resume: --{k.replace('_', '-')} {v!r} differs from the run's {was!r} "
                    f"({config_path}); resume with the run's flags or choose another --out")
    return None


def keep_metrics_upto(path, step):
    """On resume: drop log lines after the checkpoint's step (and any torn last line), atomically."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError):
                break
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)

def write_json(path, obj):
    """Atomically: a reader (or a kill) sees the old file or the new one, never half of one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)

