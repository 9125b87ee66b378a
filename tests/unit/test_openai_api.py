"""OpenAI's and vLLM's response shapes, as pure functions: hand-made cases."""

from __future__ import annotations

import pytest

from deployments.openai_api import echo_scores, finite, logprobs, merged_usage, prompt_logprobs, usage

TEXT = {1: "a", 2: "bc", 3: "é", 4: ""}


def decode(ids: list[int]) -> str:
    return "".join(TEXT[i] for i in ids)


def test_the_legacy_columns_offset_each_token_by_the_characters_before():
    lps = [(-0.5, [(1, -0.5), (2, -1.0)]), (float("-inf"), [(2, -0.1)]), (-1.5, [])]
    out = logprobs(decode, [1, 2, 3], lps, chat=False, offset=10)
    content = out.pop("content")  # llama-server's form of the same, beside OpenAI's columns
    assert out == {"tokens": ["a", "bc", "é"], "token_logprobs": [-0.5, -9999.0, -1.5],
                   "top_logprobs": [{"a": -0.5, "bc": -1.0}, {"bc": -0.1}, {}], "text_offset": [10, 11, 13]}
    assert [(e["id"], e["token"], e["logprob"]) for e in content] == [(1, "a", -0.5), (2, "bc", -9999.0), (3, "é", -1.5)]
    assert [[(t["id"], t["logprob"]) for t in e["top_logprobs"]] for e in content] == [[(1, -0.5), (2, -1.0)], [(2, -0.1)], []]
    echoed = logprobs(decode, *echo_scores([2, 1], [(-0.25, [(1, -0.25), (3, -2.0)], 1)], 1), chat=False)
    content = echoed.pop("content")
    assert echoed == {"tokens": ["bc", "a"], "token_logprobs": [None, -0.25], "top_logprobs": [None, {"a": -0.25}],
                      "text_offset": [0, 2]}
    assert [(e["id"], e["logprob"], len(e["top_logprobs"])) for e in content] == [(2, None, 0), (1, -0.25, 1)]


def test_chat_entries_carry_bytes_and_their_most_likely_tokens():
    out = logprobs(decode, [3], [(-0.5, [(3, -0.5), (1, -3.0)])], chat=True)
    assert out == {"refusal": None, "content": [
        {"id": 3, "token": "é", "logprob": -0.5, "bytes": [195, 169],
         "top_logprobs": [{"id": 3, "token": "é", "logprob": -0.5, "bytes": [195, 169]},
                          {"id": 1, "token": "a", "logprob": -3.0, "bytes": [97]}]}]}
    assert finite(float("-inf")) == -9999.0 and finite(-12.5) == -12.5 and finite(-9999.5) == -9999.0


def test_vllms_prompt_logprobs_hold_the_token_and_the_most_likely_with_ranks():
    scores = [(-0.1, [(2, -0.1), (3, -2.5)], 1), (-4.0, [(1, -0.2), (2, -1.0)], 5)]
    out = prompt_logprobs(decode, [1, 2, 3], scores, 2)
    assert out[0] is None
    assert out[1] == {"2": {"logprob": -0.1, "rank": 1, "decoded_token": "bc"},
                      "3": {"logprob": -2.5, "rank": 2, "decoded_token": "é"}}
    assert out[2] == {"3": {"logprob": -4.0, "rank": 5, "decoded_token": "é"},
                      "1": {"logprob": -0.2, "rank": 1, "decoded_token": "a"},
                      "2": {"logprob": -1.0, "rank": 2, "decoded_token": "bc"}}
    assert prompt_logprobs(decode, [1, 2, 3], scores, 0) == [None, {"2": out[1]["2"]}, {"3": out[2]["3"]}]


def test_several_choices_count_each_prompt_once_and_sum_the_speculation():
    def u(p, c, cached, proposed, accepted, steps):
        return {"prompt_tokens": p, "completion_tokens": c, "prompt_tokens_details": {"cached_tokens": cached},
                "speculative": {"proposed": proposed, "accepted": accepted, "steps": steps}}
    one = u(5, 3, 2, 4, 1, 3)
    assert merged_usage([True], [one]) == usage(one) == {**one, "total_tokens": 8}
    out = merged_usage([True, False, True], [one, u(5, 2, 4, 0, 0, 2), u(7, 1, 0, 6, 3, 1)])
    assert (out["prompt_tokens"], out["completion_tokens"], out["total_tokens"]) == (12, 6, 18)
    assert out["prompt_tokens_details"] == {"cached_tokens": 2}
    spec = out["speculative"]
    assert (spec["proposed"], spec["accepted"], spec["steps"]) == (10, 4, 6) and spec["alpha"] == pytest.approx(0.4)
    assert len(spec["choices"]) == 3
    assert merged_usage([True, True], [u(1, 1, 0, 0, 0, 1), u(1, 1, 0, 0, 0, 1)])["speculative"]["alpha"] is None
