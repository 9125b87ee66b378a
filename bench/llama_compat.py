"""``python -m bench.llama_compat``: llama-server's own completion API (``POST /completion``)
sent to this server and to a llama-server side by side, the same requests to both, and what
differs in the answers.

For each prompt of the workload (``--workload``, ``--domains``), four requests to each server: a
greedy one whole (``n_probs``, ``return_tokens``), the same streamed, one with a stop word taken
from llama-server's own greedy text, and one with llama-server's defaults (no sampling fields);
then the greedy one again with llama.cpp's penalties (``repeat_penalty``, ``repeat_last_n``,
``frequency_penalty``), then the greedy pair again on the prompt as a templated chat (llama-server's ``/apply-template``)
with four times the tokens, where answers end at the end of sequence, ``/apply-template`` of a chat of each prompt,
and ``GET /props``; last, the fields llama-server's OpenAI answers (chat and completions, whole
and streamed) carry that ours lack.
Reported: the fields llama-server's answers carry that ours lack (results, streamed chunks, the
last streamed event, ``/props``), how many templated chats are the same text, where the greedy
texts agree whether the counts do too (the predicted tokens with an end of sequence among them,
``tokens_predicted``, ``tokens_cached``, ``stop_type``, the log-probability entries' ids and the
ids streamed) and, whatever the text, whether each server's answers obey llama-server's counting
rules (:func:`_count_rules`), how many streamed chunks carry exactly one token id (llama-server
sends a chunk a token; so do both servers' OpenAI streams, counted against the usage's tokens),
whether both streams are framed alike (``stop`` false then true, no
``[DONE]``), ``stop_type`` and ``stopping_word`` agreement on the stop-word requests, and how
often the greedy texts agree (the same weights, computed differently: llama.cpp keeps activation
scales and, in attention, queries in float16 where we do not, so a near-tie can flip and equality
is not expected of every prompt; ``python -m bench.quality --reference llamacpp`` measures how
often, and llama.cpp's own two attention paths differ as much).
"""

from __future__ import annotations

import argparse
import json
import urllib.request

from bench.bench import write_json


def _post(url: str, body: dict, key: str | None) -> tuple[object, list | None]:
    """(the JSON answer, None) or, streamed, (None, its events: JSON, or the raw text of a non-JSON one)."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=300) as r:
        text = r.read().decode()
    if not body.get("stream"):
        return json.loads(text), None
    events = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            try:
                events.append(json.loads(payload))
            except ValueError:
                events.append(payload)
    return None, events


def _post_any(url: str, path: str, body: dict, key: str | None):
    """An OpenAI endpoint's answer: the JSON, or a stream's JSON events (``[DONE]`` left out)."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=300) as r:
        text = r.read().decode()
    if not body.get("stream"):
        return json.loads(text)
    return [json.loads(b[6:]) for b in text.split("\n\n") if b.startswith("data: ") and b[6:].strip() != "[DONE]"]


def _paths(obj, prefix: str = "") -> set[str]:
    """Every key path of a JSON object (``a.b``; a list's objects as ``a[].b``, from its first)."""
    out: set[str] = set()
    for k, v in obj.items():
        out.add(prefix + k)
        if isinstance(v, dict):
            out |= _paths(v, f"{prefix}{k}.")
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            out |= _paths(v[0], f"{prefix}{k}[].")
    return out


def openai_missing(ours: str, llama: str, prompt: str, key: str | None) -> dict:
    """The key paths llama-server's OpenAI answers carry and ours lack: chat and completions, whole
    and streamed (with usage), greedy with log-probabilities."""
    asks = {"/v1/chat/completions": {"messages": [{"role": "user", "content": prompt}], "logprobs": True, "top_logprobs": 2},
            "/v1/completions": {"prompt": prompt, "logprobs": 2}}
    out = {}
    for path, ask in asks.items():
        for stream in (False, True):
            body = {**ask, "max_tokens": 8, "temperature": 0, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            a, b = _post_any(ours, path, body, key), _post_any(llama, path, body, None)
            pa = _paths(a) if not stream else set().union(*map(_paths, a))
            pb = _paths(b) if not stream else set().union(*map(_paths, b))
            out[f"{path} {'stream' if stream else 'whole'}"] = sorted(pb - pa)
    return out


def _get(url: str, path: str, key: str | None) -> dict:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _post_json(url: str, path: str, body: dict, key: str | None) -> dict:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _missing(theirs: dict, ours: dict, prefix: str = "") -> list[str]:
    """Keys (nested ones dotted) llama-server's object has and ours lacks."""
    out = []
    for k, v in theirs.items():
        if k not in ours:
            out.append(prefix + k)
        elif isinstance(v, dict) and isinstance(ours[k], dict):
            out += _missing(v, ours[k], f"{prefix}{k}.")
    return out


def _counts(whole: dict, events: list) -> dict:
    """What a client counts in a greedy answer (whole, and its stream's events)."""
    return {"tokens_evaluated": whole.get("tokens_evaluated"), "tokens": whole.get("tokens"),
            "tokens_predicted": whole.get("tokens_predicted"),
            "tokens_cached": whole.get("tokens_cached"), "stop_type": whole.get("stop_type"),
            "probability_ids": [p["id"] for p in whole.get("completion_probabilities", [])],
            "streamed_tokens": [t for e in events if isinstance(e, dict) for t in e.get("tokens", [])]}


def _counts_differ(a: dict, sa: list, b: dict, sb: list) -> list[str] | None:
    """The counts that differ where both greedy texts are the same (None: the texts differ); the
    streamed ids only where the streamed texts are the same too (a server's stream may decode a
    near-tie otherwise than its whole answer did: llama-server's reuse of its prompt cache
    changes its arithmetic)."""
    if a["content"] != b["content"]:
        return None
    ca, cb = _counts(a, sa), _counts(b, sb)
    if _text(sa) != _text(sb):
        del ca["streamed_tokens"], cb["streamed_tokens"]
    return [k for k in ca if ca[k] != cb[k]]


def _count_rules(whole: dict, events: list) -> bool:
    """llama-server's counting, which holds whatever text was decoded: every predicted token (an
    end of sequence among them, as an empty piece last) is in ``tokens`` and in the log-probability
    entries, the cache holds all but the last, and a stream carries the same ids as the whole
    answer where it decoded the same text."""
    c, probs = _counts(whole, events), whole.get("completion_probabilities", [])
    n = c["tokens_predicted"]
    return (n == len(c["tokens"] or []) == len(probs) and c["probability_ids"] == c["tokens"]
            and c["tokens_cached"] == c["tokens_evaluated"] + n - 1
            and (c["stop_type"] != "eos" or (n > 0 and probs[-1]["token"] == ""))
            and (_text(events) != whole.get("content") or c["streamed_tokens"] == c["tokens"]))


def _text(events: list) -> str:
    return "".join(e.get("content", "") for e in events if isinstance(e, dict))


def _one_id_chunks(events: list) -> tuple[int, int]:
    """(partial chunks that carry token ids, those that carry exactly one): llama-server sends a
    chunk a token, so a client may count its chunks as tokens."""
    ids = [len(e["tokens"]) for e in events[:-1] if isinstance(e, dict) and e.get("tokens")]
    return len(ids), sum(n == 1 for n in ids)


def openai_chunks(ours: str, llama: str, prompts: list[str], key: str | None, max_tokens: int = 24) -> dict:
    """Per server, over greedy streamed ``/v1/completions`` of ``prompts``: chunks with text, and
    the completion tokens the usage counts (equal where a chunk carries a token)."""
    out = {"ours": [0, 0], "llama": [0, 0]}
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        for side, url, k in (("ours", ours, key), ("llama", llama, None)):
            events = _post_any(url, "/v1/completions", body, k)
            out[side][0] += sum(bool(e["choices"] and e["choices"][0].get("text")) for e in events)
            out[side][1] += next(e["usage"]["completion_tokens"] for e in events if e.get("usage"))
    return {side: {"text_chunks": v[0], "completion_tokens": v[1]} for side, v in out.items()}


def _framed(events: list) -> bool:
    return (bool(events) and all(isinstance(e, dict) for e in events) and events[-1].get("stop") is True
            and not any(e.get("stop") for e in events[:-1]))


def compare(ours: str, llama: str, prompts: list[str], max_tokens: int, key: str | None) -> dict:
    missing: dict[str, set] = {"result": set(), "chunk": set(), "final": set(), "probability": set()}
    framed = {"ours": 0, "llama": 0}
    same_text = same_stop = defaults_ok = same_penalised = penalised_changed = 0
    counts = {"raw": [0, 0], "chat": [0, 0]}  # [counts equal, texts equal]
    rules = {"ours": 0, "llama": 0}  # greedy answers (raw and chat) that count as llama-server does
    one_id = {"ours": [0, 0], "llama": [0, 0]}  # streamed chunks with ids, and with one id
    rows = []
    for prompt in prompts:
        greedy = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "n_probs": 2, "return_tokens": True}
        a, _ = _post(ours, greedy, key)
        b, _ = _post(llama, greedy, None)
        assert isinstance(a, dict) and isinstance(b, dict)
        missing["result"] |= set(_missing(b, a))
        if a.get("completion_probabilities") and b.get("completion_probabilities"):
            missing["probability"] |= set(_missing(b["completion_probabilities"][0], a["completion_probabilities"][0]))
        _, sa = _post(ours, {**greedy, "stream": True}, key)
        _, sb = _post(llama, {**greedy, "stream": True}, None)
        assert sa is not None and sb is not None
        framed["ours"] += _framed(sa)
        framed["llama"] += _framed(sb)
        if len(sa) > 1 and len(sb) > 1 and isinstance(sa[0], dict) and isinstance(sb[0], dict):
            missing["chunk"] |= set(_missing(sb[0], sa[0]))
        if isinstance(sa[-1], dict) and isinstance(sb[-1], dict):
            missing["final"] |= set(_missing(sb[-1], sa[-1]))
        same_text += a["content"] == b["content"]
        templated = _post_json(llama, "/apply-template", {"messages": [{"role": "user", "content": prompt}]}, None)["prompt"]
        chat = {**greedy, "prompt": templated, "n_predict": 4 * max_tokens}  # room for a chat's answer to end
        (ac, _), (bc, _) = _post(ours, chat, key), _post(llama, chat, None)
        (_, sac), (_, sbc) = _post(ours, {**chat, "stream": True}, key), _post(llama, {**chat, "stream": True}, None)
        assert isinstance(ac, dict) and isinstance(bc, dict) and sac is not None and sbc is not None
        differ = {"raw": _counts_differ(a, sa, b, sb), "chat": _counts_differ(ac, sac, bc, sbc)}
        for side, pairs in (("ours", ((a, sa), (ac, sac))), ("llama", ((b, sb), (bc, sbc)))):
            rules[side] += sum(_count_rules(w, ev) for w, ev in pairs)
            for _, ev in pairs:
                chunks, one = _one_id_chunks(ev)
                one_id[side][0] += chunks
                one_id[side][1] += one
        for kind, d in differ.items():
            if d is not None:
                counts[kind][0] += not d
                counts[kind][1] += 1
        words = b["content"].split()
        word = words[len(words) // 2] if len(words) > 2 else None
        stop_row = None
        if word:
            body = {**greedy, "stop": [word]}
            a2, _ = _post(ours, body, key)
            b2, _ = _post(llama, body, None)
            assert isinstance(a2, dict) and isinstance(b2, dict)
            stop_row = {"word": word, "ours": [a2["stop_type"], a2["stopping_word"]], "llama": [b2["stop_type"], b2["stopping_word"]]}
            # the same word where both texts hold it; else each stops as its own text says
            same_stop += (a2["stop_type"], a2["stopping_word"]) == (b2["stop_type"], b2["stopping_word"])
        # llama.cpp's penalties (over the last repeat_last_n tokens, the prompt's among them), greedy
        penalised = {**greedy, "repeat_penalty": 1.3, "repeat_last_n": 16, "frequency_penalty": 0.2}
        ap, _ = _post(ours, penalised, key)
        bp, _ = _post(llama, penalised, None)
        assert isinstance(ap, dict) and isinstance(bp, dict)
        same_penalised += ap["content"] == bp["content"]
        penalised_changed += bp["content"] != b["content"]
        a3, _ = _post(ours, {"prompt": prompt, "n_predict": 8}, key)
        b3, _ = _post(llama, {"prompt": prompt, "n_predict": 8}, None)
        assert isinstance(a3, dict) and isinstance(b3, dict)
        keys = ("temperature", "top_k", "top_p", "min_p")
        # llama-server writes its settings as float32 (0.95 as 0.949999988)
        defaults_ok += all(abs(float(a3["generation_settings"][k]) - float(b3["generation_settings"][k])) < 1e-6 for k in keys)
        rows.append({"prompt": prompt[:80], "same_text": a["content"] == b["content"], "ours": a["content"][:120],
                     "llama": b["content"][:120], "stop": stop_row,
                     "tokens_predicted": [a["tokens_predicted"], b["tokens_predicted"]], "counts_differ": differ,
                     "chat_stop_type": [ac["stop_type"], bc["stop_type"]], "chat_same_text": ac["content"] == bc["content"]})
    # GET /props, and POST /apply-template of a chat of each prompt
    props_missing = _missing(_get(llama, "/props", None), _get(ours, "/props", key))
    same_template = 0
    for prompt in prompts:
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
        a4, b4 = _post_json(ours, "/apply-template", {"messages": msgs}, key), _post_json(llama, "/apply-template", {"messages": msgs}, None)
        same_template += a4["prompt"] == b4["prompt"]
    n = len(prompts)
    return {"prompts": n, "max_tokens": max_tokens, "props_missing_fields": props_missing, "apply_template_equal": same_template,
            "missing_fields": {k: sorted(v) for k, v in missing.items()},
            "streams_framed_alike": framed, "greedy_text_equal": same_text,
            "penalised_greedy_text_equal": same_penalised, "penalties_changed_llama_servers_text": penalised_changed,
            "counts_equal_where_text_equal": {k: {"equal": v[0], "of": v[1]} for k, v in counts.items()},
            "count_rules_hold": {**rules, "of": 2 * n},
            "stream_chunks_with_one_id": {k: {"one": v[1], "of": v[0]} for k, v in one_id.items()},
            "chat_ended_at_eos": {"ours": sum(r["chat_stop_type"][0] == "eos" for r in rows),
                                  "llama": sum(r["chat_stop_type"][1] == "eos" for r in rows)},
            "stop_word_requests": sum(r["stop"] is not None for r in rows), "stop_type_and_word_equal": same_stop,
            "default_sampling_equal": defaults_ok, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.llama_compat", description=__doc__.split("\n\n")[0])
    p.add_argument("--ours", default="http://127.0.0.1:8000")
    p.add_argument("--llama", default="http://127.0.0.1:8090")
    p.add_argument("--key", default=None, help="this server's API key, if it has keys")
    p.add_argument("--workload", default="bench/data/open.jsonl")
    p.add_argument("--domains", nargs="+", default=["sql", "code", "chat"])
    p.add_argument("--n", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    records = [json.loads(line) for line in open(a.workload)]
    by_domain = {d: [r["text"][:1500] for r in records if r.get("domain") == d] for d in a.domains}
    prompts = [t for group in zip(*by_domain.values()) for t in group][: a.n]
    out = compare(a.ours, a.llama, prompts, a.max_tokens, a.key)
    out["openai_missing_fields"] = openai_missing(a.ours, a.llama, prompts[0], a.key)
    out["openai_stream_chunks"] = openai_chunks(a.ours, a.llama, prompts, a.key, a.max_tokens)
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=1))
    write_json(out, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
