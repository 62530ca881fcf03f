"""The import graph is a tree of layers, never a circle (function-level imports count): every .py file of the
project is parsed with ast, each `import x` / `from x import y` anywhere in it (top level, inside functions,
under `if __name__ == "__main__"`) becomes an arrow to the project file it names, and the graph must have no
cycle. The leaves import no project file (rollout.py only lora.py, for lora_merged while sampling, grpo.py for
its log-probs, its low-precision copy lib/low_precision.py, lib/recompute.py and the KV cache's
plumbing lib/kv_cache.py, all leaves, and lib/static_decode.py, which imports kv_cache alone), no
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
            # `from lib import stats` names the module lib/stats.py (not the package's
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
    """The reader sees an import inside a function, and `from lib import x` as lib/x.py."""
    edges = graph()
    assert "support/harness/plan.py" in edges["train.py"]            # inside main(), under --plan
    assert "lib/pocket_models.py" in edges["support/harness/plan.py"]  # inside model_config()
    assert "lib/stats.py" in edges["support/harness/report.py"]


def test_the_leaves_import_no_project_file_and_no_core_file_imports_train():
    edges = graph()
    for leaf in ("grpo.py", "lora.py", "adapter.py", "lib/low_precision.py", "lib/kv_cache.py",
                 "lib/recompute.py"):
        assert edges[leaf] == set(), (leaf, edges[leaf])
    # lora_merged: the rollout samples with LoRA folded in; grpo's token_logprobs / head_logprobs: the scoring
    # pass's log-probs; low_precision_linears: --rollout-dtype; mlps_recomputed: the scoring pass's memory;
    # static_decode: the decode engine (the KV-cached loop; on CUDA with fixed shapes, a CUDA graph), on the KV
    # cache's plumbing alone
    assert edges["rollout.py"] == {"lora.py", "grpo.py", "lib/low_precision.py", "lib/kv_cache.py",
                                   "lib/recompute.py", "lib/static_decode.py"}
    assert edges["lib/static_decode.py"] == {"lib/kv_cache.py"}
    lower = [p for p in edges if p in CORE or p.startswith("support/")]
    assert not [p for p in lower if "train.py" in edges[p]], "a core file imports train.py"
    for p in lower:
        outside = [q for q in edges[p] if q.split("/")[0] in ("neighbours", "experiments", "tests")]
        assert not outside, (p, outside)


def test_nothing_but_experiments_and_tests_imports_the_scripts():
    """train.py and evaluate.py are the top of the core: the core and support/ take values, so no file imports a
    script upward except an experiment or a test (they drive runs). A neighbour's script builds its Run around its
    own g with support/harness/build.run_around, as train.py's build_run does, and runs its own copy of train.py's
    loop (before, it imported train.py for run_around)."""
    edges = graph()
    upward = sorted((p, q) for p, qs in edges.items() for q in qs if q in ("train.py", "evaluate.py")
                    and p.split("/")[0] not in ("experiments", "tests"))
    assert not upward, upward


def test_lib_is_below_the_core_and_each_index_lists_every_module():
    """lib/ is what the core leans on: no module there imports a core file or anything of support/ (what runs the
    core), so each reads on its own and no arrow runs back up (before, lib/ sat inside support/ beside harness/,
    and experts.py, rollout.py and rewards.py imported from a folder that also imports them); lib/__init__.py and
    support/__init__.py list every module of their shelf."""
    edges = graph()
    for p, qs in edges.items():
        if p.startswith("lib/"):
            up = [q for q in qs if q in CORE or q.startswith("support/") or "/" not in q]
            assert not up, (p, up)
        if p in CORE - {"train.py", "evaluate.py"}:  # the entry points call support/harness/, run by it
            assert not [q for q in qs if q.startswith("support/")], p  # the core leans on lib/ only
    for index, shelf in (("lib/__init__.py", "lib"), ("support/__init__.py", "support/harness")):
        with open(os.path.join(ROOT, index)) as f:
            part = f.read()
        modules = sorted(n for n in os.listdir(os.path.join(ROOT, shelf)) if n.endswith(".py") and n != "__init__.py")
        listed = [n for n in modules if f"\n  {n} " in part]
        assert listed == modules, (shelf, sorted(set(modules) - set(listed)))
    assert sorted(n for n in os.listdir(os.path.join(ROOT, "support")) if n.endswith(".py")) == ["__init__.py"]


def loops_over_steps(path):
    """The `for step in range(start, args.steps)` loops of a file (ast), as the names of the functions holding them."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                if (isinstance(node, ast.For) and isinstance(node.target, ast.Name) and node.target.id == "step"
                        and ast.unparse(node.iter) == "range(start, args.steps)"):
                    found.append(fn.name)
    return found


def test_the_loop_is_visible_in_train_py_and_each_neighbour_script_has_its_own():
    """The reader finds the loop where the README says: train.py holds `for step in range(start, args.steps)`,
    and each neighbour's script a copy of it over its own step; no file under support/ (nor any other core
    file) holds a loop over the steps that a script hands its step to."""
    assert loops_over_steps("train.py") == ["train"]
    for script in ("neighbours/conductor.py", "neighbours/rlae.py"):
        assert loops_over_steps(script) == ["train_run"], script
    others = [p for p in graph() if (p in CORE and p != "train.py") or p.startswith("support/")]
    assert not [p for p in others if loops_over_steps(p)]


# The parameters a function of the core, support/ or a neighbour may call: models and tokenizers (g is a model too:
# C = g(x) is data through the network, --method picks it by name), the reward function a fork passes to
# train.main, and small plumbing (a collective's operation, a config reader, a sort key, a signal's message).
CALLABLE_PARAMETERS = {"policy", "tok", "embed", "head", "method", "allowed", "score_batch",
                       "fn", "config_of", "default", "kind", "key", "keep", "f", "message", "cleanup"}


def test_no_function_takes_the_algorithm_as_an_argument():
    """No function takes a step, a builder or a loop body as an argument to swap what it does: a function whose
    parameter it calls must call only the kinds above. A `build` or `step_fn` handed to a shared loop fails."""
    called = []
    for path in graph():
        if not (path in CORE or path.startswith(("support/", "neighbours/"))):
            continue
        for fn in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
                called += [(path, fn.name, n.func.id) for n in ast.walk(fn) if isinstance(n, ast.Call)
                           and isinstance(n.func, ast.Name) and n.func.id in params
                           and n.func.id not in CALLABLE_PARAMETERS]
    assert not called, called


def definitions():
    """Each project file's top-level functions and classes (a class by its __init__): name -> (parameters
    without self, how many of them are positional-only), or None where it takes *args."""
    defs = {}
    for path in project_files():
        found = {}
        for node in ast.parse(open(os.path.join(ROOT, path)).read()).body:
            fn = node if isinstance(node, ast.FunctionDef) else next(
                (m for m in node.body if isinstance(m, ast.FunctionDef) and m.name == "__init__"), None) \
                if isinstance(node, ast.ClassDef) else None
            if fn is not None:
                a = fn.args
                names = [x.arg for x in a.posonlyargs + a.args][1 if isinstance(node, ast.ClassDef) else 0:]
                found[node.name] = None if a.vararg else (names + [x.arg for x in a.kwonlyargs])
        defs[path] = found
    return defs


def module_file(name):
    path = os.path.join(*name.split(".")) + ".py"
    return path if os.path.exists(os.path.join(ROOT, path)) else None


def test_a_function_with_more_than_four_parameters_is_called_with_keywords():
    """In the core, support/ and the neighbours, a call to a project function or class that has more than four
    parameters passes at most four of them by position; the rest are named at the call (`completion_ids=comp`),
    so a reader does not count commas. Calls through `*args` are left alone."""
    defs, wrong = definitions(), []
    for path in project_files():
        if not (path in CORE or path.startswith(("support/", "neighbours/"))):
            continue
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        names = {k: (path, k) for k in defs[path]}  # what a bare name or `module.name` calls
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update({a.asname or a.name: module_file(a.name) for a in node.names if module_file(a.name)})
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    whole, home = module_file(f"{node.module}.{a.name}"), module_file(node.module)
                    if whole or (home and a.name in defs[home]):
                        names[a.asname or a.name] = whole or (home, a.name)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or any(isinstance(x, ast.Starred) for x in node.args):
                continue
            f = node.func
            target = names.get(f.id) if isinstance(f, ast.Name) else None
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and isinstance(names.get(f.value.id), str):
                target = (names[f.value.id], f.attr)
            if not isinstance(target, tuple) or defs[target[0]].get(target[1]) is None:
                continue
            if len(defs[target[0]][target[1]]) > 4 and len(node.args) > 4:
                wrong.append(f"{path}:{node.lineno} {target[1]}: {len(node.args)} positional")
    assert not wrong, wrong
