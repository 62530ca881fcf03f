"""
Data parallelism for train.py: N processes started by torchrun share the micro-batches of every optimiser step.

    torchrun --standalone --nproc_per_node 2 train.py --task chain_sum --team tiny --device cpu --steps 3 \
        --batch-size 2 --grad-accum 2 --group-size 4 --max-new-tokens 16 --out runs/two-processes

Nothing here is in the paper; it is how its 32 prompts x G = 8 per step spread over the GPUs of one node. Every
process (rank) holds the whole run (policy, experts, g_phi, optimiser) on its own device, and:

  split     the micro-batches of each step: rank r of N takes a contiguous block of them (my_micro_batches), so
            the global batch (batch-size x grad-accum prompts, G completions each) and the maths do not change
  summed    the gradients of LoRA and g_phi: one all-reduce per optimiser pass (all_reduce_grads); every rank
            then takes the same AdamW step, so the weights stay the same on every rank without being sent
  gathered  every rank's rollouts and losses, in micro-batch order (gather): the step's metrics are computed
            from all of them, exactly as on one process, and only rank 0 writes anything (config, metrics,
            samples, checkpoints, the PEFT export)
  seeded    the random draws of a micro-batch (sampling, Gumbel routing noise, random pooling) come from a seed of
            (seed, step, micro-batch) (seed_micro_batch), so a micro-batch draws the same completions on
            whichever rank runs it: a run gives the same numbers with 1 or N processes, up to float rounding
  not split evaluation (evaluate.py runs on one process), the experts' forwards within a micro-batch, the model

Why an explicit all-reduce and not DistributedDataParallel (DDP), PyTorch's usual wrapper:
  1. DDP wraps one module and hooks its forward; here the trainable tensors sit in two places (LoRA inside the
     frozen policy, g_phi in the method), and the policy is called by rollout.py's functions, not by a wrapper.
  2. DDP all-reduces at every backward; with gradient accumulation it needs no_sync() on all but the last
     micro-batch of each rank, and it must be told about parameters a step leaves unused (hard routing's
     unchosen experts). Here: one flat buffer, one all-reduce, after the last backward.
  3. What DDP buys, overlapping communication with the backward pass in buckets, is worth nothing at this
     size: the trainable tensors are a few million floats (LoRA r = 8 on Qwen2.5-3B: 15M; g_phi: 2-6M), sent
     once per step of tens of seconds.
The sum of the gradients is the one-process sum in another order, so rounding differs (~1e-7 relative);
tests/test_distributed.py runs 1 and 2 processes and bounds the difference.

Failure: a rank that dies ends the job. torchrun stops the other ranks (SIGTERM), and a collective with a dead
peer fails; either way each surviving rank prints one line `error: ...` and exits with code 3. Only rank 0 writes,
and it writes as on one process (checkpoints atomically), so --resume continues the job, with any number of
processes: N does not change the maths.

Try it on CPU:  python -m pytest tests/test_distributed.py -q
"""
import dataclasses
import os
import signal
import sys
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class World:
    rank: int = 0        # this process, 0..size-1 (rank 0 writes)
    size: int = 1        # processes in the job (torchrun --nproc_per_node x nodes)
    local_rank: int = 0  # this process on its node: its GPU


ONE = World()  # a plain `python train.py`: one process, every function below does nothing


def world_from_env():
    """The World torchrun describes in RANK / WORLD_SIZE / LOCAL_RANK; ONE without torchrun. Needs no
    initialisation, so bad input can be refused before any process waits for another."""
    if "WORLD_SIZE" not in os.environ:
        return ONE
    return World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))


def rank_device(device, world):
    """The policy's device for this rank: on CUDA each rank takes the GPU of its local rank. Raises ValueError
    (naming the flag) when a fixed GPU is asked of several processes."""
    if world.size == 1 or device.type != "cuda":
        return device
    if device.index is not None:
        raise ValueError(f"--device {device}: under torchrun each process takes its own GPU (cuda:LOCAL_RANK); "
                         "pass --device cuda or auto")
    return torch.device("cuda", world.local_rank)


def init(world, device):
    """Join the other processes (it waits for all of them: the rendezvous) with NCCL on CUDA, gloo on CPU, and
    turn torchrun's SIGTERM (sent when another rank failed) into a one-line error."""
    if world.size == 1:
        return
    import torch.distributed as dist
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=world.rank, world_size=world.size)
    signal.signal(signal.SIGTERM, lambda *_: _died(world, "stopped by torchrun (SIGTERM): another process of "
                                                          "the job failed or the job was cancelled"))


def finish(world):
    if world.size > 1:
        import torch.distributed as dist
        dist.destroy_process_group()


def barrier(world):
    """Wait until every rank gets here (before stopping together: torchrun ends the job when one rank exits
    with an error, so the others must not exit while rank 0 still writes)."""
    if world.size > 1:
        import torch.distributed as dist
        _collective(world, dist.barrier)


def stop_together(world, msg, code):
    """Every rank leaves with `code` once all of them get here; rank 0 says why in one line. torchrun ends the job
    as soon as one rank exits with an error, by SIGTERM to the others; a rank caught by it while Python shuts
    down dies of the signal (exit code -15), because Python puts back the default handler during shut-down. So
    the signal is made to exit with `code` silently, and every rank leaves by os._exit, with no shut-down to be
    caught in (rank 0's files are closed by then: the checkpoint is renamed into place, the metrics file shut)."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(code))
    barrier(world)
    if world.rank == 0:
        print(f"error: {msg}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _died(world, why):
    """A rank died or the job was stopped: one line, exit code 3. os._exit, because the process group's
    destructors may wait for a peer that is gone; rank 0's files are whole (checkpoints are written to a
    temporary name and renamed), so --resume continues from the last checkpoint."""
    print(f"error: rank {world.rank} of {world.size}: {why}; the job stopped. Continue it with --resume (any "
          "number of processes)", file=sys.stderr, flush=True)
    os._exit(3)


def _collective(world, fn, *args):
    """Run one collective; a dead peer makes gloo / NCCL raise, which becomes the one-line error."""
    try:
        return fn(*args)
    except Exception as e:  # DistBackendError, RuntimeError("Connection closed by peer"), ...
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        _died(world, f"a collective failed, another process probably died ({why})")


# ----------------------------------------------------------------------------------------------------------
# What each rank does in a step


def my_micro_batches(world, grad_accum):
    """The micro-batch indices of this rank: a contiguous block, the first grad_accum % N ranks one more. Blocks
    in rank order are the micro-batches in order, so gathering in rank order restores the one-process order."""
    per, extra = divmod(grad_accum, world.size)
    start = world.rank * per + min(world.rank, extra)
    return range(start, start + per + (world.rank < extra))


def seed_micro_batch(seed, step, micro, pool=None):
    """Seed torch's generator (and the experts' one for random pooling) from (seed, step, micro-batch) before
    a micro-batch's rollout. Its draws then depend on nothing that ran before it, so the same completions are
    drawn whichever rank runs it, and a resumed run draws them again. One process uses it too: one code path."""
    s = int(np.random.SeedSequence([seed, step, micro, 11]).generate_state(1, np.uint64)[0])
    torch.manual_seed(s)  # CPU and every CUDA device
    if pool is not None:
        pool.generator.manual_seed(s)


def all_reduce_grads(world, param_groups):
    """Sum the trainable gradients over the ranks, in place (each rank's loss is already divided by the global
    grad_accum, so the sum is the one-process gradient). One flat buffer, one all-reduce. A tensor no rank
    touched keeps grad None, as on one process (AdamW skips it: no weight decay, no moment update)."""
    if world.size == 1:
        return
    import torch.distributed as dist
    params = [p for g in param_groups for p in g["params"]]
    has = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)     # (P,)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params] + [has])
    _collective(world, dist.all_reduce, flat)                                                     # sum
    sizes = [p.numel() for p in params] + [len(params)]
    *grads, has = flat.split(sizes)
    for p, g, h in zip(params, grads, has.tolist()):
        p.grad = g.view_as(p) if h > 0 else None


def gather(world, items, device=None):
    """Every rank's list `items` (micro-batch results, losses, metrics), concatenated in rank order = micro-
    batch order; tensors travel through the CPU and land on `device`. One process: `items` itself."""
    if world.size == 1:
        return items
    import torch.distributed as dist
    parts = [None] * world.size
    _collective(world, dist.all_gather_object, parts, _to(items, "cpu"))
    return [x for part in parts for x in _to(part, device)] if device is not None else [x for p in parts for x in p]


def _to(obj, device):
    """Tensors inside nested dicts / lists / tuples / dataclasses moved to device."""
    if torch.is_tensor(obj):
        return obj.to(device)
    if dataclasses.is_dataclass(obj):  # train.MicroBatch
        return dataclasses.replace(obj, **{f.name: _to(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj)})
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj
