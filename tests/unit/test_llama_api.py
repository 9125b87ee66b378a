"""llama-server's own completion API (``POST /completion``) on the real ingress in one process (the
app of tests/inprocess.py on a tiny Llama): its names and defaults reach the engine, its answers
and streams have its shapes and say what the OpenAI endpoints say of the same request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deployments.llama_api import stop_type, timings
from deployments.protocol import Done, LlamaCompletionRequest, Outcome
from inprocess import App, app_config, save_tiny_model
from speculative import ModelRunner, SpeculativeEngine
from speculative.models import load_tokenizer, load_weights
from config import EngineConfig, Grammar, SamplingParams


@pytest.fixture(scope="module")
def folder(tmp_path_factory, make_llama, make_tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"), make_llama, make_tokenizer)


@pytest.fixture
def app(folder, loop):
    a = App(app_config(folder))
    a.run = loop.run
    return a


def greedy(folder: str, prompt: str, n: int) -> list[int]:
    """Target-only greedy output of the same model."""
    engine = SpeculativeEngine(ModelRunner(load_weights(app_config(folder).engine.model), name="t"),
                               load_tokenizer(folder), None, EngineConfig(chat_template=False))
    return engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)).token_ids


def post(app, body: dict, **kw):
    return app.run(app.post(body, llama=True, **kw))


# -- the request's names and defaults ---------------------------------------------------------------

def test_llama_names_and_conventions_become_the_completion_request_they_mean():
    r = LlamaCompletionRequest.model_validate({"prompt": "x", "n_predict": 7, "n_probs": 2, "n_cmpl": 3, "seed": -1})
    assert (r.max_tokens, r.logprobs, r.n, r.seed) == (7, 2, 3, None)
    p = r.sampling(99)
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)  # llama-server's defaults
    p = LlamaCompletionRequest.model_validate({"prompt": "x", "n_predict": -1, "top_k": -1, "temperature": -0.5,
                                               "top_p": 1, "min_p": 0, "seed": 0xFFFFFFFF}).sampling(99)
    assert (p.max_tokens, p.top_k, p.temperature, p.top_p, p.min_p, p.seed) == (99, 0, 0.0, 1.0, 0.0, None)
    assert LlamaCompletionRequest.model_validate({"prompt": "x", "seed": 5, "n_probs": 0}).sampling(9).seed == 5
    assert LlamaCompletionRequest.model_validate({"prompt": "x", "n_probs": 0}).logprobs is None
    for refused in ({"mirostat": 2}, {"post_sampling_probs": True}, {"n_predict": 0}, {"echo": True},
                    {"repeat_penalty": 1.1, "repetition_penalty": 1.2}):
        with pytest.raises(ValueError):
            LlamaCompletionRequest.model_validate({"prompt": "x", **refused})
    # llama.cpp's penalties: all three over the last repeat_last_n tokens (64 by default), prompt included
    p = LlamaCompletionRequest.model_validate({"prompt": "x", "repeat_penalty": 1.1, "frequency_penalty": 0.5}).sampling(9)
    assert (p.repetition_penalty, p.frequency_penalty, p.penalty_last_n, p.penalised) == (1.1, 0.5, 64, True)
    p = LlamaCompletionRequest.model_validate({"prompt": "x", "presence_penalty": 1.0, "repeat_last_n": 0}).sampling(9)
    assert p.penalty_last_n == 0 and not p.penalised and not p.processes_logits  # 0: no penalties, as llama.cpp


def test_stop_types_and_timings_follow_what_ended_the_request():
    usage = {"prompt_tokens": 10, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 6},
             "speculative": {"proposed": 5, "accepted": 3}}
    assert stop_type(Done("length", usage)) == ("limit", "")
    assert stop_type(Done("stop", usage, "###")) == ("word", "###")
    assert stop_type(Done("stop", usage, 13)) == ("eos", "") and stop_type(Done("stop", usage)) == ("eos", "")
    t = timings(Outcome(0, 10, end=Done("stop", usage), first=1.5, finished=1.75), t0=1.0)
    assert (t["cache_n"], t["prompt_n"], t["predicted_n"]) == (6, 4, 4)
    assert t["prompt_ms"] == pytest.approx(500) and t["predicted_ms"] == pytest.approx(250)
    assert t["prompt_per_token_ms"] == pytest.approx(125) and t["prompt_per_second"] == pytest.approx(8)
    assert t["predicted_per_token_ms"] == pytest.approx(62.5) and t["predicted_per_second"] == pytest.approx(16)
    assert (t["draft_n"], t["draft_n_accepted"]) == (5, 3)
    # no cache figure: nothing cached; no time between the clocks: no rate (not a division by zero)
    bare = {"prompt_tokens": 10, "completion_tokens": 4}
    t = timings(Outcome(0, 10, end=Done("stop", bare), first=1.0, finished=1.0), t0=1.0)
    assert (t["cache_n"], t["prompt_n"], t["prompt_per_second"], t["predicted_per_second"]) == (0, 10, 0.0, 0.0)
    t = timings(Outcome(0, 10, end=Done("stop", bare), first=1.0005, finished=1.001), t0=1.0)  # under a millisecond each
    assert t["prompt_per_second"] == pytest.approx(20_000) and t["predicted_per_second"] == pytest.approx(8_000)
    assert "draft_n" not in timings(Outcome(0, 10, end=Done("stop", {**usage, "speculative": {"proposed": 0}}),
                                            first=1.5, finished=2.5), t0=1.0)
    # still running (timings_per_token): the cached positions its first chunk said
    t = timings(Outcome(0, 10, tokens=[5, 6], first=1.5, finished=1.75, cached=6), t0=1.0)
    assert (t["cache_n"], t["prompt_n"], t["predicted_n"]) == (6, 4, 2)


def test_generation_settings_and_probabilities_in_llama_servers_names():
    from deployments.llama_api import generation_settings, probabilities

    p = SamplingParams(max_tokens=9, temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, stop=["x"], logit_bias={7: -2.0})
    g = generation_settings(p, "m", stream=True)
    assert (g["n_predict"], g["max_tokens"], g["temperature"], g["top_k"], g["top_p"], g["min_p"]) == (9, 9, 0.5, 3, 0.9, 0.1)
    assert (g["seed"], g["n_probs"], g["repeat_penalty"], g["stop"], g["logit_bias"], g["stream"]) == (-1, 0, 1.0, ["x"], [[7, -2.0]], True)
    assert g["samplers"] == ["penalties", "temperature", "min_p", "top_k", "top_p", "top_n_sigma", "typ_p", "xtc"]
    assert g["grammar"] == ""
    assert (g["typical_p"], g["top_n_sigma"], g["xtc_probability"], g["min_keep"]) == (1.0, -1.0, 0.0, 0)  # off
    assert (g["mirostat"], g["dry_multiplier"]) == (0, 0.0)  # refused otherwise
    # every setting llama-server reports (its answer's generation_settings, recorded from the
    # llama.cpp that tools/llama_server.sh builds) but the kinds of its own speculation
    theirs = ("adaptive_decay adaptive_target backend_sampling chat_format dry_allowed_length dry_base dry_multiplier "
              "dry_penalty_last_n dry_sequence_breakers dynatemp_exponent dynatemp_range frequency_penalty generation_prompt "
              "grammar grammar_lazy grammar_triggers ignore_eos logit_bias lora max_tokens min_keep min_p mirostat mirostat_eta "
              "mirostat_tau n_discard n_keep n_predict n_probs post_sampling_probs presence_penalty preserved_tokens "
              "reasoning_format reasoning_in_content repeat_last_n repeat_penalty samplers seed stop stream temperature "
              "timings_per_token top_k top_n_sigma top_p typical_p xtc_probability xtc_threshold").split()
    assert set(theirs) <= set(g)
    grammar = Grammar(kind="gbnf", source='root ::= "a"')
    g = generation_settings(p.model_copy(update={"seed": 5, "logprobs": 3, "grammar": grammar}), "m", stream=False)
    assert (g["seed"], g["n_probs"], g["stream"], g["model"], g["grammar"]) == (5, 3, False, "m", 'root ::= "a"')
    probs = probabilities(lambda ids: f"<{ids[0]}>", [4], [(float("-inf"), [(4, -0.5), (2, float("-inf"))])])
    assert probs == [{"id": 4, "token": "<4>", "bytes": list(b"<4>"), "logprob": -9999.0,
                      "top_logprobs": [{"id": 4, "token": "<4>", "bytes": list(b"<4>"), "logprob": -0.5},
                                       {"id": 2, "token": "<2>", "bytes": list(b"<2>"), "logprob": -9999.0}]}]


def test_defaults_and_names_reach_the_engine(app):
    status, body, _ = post(app, {"prompt": "Hello world", "n_predict": 3, "seed": -1})
    assert status == 200 and body["tokens_predicted"] <= 3
    p = app.pool.calls[-1][2][0].params
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.max_tokens) == (0.8, 40, 0.95, 0.05, None, 3)
    status, body, _ = post(app, {"prompt": "Hello world", "temperature": 0, "n_predict": -1, "ignore_eos": True})
    ingress = app.ingress.cfg.ingress  # -1: as long as the server allows (its default, within its limit)
    assert status == 200 and ingress.default_max_tokens > ingress.max_tokens_limit
    assert app.pool.calls[-1][2][0].params.max_tokens == body["tokens_predicted"] == ingress.max_tokens_limit


# -- answers -----------------------------------------------------------------------------------------

def test_a_greedy_completion_is_the_target_only_text_in_llama_servers_shape(app, folder):
    tok = load_tokenizer(folder)
    ids = greedy(folder, "Hello world", 12)
    app.ingress.tenants.clock = lambda: 1000.0  # still: the token bucket does not refill meanwhile
    status, body, _ = post(app, {"prompt": "Hello world", "n_predict": 12, "temperature": 0, "ignore_eos": True,
                                 "return_tokens": True})
    assert status == 200 and isinstance(body, dict)
    assert body["content"] == tok.decode(ids) and body["tokens"] == ids and body["stop"] is True
    assert (body["tokens_predicted"], body["tokens_evaluated"], body["stop_type"], body["stopping_word"]) == (12, 11, "limit", "")
    assert body["prompt"] == "Hello world" and body["model"] == app.ingress.cfg.ingress.model_name and not body["truncated"]
    assert body["id_slot"] == -1 and body["tokens_cached"] == 11 + 12 - 1  # the last token predicted is never fed
    assert body["has_new_line"] == ("\n" in body["content"]) and "completion_probabilities" not in body
    t = body["timings"]
    assert t["predicted_n"] == 12 and t["prompt_n"] + t["cache_n"] == 11 and t["prompt_ms"] > 0 and t["predicted_ms"] >= 0
    assert t.get("draft_n", 0) == body["speculative"]["proposed"]
    assert body["generation_settings"]["n_predict"] == 12 and body["generation_settings"]["temperature"] == 0
    bucket = app.ingress.tenants.tokens["alice"]
    assert bucket.level == bucket.rate - 23  # charged prompt + completion, as the OpenAI endpoints are
    assert app.ingress.running == 0 and app.ingress.tenants.in_flight["alice"] == 0
    again = post(app, {"prompt": "Hello world", "n_predict": 12, "temperature": 0, "ignore_eos": True})[1]
    assert again["tokens"] == [] and again["content"] == body["content"]  # ids only when asked for


def test_a_stream_is_partial_results_then_the_final_one_without_done(app, folder):
    tok = load_tokenizer(folder)
    ids = greedy(folder, "Hello world", 10)
    status, events, headers = post(app, {"prompt": "Hello world", "n_predict": 10, "temperature": 0, "ignore_eos": True,
                                         "stream": True, "return_tokens": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in events and events[-1]["stop"] is True and not any(e["stop"] for e in events[:-1])
    assert all(e["id_slot"] == -1 and e["tokens_evaluated"] == 11 for e in events)
    assert "".join(e["content"] for e in events) == tok.decode(ids)
    assert [t for e in events[:-1] for t in e["tokens"]] == ids and events[-1]["tokens"] == []
    # as llama-server: a chunk a token, with that token's own text (a speculative step emits several)
    assert all(len(e["tokens"]) == 1 and e["content"] == tok.decode(e["tokens"]) for e in events[:-1])
    assert [e["tokens_predicted"] for e in events[:-1]] == sorted(e["tokens_predicted"] for e in events[:-1])
    final = events[-1]
    assert final["content"] == "" and final["tokens_predicted"] == 10 and final["stop_type"] == "limit"
    assert final["timings"]["predicted_n"] == 10 and "timings" not in events[0]
    assert final["generation_settings"]["timings_per_token"] is False
    _, timed, _ = post(app, {"prompt": "Hello world", "n_predict": 10, "temperature": 0, "ignore_eos": True,
                             "stream": True, "timings_per_token": True})
    assert all(e["timings"]["predicted_n"] == e["tokens_predicted"] for e in timed)  # each chunk: the timings so far
    assert timed[-1]["generation_settings"]["timings_per_token"] is True
    assert app.ingress.running == 0 and app.ingress.tenants.in_flight["alice"] == 0


def test_each_chunks_timings_count_the_prompts_cached_positions_from_the_first(folder, loop):
    """``timings_per_token``: a prompt whose opening the target has cached says so on its first
    chunk (``cache_n``, and ``prompt_n`` the rest), as its end does; a prompt seen first, 0."""
    app = App(app_config(folder, quantize="int4"))
    app.run = loop.run
    body = {"prompt": "Summarise the following report in two short sentences for a busy reader: sales rose.",
            "n_predict": 6, "temperature": 0, "ignore_eos": True, "stream": True, "timings_per_token": True}
    for again in (False, True):
        _, events, _ = post(app, body)
        final = events[-1]["timings"]
        assert (final["cache_n"] > 0) == again, final
        assert len(events) > 2 and all(e["timings"]["cache_n"] == final["cache_n"] for e in events), events
        assert all(e["timings"]["prompt_n"] == final["prompt_n"] for e in events)
    # the OpenAI stream's timings too (llama-server's extension to it)
    ask = {"prompt": body["prompt"], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
           "timings_per_token": True}
    _, events, _ = app.run(app.post(ask))
    timed = [e["timings"] for e in events if isinstance(e, dict) and "timings" in e]
    assert len(timed) > 2 and timed[-1]["cache_n"] > 0 and all(t["cache_n"] == timed[-1]["cache_n"] for t in timed), timed


def test_a_stop_word_is_named_and_cut(app, folder):
    text = load_tokenizer(folder).decode(greedy(folder, "Hello world", 12))
    stop = text[4:6]
    for stream in (False, True):
        _, body, _ = post(app, {"prompt": "Hello world", "n_predict": 12, "temperature": 0, "ignore_eos": True,
                                "stop": [stop], "stream": stream})
        final = body[-1] if stream else body
        content = "".join(e["content"] for e in body) if stream else body["content"]
        assert content == text[: text.index(stop)] and (final["stop_type"], final["stopping_word"]) == ("word", stop)


def test_n_probs_give_each_tokens_log_probability_and_the_most_likely(app):
    status, body, _ = post(app, {"prompt": "Hello world", "n_predict": 6, "temperature": 0, "ignore_eos": True,
                                 "n_probs": 3, "return_tokens": True})
    probs = body["completion_probabilities"]
    assert status == 200 and [p["id"] for p in probs] == body["tokens"]
    for p in probs:
        assert len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"]  # greedy: the most likely
        assert p["logprob"] == pytest.approx(p["top_logprobs"][0]["logprob"]) and p["logprob"] <= 0
        assert [t["logprob"] for t in p["top_logprobs"]] == sorted((t["logprob"] for t in p["top_logprobs"]), reverse=True)
        assert bytes(p["bytes"]).decode() == p["token"]
    _, events, _ = post(app, {"prompt": "Hello world", "n_predict": 6, "temperature": 0, "ignore_eos": True,
                              "n_probs": 3, "stream": True})
    streamed = [p for e in events[:-1] for p in e["completion_probabilities"]]
    assert [p["id"] for p in streamed] == body["tokens"]
    assert [p["logprob"] for p in streamed] == pytest.approx([p["logprob"] for p in probs], abs=1e-4)


@pytest.fixture(scope="module")
def ending(tmp_path_factory, make_llama, make_tokenizer, folder):
    """The tiny model with an end of sequence its greedy output meets, as llama-server's EOS: its
    folder, the output before that token, and the token."""
    ids = greedy(folder, "Hello world", 12)
    p = next(j for j in range(2, len(ids)) if ids[j] not in ids[:j])
    assert 0 not in ids[: p + 1]  # the tokenizer's own end of sequence (id 0) comes later, if at all
    path = save_tiny_model(tmp_path_factory.mktemp("tiny-ending"), make_llama, make_tokenizer)
    gen = json.loads((Path(path) / "generation_config.json").read_text())
    (Path(path) / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [0, ids[p]]}))
    return path, ids[:p], ids[p]


def test_the_end_of_sequence_is_predicted_scored_and_streamed_as_llama_server_does(ending, loop):
    """llama-server counts the end of sequence as predicted, lists it in ``tokens`` and
    ``completion_probabilities``, and streams it as a chunk of its own without text; the OpenAI
    endpoints do none of that."""
    path, before, eos = ending
    app = App(app_config(path))
    app.run = loop.run
    tok = load_tokenizer(path)
    ask = {"prompt": "Hello world", "n_predict": 12, "temperature": 0, "n_probs": 2, "return_tokens": True}
    status, body, _ = post(app, ask)
    assert status == 200 and body["content"] == tok.decode(before) and body["stop_type"] == "eos"
    assert body["tokens"] == before + [eos]
    assert body["tokens_predicted"] == body["timings"]["predicted_n"] == len(before) + 1
    assert body["tokens_cached"] == 11 + len(before)
    probs = body["completion_probabilities"]
    assert [p["id"] for p in probs] == before + [eos] and probs[-1]["token"] == tok.decode([eos])
    assert probs[-1]["top_logprobs"][0]["id"] == eos and probs[-1]["logprob"] == probs[-1]["top_logprobs"][0]["logprob"]

    _, events, _ = post(app, {**ask, "stream": True})
    *chunks, last, final = events
    assert (last["content"], last["tokens"], last["tokens_predicted"]) == ("", [eos], len(before) + 1)
    assert [p["id"] for p in last["completion_probabilities"]] == [eos]
    assert last["completion_probabilities"][0]["logprob"] == pytest.approx(probs[-1]["logprob"], abs=1e-4)
    assert [t for e in chunks for t in e["tokens"]] == before and "".join(e["content"] for e in chunks) == body["content"]
    assert final["stop"] and final["tokens_predicted"] == final["timings"]["predicted_n"] == len(before) + 1

    _, oai, _ = app.run(app.post({"prompt": "Hello world", "max_tokens": 12, "logprobs": 2}))
    assert oai["usage"]["completion_tokens"] == len(oai["choices"][0]["logprobs"]["tokens"]) == len(before)


def test_an_immediate_end_of_sequence_is_one_predicted_token_of_no_text(app):
    """The model's own end of sequence (a special token) first: llama-server answers no text, one
    predicted token, and its entry with an empty piece."""
    status, body, _ = post(app, {"prompt": "Hello world", "n_predict": 8, "temperature": 0, "n_probs": 1,
                                 "return_tokens": True, "logit_bias": [[0, 100]]})
    assert status == 200 and body["content"] == "" and body["stop_type"] == "eos"
    assert body["tokens"] == [0] and body["tokens_predicted"] == 1 and body["tokens_cached"] == 11
    (entry,) = body["completion_probabilities"]
    assert entry["id"] == 0 and entry["token"] == "" and entry["bytes"] == [] and entry["logprob"] <= 0


def test_llama_cpps_penalties_reach_the_engine_and_are_reported(app, folder):
    """``repeat_penalty`` over the last ``repeat_last_n`` tokens: the text is the engine's own
    under llama.cpp's counting (whatever drafted; tests/unit/test_processors.py), not the plain one."""
    ask = {"prompt": "Hello world", "n_predict": 16, "temperature": 0, "ignore_eos": True}
    _, plain, _ = post(app, ask)
    _, got, _ = post(app, {**ask, "repeat_penalty": 3.0, "repeat_last_n": 6, "frequency_penalty": 0.5})
    engine = SpeculativeEngine(ModelRunner(load_weights(app_config(folder).engine.model), name="t"),
                               load_tokenizer(folder), None, EngineConfig(chat_template=False))
    want = engine.generate("Hello world", SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=3.0,
                                                         frequency_penalty=0.5, penalty_last_n=6)).text
    assert got["content"] == want != plain["content"]
    g = got["generation_settings"]
    assert (g["repeat_penalty"], g["repeat_last_n"], g["frequency_penalty"]) == (3.0, 6, 0.5)
    assert (plain["generation_settings"]["repeat_penalty"], plain["generation_settings"]["repeat_last_n"]) == (1.0, 64)


def test_several_prompts_are_an_array_of_results_in_order(app, folder):
    tok = load_tokenizer(folder)
    status, body, _ = post(app, {"prompt": ["Hello world", "abc"], "n_predict": 5, "temperature": 0, "ignore_eos": True})
    assert status == 200 and isinstance(body, list) and [r["index"] for r in body] == [0, 1]
    assert [r["content"] for r in body] == [tok.decode(greedy(folder, p, 5)) for p in ("Hello world", "abc")]
    assert [r["prompt"] for r in body] == ["Hello world", "abc"]
    _, events, _ = post(app, {"prompt": ["Hello world", "abc"], "n_predict": 5, "temperature": 0, "ignore_eos": True,
                              "stream": True})
    finals = [e for e in events if e["stop"]]
    assert sorted(e["index"] for e in finals) == [0, 1]
    for i, r in enumerate(body):
        assert "".join(e["content"] for e in events if e["index"] == i) == r["content"]


def test_refusals_are_400s_in_the_servers_error_shape(app):
    for bad in ({"prompt": "x", "mirostat": 2}, {"prompt": "x", "samplers": ["top_k", "adaptive_p"]},
                {"prompt": "x", "xtc_probability": 0.5, "temperature": 0}, {"prompt": "", "n_predict": 2}, {"n_predict": 2},
                {"prompt": "x", "n_predict": 10**6}):
        status, body, _ = post(app, bad)
        assert status == 400 and body["error"]["message"], bad
    assert app.ingress.running == 0 and app.ingress.tenants.in_flight["alice"] == 0


def test_the_side_by_side_check_names_missing_fields_and_stream_framing():
    from bench.llama_compat import _framed, _missing

    theirs = {"content": "x", "timings": {"prompt_n": 1, "predicted_n": 2}, "stop": True}
    assert _missing(theirs, {"content": "y", "timings": {"prompt_n": 3}}) == ["timings.predicted_n", "stop"]
    assert _missing(theirs, {**theirs, "extra": 1}) == []
    assert _framed([{"stop": False}, {"stop": False}, {"stop": True}])
    assert not _framed([{"stop": False}, {"stop": True}, "[DONE]"]) and not _framed([{"stop": True}, {"stop": True}])
    assert not _framed([])
    from bench.llama_compat import _one_id_chunks

    stream = [{"tokens": [5]}, {"tokens": []}, {"tokens": [6, 7]}, "odd", {"tokens": [8]}, {"tokens": [9], "stop": True}]
    assert _one_id_chunks(stream) == (3, 2)  # the final result is not a chunk of text


def test_the_side_by_side_counting_rules_hold_for_llama_servers_own_answer():
    """llama-server's answer to a chat that ends at its end of sequence (recorded from llama-server,
    ids and counts only) obeys the rules; the same answer without the end of sequence's entry, or
    with the cache counted to the last token, does not."""
    from bench.llama_compat import _count_rules

    def entry(i, piece):
        return {"id": i, "token": piece}

    whole = {"content": "Yes.", "tokens": [10539, 30, 2], "tokens_predicted": 3, "tokens_evaluated": 15,
             "tokens_cached": 17, "stop_type": "eos", "completion_probabilities": [entry(10539, "Yes"), entry(30, "."), entry(2, "")]}
    stream = [{"content": "Yes", "tokens": [10539]}, {"content": ".", "tokens": [30]}, {"content": "", "tokens": [2]},
              {"content": "", "tokens": []}]
    assert _count_rules(whole, stream)
    dropped = {**whole, "tokens": [10539, 30], "tokens_predicted": 2, "tokens_cached": 17,
               "completion_probabilities": whole["completion_probabilities"][:2]}
    assert not _count_rules(dropped, stream[:2] + stream[3:])
    assert not _count_rules({**whole, "tokens_cached": 18}, stream)
    assert not _count_rules(whole, stream[:2] + stream[3:])  # the stream left the end of sequence out
    assert _count_rules({**whole, "content": "Yes!"}, stream[:2] + stream[3:])  # another text: its ids not compared


def test_a_templated_chat_sent_to_completion_is_answered_as_the_chat_is(app, folder):
    """``/apply-template`` gives the text a chat request's prompt is made of: sent to /completion
    (greedy), it gets the chat's own answer. Any valid key; a bad body is a 400."""
    from inprocess import answer, request

    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]

    async def call(route, body, key="sk-alice"):
        return await answer(await getattr(app.ingress, route)(request(body, key)))

    status, body, _ = app.run(call("apply_template", {"messages": msgs}))
    tok = load_tokenizer(folder)
    assert status == 200 and body["prompt"] == tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, msgs[1]], add_generation_prompt=True, tokenize=False)
    chat = app.run(app.post({"messages": msgs, "max_tokens": 8, "ignore_eos": True}, chat=True))[1]
    done = post(app, {"prompt": body["prompt"], "n_predict": 8, "temperature": 0, "ignore_eos": True})[1]
    assert done["content"] == chat["choices"][0]["message"]["content"]
    assert done["tokens_evaluated"] == chat["usage"]["prompt_tokens"]
    assert app.run(call("apply_template", {"messages": msgs}, key=None))[0] == 401
    for bad in ({}, {"messages": []}, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                {"messages": [{"role": "user", "content": "x" * 10_000}]}):
        status, err, _ = app.run(call("apply_template", bad))
        assert status in (400, 413) and err["error"]["message"], bad


def test_tokenize_takes_llama_servers_options(app, folder):
    """llama-server's ``/tokenize`` options: ``with_pieces`` (each id with its text), ``add_special``
    (default false for ``content``) and ``parse_special`` false (a special token's text as text)."""
    from inprocess import answer, request

    def tokenize(body):
        return app.run(answer(app.run(app.ingress.tokenize(request(body, "sk-alice")))))

    tok = load_tokenizer(folder)
    status, body, _ = tokenize({"content": "ab<eos>", "with_pieces": True})
    want = tok("ab<eos>", add_special_tokens=False)["input_ids"]
    assert status == 200 and [t["id"] for t in body["tokens"]] == want and want[-1] == tok.eos_token_id
    assert [t["piece"] for t in body["tokens"]] == ["a", "b", "<eos>"] and body["count"] == 3
    status, body, _ = tokenize({"content": "ab<eos>", "parse_special": False})
    assert status == 200 and body["tokens"] == tok("ab<", add_special_tokens=False)["input_ids"] + tok("eos>", add_special_tokens=False)["input_ids"]
    assert tok.eos_token_id not in body["tokens"]
    from tokenizers import processors

    unk = tok.convert_tokens_to_ids("<unk>")  # a tokenizer that adds a token of its own, as a BOS
    app.ingress._vocabulary().backend.post_processor = processors.TemplateProcessing(single="<unk> $A", special_tokens=[("<unk>", unk)])
    ab = tok("ab", add_special_tokens=False)["input_ids"]
    assert tokenize({"content": "ab"})[1]["tokens"] == ab  # llama-server's default: nothing added
    assert tokenize({"content": "ab", "add_special": True})[1]["tokens"] == [unk, *ab]
    assert tokenize({"prompt": "ab"})[1]["tokens"] == [unk, *ab]  # vLLM's default: added
    assert tokenize({"prompt": "ab", "add_special_tokens": False})[1]["tokens"] == ab
    assert tokenize({"content": "ab", "with_pieces": "yes"})[0] == 400


def test_props_say_the_context_the_template_and_the_completion_defaults(app, folder):
    from transformers import AutoConfig

    props = app.ingress.props()
    tok = load_tokenizer(folder)
    assert props["default_generation_settings"]["n_ctx"] == AutoConfig.from_pretrained(folder).max_position_embeddings > 0
    params = props["default_generation_settings"]["params"]
    assert (params["temperature"], params["top_k"], params["top_p"], params["min_p"]) == (0.8, 40, 0.95, 0.05)
    ingress = app.ingress.cfg.ingress
    assert params["n_predict"] == min(ingress.default_max_tokens, ingress.max_tokens_limit)
    assert props["total_slots"] == ingress.max_in_flight and props["model_alias"] == ingress.model_name
    assert props["chat_template"] == tok.chat_template and "messages" in props["chat_template"]
    assert props["eos_token"] == tok.eos_token
    assert props["build_info"].startswith("osd-serve ")


def test_llama_cpps_samplers_reach_the_engine_in_the_order_sent_and_the_answer_says_them(app):
    status, body, _ = post(app, {"prompt": "Hello world", "n_predict": 3, "typical_p": 0.7, "xtc_probability": 0.3,
                                 "xtc_threshold": 0.2, "top_n_sigma": 1.5, "dynatemp_range": 0.2, "min_keep": 2,
                                 "samplers": "kyxt"})
    assert status == 200, body
    p = app.pool.calls[-1][2][0].params
    assert p.order == ("top_k", "typ_p", "xtc", "temperature") and (p.typical_p, p.xtc_probability, p.min_keep) == (0.7, 0.3, 2)
    g = body["generation_settings"]
    assert g["samplers"] == ["top_k", "typ_p", "xtc", "temperature"]  # as sent (no penalty is on)
    assert (g["typical_p"], g["xtc_probability"], g["xtc_threshold"], g["top_n_sigma"], g["dynatemp_range"], g["min_keep"]) == (
        0.7, 0.3, 0.2, 1.5, 0.2, 2)
    status, body, _ = post(app, {"prompt": "Hello world", "n_predict": 3})  # none sent: llama-server's order
    assert body["generation_settings"]["samplers"] == ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p",
                                                       "min_p", "xtc", "temperature"]
