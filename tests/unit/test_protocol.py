"""The OpenAI-compatible request shapes, by hand: what a client may send, what it is refused, and the
sampling settings a request becomes. (The live app's HTTP tests check that a refusal is a 400 with
OpenAI's error body; these check each rule on its own.)"""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from config import Grammar

from deployments.protocol import (
    MAX_PROMPT_IDS,
    MAX_PROMPTS,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    error_body,
    new_id,
)


def completion(**kw) -> CompletionRequest:
    return CompletionRequest(**{"prompt": "Hello", **kw})


def test_a_bare_request_samples_as_openai_does():
    p = completion().sampling(default_max_tokens=77)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop, p.seed, p.ignore_eos) == (
        77, 1.0, 1.0, 0, [], None, False)


def test_every_sampling_field_is_carried_over():
    p = completion(max_tokens=9, temperature=0.0, top_p=0.5, top_k=7, stop="\n", seed=3, ignore_eos=True).sampling(77)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop, p.seed, p.ignore_eos) == (
        9, 0.0, 0.5, 7, ["\n"], 3, True)
    assert p.greedy  # temperature 0 is greedy, not the default 1
    # the newer name wins over the older one; either alone is used
    assert completion(max_tokens=9, max_completion_tokens=5).sampling(77).max_tokens == 5
    assert completion(max_completion_tokens=5).sampling(77).max_tokens == 5


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", "5"), ("max_tokens", 5.0), ("max_tokens", True),
    ("max_completion_tokens", 0),
    ("temperature", -0.01), ("temperature", 2.01), ("temperature", math.nan), ("temperature", math.inf),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan),
    ("top_k", -1), ("top_k", "3"),
    ("seed", "1"), ("seed", 1.5),
    ("n", 129), ("n", 0), ("n", "1"),
    ("stream", "yes"), ("stream", 1),
    ("ignore_eos", "true"),
    ("stop", ["a", "b", "c", "d", "e"]),
    ("stop", "x" * 257), ("stop", ["a", "y" * 257]),  # bounded work per request: a stop's length is capped
    ("user", "u" * 257), ("model", "m" * 257), ("stream_options", {str(i): True for i in range(9)}),
])
def test_out_of_range_or_mistyped_fields_are_refused(field, value):
    with pytest.raises(ValidationError) as e:
        completion(**{field: value})
    assert e.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 1), ("temperature", 0.0), ("temperature", 2.0), ("top_p", 1.0), ("top_p", 1e-6),
    ("top_k", 0), ("n", 1), ("stop", ["a", "b", "c", "d"]), ("stop", []), ("seed", -5),
    ("stop", ["x" * 256] * 4), ("user", "u" * 256),
    ("logit_bias", {"0": -100, "7": 100.0}), ("logit_bias", {str(i): 1 for i in range(1024)}), ("stop_token_ids", [0]),
    ("min_tokens", 0), ("min_p", 1.0), ("frequency_penalty", 2.0), ("presence_penalty", -2.0), ("repetition_penalty", 10.0),
    ("repetition_penalty", 0.01),
])
def test_the_edges_of_each_range_are_accepted(field, value):
    completion(**{field: value})


def test_unknown_fields_are_ignored_and_stops_are_a_list():
    r = completion(logprobs=None, cache_prompt=True, metadata={"a": 1}, stop=None)
    assert r.stop == [] and not hasattr(r, "cache_prompt") and not hasattr(r, "metadata")
    assert completion(stop="x").stop == ["x"] and completion(stop=["x", "y"]).stop == ["x", "y"]


def test_usage_is_included_only_in_a_stream_that_asks_for_it():
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage
    assert not completion(stream=True, stream_options={"include_usage": False}).include_usage
    assert not completion(stream=True).include_usage
    assert not completion(stream=False, stream_options={"include_usage": True}).include_usage


def test_a_prompt_is_a_text_or_token_ids_or_a_batch_of_either():
    assert completion(prompt="Hi").prompts == ["Hi"] == completion(prompt=["Hi"]).prompts
    assert completion(prompt=["Hi", "there"]).prompts == ["Hi", "there"]
    assert completion(prompt=[1, 2, 3]).prompts == [[1, 2, 3]] == completion(prompt=[[1, 2, 3]]).prompts
    assert completion(prompt=[[1, 2], [3]]).prompts == [[1, 2], [3]]
    assert completion(prompt=[0] * MAX_PROMPT_IDS).prompts == [[0] * MAX_PROMPT_IDS]
    assert len(completion(prompt=["a"] * MAX_PROMPTS).prompts) == MAX_PROMPTS
    for bad in ([], "", "  \n", [0] * (MAX_PROMPT_IDS + 1), [[0] * (MAX_PROMPT_IDS + 1)], [True, 2], [1, "a"], [["a"]], [" "],
                ["a", " "], ["a", [1]], [[1], []], [[]], [[1], [True]], ["a"] * (MAX_PROMPTS + 1), 5, {"a": 1}):
        with pytest.raises(ValidationError):
            completion(prompt=bad)
    with pytest.raises(ValidationError):
        CompletionRequest()  # no prompt at all


def test_chat_messages_become_the_template_roles_and_the_last_user_text():
    r = ChatRequest(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "sec"}, {"type": "text", "text": "ond"}]},
        {"role": "tool", "content": "42"},
    ])
    assert r.chat() == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "second"},
        {"role": "tool", "content": "42"},
    ]
    assert r.last_user_text() == "second"
    no_user = ChatRequest(messages=[{"role": "system", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert no_user.last_user_text() == "b"


def test_chat_refuses_what_it_cannot_serve():
    for bad in ([], [{"role": "robot", "content": "x"}], [{"role": "user"}]):
        with pytest.raises(ValidationError):
            ChatRequest(messages=bad)
    for part in ({"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": 3}, {"text": "no type"}):
        with pytest.raises(ValueError, match="only text content parts"):
            ChatMessage(role="user", content=[{"type": "text", "text": "ok"}, part]).text()


def test_error_bodies_and_ids_have_openai_shapes():
    assert error_body("bad", param="top_p") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "top_p", "code": None}}
    assert error_body("gone", "server_error", code="x")["error"] == {
        "message": "gone", "type": "server_error", "param": None, "code": "x"}
    a, b = new_id("chatcmpl"), new_id("chatcmpl")
    assert a.startswith("chatcmpl-") and len(a) == len("chatcmpl-") + 32 and a != b


def test_a_chat_is_bounded_in_messages_and_content_parts():
    from deployments.protocol import MAX_CONTENT_PARTS, MAX_MESSAGES, ChatRequest

    ChatRequest.model_validate({"messages": [{"role": "user", "content": ""}] * MAX_MESSAGES})
    with pytest.raises(ValidationError) as e:
        ChatRequest.model_validate({"messages": [{"role": "user", "content": ""}] * (MAX_MESSAGES + 1)})
    assert e.value.errors()[0]["loc"][0] == "messages"
    part = {"type": "text", "text": "a"}
    ChatRequest.model_validate({"messages": [{"role": "user", "content": [part] * MAX_CONTENT_PARTS}]})
    with pytest.raises(ValidationError, match="at most 64 content parts"):
        ChatRequest.model_validate({"messages": [{"role": "user", "content": [part] * (MAX_CONTENT_PARTS + 1)}]})


def test_text_that_is_not_unicode_is_refused_at_the_edge():
    """JSON lets a string hold a lone surrogate; the tokenizer cannot read one (it was a 500)."""
    bad = "ab\ud800c"
    with pytest.raises(ValidationError, match="lone surrogate at character 2"):
        completion(prompt=bad)
    with pytest.raises(ValidationError, match="not valid Unicode"):
        completion(prompt="ok", stop=["x", bad])
    with pytest.raises(ValidationError, match="not valid Unicode"):
        ChatRequest(messages=[{"role": "user", "content": bad}])
    with pytest.raises(ValueError, match="not valid Unicode"):
        ChatRequest(messages=[{"role": "user", "content": [{"type": "text", "text": bad}]}]).chat()
    assert completion(prompt="é 漢字 🙂").prompts == ["é 漢字 🙂"]  # every other character passes


@pytest.mark.parametrize("field,value", [
    ("best_of", 3), ("suffix", "x"), ("tools", [{"type": "function"}]),
    ("functions", [{"name": "f"}]), ("tool_choice", "required"), ("guided_grammar", "root ::= x"),
    ("tfs_z", 0.9), ("mirostat", 2), ("dry_multiplier", 0.8), ("n_probs", 3), ("use_beam_search", True), ("bad_words", ["x"]), ("allowed_token_ids", [1]),
    ("include_stop_str_in_output", True), ("skip_special_tokens", False)])
def test_what_changes_the_output_and_is_not_served_is_refused_not_ignored(field, value):
    for make in (lambda **kw: completion(prompt="Hi", **kw), lambda **kw: ChatRequest(messages=[{"role": "user", "content": "Hi"}], **kw)):
        with pytest.raises(ValidationError) as e:
            make(**{field: value})
        err = e.value.errors()[0]
        assert err["msg"].startswith(f"{field} is not supported") and err["ctx"]["param"] == field


def test_penalties_count_as_openais_unless_llama_cpps_names_are_sent():
    p = completion(prompt="Hi", frequency_penalty=1.0, repetition_penalty=1.2).sampling(8)
    assert (p.penalty_last_n, p.repetition_penalty, p.frequency_penalty) == (None, 1.2, 1.0)  # vLLM's and OpenAI's
    p = completion(prompt="Hi", frequency_penalty=1.0, repeat_penalty=1.2).sampling(8)
    assert (p.penalty_last_n, p.repetition_penalty, p.frequency_penalty) == (64, 1.2, 1.0)  # llama.cpp's window
    p = ChatRequest(messages=[{"role": "user", "content": "Hi"}], presence_penalty=0.5, repeat_last_n=-1).sampling(8)
    assert (p.penalty_last_n, p.repetition_penalty, p.presence_penalty) == (-1, 1.0, 0.5)
    assert completion(prompt="Hi", repeat_penalty=1.2, repetition_penalty=1.2).sampling(8).repetition_penalty == 1.2
    for bad in ({"repeat_penalty": 1.2, "repetition_penalty": 1.3}, {"repeat_last_n": -2}, {"repeat_penalty": 0}):
        with pytest.raises(ValidationError):
            completion(prompt="Hi", **bad)


def test_the_defaults_of_what_is_not_served_are_accepted():
    """Clients send defaults: every one of them passes."""
    defaults = {"logit_bias": {}, "frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                "echo": False, "best_of": 1, "suffix": None, "min_tokens": 0, "min_p": 0.0, "stop_token_ids": [],
                "response_format": {"type": "text"}, "tools": [], "functions": None, "tool_choice": "auto",
                "guided_json": None, "grammar": "", "repeat_penalty": 1.0, "typical_p": 1.0, "mirostat": 0,
                "top_n_sigma": -1.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "skip_special_tokens": True}
    assert completion(prompt="Hi", **defaults).prompts == ["Hi"]
    assert ChatRequest(messages=[{"role": "user", "content": "Hi"}], **defaults).n == 1


def test_logprobs_are_asked_as_openai_asks_them():
    msgs = [{"role": "user", "content": "Hi"}]
    assert ChatRequest(messages=msgs).sampling(8).logprobs is None
    assert ChatRequest(messages=msgs, logprobs=False, top_logprobs=0).sampling(8).logprobs is None
    assert ChatRequest(messages=msgs, logprobs=True).sampling(8).logprobs == 0
    assert ChatRequest(messages=msgs, logprobs=True, top_logprobs=16).sampling(8).logprobs == 16
    assert completion(prompt="Hi", logprobs=3).sampling(8).logprobs == 3 and completion(prompt="Hi").sampling(8).logprobs is None
    for bad in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 17}, {"logprobs": 1}):
        with pytest.raises(ValidationError):
            ChatRequest(messages=msgs, **bad)
    for bad in (17, -1, True, 2.0):
        with pytest.raises(ValidationError):
            completion(prompt="Hi", logprobs=bad)


def test_penalties_bias_min_p_and_token_stops_are_carried_over():
    p = completion(frequency_penalty=0.5, presence_penalty=-1.0, repetition_penalty=1.2, min_p=0.05,
                   logit_bias={"50": 100, "7": -100}, min_tokens=3, stop_token_ids=[2, 9]).sampling(8)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty, p.min_p) == (0.5, -1.0, 1.2, 0.05)
    assert p.logit_bias == {50: 100.0, 7: -100.0} and (p.min_tokens, p.stop_token_ids) == (3, [2, 9])
    assert p.processes_logits and sorted(p.token_ids()) == [2, 7, 9, 50]
    # llama.cpp's form of logit_bias: [[id, bias], ...]
    assert completion(logit_bias=[[5, 1.5], ["6", -2]]).sampling(8).logit_bias == {5: 1.5, 6: -2.0}
    bare = completion().sampling(8)
    assert not bare.processes_logits and bare.repetition_penalty == 1.0 and bare.min_p == 0.0
    assert not completion(min_p=0.3).sampling(8).processes_logits  # min-p is a filter of the warp


@pytest.mark.parametrize("field, value", [
    ("frequency_penalty", 2.5), ("presence_penalty", -2.01), ("repetition_penalty", 0.0), ("repetition_penalty", 5e-324),
    ("repetition_penalty", 0.0099), ("min_p", 1.5),
    ("min_p", math.nan), ("logit_bias", {"x": 1}), ("logit_bias", {"1": 101}), ("logit_bias", {"1": -101}), ("logit_bias", {"-1": 1}),
    ("logit_bias", [[1]]), ("logit_bias", [5]), ("logit_bias", {"1": True}), ("logit_bias", "1"), ("logit_bias", {str(i): 1 for i in range(1025)}),
    ("min_tokens", -1), ("stop_token_ids", [-1]), ("stop_token_ids", list(range(65)))])
def test_penalties_and_biases_out_of_range_are_refused(field, value):
    with pytest.raises(ValidationError) as e:
        completion(**{field: value})
    assert e.value.errors()[0]["loc"][0] == field


def test_min_tokens_past_max_tokens_is_refused():
    with pytest.raises(ValidationError, match="min_tokens"):
        completion(max_tokens=4, min_tokens=5).sampling(8)
    assert completion(max_tokens=4, min_tokens=4).sampling(8).min_tokens == 4


def test_structured_output_is_read_from_each_form_clients_send():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    forms = [
        (dict(response_format={"type": "json_object"}), Grammar(kind="json", source='{"type": "object"}')),
        (dict(response_format={"type": "json_object", "schema": schema}), Grammar(kind="json", source=json.dumps(schema))),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}),
         Grammar(kind="json", source=json.dumps(schema))),
        (dict(json_schema=schema), Grammar(kind="json", source=json.dumps(schema))),  # llama.cpp's
        (dict(guided_json=json.dumps(schema)), Grammar(kind="json", source=json.dumps(schema))),  # vLLM's, as text
        (dict(grammar='root ::= "yes" | "no"'), Grammar(kind="gbnf", source='root ::= "yes" | "no"')),
        (dict(guided_regex="[0-9]+"), Grammar(kind="regex", source="[0-9]+")),
        (dict(guided_choice=["a", "b c"]), Grammar(kind="choice", source='["a", "b c"]')),
    ]
    for fields, want in forms:
        assert completion(**fields).sampling(8).grammar == want, fields
        chat = ChatRequest(messages=[{"role": "user", "content": "Hi"}], **fields)
        assert chat.sampling(8).grammar == want and chat.sampling(8).processes_logits
    assert completion(response_format={"type": "text"}).sampling(8).grammar is None
    assert completion(grammar="").sampling(8).grammar is None  # llama.cpp's default: none
    assert completion(guided_choice=[], guided_json=None).sampling(8).grammar is None


@pytest.mark.parametrize("fields, message", [
    (dict(response_format={"type": "xml"}), "response_format type 'xml'"),
    (dict(response_format="json"), "response_format is an object"),
    (dict(response_format={"type": "json_schema"}), "needs json_schema.schema"),
    (dict(guided_json="{not json"), "guided_json is not valid JSON"),
    (dict(guided_json="[" * 100_000), "guided_json is not valid JSON"),  # nested past Python's recursion bound
    (dict(json_schema=[1]), "json_schema is a JSON schema"),
    (dict(guided_choice=["a", ""]), "guided_choice is a non-empty list"),
    (dict(guided_regex=5), "guided_regex is a string"),
    (dict(guided_regex="a", guided_json={"type": "object"}), "one structured output at a time"),
    (dict(guided_regex="a" * 65_537), "at most 65536 characters"),
    (dict(response_format={"type": "json_object"}, ignore_eos=True), "takes no ignore_eos or min_tokens"),
])
def test_structured_output_that_cannot_be_served_is_refused(fields, message):
    with pytest.raises(ValidationError, match=message):
        completion(**fields).sampling(8)


def test_prompt_logprobs_is_vllms_count_on_both_endpoints():
    assert completion(prompt_logprobs=0).prompt_logprobs == 0 and completion().prompt_logprobs is None
    assert ChatRequest(messages=[{"role": "user", "content": "Hi"}], prompt_logprobs=3).prompt_logprobs == 3
    for bad in (-1, 21, True, "2"):  # -1 (vLLM's whole vocabulary) is not served
        with pytest.raises(ValidationError):
            completion(prompt_logprobs=bad)


def test_echo_is_a_completions_field_with_or_without_logprobs():
    assert completion(echo=True).echo and completion(echo=False, logprobs=2).logprobs == 2
    assert completion(echo=True, logprobs=0).logprobs == 0  # the prompt's log-probabilities too
    with pytest.raises(ValidationError) as e:
        ChatRequest(messages=[{"role": "user", "content": "Hi"}], echo=True)
    assert e.value.errors()[0]["ctx"]["param"] == "echo"
    assert ChatRequest(messages=[{"role": "user", "content": "Hi"}], echo=False).n == 1  # its default passes


def test_llama_cpps_samplers_by_name_alias_or_letter_in_the_order_sent():
    from config.sampling import DEFAULT_ORDER, LLAMA_ORDER
    from deployments.protocol import LlamaCompletionRequest

    p = completion(samplers=["penalties", "dry", "Top-K", "typ", "nucleus", "min_p", "xtc", "temp"], typical_p=0.6,
                   top_n_sigma=1.5, xtc_probability=0.2, xtc_threshold=0.2, dynatemp_range=0.3, dynatemp_exponent=2.0,
                   min_keep=2, temperature=0.7).sampling(8)
    assert p.order == ("top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
    assert (p.typical_p, p.top_n_sigma, p.xtc_probability, p.xtc_threshold, p.dynatemp_range, p.dynatemp_exponent,
            p.min_keep) == (0.6, 1.5, 0.2, 0.2, 0.3, 2.0, 2)
    assert completion(samplers="ekyt").sampling(8).order == ("top_k", "typ_p", "temperature")  # llama.cpp's letters
    assert completion().sampling(8).order == DEFAULT_ORDER  # the OpenAI endpoints: vLLM's order, then llama.cpp's extras
    assert LlamaCompletionRequest(prompt="Hi").sampling(8).order == LLAMA_ORDER  # llama-server's own: its order
    chat = ChatRequest(messages=[{"role": "user", "content": "Hi"}], typical_p=0.5, temperature=0.5).sampling(8)
    assert chat.typical_p == 0.5 and chat.order == DEFAULT_ORDER


@pytest.mark.parametrize("body,says", [
    ({"samplers": ["top_k", "mirostat"]}, "not a sampler this server serves"),
    ({"samplers": ["top_k", "adaptive_p"]}, "not a sampler this server serves"),
    ({"samplers": "kq"}, "not a sampler this server serves"),
    ({"samplers": ["top_k", "topk"]}, "at most once"),
    ({"samplers": [1, 2]}, "samplers"),
    ({"samplers": ["top_k", "penalties"], "frequency_penalty": 0.5}, "name it first"),
    ({"samplers": ["top_k", "temperature"], "presence_penalty": 0.5}, "leaves out 'penalties'"),
    ({"xtc_probability": 0.5, "temperature": 0}, "temperature above 0"),
    ({"typical_p": 0}, "greater than 0"),
])
def test_samplers_that_would_be_served_otherwise_than_asked_are_refused(body, says):
    with pytest.raises(ValueError, match=says):
        completion(**body).sampling(8)
    ok = completion(samplers=["top_k", "penalties"]).sampling(8)  # no penalty on: where the list names them is moot
    assert ok.order == ("top_k",) and ok.chain == ("top_k", "penalties")
