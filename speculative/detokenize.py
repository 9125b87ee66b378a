"""Streaming text that is never garbled: one incremental detokeniser for the CLI and the server.

Decoding ``output[:n]`` token by token and printing ``text[len(shown):]`` breaks in two ways:
  - a character split across tokens (byte-level BPE: one CJK character or emoji is often 2-4
    tokens) decodes to U+FFFD until its last byte arrives, and the half-done character is printed;
  - some tokenizers' decode of a prefix is not a prefix of the decode of the whole (SentencePiece
    drops the leading space of the first piece, cleanup merges " ." into "."), so text already
    shown stops matching the final text.
:class:`Detokenizer` streams only text that is final: text that ends in a complete character and
that stays the same whether or not the newest token is included, and never the start of a stop
string that may still complete. When the request finishes, :meth:`Detokenizer.finish` releases
the rest, so the concatenated stream equals :func:`final_text` exactly.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"


def cut_at_stop(text: str, stop: list[str] | tuple[str, ...]) -> str:
    """Text before the earliest occurrence of any stop string (the stop string is not returned)."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(cuts)] if cuts else text


def final_text(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], stop: list[str] | tuple[str, ...] = ()) -> str:
    """The text of a finished output: its decode (special tokens skipped), cut at the first stop string."""
    return cut_at_stop(tokenizer.decode(token_ids, skip_special_tokens=True), stop)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _stop_prefix_len(text: str, stop: list[str] | tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class Detokenizer:
    """Turns a growing list of output token ids into text deltas that are final.

    ``update(ids)`` takes the whole output so far and returns the new text to show; ``finish(ids)``
    returns the remainder once the request has ended. ``"".join`` of every delta equals
    ``final_text(tokenizer, ids, stop)``. Each update decodes the output twice (with and without its
    newest token): O(n) per step in the tokenizer's native decoder, which for the outputs served
    here (<= a few thousand tokens) costs far less than the model step it follows.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.emitted = ""  # text already returned

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, ids: list[int]) -> str:
        """New final text of the output ``ids`` (the whole output so far)."""
        if not ids:
            return ""
        full = self._decode(ids)
        stable = full[: _common_prefix(full, self._decode(ids[:-1]))]  # unchanged by the newest token
        cut = cut_at_stop(stable, self.stop)
        if cut == stable:  # no stop string complete yet: hold back what may become one
            cut = stable[: len(stable) - _stop_prefix_len(stable, self.stop)]
        return self._advance(cut.rstrip(REPLACEMENT))  # an incomplete character waits for its last bytes

    def finish(self, ids: list[int]) -> str:
        """The rest of the text once the request has finished (EOS, stop string or length)."""
        return self._advance(final_text(self.tokenizer, ids, self.stop))

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.emitted) or not text.startswith(self.emitted):
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta
