"""
The frozen experts' pooled states on disk (train.py --expert-cache DIR): one small file per (expert, how it is
read, prompt), so that runs and evaluations naming the same folder compute each state once, and a run on states
precomputed by train.py --precompute-states never loads its experts (experts.ExpertPool reads and writes here;
support/harness/plan.py asks here what a run will not load).

A shared cache is untrusted input, as a shared run folder is: a state file that cannot be read as one finite
[d] tensor of the recorded width (truncated, foreign, a link, a crafted pickle: weights_only builds nothing else)
counts as missing and is computed again, its file replaced; a width file that is not a number is refused in one
line before any model loads (cache_problem). Writes are lib/files.whole_write's: exclusive, never through a
link, nothing left behind on a full disk.

Try it on CPU:  python -m pytest tests/test_experts.py -q -k store
"""
import glob
import hashlib
import os
import stat

import torch

from lib.files import whole_write


def store_identity(name, device, dtype, pooling, depth, max_length):
    """What files an expert's states in --expert-cache: a state computed on another device or in another dtype,
    pooled otherwise, at another depth or truncation is another state. support/harness/plan.py asks with the run's
    real device while it builds the models on the meta device."""
    return f"{name}|{device}|{dtype}|{pooling}|{depth}|{max_length}"


def reads_stored_states(store, pooling, heads=False):
    """Whether a run may read this expert's states from `store` and never load the expert: some were
    precomputed, the pooling draws nothing at random, and the run does not generate from it (heads)."""
    return not heads and not pooling.startswith("random") and store.dim() is not None


class StateStore:
    """Pooled states on disk, one small file per text, for one expert read one way (`identity`: its
    name, device, dtype, pooling, depth, length limit). A file is written whole, then renamed into
    place, so two runs sharing the folder never read half a state. A state read back is the very
    tensor that was computed; a state computed again may differ in its last bits (another batch,
    other padding)."""

    def __init__(self, folder, identity):
        self.folder, self.identity = folder, identity  # made on the first write: --plan writes nothing

    def path(self, text):
        key = hashlib.sha256(f"{self.identity}\0{text}".encode()).hexdigest()[:32]
        return os.path.join(self.folder, key + ".pt")

    def dim(self):
        """The states' width, once a state was written (else None): what a run that never loads the
        expert needs to build g_phi. A width file that is not a number counts as none."""
        return read_width(self.path("\0width")[:-3] + ".width")

    def set_dim(self, d):
        if self.dim() != d:
            os.makedirs(self.folder, exist_ok=True)
            whole_write(self.path("\0width")[:-3] + ".width", str(d))

    def read(self, texts):
        """{text: state} for the texts whose state on disk reads back as one finite [d] tensor (d: the recorded
        width); any other file is left out, so its state is computed again and its file replaced."""
        d, states = self.dim(), {}
        for t in texts:
            path = self.path(t)
            try:
                if not stat.S_ISREG(os.lstat(path).st_mode):  # a link or a pipe: never followed
                    continue
                h = torch.load(path, weights_only=True)
            except Exception:  # missing, truncated, foreign, a pickle of other objects
                continue
            if torch.is_tensor(h) and h.dim() == 1 and h.is_floating_point() and (d is None or len(h) == d) \
                    and bool(torch.isfinite(h).all()):
                states[t] = h
        return states

    def write(self, states):
        os.makedirs(self.folder, exist_ok=True)
        for text, h in states.items():
            whole_write(self.path(text), h.cpu().clone())  # clone: not the batch's storage


def read_width(path):
    """The int a width file holds, or None (no file, or not a positive number)."""
    try:
        with open(path) as f:
            text = f.read(32)
        return int(text) if text.strip().isdigit() and int(text) > 0 else None
    except (OSError, ValueError):
        return None


def cache_problem(folder, flag):
    """Before any model loads: one line naming a width file of `folder` that is a link, not a plain file or not
    a positive number (the width g_phi is built with when the expert is never loaded), or None."""
    for path in glob.glob(os.path.join(glob.escape(folder), "*.width")):
        if not stat.S_ISREG(os.lstat(path).st_mode) or read_width(path) is None:
            return (f"{flag} {folder}: {os.path.basename(path)} is not a width (a positive number in a plain "
                    "file); delete it and its expert's states are computed again")
    return None
