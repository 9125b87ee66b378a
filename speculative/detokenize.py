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


def _text(decoded: str | list[str]) -> str:
    """A tokenizer's decode of one sequence (typed as ``str | list[str]``: a batch decodes to a list)."""
    assert isinstance(decoded, str)
    return decoded


def cut_at_stop(text: str, stop: list[str] | tuple[str, ...]) -> str:
    """Text before the earliest occurrence of any stop string (the stop string is not returned)."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(cuts)] if cuts else text


def final_text(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], stop: list[str] | tuple[str, ...] = ()) -> str:
    """The text of a finished output: its decode (special tokens skipped), cut at the first stop string."""
    return cut_at_stop(_text(tokenizer.decode(token_ids, skip_special_tokens=True)), stop)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _stop_prefix_len(text: str, stop: list[str] | tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    last = text[-1:] or None
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s[n - 1] == last and text.endswith(s[:n]):  # the slice only where the last character matches
                best = n
                break
    return best


#: tokens of left context decoded again before the first unsettled token: enough for every local
#: effect of a decoder (a SentencePiece piece's leading space, WordPiece's cleanup of " ' s", the
#: 2-4 byte-level tokens of one character), so that the text of the window past its context equals
#: what a decode of the whole output has there
CONTEXT_TOKENS = 6


class Detokenizer:
    """Turns a growing list of output token ids into text deltas that are final.

    ``update(ids)`` takes the whole output so far and returns the new text to show; ``finish(ids)``
    returns the remainder once the request has ended. ``"".join`` of every delta equals
    ``final_text(tokenizer, ids, stop)``.

    Each update costs time linear in its new tokens, not in the output: the text of the tokens up to
    an anchor is settled (unchanged by every token since) and never decoded again; an update decodes
    the window from ``CONTEXT_TOKENS`` before the anchor to the end, with and without its newest
    token, and searches for stop strings only in the text not yet shown (which never holds more than
    the longest stop of text held back). Should a window's decode not extend its context's decode (a
    decoder with a longer reach), that update decodes the whole output instead.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._keep = max((len(s) for s in self.stop), default=0)  # settled characters kept for the stop search
        self._parts: list[str] = []  # text already returned, in pieces
        self.emitted_len = 0
        self.anchor = 0  # tokens whose text is settled
        self.settled_len = 0  # characters of that text
        self.tail = ""  # its last characters (at least the longest stop's, and what is not yet shown)

    @property
    def emitted(self) -> str:
        """Text already returned."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _decode(self, ids: list[int]) -> str:
        return _text(self.tokenizer.decode(ids, skip_special_tokens=True))

    def update(self, ids: list[int]) -> str:
        """New final text of the output ``ids`` (the whole output so far)."""
        n = len(ids)
        if not n:
            return ""
        if n <= self.anchor:  # a shorter output than already settled (not produced by the engine): start over
            self.anchor = self.settled_len = 0
            self.tail = ""
        start = max(0, self.anchor - CONTEXT_TOKENS)
        base = self._decode(ids[start : self.anchor]) if self.anchor > start else ""
        full, without = self._decode(ids[start:n]), self._decode(ids[start : n - 1])
        if not (full.startswith(base) and without.startswith(base)):  # a decoder reaching further back
            self.anchor = self.settled_len = start = 0
            self.tail, base = "", ""
            full, without = self._decode(ids), self._decode(ids[:-1])
        stable = full[: max(len(base), _common_prefix(full, without))][len(base) :]  # unchanged by the newest token
        seg_start = self.settled_len - len(self.tail)  # ``seg``: the stable text from this character on
        seg = self.tail + stable
        shown = self.emitted_len - seg_start
        cuts = [i for i in (seg.find(s, max(0, shown - len(s) + 1)) for s in self.stop) if i >= 0]
        if cuts:
            cut = seg[: min(cuts)]
        else:  # no stop string complete yet: hold back what may become one (of the text before an
            # incomplete character, which is held anyway: its replacement marks would hide a stop's start)
            whole = seg.rstrip(REPLACEMENT)
            cut = whole[: len(whole) - _stop_prefix_len(whole[max(0, shown - self._keep) :], self.stop)]
        delta = self._advance_by(cut.rstrip(REPLACEMENT), shown)  # an incomplete character waits for its last bytes
        settled = without[len(base) :]
        if len(_common_prefix_text(full, without)) >= len(without) and not settled.endswith(REPLACEMENT):
            # the text of every token but the newest is settled: the next window starts after it
            self.anchor, self.settled_len = n - 1, self.settled_len + len(settled)
            self.tail = self.tail + settled
        seg_start = self.settled_len - len(self.tail)
        cut_from = min(self.emitted_len, self.settled_len - self._keep) - seg_start
        if cut_from > 0:
            self.tail = self.tail[cut_from:]
        return delta

    def finish(self, ids: list[int]) -> str:
        """The rest of the text once the request has finished (EOS, stop string or length)."""
        return self._advance(final_text(self.tokenizer, ids, self.stop))

    def _advance_by(self, seg_text: str, shown: int) -> str:
        """``seg_text``: the text to show from the start of ``seg``, of which ``shown`` is shown."""
        if len(seg_text) <= shown:
            return ""
        delta = seg_text[shown:]
        self._parts.append(delta)
        self.emitted_len += len(delta)
        return delta

    def _advance(self, text: str) -> str:
        emitted = self.emitted
        if len(text) <= len(emitted) or not text.startswith(emitted):
            return ""
        delta = text[len(emitted) :]
        self._parts.append(delta)
        self.emitted_len += len(delta)
        return delta


class TokenPieces:
    """Each output token's own text, for streams that send a token a chunk (llama-server's and
    OpenAI's do): the text a token adds is final only once the next token shows it, so each token's
    piece comes out when its successor arrives (or when the request ends).

    :meth:`add` feeds the newest tokens one at a time through a :class:`Detokenizer` and returns
    ``(text, n)`` pairs: the text released and how many of the tokens not yet given a piece it
    covers, oldest first. A token whose text is held back (the first bytes of a character, or the
    start of what may become a stop string) goes with the next piece, so ``n`` can exceed 1. The
    texts joined are the detokeniser's stream; the counts add up to the tokens fed, once the
    request has ended."""

    def __init__(self, detok: Detokenizer, sent: list[int] | None = None):
        self.detok = detok
        self.waiting = 0  # tokens fed that no piece covers yet
        if sent:  # output sent before (a resumed request): the same pieces again, to know what waits
            self.add(list(sent), len(sent), finished=False)

    def add(self, output: list[int], new: int, finished: bool) -> list[tuple[str, int]]:
        """The pieces that the newest ``new`` tokens of ``output`` (the whole output so far) release;
        ``finished``: the request ended with them (or, with ``new`` 0, was cut short), and every
        token gets its piece."""
        pieces: list[tuple[str, int]] = []
        for end in range(len(output) - new + 1, len(output) + 1):
            text = self.detok.update(output[:end])  # text of the tokens before the newest
            if text:
                pieces.append((text, self.waiting))
                self.waiting = 1
            else:
                self.waiting += 1
        if finished:  # the rest: the newest token's text, and any held back
            text = self.detok.finish(output)
            if text or self.waiting:
                pieces.append((text, self.waiting))
            self.waiting = 0
        return pieces


def _common_prefix_text(a: str, b: str) -> str:
    return a[: _common_prefix(a, b)]


class StopScanner:
    """Whether a growing output holds one of its stop strings, in time linear in its new tokens.

    The engine checks after every token. The output is decoded from ``CONTEXT_TOKENS`` before its
    last settled token (one whose text ends in a complete character) to its end, and the stops
    are searched for only in the settled text's last (longest stop - 1) characters followed by the
    new text: a stop in the earlier text would have ended the request already. A window whose
    decode does not extend its context's is decoded whole instead (a decoder with a longer reach).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str] | tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._keep = max((len(s) for s in self.stop), default=1) - 1
        self.anchor = 0  # output tokens whose text is settled
        self.tail = ""  # the last ``_keep`` characters of that text
        self.seen = 0  # output tokens checked
        self.matched: str | None = None  # the stop string found

    def _decode(self, ids) -> str:
        return _text(self.tokenizer.decode(ids, skip_special_tokens=True))

    def hit(self, tokens: list[int], start: int = 0) -> bool:
        """Whether the output ``tokens[start:]`` (the whole output so far) holds a stop string."""
        n = len(tokens) - start
        if n < self.seen:  # the output was cut back: start over
            self.anchor, self.tail = 0, ""
        self.seen = n
        lo = max(0, self.anchor - CONTEXT_TOKENS)
        base = self._decode(tokens[start + lo : start + self.anchor]) if self.anchor > lo else ""
        cur = self._decode(tokens[start + lo :])
        if cur.startswith(base):
            window = self.tail + cur[len(base) :]
        else:  # a decoder reaching further back: the whole output, once
            window = self._decode(tokens[start:])
        found = [(window.find(s), i) for i, s in enumerate(self.stop) if s in window]
        if found:
            self.matched = self.stop[min(found)[1]]  # the one that starts first (the listed first of a tie)
            return True
        if not window.endswith(REPLACEMENT):  # complete characters: settled
            self.anchor = n
            self.tail = window[max(0, len(window) - self._keep) :] if self._keep else ""  # all of it when shorter
        return False
