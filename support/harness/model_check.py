"""
What a model flag (--policy, --experts, --team's models, a run's recorded team) may name, checked before
anything loads, so that a bad flag fails in a second with one line naming it: a `shape:`, `tiny:` or `pocket:`
name that exists (and, for pocket, is installed), a local folder with a config.json or a .gguf file, or, with
the hub off, a hub id already in its cache. experts.load_model is what then loads it.

Try it on CPU:  python -m pytest tests/test_model_check.py -q
"""
import os

from experts import ORACLE


def hub_offline():
    """HF_HUB_OFFLINE is set (tests and CI set it): no request leaves the machine, only cached
    hub models load."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def hub_reachable(timeout=3.0):
    """Whether the model hub (HF_ENDPOINT, else huggingface.co) answers a TCP connection within
    `timeout` seconds. Without a network huggingface_hub retries each file for ~half a minute (26 s
    and 11 lines of retries were seen before one clear error), so a run that needs the hub asks
    once, here, and fails in seconds."""
    import socket
    from urllib.parse import urlsplit
    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout).close()
        return True
    except OSError:
        return False


def check_models(specs):
    """specs: [(model, flag that chose it)]. Raise ValueError naming the flag for a local path
    that does not exist, or a hub id that is not in the cache while the hub is off or cannot be
    reached: a bad flag fails in seconds, before anything loads (huggingface_hub would retry an
    unreachable hub for half a minute per file)."""
    for spec, flag in specs:
        spec = spec.removeprefix(ORACLE)
        if spec.startswith("shape:"):
            from lib.shape_models import split_name
            try:  # a model without published dimensions
                split_name(spec[6:])
            except ValueError as e:
                raise ValueError(f"{flag}: {e}") from None
            continue
        if spec.startswith("tiny:"):
            from lib.tiny_models import NAMES
            if spec[5:] not in NAMES:
                raise ValueError(f"{flag}: unknown tiny model {spec!r}; choose from "
                                 f"{', '.join('tiny:' + n for n in NAMES)}")
            continue
        if spec.startswith("pocket:"):
            from lib import pocket_models
            if spec[7:] not in pocket_models.POCKET_MODELS:
                raise ValueError(f"{flag}: unknown pocket model {spec!r}; choose from "
                                 f"{', '.join('pocket:' + n for n in pocket_models.POCKET_MODELS)}")
            try:  # not installed: the pip command
                pocket_models.converted_dir(spec[7:])
            except (FileNotFoundError, ValueError) as e:
                raise ValueError(f"{flag}: {e}") from None
            continue
        if os.path.isfile(spec) and not spec.endswith(".gguf"):
            raise ValueError(f"{flag}: {spec!r} is a file, not a model folder or a .gguf file")
        if os.path.isdir(spec) and not os.path.isfile(os.path.join(spec, "config.json")):
            raise ValueError(f"{flag}: folder {spec!r} holds no config.json: it is not a model folder")
        if os.path.exists(spec):
            continue
        if spec.endswith(".gguf") or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
            raise ValueError(f"{flag}: no such file or folder {spec!r}")
        from huggingface_hub import try_to_load_from_cache
        try:
            cached = isinstance(try_to_load_from_cache(spec, "config.json"), str)
        except ValueError:  # not a valid hub id either
            cached = False
        if not cached and hub_offline():
            raise ValueError(f"{flag}: model {spec!r} is not a local path and not in the hub "
                             "cache, and the hub is off (HF_HUB_OFFLINE); pass a local folder "
                             "or .gguf file (--policy, --experts) or use --team pocket")
        if not cached and not hub_reachable():
            raise ValueError(f"{flag}: model {spec!r} is not a local path and not in the hub "
                             "cache, and the hub (HF_ENDPOINT or huggingface.co) cannot be reached "
                             "from this machine; pass a local folder or .gguf file (--policy, "
                             "--experts) or use --team pocket")
