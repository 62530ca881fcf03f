"""
The MLPs' activations computed again in the backward pass instead of kept (rollout.completion_logprobs, the
scoring pass with gradient): the memory of a step's loss pass, not one of its numbers. Not in the paper.

Try it on CPU:  python -m pytest tests/test_adapter.py -q -k recompute
"""
import contextlib

import torch


@contextlib.contextmanager
def mlps_recomputed(model):
    """With gradient on, each block's MLP keeps only its input [tokens, d] for the backward pass
    and runs again there (torch.utils.checkpoint), instead of keeping its four [tokens, d_ff]
    activations (gate, up, act(gate), act(gate) * up). On the pocket policy (d 576, d_ff 1536,
    30 blocks) that is ~24 KB per token and block, ~1.2 GB for a step's ~1,700 tokens: with it
    the README's first run peaked at 4.0 GB in the policy pass and backward, against >= 5.6 GB
    without (results/performance.md). It costs one more forward of the MLPs in the backward
    pass. Exact: non-reentrant checkpointing keeps the autograd graph as it is and only computes
    its saved tensors again, with the same kernels on the same inputs. train.py --keep-activations
    (model.recompute_mlps = False) turns it off where memory is plentiful: ~10 % faster steps on
    the pocket policy, the same metrics bit for bit (results/performance.md)."""
    from torch.utils.checkpoint import checkpoint
    mlps = [m for name, m in model.named_modules() if name.endswith(".mlp")]
    if not torch.is_grad_enabled() or not getattr(model, "recompute_mlps", True):
        mlps = []  # nothing is kept for a backward pass, or the caller keeps the activations
    for m in mlps:
        # an instance attribute, as in lib.low_precision
        m.forward = lambda x, f=m.forward: checkpoint(f, x, use_reentrant=False)
    try:
        yield model
    finally:
        for m in mlps:
            del m.forward
