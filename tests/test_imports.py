"""The import graph is a tree of layers, never a circle (function-level imports count): every .py file of the
project is parsed with ast, each `import x` / `from x import y` anywhere in it (top level, inside functions,
under `if __name__ == "__main__"`) becomes an arrow to the project file it names, and the graph must have no
cycle. The leaves import no project file (rollout.py only lora.py, for lora_merged while sampling, grpo.py for
its log-probs, its low-precision copy support/lib/low_precision.py, support/lib/recompute.py and the KV cache's
plumbing support/lib/kv_cache.py, all leaves, and support/lib/static_decode.py, which imports kv_cache alone), no
core file imports train.py, and nothing in the core or support/ imports a neighbour, an experiment or a test."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = {".git", "results", "runs", "__pycache__", ".pytest_cache"}
CORE = {"experts.py", "adapter.py", "lora.py", "grpo.py", "rollout.py", "rewards.py", "train.py",
        "evaluate.py", "baselines.py"}


def project_files():
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIP and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(folder, name), ROOT)


def resolve(name, importer):
    """The project file a dotted module name means, seen from `importer`: from the repository root (its
    modules and packages) or from the importer's own folder (a script's sys.path[0]); None if neither."""
    parts = name.split(".")
    for base in ("", os.path.dirname(importer)):
        for path in (os.path.join(base, *parts) + ".py", os.path.join(base, *parts, "__init__.py")):
            if os.path.exists(os.path.join(ROOT, path)):
                return os.path.normpath(path)
    return None


def imports_of(path):
    """The project files `path` imports, anywhere in the file."""
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from support.lib import stats` names the module support/lib/stats.py (not the package's
            # __init__.py); `from train import main` names train.py
            modules = {resolve(f"{node.module}.{a.name}", path) for a in node.names} - {None}
            names = [node.module] if not modules else []
            found |= modules
        else:
            continue
        found |= {resolve(name, path) for name in names} - {None}
    return found - {path}


def graph():
    return {path: imports_of(path) for path in project_files()}


def find_cycle(edges):
    """One cycle as a list of files [a, b, ..., a], or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour, stack = {n: WHITE for n in edges}, []

    def visit(n):
        colour[n] = GREY
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if colour.get(m, BLACK) == GREY:
                return stack[stack.index(m):] + [m]
            if colour.get(m) == WHITE and (cycle := visit(m)):
                return cycle
        colour[n] = BLACK
        stack.pop()
        return None

    for n in sorted(edges):
        if colour[n] == WHITE and (cycle := visit(n)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    edges = graph()
    assert len(edges) > 40 and "grpo.py" in edges["neighbours/conductor.py"], "the graph was not read"
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_function_level_imports_count():
    """The reader sees an import inside a function, and `from support.lib import x` as support/lib/x.py."""
    edges = graph()
    assert "support/harness/plan.py" in edges["train.py"]            # inside main(), under --plan
    assert "support/lib/pocket_models.py" in edges["support/harness/plan.py"]  # inside model_config()
    assert "support/lib/stats.py" in edges["support/harness/report.py"]


def test_the_leaves_import_no_project_file_and_no_core_file_imports_train():
    edges = graph()
    for leaf in ("grpo.py", "lora.py", "adapter.py", "support/lib/low_precision.py", "support/lib/kv_cache.py",
                 "support/lib/recompute.py"):
        assert edges[leaf] == set(), (leaf, edges[leaf])
    # lora_merged: the rollout samples with LoRA folded in; grpo's token_logprobs / head_logprobs: the scoring
    # pass's log-probs; low_precision_linears: --rollout-dtype; mlps_recomputed: the scoring pass's memory;
    # static_decode: the decode loop with fixed shapes (a CUDA graph), on the KV cache's plumbing alone
    assert edges["rollout.py"] == {"lora.py", "grpo.py", "support/lib/low_precision.py", "support/lib/kv_cache.py",
                                   "support/lib/recompute.py", "support/lib/static_decode.py"}
    assert edges["support/lib/static_decode.py"] == {"support/lib/kv_cache.py"}
    lower = [p for p in edges if p in CORE or p.startswith("support/")]
    assert not [p for p in lower if "train.py" in edges[p]], "a core file imports train.py"
    for p in lower:
        outside = [q for q in edges[p] if q.split("/")[0] in ("neighbours", "experiments", "tests")]
        assert not outside, (p, outside)


def test_nothing_but_experiments_tests_and_neighbours_imports_the_scripts():
    """train.py and evaluate.py are the top of the core: the core and support/ take values, so no file imports a
    script upward except an experiment or a test (they drive runs) and a neighbour's script, which runs train.py's
    run (train.build_run, support/harness/run.run_training) with its own g and step."""
    edges = graph()
    upward = sorted((p, q) for p, qs in edges.items() for q in qs if q in ("train.py", "evaluate.py")
                    and p.split("/")[0] not in ("experiments", "tests")
                    and not (p.startswith("neighbours/") and q == "train.py"))
    assert not upward, upward


def test_support_is_two_shelves_and_its_index_lists_every_module():
    """support/lib/ is what the core leans on: no module there imports a core file or anything of
    support/harness/ (what runs the core), so each reads on its own; support/__init__.py lists every module
    of both shelves, on the shelf it is on."""
    edges = graph()
    for p, qs in edges.items():
        if p.startswith("support/lib/"):
            up = [q for q in qs if q in CORE or q.startswith("support/harness/") or "/" not in q]
            assert not up, (p, up)
    with open(os.path.join(ROOT, "support", "__init__.py")) as f:
        index = f.read()
    lib_part, harness_part = index.split("harness/ (above the core)")
    for shelf, part in (("lib", lib_part), ("harness", harness_part)):
        modules = sorted(n for n in os.listdir(os.path.join(ROOT, "support", shelf))
                         if n.endswith(".py") and n != "__init__.py")
        listed = [n for n in modules if f"\n  {n} " in part]
        assert listed == modules, (shelf, sorted(set(modules) - set(listed)))
    assert sorted(n for n in os.listdir(os.path.join(ROOT, "support")) if n.endswith(".py")) == ["__init__.py"]
