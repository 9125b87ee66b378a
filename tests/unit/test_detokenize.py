"""Streaming text: the concatenated stream equals the final text exactly, with no half characters.

Two tokenizers built in code (nothing downloaded): a byte-level BPE (the family of SmolLM2's
tokenizer: a CJK character or an emoji is often split over 2-4 tokens) and a SentencePiece-style
Metaspace BPE (the first piece loses its leading space), and a BERT-style WordPiece whose decode of
a prefix is not always a prefix of the whole decode (cleanup merges "it ' s" into "it's").
"""

from __future__ import annotations

import random

import pytest

from speculative.detokenize import REPLACEMENT, Detokenizer, TokenPieces, cut_at_stop, final_text

TEXTS = [
    "用一句话介绍一下长城。长城是中国古代的军事防御工程。",
    "万里长城 🧱🏯 is long. Très long ! ¿Verdad?",
    "日本語のテキスト、カタカナとひらがな。東京タワー🗼",
    "Emoji families: 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽 done .",
    "Русский текст , и немного العربية و हिन्दी भी .",
    "한국어 문장입니다. Ελληνικά κείμενα . Zürich straße",
    "code: def f(x):\n    return x ** 2  # ✓\n\n",
    "mixed 😀a😃b😄c 🤖 . end",
]
TRAIN = TEXTS + ["the quick brown fox jumps over the lazy dog . " * 3, "长城 长城 长 城", "ab ab ab . , !"]


def _byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"], show_progress=False)
    raw.train_from_iterator(TRAIN, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", clean_up_tokenization_spaces=False)


def _sentencepiece_like():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<eos>"], show_progress=False)
    raw.train_from_iterator(TRAIN, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=True)


def _wordpiece():
    """BERT-style: the decoder's cleanup turns "it ' s" into "it's" once the "s" arrives, so the decode
    of a prefix ("it '") is not a prefix of the decode of the whole."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    raw.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]", "<eos>"], show_progress=False)
    raw.train_from_iterator(TRAIN + ["it's don't can't it ' s"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="[UNK]",
                                   clean_up_tokenization_spaces=True)


TOKENIZERS = {"byte_level": _byte_level(), "sentencepiece_like": _sentencepiece_like(), "wordpiece": _wordpiece()}


def _stream(tok, ids, stop=(), seed=0) -> list[str]:
    """Feed ``ids`` in steps of 1..5 tokens (as speculative steps emit them); the deltas, then the rest."""
    rng = random.Random(seed)
    detok = Detokenizer(tok, stop)
    deltas, n = [], 0
    while n < len(ids):
        n = min(len(ids), n + rng.randint(1, 5))
        deltas.append(detok.update(ids[:n]))
    deltas.append(detok.finish(ids))
    return deltas


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("seed", range(3))
def test_stream_equals_final_text_and_never_shows_half_characters(name, seed):
    tok = TOKENIZERS[name]
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        deltas = _stream(tok, ids, seed=seed)
        assert "".join(deltas) == final_text(tok, ids), text
        assert not any(REPLACEMENT in d for d in deltas), (text, deltas)


def test_the_byte_level_tokenizer_splits_characters_and_naive_streaming_garbles_them():
    """The data exercises the problem: characters span several tokens, and the old way of streaming
    (print decode(output)[len(shown):] after every token) prints U+FFFD that is never corrected."""
    tok = TOKENIZERS["byte_level"]
    ids = tok(TEXTS[0], add_special_tokens=False)["input_ids"]
    assert len(ids) > len(TEXTS[0])  # more tokens than characters
    shown, printed = "", []
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        printed.append(text[len(shown):])
        shown = text
    assert REPLACEMENT in "".join(printed)
    assert "".join(printed) != final_text(tok, ids)


def test_a_split_character_is_held_back_until_complete():
    tok = TOKENIZERS["byte_level"]
    ids = tok("🧱", add_special_tokens=False)["input_ids"]
    assert len(ids) >= 2
    detok = Detokenizer(tok)
    assert [detok.update(ids[:n]) for n in range(1, len(ids))] == [""] * (len(ids) - 1)
    assert detok.update(ids) + detok.finish(ids) == "🧱"


def test_prefix_instability_is_not_streamed():
    """"it '" becomes "it'" once the next token arrives (cleanup): the space must not be shown early."""
    tok = TOKENIZERS["wordpiece"]
    ids = tok("it's and don't", add_special_tokens=False)["input_ids"]
    decodes = [tok.decode(ids[:n]) for n in range(1, len(ids) + 1)]
    assert any(not decodes[-1].startswith(d) for d in decodes), "the tokenizer no longer shows the instability"
    assert "".join(_stream(tok, ids)) == final_text(tok, ids)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_random_token_sequences(name):
    """Arbitrary outputs, invalid byte sequences included: the stream still equals the final text."""
    tok = TOKENIZERS[name]
    rng = random.Random(7)
    for trial in range(60):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
        assert "".join(_stream(tok, ids, seed=trial)) == final_text(tok, ids), ids


@pytest.mark.parametrize("name", TOKENIZERS)
def test_stop_strings_are_never_streamed(name):
    tok = TOKENIZERS[name]
    for text, stop in [(TEXTS[0], ["长城是"]), (TEXTS[6], ["\n\n", "return"]), (TEXTS[1], ["🏯", "long"]),
                       (TEXTS[3], ["zzz"])]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        deltas = _stream(tok, ids, stop)
        streamed = "".join(deltas)
        assert streamed == final_text(tok, ids, stop) == cut_at_stop(tok.decode(ids, skip_special_tokens=True), stop)
        assert not any(s in streamed for s in stop)


def test_cut_at_stop_takes_the_earliest():
    assert cut_at_stop("abcXdefYg", ["Y", "X"]) == "abc"
    assert cut_at_stop("abc", ["z"]) == "abc"
    assert cut_at_stop("abc", []) == "abc"
    assert cut_at_stop("Xabc", ["X"]) == ""  # a stop at the very start leaves nothing


def test_text_that_no_longer_extends_what_was_streamed_adds_nothing(tok):
    """Once streamed, text is never taken back: a final text that does not begin with what was
    sent (a decode that changed earlier characters) adds no delta rather than a garbled one."""
    detok = Detokenizer(tok)
    ids = tok("hello world")["input_ids"]
    shown = "".join(detok.update(ids[:n]) for n in range(1, len(ids) + 1))
    assert shown == "hello worl"  # the newest character waits until it is settled
    assert detok.finish(tok("jello world!")["input_ids"]) == ""
    assert detok.finish(tok("hello world!")["input_ids"]) == "d!"


def test_held_back_stop_prefix_is_released_when_the_stop_does_not_complete(tok):
    """With the one-character-per-token tokenizer: text that may start a stop string waits."""
    ids = tok("say long story")["input_ids"]
    detok = Detokenizer(tok, ["long!"])
    shown = "".join(detok.update(ids[:n]) for n in range(1, len("say long") + 2))  # ... "say long "
    assert shown == "say "  # "long" (and the newest, unsettled character) are held back
    rest = "".join(detok.update(ids[:n]) for n in range(len("say long") + 2, len(ids) + 1))
    assert shown + rest == "say long stor"
    assert shown + rest + detok.finish(ids) == "say long story"


def _counting(tok):
    """``tok`` whose decode records how many ids each call decodes."""
    calls: list[int] = []
    real = tok.decode

    def decode(ids, *args, **kw):
        calls.append(len(ids))
        return real(ids, *args, **kw)

    tok.decode = decode
    return calls


@pytest.mark.parametrize("name", TOKENIZERS)
def test_each_update_decodes_a_bounded_window_however_long_the_output(name):
    """Streaming a long output a token at a time (with four long stop strings that never occur)
    decodes a bounded number of ids per update, not the whole output: the work per step does not
    grow with the output, and the stream still equals the final text."""
    tok = TOKENIZERS[name].__class__(tokenizer_object=TOKENIZERS[name].backend_tokenizer, eos_token="<eos>",
                                     clean_up_tokenization_spaces=TOKENIZERS[name].clean_up_tokenization_spaces)
    ids = tok(" ".join(TEXTS * 16), add_special_tokens=False)["input_ids"]
    assert len(ids) > 1000
    stops = ["\u2603" * 256, "zq" * 128, "\n\n\n\n" * 64, "\u00a7" * 200]  # none is in the text
    calls = _counting(tok)
    detok = Detokenizer(tok, stops)
    deltas, per_update = [], []
    for n in range(1, len(ids) + 1):
        before = sum(calls)
        deltas.append(detok.update(ids[:n]))
        per_update.append(sum(calls) - before)
    deltas.append(detok.finish(ids))
    assert "".join(deltas) == final_text(tok, ids, stops)
    assert max(per_update) <= 3 * 16, max(per_update)  # 3 decodes of the context and a few tokens
    assert sum(per_update[-200:]) <= sum(per_update[:200]) * 1.5 + 50


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_stop_scanner_fires_at_the_first_token_whose_text_holds_a_stop(name):
    """Token by token, as the engine checks: the scanner says yes first exactly where the decode of
    the output so far first holds a stop string. Seeded stops of every length cut from the texts,
    many longer than the text settled when they start (multi-token characters held back): a stop
    the scanner missed used to run the request on to max_tokens."""
    from speculative.detokenize import StopScanner

    tok, rng = TOKENIZERS[name], random.Random(11)
    cases = [("🌊🐟\n\n" * 8, "🐟\n\n🌊🐟\n\n")]  # the case a live server missed
    for text in TEXTS:
        for _ in range(6):
            a = rng.randrange(len(text) - 1)
            cases.append((text, text[a : a + rng.randint(1, 12)]))
    checked = 0
    for text, stop in cases:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        want = next((n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n], skip_special_tokens=True)), None)
        if want is None:  # the tokenizer's decode never shows it (cleanup, unknown pieces)
            continue
        scan = StopScanner(tok, [stop])
        got = next((n for n in range(1, len(ids) + 1) if scan.hit(ids[:n])), None)
        assert got == want, (text, stop)
        checked += 1
    assert checked >= 30


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_stream_never_shows_the_start_of_a_stop_string_that_completes(name):
    """Seeded stops cut from the texts, streamed in steps of 1-5 tokens: the stream is exactly the
    final text, cut at the stop. A stop's start followed by a character still arriving in pieces
    (its bytes decoding to replacement marks) used to be shown, and the stream then held more than
    the response."""
    tok, rng = TOKENIZERS[name], random.Random(5)
    cases = [("🌊🐟\n\n" * 8, ["🐟\n\n🌊🐟\n\n"])]  # the case a live server showed
    for text in TEXTS:
        for _ in range(6):
            a = rng.randrange(len(text) - 1)
            cases.append((text, [text[a : a + rng.randint(2, 10)]]))
    for i, (text, stop) in enumerate(cases):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert "".join(_stream(tok, ids, stop, seed=i)) == final_text(tok, ids, stop), (text, stop)


def test_each_tokens_bytes_make_the_texts_bytes_and_a_split_character_is_bytes_not_text():
    """/tokenize's pieces (llama-server's ``with_pieces``): a byte-level token holds the bytes it
    stands for, part of a character where the BPE split one; a special token is its text."""
    from deployments.llama_api import pieces
    from speculative.locate import token_bytes

    tok = TOKENIZERS["byte_level"]
    split = 0
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        raw = token_bytes(tok.backend_tokenizer, ids)
        assert b"".join(raw) == text.encode("utf-8"), text
        shown = pieces(ids, raw)
        assert [p["id"] for p in shown] == ids
        for p, b in zip(shown, raw):
            assert p["piece"] == (list(b) if isinstance(p["piece"], list) else b.decode("utf-8"))
        split += sum(isinstance(p["piece"], list) for p in shown)
    assert split > 0  # the data has characters split over tokens
    assert token_bytes(tok.backend_tokenizer, [tok.convert_tokens_to_ids("<eos>")]) == [b"<eos>"]
    meta = TOKENIZERS["sentencepiece_like"]  # not byte-level: each token's text decoded alone
    ids = meta("Zürich straße", add_special_tokens=False)["input_ids"]
    assert b"".join(token_bytes(meta.backend_tokenizer, ids)).decode().replace(" ", "") == "Zürichstraße"


def test_byte_level_stand_ins_map_back_to_every_byte_once_as_gpt2s_map_does():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from speculative.locate import _byte_decoder

    assert _byte_decoder() == {c: b for b, c in bytes_to_unicode().items()}


def test_byte_fallback_tokens_are_their_bytes():
    """A SentencePiece-style vocabulary spells a character it lacks as byte tokens (``<0xF0>``):
    each is its byte, so the pieces of a split character join to its UTF-8."""
    from tokenizers import Tokenizer, decoders, models

    from speculative.locate import token_bytes

    vocab = {"<unk>": 0, "a": 1, "bc": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    ids = tok.encode("a🦙").ids
    assert len(ids) == 5 and token_bytes(tok, ids) == [b"a", *(bytes([b]) for b in "🦙".encode())]
    assert token_bytes(tok, [2, 3 + 0x41]) == [b"bc", b"A"]


# -- each token's own text (streams that send a token a chunk) ------------------------------------

def _pieces(tok, ids, stop=(), steps=None, sent=0) -> list[tuple[str, int]]:
    """``TokenPieces`` fed ``ids`` in the given step sizes (one token a step by default), the last
    step finishing the request; ``sent``: a resumed request, the first ``sent`` tokens sent before."""
    split = TokenPieces(Detokenizer(tok, stop), ids[:sent])
    out, n, steps = [], sent, list(steps or [])
    while n < len(ids):
        step = min(len(ids) - n, steps.pop(0) if steps else 1)
        n += step
        out += split.add(ids[:n], step, finished=n == len(ids))
    return out


def test_each_whole_token_is_a_piece_of_its_own_text():
    tok = TOKENIZERS["byte_level"]
    ids = tok("the quick brown fox", add_special_tokens=False)["input_ids"]
    assert len(ids) >= 4
    assert _pieces(tok, ids) == [(tok.decode([i]), 1) for i in ids]
    assert _pieces(tok, ids, steps=[3, 1, 2]) == [(tok.decode([i]), 1) for i in ids]  # steps of several


def test_a_split_character_is_one_piece_of_all_its_tokens():
    tok = TOKENIZERS["byte_level"]
    brick = tok("🧱", add_special_tokens=False)["input_ids"]
    ids = tok("a", add_special_tokens=False)["input_ids"] + brick + tok("b", add_special_tokens=False)["input_ids"]
    assert len(brick) >= 2 and len(ids) == len(brick) + 2
    assert _pieces(tok, ids) == [("a", 1), ("🧱", len(brick)), ("b", 1)]


def test_the_start_of_a_stop_string_waits_with_its_tokens_and_the_stop_is_never_a_piece():
    tok = TOKENIZERS["byte_level"]
    ids = tok("ab ab ab . , !", add_special_tokens=False)["input_ids"]
    pieces = _pieces(tok, ids, stop=[" . ,"])
    assert "".join(t for t, _ in pieces) == "ab ab ab" and sum(n for _, n in pieces) == len(ids)
    assert pieces[-1][0] == ""  # the tokens of the stop end the request with no text of their own


@pytest.mark.parametrize("name", TOKENIZERS)
def test_pieces_join_to_the_final_text_cover_every_token_once_and_do_not_depend_on_the_steps(name):
    tok = TOKENIZERS[name]
    rng = random.Random(3)
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for stop in ((), ("长城是",), ("\n\n", "return"), ("🏯", "long")):
            one = _pieces(tok, ids, stop)
            assert "".join(t for t, _ in one) == final_text(tok, ids, stop), (text, stop)
            assert sum(n for _, n in one) == len(ids) and all(n >= 1 for _, n in one)
            assert not any(REPLACEMENT in t for t, _ in one)
            steps = [rng.randint(1, 5) for _ in ids]  # as speculative steps (and stream intervals) group them
            assert _pieces(tok, ids, stop, steps) == one, (text, stop, steps)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_resumed_request_goes_on_with_the_pieces_the_first_replica_would_have_sent(name):
    tok = TOKENIZERS[name]
    for text in TEXTS[:4]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        whole = _pieces(tok, ids)
        for sent in (1, len(ids) // 2, len(ids) - 1):
            before = TokenPieces(Detokenizer(tok))
            covered = [p for n in range(1, sent + 1) for p in before.add(ids[:n], 1, finished=False)]
            assert covered == whole[: len(covered)]
            assert _pieces(tok, ids, sent=sent) == whole[len(covered):], (text, sent)


def test_a_request_cut_short_between_steps_gives_the_waiting_tokens_their_text():
    tok = TOKENIZERS["byte_level"]
    ids = tok("the fox", add_special_tokens=False)["input_ids"]
    split = TokenPieces(Detokenizer(tok))
    first = split.add(ids, len(ids), finished=False)
    rest = split.add(ids, 0, finished=True)
    assert sum(n for _, n in first) == len(ids) - 1 and rest == [(tok.decode(ids[-1:]), 1)]
    assert split.add(ids, 0, finished=True) == []  # nothing waits any more
