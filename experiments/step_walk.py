"""
Which files a reader opens to follow one optimiser step: the calls train.grpo_step makes, in source order, with the
helpers inside train.py followed where they are called (each once) and every other call counted as one visit to
the file that defines it. `g(...)` / `run.method(...)`, the context builder, counts as a visit to baselines.py
(g is --method's builder there). It reads the code (ast); nothing runs.

    python experiments/step_walk.py            # this checkout
    python experiments/step_walk.py --root DIR # another checkout, e.g. an older commit's
    python experiments/step_walk.py --paper    # the paper's path: lines marked `# lever:` skipped, torchrun's
                                               # calls (lib/distributed.py, no-ops on one process) too

Prints the files in the order a reader meets them (consecutive calls into the same file are one visit), the
number of distinct files, and the jumps: how often the reader leaves train.py for another file.
"""
import argparse
import ast
import os


def module_file(root, dotted):
    path = dotted.replace(".", "/")
    for candidate in (path + ".py", path + "/__init__.py"):
        if os.path.exists(os.path.join(root, candidate)):
            return candidate
    return None


def walk(root, paper=False):
    source = open(os.path.join(root, "train.py")).read()
    lines = source.splitlines()
    tree = ast.parse(source)
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    names = {}  # a name train.py imports -> the file it comes from
    for n in tree.body:
        if isinstance(n, ast.Import):
            for a in n.names:
                names[a.asname or a.name] = module_file(root, a.name)
        elif isinstance(n, ast.ImportFrom) and n.module:
            for a in n.names:  # `from lib import distributed` is a module; `from grpo import x` a name
                names[a.asname or a.name] = (module_file(root, f"{n.module}.{a.name}")
                                             or module_file(root, n.module))
    route, seen = [], set()

    def visit(fn):
        seen.add(fn)
        calls = sorted((c for c in ast.walk(funcs[fn]) if isinstance(c, ast.Call)),
                       key=lambda c: (c.lineno, c.col_offset))
        levers = [range(n.lineno, n.end_lineno + 1) for n in ast.walk(funcs[fn])  # `if ...:  # lever:` blocks
                  if isinstance(n, ast.If) and "# lever:" in lines[n.lineno - 1]]
        for call in calls:
            f = call.func
            if paper and ("# lever:" in lines[call.lineno - 1] or any(call.lineno in r for r in levers)):
                continue
            if isinstance(f, ast.Name) and f.id in funcs:
                if f.id not in seen:
                    visit(f.id)
            elif isinstance(f, ast.Name) and f.id == "g":
                route.append("baselines.py")
            elif isinstance(f, ast.Name) and names.get(f.id):
                route.append(names[f.id])
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and names.get(f.value.id):
                route.append(names[f.value.id])
            elif (isinstance(f, ast.Attribute) and f.attr == "method" and isinstance(f.value, ast.Name)
                  and f.value.id == "run") or (isinstance(f, ast.Subscript) and "method" in ast.unparse(f)):
                route.append("baselines.py")
    visit("grpo_step")
    if paper:
        route = [f for f in route if f != module_file(root, "lib.distributed")
                 and f != module_file(root, "support.distributed")]
    route = [f for f in route if f]
    visits = [f for i, f in enumerate(route) if i == 0 or route[i - 1] != f]
    return visits


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--paper", action="store_true", help="skip `# lever:` lines and torchrun's calls")
    a = p.parse_args(argv)
    visits = walk(a.root, a.paper)
    print("train.py -> " + " -> ".join(visits))
    print(f"{len(set(visits))} files besides train.py: {', '.join(sorted(set(visits)))}")
    print(f"{len(visits)} jumps out of train.py")
    return visits


if __name__ == "__main__":
    main()
