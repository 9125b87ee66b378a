"""Structured output (``speculative.grammar``): each verified row is masked by the grammar after the
output so far and the draft's tokens before it, so the text follows the grammar and is the masked
target's own whatever was drafted. (Its law under sampling: the grammar cases of
``tests/unit/test_lossless.py``.)"""

from __future__ import annotations

import json

import pytest
import torch

from config import EngineConfig, Grammar, KPolicyConfig, SamplingParams, SuffixConfig
from conftest import _char_tokenizer, int4_engines
from speculative import RequestError, SpeculativeEngine
from speculative.grammar import Constraint, ll_tokenizer
from speculative.runner import ForwardCall
from speculative.suffix import SuffixProposer
from test_detokenize import _byte_level

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _allowed(tok, row: torch.Tensor) -> set[str]:
    return {tok.convert_ids_to_tokens(int(i)) for i in row.nonzero().flatten()}


# -- by hand -----------------------------------------------------------------------------------------------
def test_row_masks_follow_the_drafts_tokens_and_leave_the_matcher_where_it_was():
    tok = _char_tokenizer()
    c = Constraint.compile(Grammar(kind="regex", source="ab(c|d)e"), ll_tokenizer(tok, 128, {0}), 128)
    a, b, c_, x = _ids(tok, "abcx")
    rows = c.masks([a, b, c_])  # [4, 128]
    assert [_allowed(tok, r) for r in rows] == [{"a"}, {"b"}, {"c", "d"}, {"e"}]
    rows = c.masks([a, x, b])  # x is not allowed after "a": the rows after it repeat row 1
    assert [_allowed(tok, r) for r in rows] == [{"a"}, {"b"}, {"b"}, {"b"}]
    assert _allowed(tok, c.masks([])[0]) == {"a"}  # rolled back: still at the start
    c.commit([a, b])
    assert _allowed(tok, c.masks([])[0]) == {"c", "d"} and not c.done
    c.commit(_ids(tok, "de"))
    assert c.done and _allowed(tok, c.masks([])[0]) == {"<eos>"}  # complete: only the end
    with pytest.raises(RuntimeError, match="refused an emitted token"):
        c.commit([a])


def test_a_drafted_end_of_sequence_is_not_consumed_so_the_matcher_rolls_back_whole():
    tok = _char_tokenizer()
    c = Constraint.compile(Grammar(kind="regex", source="ab"), ll_tokenizer(tok, 128, {0}), 128, frozenset({0}))
    a, b = _ids(tok, "ab")
    rows = c.masks([a, b, 0, a])  # the draft ends the text, then goes on
    assert [_allowed(tok, r) for r in rows] == [{"a"}, {"b"}, {"<eos>"}, {"<eos>"}, {"<eos>"}]
    assert not c.matcher.is_error() and _allowed(tok, c.masks([])[0]) == {"a"}
    c.commit([a, b])
    assert c.done


def test_a_byte_level_tokenizer_is_read_by_llguidance_itself():
    tok = _byte_level()
    vocab = len(tok)
    c = Constraint.compile(Grammar(kind="choice", source='["the fox", "the dog"]'), ll_tokenizer(tok, vocab, {0}), vocab)
    starts = [tok.decode([int(i)]) for i in c.masks([])[0].nonzero().flatten()]
    assert starts and all("the fox".startswith(s) or "the dog".startswith(s) for s in starts)
    c.commit(_ids(tok, "the dog"))
    assert c.done


@pytest.mark.parametrize("grammar, message", [
    (Grammar(kind="regex", source="a("), "regex grammar does not compile"),
    (Grammar(kind="json", source='{"type": "objec"}'), "json grammar does not compile"),
    (Grammar(kind="gbnf", source="root ::= foo"), "gbnf grammar does not compile"),
    # the parser's own limits: nesting past them is refused, not recursed into
    (Grammar(kind="lark", source="start: " + "(" * 2000 + '"a"' + ")" * 2000), "too deeply nested"),
    (Grammar(kind="json", source='{"type": "array", "items": ' * 300 + '{"type": "integer"}' + "}" * 300), "recursion limit")])
def test_a_grammar_that_does_not_compile_is_refused_when_queued(grammar, message):
    _, _, (alone, *_) = _engines()
    with pytest.raises(RequestError, match=message):
        alone.add_request("abc", SamplingParams(grammar=grammar))
    assert not alone.requests


def test_structured_output_takes_no_ignore_eos_or_min_tokens():
    g = Grammar(kind="regex", source="a+")
    for bad in (dict(ignore_eos=True), dict(min_tokens=2)):
        with pytest.raises(ValueError, match="grammar is complete"):
            SamplingParams(grammar=g, **bad)


# -- through the engine --------------------------------------------------------------------------------------
def _engines():
    return int4_engines()  # (target, tokenizer, (target-only, draft model, prompt lookup))


def _plain_masked_greedy(target, tok, prompt_ids, grammar, n):
    """No speculation: the whole sequence forward each token, its row masked by a matcher that has
    consumed the output so far, then the argmax; the end where the grammar is complete."""
    c = Constraint.compile(grammar, ll_tokenizer(tok, target.vocab_size, {tok.eos_token_id}), target.vocab_size)
    out: list[int] = []
    while len(out) < n and not c.done:
        z = target.forward_batch([ForwardCall("ref", 0, list(prompt_ids) + out, 1)])[0][0].float()
        target.release("ref")
        nxt = int(z.masked_fill(~c.masks([])[0], float("-inf")).argmax())
        if nxt == tok.eos_token_id:
            break
        c.commit([nxt])
        out.append(nxt)
    return out


@pytest.mark.parametrize("grammar", [Grammar(kind="json", source=json.dumps(SCHEMA)),
                                     Grammar(kind="gbnf", source='root ::= "a" [0-9]+ "z"'),
                                     Grammar(kind="choice", source='["red fox", "blue.jay"]')])
def test_greedy_structured_output_is_the_masked_targets_whatever_drafted(grammar):
    target, tok, engines = _engines()
    prompt = "abcabcabcab"
    want = _plain_masked_greedy(target, tok, _ids(tok, prompt), grammar, 60)
    oracle = SuffixProposer(SuffixConfig(max_depth=32, spec_factor=4.0, min_token_prob=0.0))
    oracle.add_served("seen", _ids(tok, prompt) + want)  # proposes the answer whole: drafted rows are masked
    knows = SpeculativeEngine(target, tok, oracle, EngineConfig(chat_template=False, k=KPolicyConfig(k_max=4, fixed_k=4)))
    for engine in (*engines, knows):
        steps = []
        gen = engine.generate(prompt, SamplingParams(max_tokens=60, grammar=grammar), on_step=steps.append)
        assert gen.token_ids == want, type(engine.proposer).__name__
    assert sum(s.accepted for s in steps) >= len(want) // 2
    if grammar.kind == "json":
        value = json.loads(tok.decode(want))  # complete, compact, of the schema
        assert set(value) == {"name", "n"} and isinstance(value["n"], int) and len(value["name"]) <= 6
        assert gen.finish_reason == "stop"


def test_seeded_structured_output_is_the_same_whatever_drafted_and_follows_the_schema():
    _, tok, engines = _engines()
    grammar = Grammar(kind="json", source=json.dumps(SCHEMA))
    for seed in range(3):
        params = SamplingParams(max_tokens=80, temperature=1.0, seed=seed, grammar=grammar)
        texts = {e.generate("abc", params).text for e in engines}
        assert len(texts) == 1
        value = json.loads(texts.pop())
        assert set(value) == {"name", "n"} and isinstance(value["n"], int)


def test_a_resumed_request_continues_the_grammar_from_its_output():
    target, tok, (alone, drafted, _) = _engines()
    grammar = Grammar(kind="json", source=json.dumps(SCHEMA))
    whole = alone.generate("abc", SamplingParams(max_tokens=60, grammar=grammar)).token_ids
    rid = drafted.add_request("abc", SamplingParams(max_tokens=60, grammar=grammar))
    drafted.resume(rid, whole[:7])  # produced by a replica that died
    while not drafted.requests[rid].finished:
        drafted.step(rid)
    assert drafted.requests[rid].output == whole


def test_the_engines_end_of_sequence_ids_are_the_grammars_end():
    tok = _char_tokenizer()
    for eos, want in (({5}, {5}), ({5, 7}, {5, 7}), (set(), {0})):  # none given: the tokenizer's own
        c = Constraint.compile(Grammar(kind="regex", source="a"), ll_tokenizer(tok, 128, eos), 128)
        c.commit(_ids(tok, "a"))
        assert set(c.masks([])[0].nonzero().flatten().tolist()) == want


def test_a_tokenizer_llguidance_cannot_read_is_given_its_tokens_bytes_over_the_models_rows():
    from tokenizers import processors

    from speculative.grammar import _Bytes

    tok = _char_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<unk> $A", special_tokens=[("<unk>", 1)])
    assert tok("ab")["input_ids"][0] == 1  # the tokenizer adds a token of its own to text
    view = _Bytes(tok, 1, 0)  # a model of one row: the tokenizer's other special token is past it
    assert view.special_token_ids == [0] and view.tokens == [b""]
    view = _Bytes(tok, 128, 0)
    assert view("ab") == _ids(tok, "ab") and view.tokens[_ids(tok, "α")[0]] == "α".encode()


def test_a_draft_that_proposes_the_end_and_more_leaves_the_output_the_masked_targets():
    target, tok, _ = _engines()
    prompt, grammar = "abcabcabcab", Grammar(kind="regex", source="[a-c]{1,3}")
    want = _plain_masked_greedy(target, tok, _ids(tok, prompt), grammar, 40)
    assert 0 < len(want) <= 3  # then only the end is allowed
    oracle = SuffixProposer(SuffixConfig(max_depth=32, spec_factor=4.0, min_token_prob=0.0))
    oracle.add_served("seen", _ids(tok, prompt) + want + [tok.eos_token_id] + _ids(tok, "abcabc"))
    knows = SpeculativeEngine(target, tok, oracle, EngineConfig(chat_template=False, k=KPolicyConfig(k_max=4, fixed_k=4)))
    steps = []
    gen = knows.generate(prompt, SamplingParams(max_tokens=40, grammar=grammar), on_step=steps.append)
    assert gen.token_ids == want and gen.finish_reason == "stop"
    assert any(tok.eos_token_id in s.draft_tokens for s in steps)  # the end was drafted
