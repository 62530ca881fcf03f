"""
The frozen experts' pooled states on disk (train.py --expert-cache DIR): one small file per (expert, how it is
read, prompt), so that runs and evaluations naming the same folder compute each state once, and a run on states
precomputed by train.py --precompute-states never loads its experts (experts.ExpertPool reads and writes here;
support/plan.py asks here what a run will not load).
"""
import hashlib
import os

import torch


def store_identity(name, device, dtype, pooling, depth, max_length):
    """What files an expert's states in --expert-cache: a state computed on another device or in another dtype,
    pooled otherwise, at another depth or truncation is another state. support/plan.py asks with the run's
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
        expert needs to build g_phi."""
        path = self.path("\0width")[:-3] + ".width"
        return int(open(path).read()) if os.path.exists(path) else None

    def set_dim(self, d):
        if self.dim() != d:
            path = self.path("\0width")[:-3] + ".width"
            os.makedirs(self.folder, exist_ok=True)
            with open(path + f".{os.getpid()}.tmp", "w") as f:
                f.write(str(d))
            os.replace(path + f".{os.getpid()}.tmp", path)

    def read(self, texts):
        """{text: state} for the texts already on disk."""
        return {t: torch.load(self.path(t), weights_only=True) for t in texts if os.path.exists(self.path(t))}

    def write(self, states):
        os.makedirs(self.folder, exist_ok=True)
        for text, h in states.items():
            path = self.path(text)
            torch.save(h.cpu().clone(), path + f".{os.getpid()}.tmp")  # clone: not the batch's storage
            os.replace(path + f".{os.getpid()}.tmp", path)

