"""
The union vocabulary of RLAE's members (neighbours/rlae.py): members with different tokenizers mix their
next-token distributions over one vocabulary, built once per team (UnionVocab): every member token is turned into
the bytes it stands for (byte-level BPE through GPT-2's byte alphabet, SentencePiece's "\u2581" as a space and
its <0xNN> byte tokens as bytes), equal bytes share one union entry, the members' end-of-sequence tokens share
one, and other special tokens are dropped (each member's distribution is renormalised over what remains). A
chosen union token goes back to each member as its own tokens (its bytes as text, or as byte tokens when they
are not valid UTF-8 alone), appended to that member's KV cache.

Try it on CPU:  python -m pytest tests/test_rlae.py -q -k "union or mixture"
"""
import torch

EOS = b"<eos>"     # the union entry every member's end-of-sequence tokens map to (not a byte string any token has)


def gpt2_byte_alphabet():
    """GPT-2's printable stand-in for each byte (byte-level BPE token strings are written in it): byte -> char.
    A printable byte stands for itself; the others, in order, for chr(256), chr(257), ..."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(others)) for b in range(256)}


def token_scheme(tok):
    """'bytelevel' (GPT-2 style), 'sentencepiece' (\u2581 for a space, <0xNN> byte tokens) or 'plain'."""
    first = tok.convert_ids_to_tokens(tok.encode(" a", add_special_tokens=False))[0]
    return {"\u0120": "bytelevel", "\u2581": "sentencepiece"}.get(first[:1], "plain")


def token_bytes(tok, scheme):
    """The bytes each token id of `tok` stands for; None for special tokens."""
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    to_byte = {c: b for b, c in gpt2_byte_alphabet().items()}

    def spell(s):
        if scheme == "bytelevel" and all(c in to_byte for c in s):
            return bytes(to_byte[c] for c in s)
        if scheme == "sentencepiece" and len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
            return bytes([int(s[3:5], 16)])                                   # a byte token, <0xNN>
        return (s.replace("\u2581", " ") if scheme == "sentencepiece" else s).encode()
    strings = tok.convert_ids_to_tokens(list(range(len(tok))))
    return [None if i in special or s is None else spell(s) for i, s in enumerate(strings)]


class UnionVocab:
    """One entry per distinct byte string over the members' vocabularies. to_union[k] [V_k] maps member k's ids to
    union ids (-1: dropped). piece(k, u) re-tokenises union token u for member k."""

    def __init__(self, tokenizers, eos_ids, vocab_sizes):
        self.tokenizers, self.schemes = tokenizers, [token_scheme(t) for t in tokenizers]
        self.index, self.to_union, self.pieces = {EOS: 0}, [], [{} for _ in tokenizers]   # index: bytes -> union id
        self.member_bytes = [token_bytes(tok, scheme) for tok, scheme in zip(tokenizers, self.schemes)]
        for spell, eos, V in zip(self.member_bytes, eos_ids, vocab_sizes):
            m = torch.full((V,), -1, dtype=torch.long)     # model rows beyond the tokenizer stay -1
            for i, b in enumerate(spell):
                if i in eos:
                    m[i] = 0
                elif b:
                    m[i] = self.index.setdefault(b, len(self.index))  # a new byte string: the next union id
            self.to_union.append(m)
        self.strings = list(self.index)                    # union id -> bytes (a dict keeps its order)

    def __len__(self):
        return len(self.strings)

    def member_probs(self, k, logits, temperature):
        """softmax(z_k / T) moved onto the union vocabulary and renormalised over the kept tokens: [N, U]."""
        probs = torch.softmax(logits.float() / temperature, -1)                  # (N, V_k)
        m = self.to_union[k].to(logits.device)
        keep = m >= 0
        pu = probs.new_zeros(probs.shape[0], len(self)).index_add_(1, m[keep], probs[:, keep])  # (N, U)
        return pu / pu.sum(-1, keepdim=True).clamp_min(1e-30)

    def piece(self, k, u):
        """Member k's ids for union token u: its tokenizer's ids for the bytes as text, or else its byte tokens,
        whichever spells exactly these bytes (a tokenizer may normalise text: SmolLM2's drops control
        characters); [] if neither does (bytes the member has no token for, e.g. 0xC0 in SmolLM2: that member
        does not see the token)."""
        if u not in self.pieces[k]:
            tok, b, spell = self.tokenizers[k], self.strings[u], self.member_bytes[k]
            tries = []
            try:
                tries.append(tok.encode(b.decode("utf-8"), add_special_tokens=False))
            except UnicodeDecodeError:
                pass
            alphabet = gpt2_byte_alphabet()
            byte_tokens = [alphabet[x] for x in b] if self.schemes[k] == "bytelevel" else [f"<0x{x:02X}>" for x in b]
            tries.append(tok.convert_tokens_to_ids(byte_tokens))
            ok = [ids for ids in tries if all(i is not None and i < len(spell) for i in ids)
                  and b"".join(spell[i] or b"\0special" for i in ids) == b]
            self.pieces[k][u] = ok[0] if ok else []
        return self.pieces[k][u]

    def decode(self, units):
        """Union ids [int] -> text (EOS and everything after it dropped; invalid UTF-8 becomes U+FFFD)."""
        end = units.index(0) if 0 in units else len(units)
        return b"".join(self.strings[u] for u in units[:end]).decode("utf-8", "replace")


def mixture(member_probs, w):
    """p = sum_k w_k p_k: member_probs [K, N, U], w [N, K] -> [N, U]."""
    return torch.einsum("knu,nk->nu", member_probs, w)
