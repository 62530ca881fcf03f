"""
Checkpoints and resume for train.py: a killed run continues to the very numbers of a run never killed.

Nothing here is in the paper; it is what makes a 500-step run on a shared GPU safe to stop. What a checkpoint
holds: the step, LoRA's tensors, g_phi's state, the optimiser's state and every random generator (torch, numpy,
python, CUDA, the experts' draws for random pooling). Together with the data order, which is a pure function of
(seed, step) (rewards.batch_indices), that is all a step depends on.

A checkpoint holds tensors, numbers, strings, lists, tuples and dicts only (numpy's generator state is stored as
a tensor and numbers), and every file is read with torch.load(weights_only=True), which builds nothing else: a
run folder someone shared cannot run code when it is loaded. A checkpoint written before that (numpy arrays
pickled) is refused in one line that names the command converting it, for a file one trusts:
`python -m support.harness.checkpoint PATH`.

  save_checkpoint    one file, written to a temporary name and renamed: it is the old one or the new one
  check_checkpoint   before any model loads: readable, a format this code reads, LoRA's rank and g's latents
  load_checkpoint    refuses a file that does not fit the run, in one line that says why
  read_checkpoint    torch.load(weights_only=True), a refusal in one line (evaluate.py reads runs with it)
  check_resume       --resume refuses flags that would change the maths of the run it continues
  read_log           a JSONL log's records; a line that is not JSON is an error (a torn last line is not)
  keep_metrics_upto  drops the log lines written after the checkpoint

Every file here is written by lib/files.py's `whole_write` (exclusive temporary file, renamed; nothing left
behind when the disk is full), never through a link. A checkpoint records its format (CHECKPOINT_FORMAT): a newer
one is refused before any model loads, as is one whose LoRA rank or latent queries do not fit the run.

Try it on CPU:  python -m pytest tests/test_hardening.py -q -k resume
"""
import errno
import json
import os
import random
import sys

import numpy as np
import torch

from lora import load_lora_state_dict, lora_state_dict
from lib.files import UnsafePath, refuse_link, whole_write

# Flags a resumed run may change: none of them changes the maths of a step. (Neither does the number of torchrun
# processes: a run may resume with another.) Not --expert-cache: a state read from a cache is the one computed in
# the batch that first filled it (--precompute-states: 64 prompts a batch), and a state computed in another batch,
# with other padding, differs in its last bits; adding a precomputed cache on --resume moved the weights by 1.5e-8
# and kl in its 8th digit on the tiny team. So a run resumes with the cache it ran with (or none, if none).
RESUME_MAY_CHANGE = {"steps", "keep_activations", "device", "expert_device", "plan", "out",
                     "resume", "save_every", "sample_every", "preset", "max_bad_steps", "config",
                     "track"}


# 1: a checkpoint written before the format was recorded; 2: the same keys, and "format". A newer one is refused.
CHECKPOINT_FORMAT = 2
MAX_CONFIG_BYTES = 1 << 20  # a config.json holds flag values: a few kB


def save_checkpoint(path, step, policy, method, optimizer, pool):
    """One file: the old checkpoint or the new one, whole (a kill while writing leaves the old one and a stray
    temporary file, which the next start removes)."""
    whole_write(path, {"format": CHECKPOINT_FORMAT, "step": step, "lora": lora_state_dict(policy),
                       "method": method.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng_state(pool)})


def rng_state(pool):
    """Every random generator's state as tensors, numbers, strings and lists (what weights_only loads)."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"name": name, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
            "python": [version, list(internal), gauss_next],
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "experts": pool.generator.get_state() if pool is not None else None}


def set_rng_state(rng, pool):
    n = rng["numpy"]
    np.random.set_state((n["name"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    version, internal, gauss_next = rng["python"]
    random.setstate((version, tuple(internal), gauss_next))
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if pool is not None and rng["experts"] is not None:
        pool.generator.set_state(rng["experts"])


def read_checkpoint(path, flag, mmap=False):
    """torch.load(path, weights_only=True). ValueError (one line, naming `flag`) for a file that is not a
    checkpoint, or one that holds other Python objects (an older checkpoint, or a crafted file), which are not
    built: unpickling them could run code. mmap: the tensors stay on disk until read (a check reads shapes)."""
    try:
        refuse_link(path)
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "a folder, not a file")
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except UnsafePath as e:
        raise ValueError(f"{flag}: {e}") from None
    except Exception as e:
        if "Weights only load failed" in str(e) and "Unsupported global" in str(e):
            raise ValueError(f"{flag}: {path} holds Python objects other than tensors, numbers, strings, lists "
                             "and dicts (a checkpoint from before they were refused, or a crafted file); they are "
                             "not loaded, as they could run code. If you trust the file, convert it: python -m "
                             f"support.harness.checkpoint {path}") from None
        why = (str(e).splitlines() or [""])[0][:160]
        raise ValueError(f"{flag}: checkpoint {path} is unreadable ({type(e).__name__}: {why})") from None


def check_checkpoint(path, args):
    """--resume's checkpoint, before any model loads (minutes and gigabytes on the paper's team): readable, a
    format this code reads, the keys save_checkpoint writes, LoRA's tensors of rank --lora-rank and g's latent
    queries of --num-latents x --latent-dim, every trainable tensor finite. Returns the error message (naming
    --resume) or None. load_checkpoint still checks every tensor against the built models."""
    try:
        state = read_checkpoint(path, "--resume", mmap=True)
    except ValueError as e:
        return str(e)
    bad = f"--resume: checkpoint {path}"
    if not isinstance(state, dict):
        return f"{bad} is not a checkpoint (a {type(state).__name__}, not a dict)"
    version = state.get("format", 1)
    if not isinstance(version, int) or version > CHECKPOINT_FORMAT:
        return (f"{bad} has format {version!r}, newer than this code reads ({CHECKPOINT_FORMAT}): update the code, "
                "or start a new run in another --out")
    kinds = {"step": int, "lora": dict, "method": dict, "optimizer": dict, "rng": dict}
    wrong = [k for k, kind in kinds.items() if not isinstance(state.get(k), kind) or isinstance(state.get(k), bool)]
    if wrong:
        return f"{bad} is not a checkpoint of train.py: {wrong[0]!r} is missing or not of type {kinds[wrong[0]].__name__}"
    if not 0 <= state["step"] <= 10**9:
        return f"{bad} holds step {state['step']}"
    tensors = {**state["lora"], **state["method"]}
    if not all(torch.is_tensor(v) for v in tensors.values()):
        return f"{bad} holds LoRA or g_phi values that are not tensors"
    for k, v in state["lora"].items():
        rank = v.shape[0] if k.endswith("lora_A") else v.shape[-1] if k.endswith("lora_B") else None
        if v.dim() != 2 or rank != args.lora_rank:
            return (f"{bad}: LoRA tensor {k} has shape {tuple(v.shape)}, not rank --lora-rank {args.lora_rank} "
                    "(a checkpoint of another run?)")
    want = (getattr(args, "num_latents", None), getattr(args, "latent_dim", None))
    for k, v in state["method"].items():
        if k.endswith("latents") and tuple(v.shape) != want:
            return (f"{bad}: {k} has shape {tuple(v.shape)}, not --num-latents x --latent-dim {want} (a checkpoint "
                    "of another run?)")
    non_finite = [k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if non_finite:  # it would train nothing: every step would be skipped
        return f"{bad} holds non-finite weights in {non_finite[0]} and {len(non_finite) - 1} other tensors"
    return None


def load_checkpoint(path, policy, method, optimizer, pool):
    """Load everything save_checkpoint wrote; returns the step. ValueError (one line) if it does not fit."""
    state = read_checkpoint(path, "--resume")
    try:
        bad = [k for k, v in {**state["lora"], **state["method"]}.items()
               if torch.is_tensor(v) and v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:  # it would train nothing: every step would be skipped
            raise ValueError(f"non-finite weights in {bad[0]} and {len(bad) - 1} other tensors")
        load_lora_state_dict(policy, state["lora"])
        method.load_state_dict(state["method"])
        optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"], pool)
        return int(state["step"])
    except Exception as e:  # other model, other method: refuse, say which
        why = (str(e).splitlines() or [""])[0][:160]
        raise ValueError(f"--resume: checkpoint {path} does not fit this run "
                         f"({type(e).__name__}: {why})") from None


def checkpoint_step(path):
    """The step a checkpoint holds, or None when there is none (or it cannot be read)."""
    try:
        refuse_link(path)
        return int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"])
    except Exception:
        return None


def check_resume(args, config_path, default=lambda flag: None):
    """--resume continues the run saved in --out. Returns an error message (naming the flag) or None: a flag
    outside RESUME_MAY_CHANGE that differs from the saved run would make it another run. A flag the saved
    config lacks is newer than the run, which ran as that flag's `default` (the parser's) behaves."""
    if not os.path.exists(config_path):
        return f"--resume: no run to resume in --out {args.out} (no config.json)"
    try:
        refuse_link(config_path)
        if os.path.getsize(config_path) > MAX_CONFIG_BYTES:
            return f"--resume: {config_path} is larger than {MAX_CONFIG_BYTES} bytes: not a config.json of train.py"
        with open(config_path) as f:
            saved = json.load(f)
    except ValueError as e:
        return f"--resume: {e}" if "symbolic link" in str(e) or "plain file" in str(e) else \
            f"--resume: cannot read {config_path} ({type(e).__name__})"
    except (OSError, RecursionError) as e:
        return f"--resume: cannot read {config_path} ({type(e).__name__})"
    if not isinstance(saved, dict):
        return f"--resume: {config_path} is not a JSON object of flag values"
    for k, v in vars(args).items():
        was = saved[k] if k in saved else default(k)
        if k not in RESUME_MAY_CHANGE and was != v:
            return (f"--resume: --{k.replace('_', '-')} {v!r} differs from the run's {was!r} "
                    f"({config_path}); resume with the run's flags or choose another --out")
    return None


def read_log(path, flag="--resume"):
    """The records of a JSONL log (metrics.jsonl, samples.jsonl), [] when there is none. A last line without its
    newline is the torn write of a killed run and is left out; any other line that is not a JSON record with a
    step raises ValueError naming it (and `flag`, what read it): --resume drops nothing quietly, and
    evaluate.py --summarize reads logs the same way."""
    if not os.path.lexists(path):
        return []
    refuse_link(path)
    with open(path) as f:
        lines = f.readlines()
    records = []
    for n, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            ok = isinstance(record, dict) and isinstance(record.get("step"), int)
        except ValueError:
            ok = False
        if not ok:
            if n == len(lines) and not line.endswith("\n"):
                break
            raise ValueError(f"{flag}: line {n} of {path} is not a JSON record with a step: {line.strip()[:40]!r}; "
                             f"repair or delete that line{', then resume again' if flag == '--resume' else ''}")
        records.append((record, line if line.endswith("\n") else line + "\n"))
    return records


def keep_metrics_upto(path, step):
    """On resume: keep the log lines up to the checkpoint's step, atomically (read_log's checks first). Returns
    how many lines went (the torn last one included): their steps run again."""
    if not os.path.exists(path):
        return 0
    records = read_log(path)
    with open(path) as f:
        total = sum(1 for _ in f)
    kept = [line for record, line in records if record["step"] <= step]
    whole_write(path, "".join(kept))
    return total - len(kept)


def upgrade_checkpoint(path):
    """Rewrite an older checkpoint (numpy's generator state pickled as an array) in the form read_checkpoint
    loads. It unpickles the file with weights_only=False, which can run code: only for a file one trusts."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    numpy_state, python_state = state["rng"]["numpy"], state["rng"]["python"]
    if not isinstance(numpy_state, dict):
        name, key, pos, has_gauss, gauss = numpy_state
        state["rng"]["numpy"] = {"name": name, "key": torch.from_numpy(np.asarray(key).astype(np.int64)),
                                 "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}
    state["rng"]["python"] = [python_state[0], list(python_state[1]), python_state[2]]
    whole_write(path, state)
    read_checkpoint(path, "the converted file")  # it now loads with weights_only=True


if __name__ == "__main__":  # python -m support.harness.checkpoint PATH: convert an older checkpoint one trusts
    if len(sys.argv) != 2:
        sys.exit("usage: python -m support.harness.checkpoint PATH/checkpoint.pt  (a file you trust: it is unpickled)")
    upgrade_checkpoint(sys.argv[1])
    print(f"converted {sys.argv[1]}: it loads with weights_only=True")
