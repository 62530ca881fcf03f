"""
The process's settings a run makes before its work: glibc hands freed memory back to the system, and
before any CUDA work (CUDA reads each once, when it starts) the caching allocator's expandable segments
and --deterministic's kernels. Not in the paper; no number changes except through --deterministic's
kernels on a GPU.

Try it on CPU:  python -m pytest tests/test_memory.py -q -k expandable
"""
import ctypes
import os

import torch


def hand_back_freed_memory():
    """Ask glibc's allocator to give every block of 1 MiB or more a mapping of its own, so that a
    freed tensor's memory goes back to the system at once. By default glibc raises that threshold
    as large blocks are freed (up to 32 MiB) and keeps freed blocks for reuse, and a run's RSS
    keeps what its largest moment needed: the first command's validation before training peaked
    at 3.70 GiB, with this setting at 3.08 GiB, the same 100 scores in the same time
    (results/performance.md). It changes no number. Nothing happens where the C library is not
    glibc (macOS, Windows)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_MMAP_THRESHOLD = -3  # glibc's malloc.h
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)


def deterministic_kernels():
    """--deterministic: CUDA's kernels in their deterministic versions (cuBLAS with a fixed
    workspace, cuDNN without autotuning, torch's deterministic algorithms), so that on a GPU
    --resume and N processes reach the numbers of one uninterrupted process, as they do on a CPU
    without this flag. Strict mode on purpose: with warn_only=True the flash and memory-efficient
    attention backward kernels keep their faster atomic-add algorithm and only warn (measured on an
    H200: the same 4-step run reached two different step-2 gradient norms across processes, with
    the flag in that mode and without it). A kernel with no deterministic version stops the run
    with PyTorch's error naming it."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True)


def expandable_segments(args):
    """On CUDA, PyTorch's caching allocator with expandable segments: a segment grows by mapping more
    memory instead of each new size taking a new block, so freed blocks are reused across the step's
    phases of different shapes (the rollout's cache, the loss pass's activations) rather than kept
    reserved beside them (an H200 run reserved 138.9 GiB for a 62.7 GiB allocated peak). Allocation only:
    the numbers are the same. Set where the run's device is CUDA and the user set neither
    PYTORCH_ALLOC_CONF nor PYTORCH_CUDA_ALLOC_CONF; it must come before CUDA's allocator starts, which
    reads it once."""
    cuda = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not ({"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"} & set(os.environ)):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # the name every torch 2.x reads
