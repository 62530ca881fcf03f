"""
Live tracking (--track): each step's record of metrics.jsonl, sent as it is written to TensorBoard, Trackio or
Weights & Biases. metrics.jsonl stays the run's record; a tracker is a live view of it.

    python train.py --preset smoke --eval-items 0 --track tensorboard --out runs/smoke-tb
    tensorboard --logdir runs/smoke-tb/tensorboard

Nothing here is in the paper. Each backend is one small class: made once the run starts writing (rank 0, after
config.json), log(record) after each step's line in metrics.jsonl, close() however the run ends
(support/harness/run.py release_folders). Its library is imported only when --track names it; check_library, called
while the flags are checked, turns a missing one into one line and exit code 2 before any model loads.
A tracker takes scalars only (scalars below): a list such as utilization becomes one scalar per index
(utilization/0, utilization/1, ...), a dict one per key, and what is not a number (utilization_names) or is
null is left out.
"""
import importlib
import os

PROJECT = "n-musketeers"  # the project name Trackio and W&B file the runs under


def check_library(track):
    """The one-line error for a --track whose library is not installed, or None."""
    if track == "none":
        return None
    try:
        importlib.import_module(track)  # "tensorboard", "trackio", "wandb": each library's own name
    except ImportError:
        return f"--track {track}: pip install {track}"
    return None


def open_tracker(args, start):
    """The --track backend of this run (None for --track none). start: the step the run starts from (0, or
    --resume's checkpoint)."""
    return None if args.track == "none" else BACKENDS[args.track](args, start)


def scalars(record, prefix=""):
    """{name: float} of a metrics record: numbers and switches as floats (NaN kept), lists and dicts one scalar
    per entry (name/index, name/key), strings and nulls left out; "step" is the x axis, not a scalar."""
    out = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if name == "step" or value is None or isinstance(value, str):
            continue
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, (list, tuple)):
            out.update(scalars(dict(enumerate(value)), f"{name}/"))
        else:
            out[name] = float(value)  # bool, int, float (True -> 1.0)
    return out


def run_name(args):
    """The run's name in a tracker: its --out folder's name."""
    return os.path.basename(os.path.normpath(args.out))


class TensorBoard:
    """torch.utils.tensorboard's SummaryWriter, into OUT/tensorboard/, flushed after every step (the file is
    live, and a run killed with SIGKILL keeps its steps). On --resume the events of the steps after the
    checkpoint are purged (purge_step), as metrics.jsonl drops their lines: those steps run again."""

    def __init__(self, args, start):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(os.path.join(args.out, "tensorboard"), purge_step=start + 1 if start else None)

    def log(self, record):
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])
        self.writer.flush()

    def close(self):
        self.writer.close()


class Trackio:
    """Trackio (Hugging Face's local-first tracker with W&B's calls): init, log, finish, into a local SQLite
    database ($TRACKIO_DIR). Not a test dependency: tests/test_track.py reads that database back where trackio is
    installed (it passed with 0.43.0) and is skipped elsewhere."""

    def __init__(self, args, start):
        import trackio
        self.trackio = trackio
        trackio.init(project=PROJECT, name=run_name(args), config=vars(args))

    def log(self, record):
        self.trackio.log(scalars(record), step=record["step"])

    def close(self):
        self.trackio.finish()


class WandB:
    """Weights & Biases: wandb.init, run.log, run.finish (an account, or WANDB_MODE=offline and `wandb sync`
    later). Not a test dependency: tests/test_track.py runs it offline where wandb is installed (it passed with
    0.31.0) and is skipped elsewhere. A --resume starts a new W&B run of the same name."""

    def __init__(self, args, start):
        import wandb
        self.run = wandb.init(project=PROJECT, name=run_name(args), config=vars(args))

    def log(self, record):
        self.run.log(scalars(record), step=record["step"])

    def close(self):
        self.run.finish()


BACKENDS = {"tensorboard": TensorBoard, "trackio": Trackio, "wandb": WandB}  # --track's choices beside "none"
