"""Structured output: a request's grammar (a JSON schema, a regular expression, a Lark or a GBNF
grammar) as a mask over the target's rows, by llguidance's matcher.

Verification scores k + 1 positions at once. Row j's mask is the grammar's after the output so far
and the draft's first j tokens: the matcher consumes d_1..d_j (as far as the grammar allows them),
and rolls them back once the rows are masked. A draft token the grammar forbids cannot be accepted
(its row gives it no mass), so the rows after it are never used, and the output is the masked
target's whatever was drafted. Once verification has chosen, the emitted tokens are committed.

The tokenizer is turned into llguidance's once per engine (about a second for a 49k vocabulary);
a grammar compiles when its request is queued, so an invalid one is refused then.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from config import Grammar


class GrammarError(ValueError):
    """The grammar does not compile, or the combination of parameters cannot be served."""


#: JSON is written compactly (``{"a": 1, "b": [2, 3]}``): flexible whitespace lets a model pad
#: its output with blanks up to max_tokens, a known failure of JSON modes
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _grammar_source(g: Grammar) -> str:
    import llguidance

    if g.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(g.source, defaults=JSON_OPTIONS)
    return llguidance.grammar_from(g.kind, g.source)


class _Bytes:
    """A tokenizer llguidance cannot read by itself (one whose decoder is not byte-level, such as a
    character-level one): each token's bytes from its own decoded text."""

    def __init__(self, tokenizer, vocab: int, eos: int):
        self.eos_token_id, self.bos_token_id = eos, None
        special = set(getattr(tokenizer, "all_special_ids", []))
        self.special_token_ids = sorted(i for i in special if i < vocab)
        self.tokens = [b"" if i in special else tokenizer.decode([i]).encode("utf-8") for i in range(vocab)]
        self._tok = tokenizer

    def __call__(self, s: str) -> list[int]:
        return self._tok(s, add_special_tokens=False)["input_ids"]


def ll_tokenizer(tokenizer, vocab: int, eos_ids: set[int]):
    """llguidance's view of ``tokenizer`` over the model's ``vocab`` rows, ending at ``eos_ids``."""
    import llguidance
    import llguidance.hf

    eos = sorted(eos_ids) or [int(tokenizer.eos_token_id)]
    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
    except ValueError:  # a decoder it does not know: give it every token's bytes
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes(tokenizer, vocab, eos[0])), n_vocab=vocab,
                                      eos_token=eos)


@dataclass
class Constraint:
    """One request's matcher, kept in step with its output."""

    matcher: object  # llguidance.LLMatcher
    vocab: int
    #: end-of-sequence ids: a drafted one is never consumed (it ends the sequence, so no row after it
    #: is used, and the matcher cannot roll back past it)
    eos: frozenset[int] = frozenset()

    @classmethod
    def compile(cls, grammar: Grammar, ll_tok, vocab: int, eos: frozenset[int] = frozenset()) -> "Constraint":
        import llguidance

        try:
            matcher = llguidance.LLMatcher(ll_tok, _grammar_source(grammar))
        except (ValueError, RuntimeError) as e:
            raise GrammarError(f"the {grammar.kind} grammar does not compile: {e}") from None
        if matcher.is_error():
            raise GrammarError(f"the {grammar.kind} grammar does not compile: {matcher.get_error()}")
        return cls(matcher, vocab, eos)

    def _mask(self) -> np.ndarray:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool)  # [V]

    def masks(self, draft: list[int]) -> torch.Tensor:
        """[k+1, V] bool: row j's allowed tokens after the output so far and d_1..d_j. Rows past
        the first draft token the grammar forbids, or past a drafted end of sequence, repeat the row
        before (they are never used)."""
        rows = [self._mask()]
        taken = 0
        for d in draft:
            if taken == len(rows) - 1 and d not in self.eos and rows[-1][d] and self.matcher.consume_token(d):
                taken += 1
                rows.append(self._mask())
            else:
                rows.append(rows[-1])
        if taken:
            self.matcher.rollback(taken)
        return torch.from_numpy(np.stack(rows))  # (numpy's stack: torch's of one row costs milliseconds)

    def commit(self, tokens: list[int]) -> None:
        """The emitted tokens (end-of-sequence excluded). A token the grammar refuses here is a bug
        upstream (verification chose a masked token): raise rather than serve it."""
        if tokens and not self.matcher.consume_tokens(tokens):
            raise RuntimeError(f"structured output: the grammar refused an emitted token ({self.matcher.get_error()})")

    @property
    def done(self) -> bool:
        """The grammar is complete and takes nothing but the end of the sequence."""
        return bool(self.matcher.is_stopped())
