"""Safe scoring: reasoning-gym's scorers applied to untrusted model text, which must never run as code and
never block training.

rewards.score_batch extracts each completion's answer and calls `score_answers`, which returns (reward in
[0, 1], status) per answer; the status is one of STATUSES: "ok", "refused", "error" or "timeout".

Threat model. The answer is written by a policy that RL pushes towards whatever scores 1, so it is hostile input.
Read in the reasoning-gym 0.1.25 source (SCORERS is the survey of every scorer of the three task families):
  a. Code execution: intermediate_integration and polynomial_multiplication hand the answer to
     sympy.parse_expr, which is Python eval; binary_matrix calls eval() itself when the answer is not an exact
     match.
  b. Hangs: sympy evaluates "9**9**9**9" for ever; propositional_logic's parser is quadratic and its truth table
     has 2^atoms rows; complex_arithmetic strips brackets in a quadratic loop; a huge answer or a memory bomb
     can stall the trainer or swap the host.
  c. Reward hacking: complex_arithmetic gives "nan" full marks.
  d. Crashes: a scorer may raise (RecursionError on deep nesting, MemoryError), an entry may be malformed.
How each is handled:
  a. Every scorer kind has a guard (GUARDS), a whitelist of what a real answer looks like: sympy answers hold
     only digits, operators, brackets and maths names (no '_', quotes, '[', '=' or attribute access);
     binary_matrix answers only digits, brackets, commas and spaces. A refused answer is never scored.
  b. Every scorer that is not a plain string comparison runs in a worker process; when one answer takes longer
     than `timeout` (2 s) the worker is killed and restarted (~10 ms: a forkserver with reasoning-gym
     preloaded). Guards cap the length (10,000 characters, 1,000 for formulas), and the worker's address space
     is capped at its start + 1 GiB on Linux, so a memory bomb raises MemoryError instead of swapping.
  c. The complex_arithmetic guard allows no letters ('nan', 'inf'); any NaN reward becomes 0 and every reward
     is clipped to [0, 1].
  d. Any exception scores 0 with status "error"; train.py logs the refused, failed and timed-out scorings of
     every step and goes on.
A dataset nobody surveyed gets a deny-list guard (kind "unknown"), weaker than a whitelist, and the time limit.

Deviations from the paper (which only names the datasets and their scorers):
1. Refused and timed-out answers score 0, and so does "nan" on complex_arithmetic. A refusal can, rarely, zero
   a correct answer written in an unusual form (e.g. "1e3" in a sympy task).

Try it on CPU (about 5 s, no network): a right answer and four hostile ones on three dangerous scorers
    python -m lib.safe_scoring
"""

import math
import multiprocessing as mp
import os
import re
import signal
import sys
import types
from decimal import Decimal

# -----------------------------------------------------------------------------
# Survey: dataset -> (kind, what its score_answer does with the answer text). The kind picks the guard (GUARDS)
# and where the scorer runs: in this process (IN_PROCESS_KINDS) or in the worker.

_DEFAULT = "default: 1.0 on exact match, else len(gold)/len(answer) if the gold is a substring"
SCORERS = {
    "complex_arithmetic": ("complex", "strips outer brackets in an O(n^2) loop, complex(); 'nan' scores 1.0"),
    "intermediate_integration": ("sympy", "sympy.parse_expr = eval (runs code), then diff and simplify"),
    "polynomial_equations": ("number", "float() of each comma-separated part; nan/inf score 0"),
    "polynomial_multiplication": ("sympy", "sympy.parse_expr = eval (runs code), structural =="),
    "bitwise_arithmetic": ("number", "int(text, 0); eval() only of the item's own problem (trusted)"),
    "chain_sum": ("number", "Decimal() without commas, else substring credit"),
    "decimal_arithmetic": ("number", "Decimal() within a tolerance; NaN raises inside its try: 0"),
    "decimal_chain_sum": ("number", "Decimal() equality"),
    "binary_matrix": ("eval", "Python eval() of the text (runs code) when it is not an exact match"),
    "cryptarithm": ("number", "split on ',' and '=', int() of each digit"),
    "jugs": ("json", "json.loads (deep nesting -> RecursionError, caught), then replays the moves"),
    "propositional_logic": ("logic", "own recursive parser (O(n^2); RecursionError not caught), then a "
                                     "truth table over every distinct atom: 2^atoms dicts in one list"),
    "ab": ("string", "exact match"),
    "self_reference": ("string", "exact match"),
    "circuit_logic": ("string", "exact match, or match after strip()"),
    "zebra_puzzles": ("string", "exact match after lower()"),
    "knights_knaves": ("string", "lower/replace/split into (name, role) pairs: linear"),
    **{name: ("string", _DEFAULT) for name in ["simple_geometry", "base_conversion", "binary_alternation", "aiw",
                                               "caesar_cipher", "isomorphic_strings", "rotate_matrix",
                                               "string_manipulation", "syllogism"]},
    "gsm8k": ("gsm8k", "score_gsm8k: a regex and Decimal on at most 64 characters"),
}
STATUSES = ("ok", "refused", "error", "timeout")
IN_PROCESS_KINDS = ("string", "gsm8k")  # verified linear-time string work: scored here, no worker round trip
MAX_ANSWER_CHARS = 10_000  # for the worker kinds; no real answer of these tasks comes near it
MAX_FORMULA_CHARS = 1_000  # sympy and propositional logic: their parsers are quadratic or recursive
_SYMPY_CHARS = frozenset("0123456789+-*/^()., \t\nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_SYMPY_NAMES = frozenset("C E I pi oo sqrt exp log ln sin cos tan cot sec csc asin acos atan acot sinh cosh "
                         "tanh asinh acosh atanh Abs Integral".split())  # all names in 2,000 gold answers and more
_COMPLEX_CHARS = frozenset("0123456789.+-eEiIjJ() \t")  # no letters for 'nan' or 'inf'
_LIST_CHARS = frozenset("0123456789[], \t\n")  # a list of lists of non-negative ints, nothing else
_DENY = re.compile(r"__|\b(?:import|lambda|eval|exec|open|compile|getattr|globals|os|sys|subprocess)\b")


# -----------------------------------------------------------------------------
# Guards: a whitelist per scorer kind

def _guard_sympy(answer, entry):
    """parse_expr is eval: digits, operators, brackets and whitelisted maths names only. No '_', quotes, '[',
    '=', or '.' before a letter (attribute access): no dunders, strings, subscripts, keywords or calls of
    anything but maths functions."""
    meta = entry["metadata"]
    names = _SYMPY_NAMES | set(meta.get("variables", [])) | {meta.get("variable", "x")}
    if len(answer) > MAX_FORMULA_CHARS or not set(answer) <= _SYMPY_CHARS:  # deep nesting: a SyntaxError
        return "not a short formula"
    if re.search(r"\.\s*[A-Za-z]", answer) or not set(re.findall(r"[A-Za-z]+", answer)) <= names:
        return "name outside the maths whitelist"
    return None


def _guard_logic(answer, entry):
    """Formulas over the item's own variables only: every atom is one variable, so the truth table has at most
    2^len(variables) rows, and the nesting stays far below the recursion limit."""
    variables, text = set(entry["metadata"]["variables"]), "".join(answer.split())
    if len(text) > MAX_FORMULA_CHARS or any(len(v) != 1 for v in variables):
        return "too long"
    depth, prev = 0, "op"  # what came before: 'op' (start, '(', '¬', binary operator) or 'term' (var, ')')
    for char in text:
        if char in variables or char in "¬(":
            ok, new = prev == "op", ("term" if char in variables else "op")
        elif char in ")∧∨→↔":
            ok, new = prev == "term", ("term" if char == ")" else "op")
        else:
            return "character outside the formula grammar"
        depth += (char == "(") - (char == ")")
        if not ok or not 0 <= depth <= 30:
            return "not a formula"
        prev = new
    return None if depth == 0 and prev == "term" else "not a formula"


GUARDS = {  # kind -> function(answer, entry): None if the answer may be scored, else why it is refused
    "number": lambda answer, entry: "too long" if len(answer) > MAX_ANSWER_CHARS else None,
    "json": lambda answer, entry: "too long" if len(answer) > MAX_ANSWER_CHARS else None,  # json runs no code
    "complex": lambda answer, entry: None if len(answer) <= MAX_ANSWER_CHARS and set(answer) <= _COMPLEX_CHARS
    else "not a complex number",
    "eval": lambda answer, entry: None if len(answer) <= MAX_ANSWER_CHARS and set(answer) <= _LIST_CHARS
    else "not a list of integers",
    "sympy": _guard_sympy,
    "logic": _guard_logic,
    # a dataset nobody surveyed: a deny-list is weaker than a whitelist, but the worker still bounds the time
    "unknown": lambda answer, entry: "too long or code-like" if len(answer) > MAX_ANSWER_CHARS
    or _DENY.search(answer) else None,
}


# -----------------------------------------------------------------------------
# Scoring: in this process for the string kinds, else in the worker process

def _kind(name):
    if name in SCORERS:
        return SCORERS[name][0]
    from reasoning_gym.dataset import ProceduralDataset
    from reasoning_gym.factory import DATASETS

    return "string" if DATASETS[name][0].score_answer is ProceduralDataset.score_answer else "unknown"


def _make_scorer(name, config):
    """score_answer of the dataset built with `config` (rewards.dataset_config: the paper's), as in the
    composite that made the entry."""
    if name == "gsm8k":
        return score_gsm8k
    from reasoning_gym import create_dataset

    return create_dataset(name, **config).score_answer


_GSM8K_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")


def _parse_number(text):
    """'1,234', '$18', '18.0', ' 18 ', '18.' -> Decimal; anything else -> None. At most 64 characters reach
    the regex and Decimal, so a hostile answer costs nothing (GSM8K is scored in the trainer's own
    process)."""
    if len(text) > 1000:
        return None
    text = re.sub(r"[\s,$]", "", text).rstrip(".")
    return Decimal(text) if len(text) <= 64 and _GSM8K_NUMBER.fullmatch(text) else None


def score_gsm8k(answer, entry):
    """GSM8K's reward (rewards.py deviation 5): 1 if the answer equals the gold number numerically, else 0."""
    gold = _parse_number(entry["answer"])
    return float(gold is not None and _parse_number(answer) == gold)


def _call_scorer(cache, name, config, entry, answer):
    """(reward, status) of one answer that passed its guard; any exception scores 0 with 'error'."""
    try:
        if name not in cache:
            cache[name] = _make_scorer(name, config)
        reward = float(cache[name](answer, entry))
        return (0.0 if math.isnan(reward) else min(1.0, max(0.0, reward))), "ok"
    except Exception:  # includes RecursionError and MemoryError
        return 0.0, "error"


_LOCAL_SCORERS = {}  # scorers of the in-process kinds, built once per process


def _score_here(entry, answer, config_of):
    """(result, None) when the answer is scored, refused or broken here; (None, job) when the worker must."""
    try:
        name = entry["metadata"]["source_dataset"]
        if answer is None:
            return (0.0, "ok"), None
        answer = answer.encode("utf-8", "replace").decode("utf-8")  # lone surrogates -> '?'
        kind, config = _kind(name), config_of(name)
        if kind in IN_PROCESS_KINDS:
            return _call_scorer(_LOCAL_SCORERS, name, config, entry, answer=answer), None
        if GUARDS[kind](answer, entry) is not None:
            return (0.0, "refused"), None
        return None, (name, config, entry, answer)
    except Exception:  # a malformed entry or an unregistered source_dataset
        return (0.0, "error"), None


def _worker_main(conn):
    """Worker process: receive a list of jobs, send one (reward, status) per job, in order."""
    # A terminal's Ctrl-C signals the whole process group, this worker too: the trainer answers it in one line and
    # ends the worker (multiprocessing ends its daemon children at exit; a closed pipe ends the loop below).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import reasoning_gym  # noqa: F401  (preloaded by the forkserver; else imported here, before "ready")

    try:  # cap memory at start + 1 GiB (Linux): a memory bomb raises MemoryError instead of swapping the host
        import resource

        with open("/proc/self/statm") as f:
            limit = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") + (1 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    except (ImportError, OSError):
        pass  # elsewhere only the timeout bounds a bomb
    conn.send("ready")
    scorers = {}
    while True:
        try:
            jobs = conn.recv()
        except EOFError:
            return
        for name, config, entry, answer in jobs:
            conn.send(_call_scorer(scorers, name, config, entry, answer=answer))


class _Worker:
    """One scoring process, killed and restarted when a single answer takes longer than `timeout`. forkserver
    is a clean process with reasoning-gym preloaded (not a fork of the torch trainer), so a restart costs
    ~10 ms instead of the 3.5 s import. The first start is not counted against any timeout."""

    def __init__(self):
        self.proc, self.conn = None, None

    def _start(self):
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"  # spawn: Windows
        ctx = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(["reasoning_gym"])
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child_conn,), daemon=True, name="scoring-worker")
        main, sys.modules["__main__"] = sys.modules["__main__"], types.ModuleType("__main__")
        try:  # multiprocessing would re-run the caller's script in the child to rebuild __main__ (slow, and
            self.proc.start()  # fails for stdin or scripts without a main guard); the worker needs none of it
        finally:
            sys.modules["__main__"] = main
        child_conn.close()
        try:
            ready = self.conn.poll(120) and self.conn.recv() == "ready"
        except EOFError:
            ready = False
        if not ready:
            self.stop()
            raise RuntimeError("the reward worker process did not start (its error is printed above)")

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
            self.conn.close()
        self.proc, self.conn = None, None

    def run(self, jobs, timeout):
        """Results of all jobs: one round trip, plus one more after each answer that timed out."""
        results = []
        while len(results) < len(jobs):
            if self.proc is None or not self.proc.is_alive():
                self.stop()
                self._start()
            pending = jobs[len(results):]
            try:
                self.conn.send(pending)
            except OSError:  # it died since the check: give up on one job so that the loop always ends
                results.append((0.0, "error"))
                self.stop()
                continue
            for _ in pending:
                results.append(self._receive(timeout))
                if self.proc is None:  # killed: send the rest to a fresh worker
                    break
        return results

    def _receive(self, timeout):
        try:
            if self.conn.poll(timeout):
                return self.conn.recv()
            status = "timeout"
        except (EOFError, OSError):  # the worker died, e.g. killed by the OS
            status = "error"
        self.stop()
        return 0.0, status


_WORKER = _Worker()  # started on first use, not on import


def score_answers(entries, answers, timeout=2.0, config_of=lambda name: {}):
    """(reward in [0, 1], status in STATUSES) of each extracted answer; None (no answer block) scores 0, "ok".
    `config_of(name)` is the config the entry's dataset was built with (rewards.dataset_config; default
    reasoning-gym's own). The answers the worker must score go in one round trip; no single answer takes
    more than `timeout` seconds."""
    assert len(entries) == len(answers), f"{len(entries)} entries but {len(answers)} answers"
    results, jobs, job_index = [], [], []
    for i, (entry, answer) in enumerate(zip(entries, answers)):
        result, job = _score_here(entry, answer, config_of)
        results.append(result)
        if job is not None:
            jobs.append(job)
            job_index.append(i)
    for i, result in zip(job_index, _WORKER.run(jobs, timeout) if jobs else []):
        results[i] = result
    return results


if __name__ == "__main__":
    import reasoning_gym

    # the importable module: the worker finds its code by name
    from lib.safe_scoring import SCORERS, score_answers

    dataset_config = {"binary_matrix": {"min_n": 2, "max_n": 6}}.get  # rewards.dataset_config, for these three

    hostile = {"code": "__import__('os').system('echo pwned')", "nan": "nan", "exponent": "9**9**9**9",
               "nesting": "(" * 5000 + "1" + ")" * 5000}
    for name in ["complex_arithmetic", "polynomial_multiplication", "binary_matrix"]:
        entry = reasoning_gym.create_dataset(name, seed=0, size=1, **dataset_config(name, {}))[0]
        answers = {"right": entry["answer"], **hostile}
        print(f"[{name}] {SCORERS[name][1]}")
        for (label, answer), (reward, status) in zip(answers.items(),
                                                     score_answers([entry] * len(answers), [*answers.values()], 1.0,
                                                                   lambda name: dataset_config(name, {}))):
            print(f"  {label:9} {answer[:40]!r:44} -> reward {reward:.3f} ({status})")
