"""
The workflow a conductor writes (neighbours/conductor.py): three equal-length Python lists (model_id = [0, 1],
subtasks = ["Solve the problem.", "Check the answer and give it."], access_list = [[], [0]]), read by a parser of
its own, scored by workflow_reward, and, under --workflow-decoding constrained, sampled under its grammar.

Parsing is the one place model text is read as structure, so it is a small parser of its own (parse_list, two
regular expressions): brackets, commas, integers and quoted strings, nothing else, and nothing the model writes is
ever evaluated. Not ast.literal_eval: it accepts sets, tuples, signs, bytes, huge integers and nesting deep enough
to exhaust the recursion limit, and needs the lists cut from the text after them; not json.loads, which refuses
the single quotes and trailing commas Python allows.

Constrained decoding (conductor.py's deviation 7): workflow_grammar is the workflows parse_workflow accepts, in the
worked example's one spelling, as a Lark grammar; llguidance gives the tokens it allows next for the text so far,
and WorkflowMasks turns them into the masks the sampler and the log-probs read. Not in the paper (its conductor
is a 7B model sampled freely).

Try it on CPU:  python -m pytest tests/test_conductor.py -q -k "parse or grammar or hostile"
"""
import importlib.util
import itertools
import re

import torch

CONDUCTOR_PREFIX = "model_id = ["  # the conductor's response is pre-filled with it; the parser reads it too
NAMES = ("model_id", "subtasks", "access_list")
MAX_TEXT = 4000      # characters of workflow text the parser reads at most
MAX_STRING = 500     # characters of one subtask
NO_LIBRARY = ("--workflow-decoding constrained needs llguidance: pip install -r requirements-conductor.txt "
              "(or pass --workflow-decoding free)")
SUBTASK_CHAR = r"[ !#-\[\]-~]"  # constrained subtasks: printable ASCII but the quote and the backslash


# ----------------------------------------------------------------------------------------------------------
# Parsing the workflow: a small recursive-descent parser for lists of integers, strings and lists


class ParseError(ValueError):
    pass


S = "[ \t\r\n]*"                                   # the spaces the parser skips
SEPARATOR = re.compile(S + "(,?)" + S + r"(\]?)")   # after '[' or an element: a comma?, then the end?
# an element: a list, an integer, or a one-line string in "..." or '...' (a backslash and the character after it
# are one: \" does not end a string; ESCAPES decodes them after)
ELEMENT = re.compile(r"""(\[)|(\d+)|"((?:[^"\\\n]|\\.)*)"|'((?:[^'\\\n]|\\.)*)'""")
ESCAPES = {"n": "\n", "t": "\t", "\\": "\\", "'": "'", '"': '"'}   # any other backslash stays as it is


def parse_list(text, i, depth=0):
    """Parse one list starting at text[i] == "[". Returns (value, index after the closing bracket). Elements are
    non-negative integers (at most 6 digits), quoted strings ("..." or '...', escapes \\" \\' \\\\ \\n \\t, at
    most MAX_STRING characters) or lists, at most 2 levels deep; a trailing comma is fine, as in Python. Anything
    else, an identifier, a call, an operator, a number with a sign or a point, raises ParseError: this is what
    keeps model text from ever being more than data."""
    if depth > 1:
        raise ParseError("lists nest at most 2 deep")
    if text[i:i + 1] != "[":
        raise ParseError(f"expected '[' at {i}")
    out, sep = [], SEPARATOR.match(text, i + 1)
    while not sep[2]:                                 # no ']' yet
        if bool(sep[1]) != bool(out):                 # a comma after each element, none before the first
            raise ParseError(f"expected ',' or ']' at {sep.start()}")
        e = ELEMENT.match(text, sep.end())
        if e is None:
            raise ParseError(f"unexpected text at {sep.end()}")
        if e[1]:
            v, i = parse_list(text, e.start(), depth + 1)
        elif e[2]:
            if len(e[2]) > 6:
                raise ParseError("integer too long")
            v, i = int(e[2]), e.end()
        else:
            body = e[3] if e[3] is not None else e[4]
            v, i = re.sub(r"\\(.)", lambda m: ESCAPES.get(m[1], m[0]), body), e.end()
            if len(v) > MAX_STRING:
                raise ParseError("string too long")
        out.append(v)
        sep = SEPARATOR.match(text, i)
    if sep[1] and not out:
        raise ParseError(f"unexpected ',' at {sep.start()}")
    return out, sep.end()


def worker_index(v, n_workers):
    """0 or "Model 0" -> 0; anything else (out of range, another name) raises ParseError."""
    name = re.fullmatch(r"Model (\d{1,6})", v) if isinstance(v, str) else None
    v = int(name[1]) if name else v
    if not isinstance(v, int) or not 0 <= v < n_workers:
        raise ParseError(f"model_id entry {v!r} is not a worker (0..{n_workers - 1})")
    return v


def parse_workflow(text, n_workers, max_steps):
    """The workflow in `text` -> (workers [int], subtasks [str], access [[int]]) with access already resolved
    ("all" -> every earlier step), or None when it is malformed. The three assignments must come first, in
    order (`model_id = [...]`, `subtasks = [...]`, `access_list = [...]`, whitespace between them); text after
    them is ignored."""
    try:
        text, i, lists = text[:MAX_TEXT], 0, []
        for name in NAMES:
            assignment = re.compile(f"{S}{name}{S}={S}").match(text, i)
            if assignment is None:
                raise ParseError(f"expected '{name} =' at {i}")
            v, i = parse_list(text, assignment.end())
            lists.append(v)
        ids, subtasks, access = lists
        if not (1 <= len(ids) <= max_steps and len(ids) == len(subtasks) == len(access)):
            raise ParseError(f"need 1..{max_steps} steps and three lists of one length")
        workers = [worker_index(v, n_workers) for v in ids]
        if not all(isinstance(s, str) and s.strip() for s in subtasks):
            raise ParseError("every subtask must be a non-empty string")
        seen = []
        for j, a in enumerate(access):
            if a == "all":
                a = list(range(j))
            if not (isinstance(a, list) and all(isinstance(k, int) and 0 <= k < j for k in a)):
                raise ParseError(f"access_list[{j}] must be 'all' or a list of earlier steps")
            seen.append(sorted(set(a)))
        return workers, subtasks, seen
    except ParseError:
        return None


def workflow_reward(plan, score):
    """0 if the workflow did not parse; else 0.5 + 0.5 * the task score of its output: 0.5 wrong, 1 right."""
    return 0.0 if plan is None else 0.5 + 0.5 * float(score)


# ----------------------------------------------------------------------------------------------------------
# Constrained decoding: the three lists sampled under their grammar (--workflow-decoding constrained)


def have_llguidance():
    return importlib.util.find_spec("llguidance") is not None


def workflow_grammar(n_workers, max_steps, max_chars):
    """The workflows parse_workflow accepts, narrowed to the worked example's spelling, as a Lark grammar (in
    llguidance's dialect) for the text after CONDUCTOR_PREFIX. A grammar cannot count, so the three lists'
    common length n is spelled out, one alternative per n = 1..max_steps; for n = 2:

        w2: wid ", " wid "]\nsubtasks = [" SUBTASK ", " SUBTASK "]\naccess_list = [" access0 ", " access1 "]"

    wid: a worker, 0..K-1 as an integer. SUBTASK: a double-quoted string of 1..max_chars printable ASCII
    characters without quote or backslash (so no escapes, and one byte per character), whose first character
    is not a space (so it is never blank). access_j: [], "all", or an increasing list of steps < j."""
    first, rest = SUBTASK_CHAR.replace("[ ", "["), SUBTASK_CHAR
    lines = [f"start: {' | '.join(f'w{n}' for n in range(1, max_steps + 1))}",
             f"wid: {' | '.join(f'{chr(34)}{k}{chr(34)}' for k in range(n_workers))}",
             f'SUBTASK: /"{first}{rest}{{0,{max_chars - 1}}}"/']
    for n in range(1, max_steps + 1):
        sep = ' ", " '
        lines.append(f'w{n}: {sep.join(["wid"] * n)} "]\\nsubtasks = [" {sep.join(["SUBTASK"] * n)} '
                     f'"]\\naccess_list = [" {sep.join(f"access{j}" for j in range(n))} "]"')
    for j in range(max_steps):
        options = ["[]", '"all"'] + [f"[{', '.join(map(str, c))}]" for r in range(1, j + 1)
                                     for c in itertools.combinations(range(j), r)]
        lines.append(f"access{j}: " + " | ".join('"' + o.replace('"', '\\"') + '"' for o in options))
    return "\n".join(lines)


def longest_workflow(n_workers, max_steps, max_chars):
    """The longest text workflow_grammar allows. Every token carries at least one byte, so a completion of
    len(longest_workflow(...)) + 1 tokens (the + 1: EOS) always has room to finish: the constrained
    rollout's token budget, which --max-new-tokens (the workers' budget) therefore does not cap."""
    n = max_steps
    access = [max(['"all"', f"[{', '.join(map(str, range(j)))}]"], key=len) for j in range(n)]
    return (", ".join([str(n_workers - 1)] * n) + ']\nsubtasks = [' + ", ".join(['"' + "x" * max_chars + '"'] * n)
            + ']\naccess_list = [' + ", ".join(access) + "]")


def unpack_bits(bits, vocab_size):
    """Packed masks [..., W] int32 -> bool [..., vocab_size]: bit b of word w says whether token 32 w + b may
    come next (llguidance's layout: 1/32 of the memory of a bool mask, the form the rollout records). Read as
    little-endian bytes, that is bit b % 8 of byte 4 w + b // 8, so one byte per token is the largest temporary."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    octets = bits.contiguous().view(torch.uint8)                                            # (..., 4 W)
    return ((octets.unsqueeze(-1) >> shifts) & 1).bool().flatten(-2)[..., :vocab_size]     # (..., V)


class WorkflowMasks:
    """rollout.sample's `allowed` for constrained decoding: one llguidance matcher per completion row follows the
    tokens drawn so far and gives the tokens the grammar allows next; every mask it gives is recorded (packed),
    so that the scoring pass scores the same masked distributions the tokens were drawn from.

    Why the masks must reach the scoring pass. With logits z, temperature T and allowed set A_t, the sampler
    draws from the renormalised distribution
        q(k) = p(k) 1[k in A_t] / sum_{j in A_t} p(j),   p = softmax(z / T)
             = exp(z_k / T) / sum_{j in A_t} exp(z_j / T)
    so  log q(k) = z_k / T - logsumexp_{j in A_t}(z_j / T): log_softmax of z / T with the entries outside A_t set
    to -inf (grpo.token_logprobs with allowed_mask). GRPO's ratio q_theta / q_old and its KL must use q, the
    policy that sampled, not p. And d log q(k) / d z_j = (1[j = k] - q(j)) / T for j in A_t, 0 outside: a step
    the grammar forces (|A_t| = 1) has log q = 0 and no gradient, so the gradient is all on the free slots
    (which worker, what subtask, which earlier answers)."""

    def __init__(self, grammar_tok, grammar, n_rows, vocab_size, eos_ids, device="cpu"):
        import llguidance
        import llguidance.torch
        self.fill, self.words = llguidance.torch.fill_next_token_bitmask, (vocab_size + 31) // 32
        compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
        self.matchers = [llguidance.LLMatcher(grammar_tok, compiled) for _ in range(n_rows)]
        self.vocab_size, self.eos_ids, self.device = vocab_size, set(eos_ids), device
        self.done, self.bits = [False] * n_rows, []       # bits: per step, int32 [N, W]

    def __call__(self, last):
        """last: the tokens drawn at the previous step [N] (None before the first) -> bool [N, V] allowed next.
        A finished row (its EOS drawn) allows everything: its tokens are padding that no loss reads, and an
        all -inf row would make its log-probs NaN."""
        for n, t in enumerate([] if last is None else last.tolist()):
            if self.done[n] or t in self.eos_ids:
                self.done[n] = True
            elif not self.matchers[n].consume_token(t):
                raise RuntimeError(f"token {t} is not in the grammar: {self.matchers[n].get_error()}")
        bits = torch.full((len(self.matchers), self.words), -1, dtype=torch.int32)   # -1: every bit set
        for n, m in enumerate(self.matchers):
            if not self.done[n]:
                self.fill(m, bits, n)
        self.bits.append(bits)
        return unpack_bits(bits, self.vocab_size).to(self.device)

    def allowed_mask(self, T, device):
        """bool [N, T, V]: the mask of each of the first T steps (the rollout's completion length)."""
        return unpack_bits(torch.stack(self.bits[:T], 1), self.vocab_size).to(device)
