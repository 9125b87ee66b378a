"""The mixture experiment on the tiny engine with the real router features (MiniLM + py3langid):
per-domain drafts are forked and trained, routes are recorded, every method serves the same stream."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from workloads import WorkloadRecord
from config import RouterConfig, SamplingParams
from drafts.build import truncated_draft
from router.router import named_draft_id
from learner.trainer import LearnerConfig

torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SQL = ["Write the SQL query: how many singers are there?", "Write the SQL query: list the names of all stadiums.",
       "Write the SQL query: count the concerts in 2014.", "Write the SQL query: show the average age of singers.",
       "Write the SQL query: which stadium has the most concerts?", "Write the SQL query: list all song names.",
       "Write the SQL query: show name and country of every singer.", "Write the SQL query: the oldest singer's age."]
EN = ["Hello, how are you today?", "What is artificial intelligence?", "Do you have feelings of your own?",
      "What is your favourite colour?", "I really like classical music.", "Where do you live right now?",
      "Good morning, how is work going?", "Can you tell me a short joke?"]
ES = ["Hola, ¿cómo estás hoy?", "¿Qué es la inteligencia artificial?", "¿Tienes sentimientos propios?",
      "¿Cuál es tu color favorito?", "Me gusta mucho la música clásica.", "¿Dónde vives ahora mismo?",
      "Buenos días, ¿qué tal el trabajo?", "¿Puedes contarme un chiste corto?"]


def _recs(texts, domain, lang, tag):
    return [WorkloadRecord(t + tag, domain, lang, "test") for t in texts]


def test_mixture_forks_per_domain_drafts_and_serves_every_record(target, make_engine, draft_proposer, extractor, tmp_path):
    from bench.mixture import format_mixture, label_of, mixed_stream, plot_mixture, run_mixture

    start = truncated_draft(target, 1)

    def factory():
        return make_engine(draft_proposer(copy.deepcopy(start)), k=3)

    # chat in Spanish is its own mode, apart from chat in English
    stream = _recs(SQL[:6], "sql", "en", "") + _recs(EN[:6], "chat", "en", "") + _recs(ES[:6], "chat", "es", "")
    train = (_recs(SQL, "sql", "en", " (train)") + _recs(EN, "chat", "en", " (train)") + _recs(ES, "chat", "es", " (train)")
             + stream[:2]  # overlap is dropped
             + [WorkloadRecord("Write an essay on the history of print.", "chat", "en", "sharegpt:1")])  # background
    lcfg = LearnerConfig(train_every=3, batch_records=4, steps_per_round=2, lr=1e-3, holdout_fraction=0.0, positions="all")
    rcfg = RouterConfig(drafts={"spawn_min_records": 3, "spawn_window": 20, "spawn_alpha": 1.0, "spawn_min_tokens": 1}, clusters={"min_cluster_size": 2})
    res = run_mixture(factory, stream, train, lcfg, rcfg, n_per_label=6, max_tokens=6, k=3, window=4,
                      extractor=extractor, log=None)
    assert res["labels"] == {"sql": 6, "chat/en": 6, "chat/es": 6} and res["train_records"] == 25
    m = res["methods"]
    for e in m.values():
        assert [r["label"] for r in e["rows"]] == [label_of(r) for r in mixed_stream(stream, 6, 0)]
        assert e["rounds"] == 18 // 3
    assert m["single"]["drafts_final"] == ["general"] and not m["single"]["spawned"]
    sup = m["supervised"]
    assert {s["domain"] for s in sup["spawned"]} == {"sql", "chat", "chat/es"}
    # a domain's own draft serves its queries (beside the general one, which the bandit may pick
    # too: here the forks are equally useless) and never the other domain's
    # (the "chat" draft may also serve chat/es, its sub-domain, when the bandit finds it better)
    for dom, must, may in (("sql", "sql", {"sql"}), ("chat", "chat/en", {"chat/en", "chat/es"}), ("chat/es", "chat/es", {"chat/es"})):
        served = {r["label"] for r in sup["rows"] if r["draft"] == named_draft_id(dom)}
        assert must in served and served <= may, (dom, served)
    assert m["clusters"]["spawned"], m["clusters"]["router"]  # spawn_alpha 1.0: every busy cluster gets a draft
    # the oracle: every draft in memory scored on every request; the routed one's = what serving measured
    for name, e in m.items():
        assert e["counterfactual_mismatches"] == 0 and e["oracle_skipped"] is None
        for r in e["rows"]:
            assert "general" in r["alpha_by_draft"] and "counterfactual_routed" not in r  # never replaced by the measured
        for part in ("all", "second_half"):
            assert e["routed_alpha"][part] <= e["oracle_alpha"][part] and e["accepted_vs_oracle"][part] <= 1
            for lb in res["labels"]:
                assert (e["oracle_label"][lb]["accepted_vs_oracle"][part] or 0) <= 1
        assert e["routed_alpha"]["all"] == e["mean_alpha"] and e["routed_alpha"]["second_half"] == e["second_half_alpha"]
    one = m["single"]  # one draft in memory: the oracle is the routed draft
    assert all(list(r["alpha_by_draft"]) == ["general"] for r in one["rows"])
    assert one["oracle_alpha"] == one["routed_alpha"] and one["routed_vs_oracle"]["all"] == 1.0
    assert one["oracle_other"]["all"] == 0
    # the forks are in memory from the request that spawned them on
    sup_rows = sup["rows"]
    assert max(len(r["alpha_by_draft"]) for r in sup_rows) == 1 + len(sup["spawned"])
    for s in sup["spawned"]:
        assert all((s["draft"] in r["alpha_by_draft"]) == (r["i"] >= s["at"]) for r in sup_rows)
    assert "supervised" in format_mixture(res) and "oracle" in format_mixture(res)
    assert plot_mixture(res, tmp_path / "m.png").stat().st_size > 0


PUZZLES = ["Unscramble these letters into a word: t-a-c", "Unscramble these letters into a word: g-o-d",
           "Unscramble these letters into a word: s-i-f-h", "Unscramble these letters into a word: e-t-r-e"]


def test_the_open_set_router_names_what_it_knows_and_clusters_the_rest(target, make_engine, draft_proposer, extractor):
    """``both``: a query of a named domain gets that domain's own draft as in ``supervised``; a query
    of a kind no label names goes to its online cluster as in ``clusters``; route accuracy counts the
    named routes only."""
    from bench.mixture import run_mixture

    start = truncated_draft(target, 1)

    def factory():
        return make_engine(draft_proposer(copy.deepcopy(start)), k=3)

    stream = _recs(SQL[:4], "sql", "en", "") + _recs(PUZZLES, "puzzle", "en", "")
    general = ["Write an essay on the history of print.", "Draft a cover letter for a nursing job.",
               "Summarize the plot of Hamlet in three sentences.", "Give me a weekly workout plan."]
    train = (_recs(SQL, "sql", "en", " (train)") + _recs(EN, "chat", "en", " (train)")
             + [WorkloadRecord(t, "chat", "en", f"sharegpt:{i}") for i, t in enumerate(general)])  # background
    lcfg = LearnerConfig(train_every=4, batch_records=4, steps_per_round=1, lr=1e-3, holdout_fraction=0.0, positions="all")
    rcfg = RouterConfig(drafts={"spawn_min_records": 2, "spawn_window": 20, "spawn_alpha": 1.0, "spawn_min_tokens": 1}, clusters={"min_cluster_size": 2})
    res = run_mixture(factory, stream, train, lcfg, rcfg, methods=["both"], n_per_label=4, max_tokens=6, k=3, window=4,
                      extractor=extractor, log=None)
    both = res["methods"]["both"]
    named = [r for r in both["rows"] if r["cluster"] is None]
    clustered = [r for r in both["rows"] if r["cluster"] is not None]
    assert [r["label"] for r in named] == ["sql"] * 4 and {r["route_domain"] for r in named} == {"sql"}
    assert [r["label"] for r in clustered] == ["puzzle"] * 4
    assert all(r["route_domain"].startswith(f"c{r['cluster']}") for r in clustered)
    assert [s["draft"] for s in both["spawned"] if s["domain"] == "sql"] == ["d-sql"]
    # its own draft from its first query on (the bandit may still try the general one); never a cluster's
    assert named[0]["draft"] == "d-sql"
    assert {r["draft"] for r in named} <= {"general", "d-sql"} and "d-sql" not in {r["draft"] for r in clustered}
    assert both["route_accuracy"] == 1.0 and both["routed_share"] == 0.5


def test_unknown_method_rejected(extractor):
    from bench.mixture import run_mixture

    with pytest.raises(ValueError):
        run_mixture(lambda: None, _recs(SQL, "sql", "en", ""), [], methods=["bogus"], extractor=extractor, log=None)


def test_mixture_with_the_controller_drafts_from_each_drafts_suffix_tree(target, make_engine, draft_proposer, extractor):
    """--controller: every routed draft runs beside a suffix tree of its own; a stream that repeats
    its queries gets them drafted from the first answers, and alpha counts those steps."""
    from bench.mixture import format_mixture, run_mixture

    start = truncated_draft(target, 1)

    def factory():
        return make_engine(draft_proposer(copy.deepcopy(start)), k=3)

    stream = _recs(SQL[:4], "sql", "en", "") * 2
    lcfg = LearnerConfig(train_every=4, batch_records=4, steps_per_round=1, lr=1e-3, holdout_fraction=0.0, positions="all")
    res = run_mixture(factory, stream, [], lcfg, RouterConfig(), methods=["single"], n_per_label=None, max_tokens=8,
                      k=3, window=4, extractor=extractor, log=None, controller=True)
    rows = res["methods"]["single"]["rows"]
    assert res["controller"] and len(rows) == 8
    e = res["methods"]["single"]  # other proposers draft some steps: no oracle
    assert e["oracle_skipped"] and e["routed_vs_oracle"] is None and all(r["alpha_by_draft"] is None for r in rows)
    assert "skipped" in format_mixture(res)
    assert sum(r["accepted"] for r in rows[4:]) > sum(r["accepted"] for r in rows[:4])


# -- the oracle: every draft in memory scored in hindsight ------------------------------------------


def test_counterfactual_counts_by_hand():
    """The engine's step accounting: k capped by the tokens left, the EOS step ends the request."""
    from bench.mixture import counterfactual_counts

    def run(pred, n_out, max_tokens, k, eos):
        return counterfactual_counts(lambda j: pred[j], lambda j: 0, n_out, max_tokens, k, eos)

    right, wrong = [0] * 20, [1] * 20
    # max_tokens 6, k 4: 4 accepted + 1 -> the last token is the target's alone (no room to draft)
    assert run(right, 6, 6, 4, False) == (4, 4)
    # every step rejected: k proposed while 4 fit, then 3, 2, 1, then a step with none
    assert run(wrong, 6, 6, 4, False) == (0, 4 + 4 + 3 + 2 + 1)
    # an output cut short of max_tokens but not at EOS (the context window): counted to its end
    assert run(wrong, 2, 10, 4, False) == (0, 8)
    # EOS at output index 2: the draft that agrees keeps going past it (the engine compares all k)
    assert run(right, 2, 10, 4, True) == (4, 4)
    # ... and one that is wrong at the EOS: 2 accepted, the target's EOS ends it
    assert run([0, 0, 1, 0, 0], 2, 10, 4, True) == (2, 4)
    # after a step that ends just before the EOS, the next step proposes and ends at the EOS
    assert run([0, 1, 1, 1, 1], 2, 10, 3, True) == (1, 6)


@pytest.fixture(scope="module")
def eos_target(make_llama):
    """The shared target's weights with token 38 as EOS: some greedy outputs end at EOS, some at max_tokens."""
    return make_llama(3, 0, eos_token_id=38)


def _engines(eos_target, make_engine, draft_proposer, make_llama, k):
    from speculative import ModelRunner

    from drafts.build import restrict_head

    target = ModelRunner(eos_target, name="target")  # shared, as in the experiment
    drafts = {"t1": truncated_draft(eos_target, 1), "t2": truncated_draft(eos_target, 2),
              "copy": copy.deepcopy(eos_target), "other": make_llama(1, 7)}  # copy: agrees with the target
    # a copy whose head covers the vocabulary in another order: its ids go through the vocab map
    V = eos_target.config.vocab_size
    keep = torch.randperm(V, generator=torch.Generator().manual_seed(0))
    maps = {"mapped": keep}
    drafts["mapped"] = restrict_head(copy.deepcopy(eos_target), keep)
    out = {}
    for d, m in drafts.items():
        eng = make_engine(draft_proposer(m, maps.get(d)), model=eos_target, k=k)
        eng.target = target
        out[d] = eng
    return out


@pytest.mark.parametrize("k", [3, 4])
def test_counterfactual_equals_what_serving_each_draft_measures(eos_target, make_engine, draft_proposer, make_llama, k):
    """Serve every request with every draft: the output is the same (greedy), and each draft's
    counterfactual, computed from any one serving, equals its measured (accepted, proposed):
    requests ending at EOS (a draft agreeing past it) and at max_tokens, near the budget's end."""
    from bench.harness import serve_recorded
    from bench.mixture import alpha_by_draft, counterfactual_skip_reason
    from config import SamplingParams

    engines = _engines(eos_target, make_engine, draft_proposer, make_llama, k)
    assert all(counterfactual_skip_reason(e) is None for e in engines.values())
    ends = set()
    for text in SQL[:2] + EN[:2] + ES[:2]:
        for max_tokens in (5, 14, 20):
            params = SamplingParams(max_tokens=max_tokens)
            served = {d: serve_recorded(e, text, params) for d, e in engines.items()}
            outs = {tuple(g.token_ids) for _, _, _, g in served.values()}
            assert len(outs) == 1, text
            rec, _, _, gen = served["t1"]
            ends.add(gen.finish_reason)
            cf = alpha_by_draft(engines, rec.tokens[: rec.prompt_len].tolist(), gen.token_ids, gen.finish_reason, params)
            assert cf == {d: [a, p] for d, (_, a, p, _) in served.items()}, (text, max_tokens)
            assert cf["copy"][0] > 0 and cf["copy"][0] >= max(a for a, _ in cf.values())
    assert ends == {"stop", "length"}
    # no scratch cache left behind in any draft or the target
    assert all(len(e.learned_draft.runner) == 0 for e in engines.values())
    assert len(next(iter(engines.values())).target) == 0


def test_oracle_skipped_with_the_controller_or_adaptive_k(target, make_engine, draft_proposer):
    from bench.mixture import alpha_by_draft, counterfactual_skip_reason
    from config import KPolicyConfig

    plain = make_engine(draft_proposer(truncated_draft(target, 1)), k=3)
    assert counterfactual_skip_reason(plain, params=SamplingParams(max_tokens=8)) is None
    for params in (SamplingParams(temperature=0.8, max_tokens=8), SamplingParams(stop=["x"], max_tokens=8),
                   SamplingParams(ignore_eos=True, max_tokens=8)):
        assert "not greedy" in counterfactual_skip_reason(plain, params=params)
        with pytest.raises(ValueError, match="greedy"):
            alpha_by_draft({"general": plain}, [1, 2], [3], "length", params)

    eng = make_engine(draft_proposer(truncated_draft(target, 1)), k=KPolicyConfig(k_max=4))
    assert "adaptive" in counterfactual_skip_reason(eng)
    assert "controller" in counterfactual_skip_reason(make_engine(draft_proposer(truncated_draft(target, 1)), k=3), True)


class _StubRouter:
    """Routes query i to ``route_to(i)``; spawns the draft ``spawn`` (forked from general) before the first."""

    def __init__(self, route_to, spawn="d:copy"):
        from config import RouterConfig

        self.route_to, self.spawn, self.cfg, self.drafts = route_to, spawn, RouterConfig(), {}
        self.n, self.seen = 0, []

    def route(self, text):
        from router.router import Route

        self.n += 1
        return Route("unknown", "en", self.route_to(self.n), 1.0, "stub")

    def events(self):
        from router.router import DraftEvent

        if self.n == 1 and self.spawn:
            return [DraftEvent("spawn", self.spawn, "x", "general", "stub")]
        return []

    def observe(self, route, accepted, proposed):
        self.seen.append((route.draft_id, accepted, proposed))

    def summary(self):
        return {"observed": len(self.seen)}


def _copy_factory(target, make_engine, draft_proposer, V):
    """The first engine (the general draft) a weak 1-layer draft; every later one a draft that copies
    the target and keeps its weights (a fork's or a round's new weights are ignored)."""
    from speculative import DraftModelProposer, ModelRunner

    class Pinned(DraftModelProposer):
        def load_state_dict(self, state, version):
            self.version = version

    calls = []

    def factory():
        calls.append(1)
        if len(calls) == 1:
            return make_engine(draft_proposer(truncated_draft(target, 1)), k=3)
        return make_engine(Pinned(ModelRunner(copy.deepcopy(target), name="draft"), V), k=3)

    return factory


def test_oracle_beats_routing_that_ignores_a_better_draft(target, make_engine, draft_proposer, V):
    """Every query routed to the weak general draft while a draft that copies the target is in
    memory: the oracle picks the copy and routing falls short of it."""
    from bench.mixture import _run_method, format_mixture

    router = _StubRouter(lambda i: "general")
    stream = _recs(SQL[:3], "sql", "en", "") + _recs(EN[:3], "chat", "en", "")
    lcfg = LearnerConfig(train_every=100, holdout_fraction=0.0)
    e = _run_method("clusters", _copy_factory(target, make_engine, draft_proposer, V), stream, lcfg, router,
                    max_tokens=10, k=3, window=4, log=None)
    assert {r["draft"] for r in e["rows"]} == {"general"} and e["counterfactual_mismatches"] == 0
    assert all(r["alpha_by_draft"]["d:copy"][0] >= r["alpha_by_draft"]["general"][0] for r in e["rows"])
    assert e["oracle_other"]["all"] > 0 and e["oracle_alpha"]["all"] > e["routed_alpha"]["all"]
    assert e["routed_vs_oracle"]["all"] < 1 and e["accepted_vs_oracle"]["all"] < 1
    assert e["oracle_label"]["sql"]["routed_vs_oracle"]["all"] < 1
    # the router saw only what the routed draft measured
    assert router.seen == [("general", r["accepted"], r["proposed"]) for r in e["rows"]]
    res = {"labels": {"sql": 3, "chat/en": 3}, "methods": {"clusters": e}}
    assert f"{e['routed_vs_oracle']['all']:.3f}" in format_mixture(res)


def test_the_oracle_has_no_side_effect(target, make_engine, draft_proposer, V, monkeypatch):
    """The same stream with and without the oracle: the same routes, router observations, learner
    records, rounds and published versions (the counterfactual only reads the drafts)."""
    import bench.mixture as mx

    observed = []

    class Spy(mx.OnlineLearner):
        def observe(self, record):
            observed.append((record.draft_id, record.tokens.tolist(), record.positions.tolist(),
                             record.draft_wrong.tolist(), record.top_ids.tolist()))
            return super().observe(record)

    monkeypatch.setattr(mx, "OnlineLearner", Spy)
    stream = _recs(SQL[:4], "sql", "en", "") + _recs(EN[:4], "chat", "en", "")
    lcfg = LearnerConfig(train_every=2, batch_records=4, steps_per_round=1, lr=1e-2, holdout_fraction=0.0,
                         gate_margin=0.0, positions="all")
    runs = []
    for oracle in (True, False):
        if not oracle:
            monkeypatch.setattr(mx, "counterfactual_skip_reason", lambda *a, **kw: "off")
        observed.clear()
        torch.manual_seed(0)
        router = _StubRouter(lambda i: ("general", "d:copy")[i % 2])  # both drafts serve, both train
        e = mx._run_method("clusters", _copy_factory(target, make_engine, draft_proposer, V), stream, lcfg, router,
                           max_tokens=8, k=3, window=4, log=None)
        rows = [{k: v for k, v in r.items() if k != "alpha_by_draft"} for r in e["rows"]]
        runs.append((rows, router.seen, list(observed), e["rounds"], e["published"]))
        assert (e["oracle_skipped"] is None) == oracle
    assert runs[0][3] > 0 and runs[0][4] > 0  # rounds ran and published new weights mid-stream
    assert runs[0] == runs[1]


def test_mode_oracle_is_the_best_fixed_draft_per_label():
    """Hand-made rows: on label a, draft y accepts more in total though x wins one request; on b
    the routed draft is best. A draft absent from a row counts with the routed draft's values."""
    from bench.mixture import mode_oracle, oracle_summary

    rows = [
        {"label": "a", "draft": "x", "accepted": 3, "proposed": 8, "alpha_by_draft": {"x": [3, 8], "y": [2, 8]}},
        {"label": "a", "draft": "x", "accepted": 1, "proposed": 8, "alpha_by_draft": {"x": [1, 8], "y": [5, 8]}},
        {"label": "a", "draft": "x", "accepted": 2, "proposed": 8, "alpha_by_draft": {"x": [2, 8]}},  # y not yet
        {"label": "b", "draft": "x", "accepted": 4, "proposed": 8, "alpha_by_draft": {"x": [4, 8], "y": [0, 8]}},
    ]
    m = mode_oracle(rows)
    assert m["mode_oracle_drafts"] == {"a": "y", "b": "x"}
    assert m["mode_oracle_alpha"] == pytest.approx((2 + 5 + 2 + 4) / 32)
    assert m["routed_vs_mode_oracle"] == pytest.approx((10 / 32) / (13 / 32))
    assert oracle_summary(rows)["oracle_alpha"] >= m["mode_oracle_alpha"]  # per request >= per mode
    # equal totals accepted: the draft that proposed fewer, then the name
    tie = [{"label": "a", "draft": "y", "accepted": 3, "proposed": 8,
            "alpha_by_draft": {"x": [3, 6], "y": [3, 8], "z": [3, 8], "w": [1, 8]}}]
    assert mode_oracle(tie)["mode_oracle_drafts"] == {"a": "x"}
    tie[0]["alpha_by_draft"].pop("x")
    assert mode_oracle(tie)["mode_oracle_drafts"] == {"a": "z"}


# -- a starting draft of its own per named domain ------------------------------------------------------


def test_a_fork_of_a_draft_with_adapters_takes_its_adapters_on_the_same_base(target, make_engine, draft_proposer):
    """Adapter learners (the server's default): a cluster's draft forked from the general draft
    after it published adapters serves those adapters on its own copy of the same start."""
    from bench.mixture import GENERAL, _Drafts
    from learner.replay import ShardConfig
    from learner.trainer import OnlineLearner
    from speculative.adapters import adapter_state, add_adapters, has_adapters

    def factory(start=None):
        return make_engine(draft_proposer(truncated_draft(target, 1)), k=3)

    cfg = LearnerConfig(holdout_fraction=0.0, adapter_rank=4)
    d = _Drafts(factory, OnlineLearner(cfg, ShardConfig()), cfg, 3)
    d.add(GENERAL)
    published = add_adapters(copy.deepcopy(_draft(d, GENERAL)), 4)
    with torch.no_grad():
        for k, v in adapter_state(published).items():
            v.add_(0.01)  # (a view of the copy's own adapters)
    d.engines[GENERAL].swap_draft(adapter_state(published), 1)
    d.add("c3-en", parent=GENERAL, at=5, domain="c3-en")
    fork, general = _draft(d, "c3-en"), _draft(d, GENERAL)
    assert has_adapters(fork) and fork is not general
    assert all(torch.equal(v, adapter_state(general)[k]) for k, v in adapter_state(fork).items())
    assert adapter_state(fork) and any(v.abs().sum() > 0 for v in adapter_state(fork).values())


def test_a_domain_starts_from_its_own_draft_its_languages_too_and_a_fork_keeps_its_head(target, make_engine, draft_proposer):
    """``starts``: a named domain's draft (and a language variant's: chat/es -> chat) is built from
    the domain's starting draft, not forked; a domain without one forks the general draft; a draft
    forked from a domain's (a cluster's) is built from that domain's starting draft, with the
    parent's current weights."""
    from bench.mixture import GENERAL, _Drafts
    from learner.trainer import OnlineLearner
    from learner.replay import ShardConfig

    weak, strong = truncated_draft(target, 1), truncated_draft(target, 1)
    with torch.no_grad():
        for p in strong.parameters():
            p.add_(0.5)
    calls = []

    def factory(start=None):
        calls.append(start)
        return make_engine(draft_proposer(copy.deepcopy(strong if start == "chat-dir" else weak)), k=3)

    cfg = LearnerConfig(holdout_fraction=0.0)
    d = _Drafts(factory, OnlineLearner(cfg, ShardConfig()), cfg, 3, starts={"chat": "chat-dir"})
    d.add(GENERAL)
    for draft_id, domain in (("d-chat", "chat"), ("d-chat-es", "chat/es"), ("d-sql", "sql")):
        d.add(draft_id, parent=GENERAL, at=2, domain=domain)
    weights = lambda i: next(iter(_draft(d, i).state_dict().values()))
    assert calls == [None, "chat-dir", "chat-dir", None]
    assert torch.equal(weights("d-chat"), next(iter(strong.state_dict().values())))
    assert torch.equal(weights("d-chat-es"), weights("d-chat")) and torch.equal(weights("d-sql"), weights(GENERAL))
    with torch.no_grad():  # the chat draft has trained since it started: a fork takes its current weights
        next(iter(_draft(d, "d-chat").parameters())).add_(1.0)
    d.add("c3-en", parent="d-chat", at=5, domain="c3-en")
    assert calls[-1] == "chat-dir" and torch.equal(weights("c3-en"), weights("d-chat"))
    assert [(s["draft"], s["parent"], s["start"]) for s in d.spawned] == [
        ("d-chat", None, "chat"), ("d-chat-es", None, "chat"), ("d-sql", GENERAL, None), ("c3-en", "d-chat", None)]
    assert {i: e.draft_version for i, e in d.engines.items()} == dict.fromkeys(d.engines, 0)  # no round yet, forks too
    # retiring: the general draft and an unknown one are kept / ignored; a cluster's goes with its trainer
    for gone in (GENERAL, "nobody"):
        d.retire(gone, 6, "asked")
    assert GENERAL in d.engines and GENERAL in d.learner.trainers and not d.retired
    d.retire("c3-en", 7, "idle")
    assert "c3-en" not in d.engines and "c3-en" not in d.learner.trainers and "d-chat" in d.learner.trainers
    assert d.retired == [{"draft": "c3-en", "at": 7, "reason": "idle"}]


def _draft(drafts, draft_id):
    from bench.harness import _draft_of

    return _draft_of(drafts.engines[draft_id]).runner.model


def test_the_oracle_sees_a_domain_draft_that_starts_better(target, make_engine, draft_proposer, V, extractor):
    """Chat's starting draft copies the target: the chat drafts accept every proposal from their
    first request on, the SQL draft (a fork of the weak general one, no rounds) scores as the
    general draft does, and the oracle picks the chat drafts on chat requests."""
    from bench.mixture import run_mixture
    from speculative import DraftModelProposer, ModelRunner

    def factory(start=None):
        if start == "copy":
            return make_engine(DraftModelProposer(ModelRunner(copy.deepcopy(target), name="draft"), V), k=3)
        return make_engine(draft_proposer(truncated_draft(target, 1)), k=3)

    stream = _recs(SQL[:4], "sql", "en", "") + _recs(EN[:4], "chat", "en", "") + _recs(ES[:4], "chat", "es", "")
    train = _recs(SQL, "sql", "en", " (train)") + _recs(EN, "chat", "en", " (train)") + _recs(ES, "chat", "es", " (train)")
    lcfg = LearnerConfig(train_every=1000, holdout_fraction=0.0)  # no rounds: every draft keeps its starting weights
    res = run_mixture(factory, stream, train, lcfg, RouterConfig(classifier={"background": False}), methods=["supervised"],
                      n_per_label=4, max_tokens=8, k=3, window=4, extractor=extractor, log=None, starts={"chat": "copy"})
    assert res["domain_starts"] == {"chat": "copy"}
    e = res["methods"]["supervised"]
    assert {s["draft"]: s["start"] for s in e["spawned"]} == {"d-sql": None, "d-chat": "chat", "d-chat-es": "chat"}
    for r in e["rows"]:
        by = r["alpha_by_draft"]
        for x in ("d-chat", "d-chat-es"):
            if x in by:
                assert by[x][0] == by[x][1] > 0  # a copy of the target: every proposal accepted
        if "d-sql" in by:
            assert by["d-sql"] == by["general"]
    assert e["counterfactual_mismatches"] == 0
    assert e["oracle_label"]["chat/en"]["oracle_alpha"]["all"] == 1.0  # d-chat is in memory from the first chat request
    sql = e["oracle_label"]["sql"]  # the chat drafts copy the target on SQL too: the oracle takes them there
    assert sql["routed_alpha"]["all"] < sql["oracle_alpha"]["all"]


def test_domain_checkpoints_are_parsed_and_refused_when_malformed():
    from bench.mixture import parse_starts

    assert parse_starts(None) == {} and parse_starts("") == {}
    assert parse_starts(" code=/a , chat/es=/b,") == {"code": "/a", "chat/es": "/b"}
    for bad in ("code", "=/a", "code=", "code=/a,code=/b"):
        with pytest.raises(ValueError):
            parse_starts(bad)


def test_the_real_factory_builds_a_domains_draft_from_its_folder_on_the_same_target(make_llama, make_tokenizer, tmp_path):
    """``osd experiment mixture --domain-checkpoints``: ``factory(folder)`` serves the saved draft
    (its own head and token ids) on the one loaded target; ``factory()`` the starting draft."""
    from bench.experiments import build_parser
    from bench.harness import _draft_of, real_engine_factory
    from inprocess import save_domain_draft, save_tiny_model

    folder = save_tiny_model(tmp_path / "model", make_llama, make_tokenizer)
    keep = save_domain_draft(tmp_path / "code", make_llama)
    args = build_parser().parse_args(["mixture", "--target", folder, "--quantize", "none", "--draft-layers", "2",
                                      "--domain-checkpoints", f"code={tmp_path / 'code'}"])
    factory = real_engine_factory(args)
    general, code = factory(), factory(str(tmp_path / "code"))
    assert code.target is general.target
    assert _draft_of(general).runner.vocab_map is None and len(_draft_of(general).runner.model.model.layers) == 2
    assert torch.equal(_draft_of(code).runner.vocab_map, keep) and len(_draft_of(code).runner.model.model.layers) == 1
    assert code.generate("def f(x):", SamplingParams(max_tokens=6)).token_ids == \
        general.generate("def f(x):", SamplingParams(max_tokens=6)).token_ids  # lossless either way


def test_a_drafts_starting_domain_by_hand():
    """A named draft takes its own domain's starting draft, else its parent domain's; a tenant's copy
    its draft's; the general draft and a cluster's none."""
    from router.router import start_domain

    doms = {"chat", "chat/es", "sql"}
    assert named_draft_id("chat/es") == "d-chat-es" and named_draft_id("sql") == "d-sql"
    cases = {"d-chat-es": "chat/es", "d-chat-fr": "chat", "d-chat": "chat", "d-sql@alice": "sql", "d-chat-es@bob": "chat/es",
             "d-code": None, "general": None, "c3-en": None, "d-sqlite": None, "d-chatty": None}
    assert {d: start_domain(d, doms) for d in cases} == cases
    assert start_domain("d-chat-es", set()) is None


def test_a_drafts_fork_parent_by_hand():
    """A draft without a starting draft of its own forks the general draft of its tenant scope; the
    general drafts and those with their domain's starting draft fork nothing."""
    from router.router import fork_parent

    doms = {"chat", "sql"}
    cases = {"general": None, "general@alice": None, "d-sql": None, "d-sql@alice": None, "d-chat-es": None,
             "d-code": "general", "c3/fr": "general", "d-sqlite": "general", "c3/fr@team/a": "general@team/a",
             "d-code@alice": "general@alice", "..": "general"}
    assert {d: fork_parent(d, doms) for d in cases} == cases
    assert fork_parent("d-sql", set()) == "general"


# -- the stream and the figures routing is judged by, by hand ---------------------------------------


def test_a_records_mode_and_whether_a_route_names_it():
    """chat is split by language, other domains are not; the router's "chat" is chat in the base
    language only; a record without a domain or language is unknown / und."""
    from bench.mixture import label_of, same_mode

    assert label_of(WorkloadRecord("x", "chat", "es", "t")) == "chat/es"
    assert label_of(WorkloadRecord("x", "sql", "es", "t")) == "sql"
    assert label_of(object()) == "unknown"
    assert label_of(WorkloadRecord("x", "chat", "", "t")) == "chat/und"
    assert same_mode("sql", "sql") and same_mode("chat/es", "chat/es") and same_mode("chat", "chat/en")
    assert not same_mode("chat", "chat/es") and not same_mode("sql", "code") and not same_mode("c3/en", "chat/en")
    assert same_mode("chat", "chat/fr", base_lang="fr") and not same_mode("chat", "chat/en", base_lang="fr")


def test_the_mixed_stream_caps_each_mode_in_order_and_shuffles_by_seed():
    from bench.mixture import label_of, mixed_stream

    recs = (_recs(SQL, "sql", "en", "") + _recs(EN, "chat", "en", "") + _recs(ES, "chat", "es", ""))
    capped = mixed_stream(recs, 3, seed=0)
    assert sorted(r.text for r in capped) == sorted(SQL[:3] + EN[:3] + ES[:3])  # the first 3 of each mode
    assert mixed_stream(recs, 3, seed=0) == capped  # seeded
    assert mixed_stream(recs, 3, seed=1) != capped and sorted(map(id, mixed_stream(recs, 3, 1))) == sorted(map(id, capped))
    assert [label_of(r) for r in capped] != sorted(label_of(r) for r in capped)  # mixed, not in blocks
    whole = mixed_stream(recs, None, seed=0)
    assert len(whole) == len(recs) and sorted(map(id, whole)) == sorted(map(id, recs))
    assert len(mixed_stream(recs, 100, seed=0)) == len(recs)


def _row(label, draft, by):
    a, p = by[draft]
    return {"label": label, "draft": draft, "accepted": a, "proposed": p, "alpha_by_draft": by}


def test_the_per_request_oracle_by_hand():
    """The oracle takes the draft that accepted most; ties go to the routed draft, then to the one
    that proposed fewer, then to the name; alphas are summed accepted over summed proposed."""
    from bench.mixture import _oracle_pick, _ratio, oracle_summary

    assert _oracle_pick(_row("a", "x", {"x": [2, 8], "y": [3, 8]})) == ("y", 3, 8)
    assert _oracle_pick(_row("a", "y", {"x": [3, 8], "y": [3, 8]})) == ("y", 3, 8)  # tie: the routed one
    assert _oracle_pick(_row("a", "z", {"x": [3, 6], "y": [3, 8], "z": [1, 8]})) == ("x", 3, 6)  # fewer proposed
    assert _oracle_pick(_row("a", "z", {"y": [3, 8], "x": [3, 8], "z": [1, 8]})) == ("y", 3, 8)  # then the name
    assert _ratio(1.0, 2.0) == 0.5 and _ratio(None, 2.0) is None and _ratio(1.0, None) is None
    assert _ratio(1.0, 0.0) is None

    rows = [_row("a", "x", {"x": [2, 8], "y": [4, 8]}), _row("a", "x", {"x": [6, 8], "y": [1, 8]}),
            _row("b", "y", {"x": [0, 4], "y": [1, 4]})]
    s = oracle_summary(rows)
    assert (s["routed_accepted"], s["oracle_accepted"], s["n"], s["oracle_other"]) == (9, 11, 3, 1)
    assert s["routed_alpha"] == pytest.approx(9 / 20) and s["oracle_alpha"] == pytest.approx(11 / 20)
    assert s["routed_vs_oracle"] == pytest.approx(9 / 11) and s["accepted_vs_oracle"] == pytest.approx(9 / 11)
    empty = oracle_summary([])
    assert empty["routed_alpha"] is None and empty["routed_vs_oracle"] is None and empty["n"] == 0


def test_a_methods_oracle_fields_whole_second_half_and_per_label():
    from bench.mixture import ORACLE_TARGET, _oracle_fields, recompute_oracle

    rows = [_row("a", "x", {"x": [1, 8], "y": [5, 8]}), _row("b", "x", {"x": [4, 8], "y": [4, 8]}),
            _row("a", "x", {"x": [6, 8], "y": [6, 8]}), _row("b", "y", {"x": [2, 8], "y": [3, 8]})]
    f = _oracle_fields(rows, ["a", "b"], 2, None, 1)
    assert f["routed_alpha"] == {"all": pytest.approx(14 / 32), "second_half": pytest.approx(9 / 16)}
    assert f["oracle_alpha"] == {"all": pytest.approx(18 / 32), "second_half": pytest.approx(9 / 16)}
    assert f["routed_vs_oracle"]["second_half"] == pytest.approx(1.0)
    assert f["oracle_met"] == {"all": 14 / 18 >= ORACLE_TARGET, "second_half": True}
    assert f["oracle_other"] == {"all": 1, "second_half": 0}
    assert f["mode_oracle_drafts"]["all"] == {"a": "y", "b": "y"}
    assert f["oracle_label"]["a"]["routed_alpha"] == {"all": pytest.approx(7 / 16), "second_half": pytest.approx(6 / 8)}
    assert f["oracle_label"]["b"]["oracle_alpha"] == {"all": pytest.approx(7 / 16), "second_half": pytest.approx(3 / 8)}
    assert f["counterfactual_mismatches"] == 1 and f["oracle_skipped"] is None
    at_target = [_row("a", "x", {"x": [19, 40], "y": [20, 40]})]  # routed / oracle exactly the target
    assert (19 / 40) / (20 / 40) == ORACLE_TARGET == 0.95
    assert _oracle_fields(at_target, ["a"], 0, None, 0)["oracle_met"] == {"all": True, "second_half": True}
    skipped = _oracle_fields(rows, ["a", "b"], 2, "adaptive k", 0)
    assert skipped["oracle_skipped"] == "adaptive k" and skipped["routed_alpha"] is None

    result = {"methods": {"both": {"rows": rows, "counterfactual_mismatches": 1, "routed_alpha": "stale"},
                          "older": {"rows": rows, "counterfactual_mismatches": None},
                          "single": {"rows": [dict(rows[0], alpha_by_draft={})], "routed_alpha": "kept"}}}
    recompute_oracle(result)
    assert result["methods"]["both"]["routed_alpha"] == f["routed_alpha"]
    assert result["methods"]["both"]["counterfactual_mismatches"] == 1
    assert result["methods"]["older"]["counterfactual_mismatches"] == 0  # not recorded: none
    assert result["methods"]["both"]["oracle_label"] == f["oracle_label"]
    assert result["methods"]["single"]["routed_alpha"] == "kept"  # no counterfactual rows: left as it was
