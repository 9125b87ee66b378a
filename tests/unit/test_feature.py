"""The feature-conditioned (EAGLE-style) draft: the target's features as verification returns them,
greedy equality, its cache across rejections, records that carry features, and online training on a
small trained model. Its sampling statistics are in tests/lossless.py (the ``feature`` cases)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from bench.harness import serve_recorded
from config import DraftConfig, EngineConfig, KPolicyConfig, SamplingParams
from drafts.build import build_proposer
from learner.replay import decode_record, encode_record
from learner.trainer import DraftTrainer, LearnerConfig
from speculative import ModelRunner, SpeculativeEngine
from speculative.fast import FastRunner
from speculative.feature import FeatureDraftProposer, FeatureRunner
from speculative.feature_draft import feature_draft
from speculative.runner import VerifyCall

GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


def full_features(model, ids: list[int]) -> torch.Tensor:
    """The target's features by one uncached forward: [len(ids), H]."""
    with torch.no_grad():
        return model.get_decoder()(input_ids=torch.tensor([ids])).last_hidden_state[0].float()


@pytest.mark.parametrize("runtime", ["hf", "int4"])
def test_verification_returns_the_features_of_every_fed_position(target, runtime):
    runner = ModelRunner(target, name="t") if runtime == "hf" else FastRunner(target, name="t", bits=4)
    ref_model = target if runtime == "hf" else None
    a, b = [5, 9, 14, 3, 7, 21, 8], [30, 31, 32]
    first = runner.verify([VerifyCall("a", 0, a[:5], 1, features=True), VerifyCall("b", 0, b, 1)])
    assert first[0].features.shape == (5, target.config.hidden_size) and first[0].features.dtype == torch.float16
    assert first[1].features is None  # only the calls that ask pay for them
    later = runner.verify([VerifyCall("a", 5, a[5:], 2, features=True), VerifyCall("b", 3, [33], 1, features=True)])[0]
    feats = torch.cat([first[0].features, later.features]).float()  # positions 0..6
    if ref_model is not None:
        torch.testing.assert_close(feats, full_features(ref_model, a), atol=2e-3, rtol=2e-3)
    else:  # the int4 runtime: its own features, computed alone, are the same bits
        alone = FastRunner(target, name="t2", bits=4).verify([VerifyCall("x", 0, a, 1, features=True)])[0].features
        assert torch.equal(feats.half(), alone)
    # the head applied to a feature gives that position's next-token row
    head = target.get_output_embeddings().weight
    assert int((feats[-1] @ head.T).argmax()) == int(later.argmax[-1])


@pytest.fixture
def feature_engine(target, tok):
    def make(k=3, model=None, runtime="hf"):
        tgt = model if model is not None else target
        runner = ModelRunner(tgt, name="t") if runtime == "hf" else FastRunner(tgt, name="t", bits=4)
        prop = build_proposer(DraftConfig(kind="feature"), tgt, tok)
        return SpeculativeEngine(runner, tok, prop, EngineConfig(chat_template=False, k=KPolicyConfig(fixed_k=k), record_top_k=8))

    return make


@pytest.mark.parametrize("runtime,k", [("hf", 1), ("hf", 3), ("int4", 4)])
def test_greedy_output_equals_the_target_alone(feature_engine, make_engine, prompts, runtime, k, target):
    engine = feature_engine(k, runtime=runtime)
    alone = SpeculativeEngine(engine.target, engine.tokenizer, None, EngineConfig(chat_template=False))
    sources = set()
    for p in prompts:
        steps = []
        got = engine.generate(list(p), GREEDY, on_step=steps.append).token_ids
        assert got == alone.generate(list(p), GREEDY).token_ids
        sources |= {s.source for s in steps if s.proposed}
        assert steps[0].proposed == 0  # nothing to read before the prompt was verified
    assert sources == {"feature"}


def test_the_drafts_cache_survives_rejections(target, tok):
    """A long-lived proposer (its cache rebuilt only where features changed) proposes what a fresh
    one proposes from the same features and tokens."""
    engine = SpeculativeEngine(ModelRunner(target, name="t"), tok, build_proposer(DraftConfig(kind="feature"), target, tok),
                               EngineConfig(chat_template=False, k=KPolicyConfig(fixed_k=3)))
    rid = engine.add_request([5, 9, 14, 3, 7, 21, 8], GREEDY)
    prop: FeatureDraftProposer = engine.proposer
    for _ in range(6):
        pending = engine.propose(rid)
        fresh = FeatureDraftProposer(FeatureRunner(prop.runner.model), target.config.vocab_size)
        if "x" not in prop._feats and rid in prop._feats:
            fresh.observe_features("x", 0, prop._feats[rid])
            again = fresh.propose("x", list(engine.requests[rid].tokens), lambda s: 3, GREEDY, None)
            assert again.tokens == pending.proposal.tokens
        engine.accept(pending, engine.target.verify([pending.call])[0])


def test_the_proposer_drafts_from_features_as_verification_delivers_them(target):
    """Features arrive in pieces, as verifications return them. The proposer drafts once it holds the
    features of every position before the pending token (after a one-token prompt: one position),
    exactly as if they had come at once. Before any features, with tokens past them, after a gap or
    at k = 0 it drafts nothing and runs no forward. Weights are loaded strictly."""
    from speculative.proposers import EMPTY

    toks = [5, 9, 14, 3, 7, 21, 8]
    feats = full_features(target, toks[:-1])  # [6, H]: positions 0..5; toks[6] is pending
    model = feature_draft(target)

    def proposer():
        return FeatureDraftProposer(FeatureRunner(model), target.config.vocab_size)

    def k3(_source):
        return 3

    whole = proposer()
    whole.observe_features("s", 0, feats)
    want = whole.propose("s", toks, k3, GREEDY, None)
    assert want.k == 3 and want.source == "feature"
    assert whole.propose("s", toks, lambda _s: 0, GREEDY, None) == EMPTY  # k = 0: no forward, no cost
    assert whole.propose("s", toks, k3, GREEDY, None).tokens == want.tokens  # asked again, no new features

    pieces = proposer()
    assert pieces.propose("s", toks[:2], k3, GREEDY, None) == EMPTY  # nothing verified yet
    pieces.observe_features("s", 0, feats[:1])
    one = pieces.propose("s", toks[:2], k3, GREEDY, None)  # a one-token prompt, verified
    first = proposer()
    first.observe_features("s", 0, feats[:1])
    assert one.k == 3 and one.tokens == first.propose("s", toks[:2], k3, GREEDY, None).tokens
    pieces.observe_features("s", 1, feats[1:4])
    pieces.observe_features("s", 4, feats[4:])
    assert pieces.propose("s", toks, k3, GREEDY, None).tokens == want.tokens
    assert pieces.propose("s", toks + [2, 4], k3, GREEDY, None) == EMPTY  # tokens whose features never came

    gap = proposer()
    gap.observe_features("s", 0, feats[:2])
    gap.observe_features("s", 4, feats[4:])  # positions 2 and 3 never came: start over when they do
    assert gap.propose("s", toks, k3, GREEDY, None) == EMPTY

    state = model.state_dict()
    with pytest.raises(RuntimeError, match="Missing key"):
        FeatureRunner(model).load_state_dict({k: v for k, v in state.items() if not k.startswith("fc.")})
    with pytest.raises(RuntimeError, match="Unexpected key"):
        FeatureRunner(model).load_state_dict({**state, "extra.weight": torch.zeros(1)})


@pytest.mark.parametrize("seeded", [False, True])
def test_the_proposal_is_the_drafts_own_autoregression(target, seeded):
    """k drafted tokens, by hand: the last pair (f_(m-1), x_m) gives f^_m and d_1 from the head;
    then (f^_(m+i-1), d_i) gives f^_(m+i) and d_(i+1), k forwards in all. Seeded sampling draws d_i
    with the race noise of its output position, len(tokens) + i - 1, and q is the head's softmax.
    The proposal counts the pairs it fed: all of them first; after the next verification only the
    new pair, in place of the draft's own at that position, then its own again."""
    import time

    from speculative.sampling import race_noise, race_sample

    toks = [5, 9, 14, 3, 7, 21, 8]
    m, k, V = len(toks) - 1, 4, target.config.vocab_size
    feats = full_features(target, toks[:-1])  # [m, H]
    model = feature_draft(target)
    with torch.no_grad():  # away from the initialisation, so that the features matter
        model.fc.weight.add_(torch.randn(model.fc.weight.shape, generator=torch.Generator().manual_seed(8)) * 0.05)
    params = SamplingParams(temperature=1.0, seed=11) if seeded else GREEDY

    ref = FeatureRunner(model)
    h = ref.step("r", 0, feats, toks[1:])[-1:]  # [1, H]
    want, rows = [], []
    for i in range(k):
        logits = ref.head(h)[0]  # [V]
        if seeded:
            q = logits.softmax(-1)
            tok = int(race_sample(q[None], race_noise(11, [len(toks) + i], V))[0])
            rows.append(q)
        else:
            tok = int(logits.argmax())
        want.append(tok)
        if i < k - 1:
            h = ref.step("r", m + i, h, [tok], own=True)

    runner = FeatureRunner(model)
    calls = []
    real_step = runner.step
    runner.step = lambda *a, **kw: calls.append(a[1]) or real_step(*a, **kw)
    prop = FeatureDraftProposer(runner, V)
    prop.observe_features("s", 0, feats)
    t0 = time.perf_counter()
    got = prop.propose("s", toks, lambda _s: k, params, None)
    assert 0 < got.seconds <= time.perf_counter() - t0  # the draft's time, for the cost model
    assert got.tokens == want and calls == [0, m, m + 1, m + 2]  # k forwards: the pairs, then its own
    assert got.input_tokens == m + k - 1
    if seeded:
        torch.testing.assert_close(got.probs, torch.stack(rows), atol=1e-6, rtol=1e-5)
    else:
        assert got.probs is None
    calls.clear()
    prop.observe_features("s", m, full_features(target, toks)[m:])  # verification: x_m's feature, final
    again = prop.propose("s", toks + [want[0]], lambda _s: k, params, None)
    assert calls[0] == m and again.input_tokens == 1 + k - 1  # only pair m is new; the draft's own there is replaced


def test_records_carry_the_features_and_survive_encoding(feature_engine, prompts, target):
    engine = feature_engine(3)
    rec, *_ = serve_recorded(engine, list(prompts[1]), GREEDY, sources=("feature",))
    L = rec.tokens.shape[0]
    assert rec.features is not None and rec.features.shape == (L - 1, target.config.hidden_size)
    torch.testing.assert_close(rec.features.float(), full_features(target, rec.tokens[: L - 1].tolist()), atol=2e-2, rtol=2e-2)
    back = decode_record(encode_record(rec))
    assert torch.equal(back.features, rec.features) and back.same_as(rec)
    assert rec.nbytes >= rec.features.numel() * 2


# -- online training on a small trained model ------------------------------------------------------------
def digits(rng: random.Random, n: int) -> str:
    """A toy language: each digit is the sum of the two before it, mod 10 (a Fibonacci sequence)."""
    out = [rng.randrange(10), rng.randrange(10)]
    while len(out) < n:
        out.append((out[-1] + out[-2]) % 10)
    return "".join(map(str, out[:n]))


@pytest.fixture(scope="module")
def trained_target(tok):
    """A tiny Llama trained for a few seconds on the toy language: its outputs have structure that
    a draft can learn and carry to new prompts (a random model's have none), and that the one-layer
    starting draft does not know."""
    from conftest import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(2, seed=7, hidden_size=64, intermediate_size=128, initializer_range=0.02).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    for _ in range(250):
        x = torch.tensor([tok(digits(rng, 24))["input_ids"] for _ in range(32)])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def recording_engine(target, tok) -> SpeculativeEngine:
    """``target`` with a fresh feature draft at k = 3, recording top-8 rows (what the learner reads)."""
    return SpeculativeEngine(ModelRunner(target, name="t"), tok, build_proposer(DraftConfig(kind="feature"), target, tok),
                             EngineConfig(chat_template=False, k=KPolicyConfig(fixed_k=3), record_top_k=8))


def served_records(engine, rng: random.Random, n: int, n_digits: int, max_tokens: int) -> list:
    """Replay records of ``n`` greedy requests of toy-language prompts of ``n_digits`` digits."""
    return [serve_recorded(engine, digits(rng, n_digits), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                           sources=("feature",))[0] for _ in range(n)]


def test_online_training_raises_held_out_agreement(trained_target, tok):
    engine = recording_engine(trained_target, tok)
    records = served_records(engine, random.Random(1), 60, n_digits=4, max_tokens=24)
    train, held = records[:40], records[40:]  # held-out prompts: never trained on
    trainer = DraftTrainer("f", engine.proposer.runner.model,
                           LearnerConfig(lr=1e-3, steps_per_round=5, positions="all", holdout_fraction=0.0, gate_margin=1.0))
    for r in held:
        trainer.add_holdout(r)
    before = trainer.agreement()
    for _ in range(10):
        rep = trainer.train_round(train)
        assert rep.accepted
    after = trainer.agreement()
    assert after >= before + 0.02, (before, after)
    # the published weights serve: held-out acceptance rises with them
    def served_alpha():
        acc = prop = 0
        for p in held[:10]:
            _, a, n, _ = serve_recorded(engine, p.tokens[: p.prompt_len].tolist(), SamplingParams(max_tokens=24, ignore_eos=True),
                                        sources=("feature",))
            acc, prop = acc + a, prop + n
        return acc / prop

    alpha_before = served_alpha()
    engine.swap_draft(*trainer.publish()[::-1])
    assert engine.draft_version == trainer.version >= 1
    assert served_alpha() > alpha_before


def test_online_rounds_can_learn_the_prompt_positions_of_feature_records(trained_target, tok):
    """With ``prompt_positions`` a feature draft's round also trains on each record's prompt rows
    (from position 2), read with the target's head from the recorded features (the target's own
    distribution there, up to float16), all of them kept even where only wrong rows are; the
    held-out agreement stays on output rows. Without the head the trainer refuses the setting."""
    from learner.trainer import records_to_batch

    engine = recording_engine(trained_target, tok)
    records = served_records(engine, random.Random(3), 6, n_digits=8, max_tokens=12)
    head = trained_target.get_output_embeddings()
    plain, plain_mask = records_to_batch(records, "wrong")
    wide, mask = records_to_batch(records, "wrong", prompt_head=head)
    n_prompt = [r.prompt_len - 2 for r in records]
    assert [w.n_out - s.n_out for w, s in zip(wide, plain)] == n_prompt and all(n > 0 for n in n_prompt)
    assert int(mask.sum()) == int(plain_mask.sum()) + sum(n_prompt)
    for w, r in zip(wide, records):
        with torch.no_grad():
            want = trained_target(input_ids=r.tokens[None, : r.prompt_len].long()).logits[0, 1 : r.prompt_len - 1].argmax(-1)
        assert (w.ids[: r.prompt_len - 2, 0].long() == want).float().mean() >= 0.9
    cfg = LearnerConfig(lr=1e-3, steps_per_round=1, holdout_fraction=0.0, gate_margin=1.0, prompt_positions=True)
    with pytest.raises(ValueError, match="target_head"):
        DraftTrainer("f", engine.proposer.runner.model, cfg)
    trainer = DraftTrainer("f", engine.proposer.runner.model, cfg, target_head=head)
    for r in records[:2]:
        trainer.add_holdout(r)
    rep = trainer.train_round(records[2:])
    assert rep.accepted and rep.positions == int(records_to_batch(records[2:], "wrong", head)[1].sum())
    assert trainer.holdout_hits().numel() == sum(r.tokens.shape[0] - r.prompt_len for r in records[:2])


def test_the_feature_draft_trains_on_its_own_predictions_too(trained_target, tok):
    """In training mode a batch gives two passes of logits: on the target's features, and with each
    pair reading the feature the draft predicted from the target's one before it (as its second
    drafted token does when serving); they differ, and eval mode gives the first only."""
    from learner.offline import student_logits_for

    engine = recording_engine(trained_target, tok)
    rec, *_ = serve_recorded(engine, "3141", SamplingParams(max_tokens=16, ignore_eos=True), sources=("feature",))
    model = copy.deepcopy(engine.proposer.runner.model)
    with torch.no_grad():  # a draft that reads the features (the starting one ignores them)
        model.fc.weight[:, : model.config.hidden_size].normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    model.train()
    both = student_logits_for(model, [rec.to_sample()])
    n_out = rec.tokens.shape[0] - rec.prompt_len
    assert both.shape[:2] == (2, n_out)
    assert not torch.allclose(both[0], both[1])  # each output of pass 2 reads a predicted feature
    model.eval()
    torch.testing.assert_close(student_logits_for(model, [rec.to_sample()]), both[0].detach())


def test_a_record_ending_inside_a_drafted_run_keeps_only_its_tokens_features():
    """An EOS accepted inside a drafted run ends the request: the target computed features for the
    positions after it, which are not the record's (the record keeps len(tokens) - 1 of them)."""
    from types import SimpleNamespace

    from learner.replay import RecordBuilder

    H, K = 4, 2
    rows = lambda n: dict(target_top_ids=torch.zeros(n, K, dtype=torch.long), target_top_probs=torch.full((n, K), 0.5),
                          target_tail=torch.zeros(n))
    prompt = [5, 6, 7]
    # step 1: the prompt fed, no draft, emits 8; step 2: feeds 8 + drafts [9, EOS, 4], all accepted,
    # emits only 9 (the EOS ends it): features came for positions 3..6
    s1 = SimpleNamespace(request_id="r", start=3, draft_tokens=[], accepted=0, draft_matches_target=[], emitted=[8],
                         source="none", draft_version=0, features=torch.randn(3, H), features_start=0, **rows(1))
    s2 = SimpleNamespace(request_id="r", start=4, draft_tokens=[9, 0, 4], accepted=3, draft_matches_target=[True] * 3,
                         emitted=[9], source="feature", draft_version=0, features=torch.randn(4, H), features_start=3,
                         **rows(4))
    b = RecordBuilder()
    b.add(s1)
    b.add(s2)
    rec = b.finish(prompt + [8, 9], len(prompt))
    assert rec.features.shape == (4, H)  # positions 0..3: the tokens 5, 6, 7, 8 (9 was never fed)
    torch.testing.assert_close(rec.features.float(), torch.cat([s1.features, s2.features[:1]]), atol=1e-2, rtol=1e-2)


# -- the offline start: distilled on the target's features before it serves ---------------------------
def test_teacher_data_carries_the_features_serving_records(trained_target, tok):
    """Offline teacher data holds the target's features at every input position: the same numbers a
    served record of the same greedy request carries (what the online learner trains on), and the
    same teacher rows as without features."""
    from learner.offline import collect_teacher_data

    prompt = tok("3141")["input_ids"]
    s, = collect_teacher_data(trained_target, tok, [prompt], max_tokens=16, top_k=8, features=True)
    L, H = int(s.tokens.shape[0]), trained_target.config.hidden_size
    assert s.features.shape == (L - 1, H) and s.features.dtype == torch.float16
    torch.testing.assert_close(s.features.float(), full_features(trained_target, s.tokens[:-1].tolist()), atol=2e-3, rtol=2e-3)
    plain, = collect_teacher_data(trained_target, tok, [prompt], max_tokens=16, top_k=8)
    assert plain.features is None and torch.equal(plain.ids, s.ids) and torch.equal(plain.tokens, s.tokens)

    engine = recording_engine(trained_target, tok)
    rec, *_ = serve_recorded(engine, list(prompt), SamplingParams(max_tokens=16, ignore_eos=True), sources=("feature",))
    assert torch.equal(rec.tokens, s.tokens)
    n = rec.features.shape[0]
    torch.testing.assert_close(rec.features.float(), s.features[:n].float(), atol=2e-3, rtol=2e-3)


def _fewer_misses(before: float, after: float) -> bool:
    """Training took at least a quarter of the held-out misses away (disagreements, or rejected
    drafts). The starting draft is the target's own last layer over its features: on some machines'
    trained target it already agrees on about 0.9 of the positions, where no fixed gain of 0.1 fits."""
    return 1 - after <= 0.75 * (1 - before)


def test_offline_distillation_raises_held_out_agreement_and_serves_from_its_checkpoint(trained_target, tok, tmp_path):
    from drafts.build import build_draft_model, load_draft, save_draft
    from learner.offline import DistillConfig, collect_teacher_data, distill
    from speculative.feature_draft import FeatureDraft

    rng = random.Random(2)
    prompts = [tok(digits(rng, 4))["input_ids"] for _ in range(48)]
    data = collect_teacher_data(trained_target, tok, prompts, max_tokens=20, top_k=8, features=True)
    train, held = data[:36], data[36:]  # held-out prompts: never trained on
    draft, keep = build_draft_model(DraftConfig(kind="feature"), trained_target, tok)
    untrained = copy.deepcopy(draft)
    hist = distill(draft, train, DistillConfig(lr=1e-3, top_k=8, batch_positions=128, max_steps=150, epochs=100,
                                               warmup_steps=5), log=None, heldout=held)
    assert hist["agreement_on"] == "heldout"
    assert _fewer_misses(hist["agreement_before"], hist["agreement_after"]), hist

    save_draft(draft, tmp_path / "f", keep, meta={"note": "offline"})
    loaded, keep2, meta = load_draft(tmp_path / "f")
    assert isinstance(loaded, FeatureDraft) and keep2 is None and meta == {"note": "offline"}
    state = draft.state_dict()
    assert loaded.state_dict().keys() == state.keys()  # the head too, though the target's config ties it
    assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items())
    with pytest.raises(ValueError, match="feature draft"):
        build_draft_model(DraftConfig(kind="truncated", checkpoint=str(tmp_path / "f")), trained_target, tok)

    def serve(model_or_ckpt):
        if isinstance(model_or_ckpt, str):
            prop = build_proposer(DraftConfig(kind="feature", checkpoint=model_or_ckpt), trained_target, tok)
        else:
            prop = FeatureDraftProposer(FeatureRunner(model_or_ckpt), trained_target.config.vocab_size)
        engine = SpeculativeEngine(ModelRunner(trained_target, name="t"), tok, prop,
                                   EngineConfig(chat_template=False, k=KPolicyConfig(fixed_k=3)))
        alone = SpeculativeEngine(engine.target, tok, None, EngineConfig(chat_template=False))
        acc = drafted = 0
        for p in prompts[36:]:
            steps = []
            out = engine.generate(list(p), SamplingParams(max_tokens=20, ignore_eos=True), on_step=steps.append)
            assert out.token_ids == alone.generate(list(p), SamplingParams(max_tokens=20, ignore_eos=True)).token_ids
            acc, drafted = acc + sum(s.accepted for s in steps), drafted + sum(s.proposed for s in steps)
        return acc / drafted

    before, after = serve(untrained), serve(str(tmp_path / "f"))
    assert after > before and _fewer_misses(before, after), (before, after)


# -- fusing several of the target's layers (EAGLE-3) --------------------------------------------------
def layer_features(model, ids: list[int], layers) -> torch.Tensor:
    """The outputs of decoder ``layers`` (0-based, in that order) then the final feature, by one
    uncached forward with every hidden state: [len(ids), (len(layers) + 1) H]."""
    with torch.no_grad():
        hs = model.get_decoder()(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1][0] for i in layers] + [hs[-1][0]], dim=-1).float()  # hs[i + 1]: layer i's output


@pytest.mark.parametrize("runtime", ["hf", "int8", "int4"])
def test_verification_returns_the_layers_each_call_asks_for(target, runtime):
    """Calls of one batch asking for different layers (or none, or in another order) each get
    theirs: the asked layers' outputs in the asked order, then the final feature."""
    bits = {"int8": 8, "int4": 4}.get(runtime)
    make = (lambda n: ModelRunner(target, name=n)) if bits is None else (lambda n: FastRunner(target, name=n, bits=bits))
    runner, H = make("t"), target.config.hidden_size
    a, b, c = [5, 9, 14, 3, 7], [30, 31, 32], [11, 12]
    got = runner.verify([VerifyCall("a", 0, a, 1, features=True, feature_layers=(1, 0)),
                         VerifyCall("b", 0, b, 1, features=True),
                         VerifyCall("c", 0, c, 1, features=True, feature_layers=(0,))])
    assert [g.features.shape for g in got] == [(5, 3 * H), (3, H), (2, 2 * H)]
    for g, ids, layers in zip(got, (a, b, c), ((1, 0), (), (0,))):
        ref = layer_features(target, ids, layers)  # the float model, uncached
        if bits is None:
            torch.testing.assert_close(g.features.float(), ref, atol=2e-3, rtol=2e-3)
        else:  # quantised layers, 8-bit activations and a float16 KV cache stay close to the float ones, chunk by chunk
            sim = torch.nn.functional.cosine_similarity(g.features.float().view(len(ids), -1, H), ref.view(len(ids), -1, H), dim=-1)
            assert sim.min() > 0.85, sim
    if bits is not None:  # the fast path's own numbers: the same call alone, layers in the other order, same bits
        alone = make("t2").verify([VerifyCall("a", 0, a, 1, features=True, feature_layers=(0, 1))])[0].features
        assert torch.equal(got[0].features, torch.cat([alone[:, H : 2 * H], alone[:, :H], alone[:, 2 * H :]], dim=-1))


def test_a_fusing_draft_starts_as_the_final_feature_draft_and_is_lossless(target, tok):
    """A draft over layers 0 and 1 besides the final feature proposes, untrained, exactly what the
    final-feature draft proposes (its fusion starts as the final feature alone); with a fusion that
    reads the layers, it proposes otherwise and the output is still the target's alone."""
    def engine(layers, runtime="hf", fuse=None):
        prop = build_proposer(DraftConfig(kind="feature", feature_layers=layers), target, tok)
        if fuse is not None:
            with torch.no_grad():
                prop.runner.model.fuse.weight.copy_(fuse)
        runner = ModelRunner(target, name="t") if runtime == "hf" else FastRunner(target, name="t", bits=4)
        return SpeculativeEngine(runner, tok, prop, EngineConfig(chat_template=False, k=KPolicyConfig(fixed_k=3)))

    prompt = [5, 9, 14, 3, 7, 21, 8]
    plain_steps, fused_steps = [], []
    engine([]).generate(list(prompt), GREEDY, on_step=plain_steps.append)
    engine([0, 1]).generate(list(prompt), GREEDY, on_step=fused_steps.append)
    assert [s.draft_tokens for s in fused_steps] == [s.draft_tokens for s in plain_steps]
    assert engine([0, 1]).proposer.feature_layers == (0, 1)

    H = target.config.hidden_size
    mixing = torch.randn(H, 3 * H, generator=torch.Generator().manual_seed(0)) * 0.3
    for runtime in ("hf", "int4"):
        steps = []
        e = engine([0, 1], runtime, fuse=mixing)
        alone = SpeculativeEngine(e.target, tok, None, EngineConfig(chat_template=False))
        for p in ([5, 9, 14, 3, 7, 21, 8], [40, 41, 2, 2, 2, 2]):
            out = e.generate(list(p), GREEDY, on_step=steps.append).token_ids
            assert out == alone.generate(list(p), GREEDY).token_ids
        assert any(s.proposed for s in steps)
    assert [s.draft_tokens for s in steps] != [s.draft_tokens for s in plain_steps]


def test_fused_records_and_teacher_data_carry_every_layer(target, tok):
    """A served record of a fusing draft holds [len - 1, 3H] features that survive encoding, the
    teacher data of the same request the same numbers (the learner and the offline start train on
    the same thing), and the prompt positions read the final chunk."""
    from learner.offline import collect_teacher_data, with_prompt_positions

    prop = build_proposer(DraftConfig(kind="feature", feature_layers=[1, 0]), target, tok)
    engine = SpeculativeEngine(ModelRunner(target, name="t"), tok, prop,
                               EngineConfig(chat_template=False, k=KPolicyConfig(fixed_k=3), record_top_k=8))
    prompt = [5, 9, 14, 3, 7, 21, 8]
    rec, *_ = serve_recorded(engine, prompt, SamplingParams(max_tokens=12, ignore_eos=True), sources=("feature",))
    L, H = rec.tokens.shape[0], target.config.hidden_size
    assert rec.features.shape == (L - 1, 3 * H)
    torch.testing.assert_close(rec.features.float(), layer_features(target, rec.tokens[: L - 1].tolist(), (1, 0)), atol=2e-2, rtol=2e-2)
    back = decode_record(encode_record(rec))
    assert torch.equal(back.features, rec.features)

    s, = collect_teacher_data(target, tok, [prompt], max_tokens=12, top_k=8, features=True, feature_layers=(1, 0))
    assert torch.equal(s.tokens, rec.tokens) and s.features.shape == (L - 1, 3 * H)
    torch.testing.assert_close(s.features.float(), rec.features.float(), atol=2e-3, rtol=2e-3)
    plain, = collect_teacher_data(target, tok, [prompt], max_tokens=12, top_k=8, features=True)
    wide, = with_prompt_positions([s], target.get_output_embeddings(), 2)
    narrow, = with_prompt_positions([plain], target.get_output_embeddings(), 2)
    assert torch.equal(wide.ids, narrow.ids)  # the head reads the final feature, not the layers'


def test_a_fusing_draft_learns_online_and_keeps_its_layers_through_a_checkpoint(trained_target, tok, tmp_path):
    from drafts.build import build_draft_model, load_draft, save_draft

    prop = build_proposer(DraftConfig(kind="feature", feature_layers=[0]), trained_target, tok)
    engine = SpeculativeEngine(ModelRunner(trained_target, name="t"), tok, prop,
                               EngineConfig(chat_template=False, k=KPolicyConfig(fixed_k=3), record_top_k=8))
    records = served_records(engine, random.Random(1), 60, n_digits=4, max_tokens=24)
    train, held = records[:40], records[40:]
    trainer = DraftTrainer("f", engine.proposer.runner.model,
                           LearnerConfig(lr=1e-3, steps_per_round=5, positions="all", holdout_fraction=0.0, gate_margin=1.0))
    model = trainer.model  # the training copy
    start_fuse = model.fuse.weight.detach().clone()
    for r in held:
        trainer.add_holdout(r)
    before = trainer.agreement()
    for _ in range(10):
        assert trainer.train_round(train).accepted
    assert trainer.agreement() >= before + 0.02
    H = trained_target.config.hidden_size
    assert not torch.equal(model.fuse.weight[:, :H], start_fuse[:, :H])  # it learned to read layer 0 too
    engine.swap_draft(*trainer.publish()[::-1])  # the published weights serve, losslessly
    alone = SpeculativeEngine(engine.target, tok, None, EngineConfig(chat_template=False))
    for r in held[:3]:
        p = r.tokens[: r.prompt_len].tolist()
        gp = SamplingParams(max_tokens=24, ignore_eos=True)
        assert engine.generate(list(p), gp).token_ids == alone.generate(list(p), gp).token_ids

    save_draft(model, tmp_path / "f", None)
    loaded, _, _ = load_draft(tmp_path / "f")
    assert loaded.feature_layers == (0,) and loaded.feature_width == 2 * trained_target.config.hidden_size
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())
    again, _ = build_draft_model(DraftConfig(kind="feature", checkpoint=str(tmp_path / "f")), trained_target, tok)
    assert again.feature_layers == (0,)
    with pytest.raises(ValueError, match="reads the target's layers"):
        build_draft_model(DraftConfig(kind="feature", checkpoint=str(tmp_path / "f"), feature_layers=[1]), trained_target, tok)


def test_feature_layers_are_checked():
    from speculative.feature_draft import FeatureDraft
    from conftest import tiny_llama

    with pytest.raises(ValueError, match="feature_layers"):
        DraftConfig(kind="truncated", feature_layers=[0])
    with pytest.raises(ValueError, match="distinct"):
        DraftConfig(kind="feature", feature_layers=[1, 1])
    cfg = tiny_llama(3, seed=0).config
    for bad in ([2], [3], [-1]):  # the last layer's output is the final feature already; out of range
        with pytest.raises(ValueError, match="before its last"):
            FeatureDraft(cfg, 10, bad)
    assert FeatureDraft(cfg, 10, [1, 0]).feature_width == 3 * cfg.hidden_size


# -- the draft's parts, held to what they promise ---------------------------------------------------------
def test_an_untrained_fusion_is_the_final_feature_and_the_head_the_targets_rows(target):
    """The fusion starts as the final feature alone, exactly (no bias: the untrained fusing draft is
    the final-feature draft); the head is the target's (its kept rows); the stored config describes
    the one decoder layer the draft has, and the runner's cache holds one layer."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    H = target.config.hidden_size
    fused = feature_draft(target, feature_layers=[0, 1])
    x = torch.randn(5, 3 * H, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fused.fuse_features(x), x[:, 2 * H:], atol=0, rtol=0)
        keep = torch.tensor([3, 7, 40, 41, 100])
        h = torch.randn(4, H, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(feature_draft(target, keep).lm_head(h), target.get_output_embeddings()(h)[:, keep])
        torch.testing.assert_close(fused.lm_head(h), target.get_output_embeddings()(h))
    layers = [m for m in fused.modules() if isinstance(m, LlamaDecoderLayer)]
    assert fused.config.num_hidden_layers == len(layers) == 1
    assert len(DynamicCache(config=fused.config).layers) == 1


def test_an_untrained_feature_draft_is_the_one_layer_truncated_token_draft(target):
    """Initialised as the module says: before any training it reads the token alone (fc maps
    [feature ; embedding] to the embedding) through the target's first layer, final norm and head,
    so over the pairs (f_j, x_(j+1)) its logits are those of the target truncated to its first
    layer over x_1, x_2, ..., whatever the features are."""
    from drafts.build import truncated_draft

    H = target.config.hidden_size
    toks = [5, 9, 14, 3, 7, 21, 2]
    feats = torch.randn(1, len(toks), H, generator=torch.Generator().manual_seed(4)) * 3.0
    draft, token_draft = feature_draft(target), truncated_draft(target, 1)
    with torch.no_grad():
        got = draft.lm_head(draft(feats, torch.tensor([toks]), torch.arange(len(toks))[None]))[0]  # [T, V]
        want = token_draft(torch.tensor([toks])).logits[0]  # [T, V]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_features_are_read_at_the_embeddings_scale(target):
    """The feature norm starts at the embeddings' RMS: a target feature of any size reaches fc at
    the scale of the token's embedding (unscaled, it would drown the token in the first updates)."""
    draft = feature_draft(target)
    emb_rms = target.get_input_embeddings().weight.detach().float().pow(2).mean().sqrt()
    for scale in (0.5, 5.0, 40.0):  # (far smaller, the norm's epsilon starts to count)
        f = torch.randn(6, target.config.hidden_size, generator=torch.Generator().manual_seed(5)) * scale
        with torch.no_grad():
            rms = draft.feature_norm(f).pow(2).mean(-1).sqrt()  # [6]
        torch.testing.assert_close(rms, emb_rms.expand(6), rtol=1e-3, atol=0)


def test_the_runners_head_is_float_unless_packed_bits_are_asked_for(target):
    """head_bits None: the draft's own float head, exactly; 8 and 4: that packed copy's kernel (the
    tiny target's width, 32, is one int4 group), close to the float head but rounded."""
    from speculative.fast import Int4Linear, Int8Linear

    draft = feature_draft(target)
    h = torch.randn(5, target.config.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = draft.lm_head(h)
    torch.testing.assert_close(FeatureRunner(draft).head(h), want, atol=0, rtol=0)
    for b, packed in {8: Int8Linear, 4: Int4Linear}.items():
        got = FeatureRunner(draft, head_bits=b).head(h)
        with torch.no_grad():
            torch.testing.assert_close(got, packed(draft.lm_head)(h).float(), atol=0, rtol=0)  # that packing's kernel
        assert not torch.equal(got, want)  # rounded: not the float head
        assert (got - want).abs().max() < 0.1 * want.abs().max(), b


def test_pairs_fed_at_once_predict_what_pairs_fed_one_by_one_do(target):
    """FeatureRunner.step over T pairs returns one predicted feature per pair, each seeing only the
    pairs up to it (causal, also when continuing a cache): the same rows as T steps of one pair. The
    draft's forward without a cache or mask is that causal one (teacher forcing)."""
    H = target.config.hidden_size
    draft = feature_draft(target, feature_layers=[1])
    with torch.no_grad():
        draft.fuse.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    feats = torch.randn(6, 2 * H, generator=torch.Generator().manual_seed(3))
    toks = [5, 9, 14, 3, 7, 21]
    runner = FeatureRunner(draft)
    with torch.no_grad():
        one = torch.cat([runner.step("one", i, feats[i : i + 1], toks[i : i + 1]) for i in range(6)])  # [6, H]
        torch.testing.assert_close(runner.step("all", 0, feats, toks), one, atol=1e-5, rtol=1e-4)
        for a, b in ((0, 3), (3, 5), (5, 6)):  # two pairs on a cache of three: the mask must see the cache
            torch.testing.assert_close(runner.step("split", a, feats[a:b], toks[a:b]), one[a:b], atol=1e-5, rtol=1e-4)
        plain = draft(draft.fuse_features(feats)[None], torch.tensor([toks]), torch.arange(6)[None])[0]
        torch.testing.assert_close(plain, one, atol=1e-5, rtol=1e-4)
        # a sequence begun again at pair 0 (a new request under a reused id) forgets its old pairs;
        # a start past the cached pairs is refused, also for a sequence never seen
        again = runner.step("all", 0, feats[3:], toks[3:])
        torch.testing.assert_close(again, runner.step("fresh", 0, feats[3:], toks[3:]), atol=0, rtol=0)
        with pytest.raises(ValueError, match="has 3 cached pairs, cannot start at 5"):
            runner.step("all", 5, feats[:1], toks[:1])
        with pytest.raises(ValueError, match="has 0 cached pairs, cannot start at 2"):
            runner.step("never-seen", 2, feats[:1], toks[:1])


def _sample(L: int, prompt_len: int, H: int, rows: int | None, seed: int):
    from learner.offline import Sample

    g = torch.Generator().manual_seed(seed)
    T = L - prompt_len
    return Sample(tokens=torch.randint(2, 100, (L,), generator=g), prompt_len=prompt_len,
                  ids=torch.zeros(T, 2, dtype=torch.int32), probs=torch.full((T, 2), 0.5), tail=torch.zeros(T),
                  features=None if rows is None else torch.randn(rows, H, generator=g))


def test_teacher_forcing_reads_the_pairs_it_needs_and_refuses_records_without_them(target):
    """The pair (f_j, x_{j+1}) predicts token j + 2, so a record of L tokens needs the features of
    positions 0..L-3 and a prompt of >= 2 tokens. With L - 2 rows it trains exactly as with the L - 1
    a served record carries (the last is never read); fewer rows, no features or a one-token prompt
    are refused. Records of different lengths batched give each record's rows as it gives them alone."""
    import dataclasses

    H = target.config.hidden_size
    draft = feature_draft(target)
    full = _sample(12, 4, H, rows=11, seed=0)
    with torch.no_grad():
        alone = draft.teacher_forced_logits([full])
        assert alone.shape == (8, target.config.vocab_size)  # one row per output position
        torch.testing.assert_close(draft.teacher_forced_logits([dataclasses.replace(full, features=full.features[:10])]),
                                   alone, atol=0, rtol=0)
        other = _sample(7, 2, H, rows=6, seed=1)
        both = draft.teacher_forced_logits([other, full])
        torch.testing.assert_close(both, torch.cat([draft.teacher_forced_logits([other]), alone]), atol=1e-5, rtol=1e-4)
    for bad in (dataclasses.replace(full, features=None), dataclasses.replace(full, features=full.features[:9]),
                dataclasses.replace(full, prompt_len=1)):
        with pytest.raises(ValueError, match="features"):
            draft.teacher_forced_logits([bad])


# -- EAGLE's feature loss ---------------------------------------------------------------------------------
def test_the_feature_loss_is_smooth_l1_averaged_over_the_features_dimensions():
    """Hand-made: |d| < beta costs 0.5 d^2 / beta, else |d| - 0.5 beta; one value per position and
    pass; the target is a constant (no gradient reaches it)."""
    from learner.losses import feature_regression

    pred = torch.tensor([[0.5, 0.0], [3.0, -2.0]], requires_grad=True)
    tgt = torch.zeros(2, 2, requires_grad=True)
    torch.testing.assert_close(feature_regression(pred, tgt), torch.tensor([0.0625, 2.0]))  # (0.125 + 0) / 2, (2.5 + 1.5) / 2
    torch.testing.assert_close(feature_regression(pred, tgt, beta=4.0), torch.tensor([0.015625, 0.8125]))  # (1.125 + 0.5) / 2
    torch.testing.assert_close(feature_regression(pred, torch.tensor([[0.5, 0.0], [3.0, -2.0]])), torch.zeros(2))
    two = feature_regression(torch.stack([pred, pred + 1.0]), tgt)  # [passes, N]
    torch.testing.assert_close(two, torch.stack([torch.tensor([0.0625, 2.0]), torch.tensor([0.75, 2.0])]))  # (1.5, 1): (1.0 + 0.5) / 2; (4, -1): (3.5 + 0.5) / 2
    two.sum().backward()
    assert pred.grad is not None and tgt.grad is None
    with pytest.raises(ValueError, match="does not end in"):
        feature_regression(pred, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="beta"):
        feature_regression(pred, tgt, beta=0.0)


def test_teacher_forcing_gives_each_row_the_feature_it_predicts(target):
    """Row p (predicted by the pair j = p - 2) is paired with the target's f_{j+1}, read from the
    record, in both passes; a record that stops before f_{j+1} marks that row invalid."""
    import dataclasses

    H = target.config.hidden_size
    draft = feature_draft(target)
    full = _sample(12, 4, H, rows=11, seed=0)  # features 0..10; output rows p = 4..11, pairs j = 2..9
    short = _sample(9, 3, H, rows=7, seed=1)  # features 0..6; rows p = 3..8, j = 1..6
    draft.train()
    logits, pred, tgt, valid = draft.teacher_forced([full, short])
    assert logits.shape == (2, 8 + 6, target.config.vocab_size) and pred.shape == (2, 14, H) and tgt.shape == (14, H)
    torch.testing.assert_close(logits, draft.lm_head(pred))
    torch.testing.assert_close(tgt[:8], full.features[3:11])
    torch.testing.assert_close(tgt[8:13], short.features[2:7])
    assert valid.tolist() == [True] * 8 + [True] * 5 + [False]  # short's last pair j = 6 would need f_7
    draft.eval()
    with torch.no_grad():
        _, pred1, tgt1, _ = draft.teacher_forced([full, short])
        every = dataclasses.replace(full, features=torch.cat([full.features, torch.randn(1, H)]))  # f_11 too: never read
        _, _, tgt2, valid2 = draft.teacher_forced([every])
    torch.testing.assert_close(pred1, pred[0].detach(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(tgt1, tgt)
    torch.testing.assert_close(tgt2, full.features[3:11])
    assert valid2.all()


def test_the_draft_loss_adds_the_weighted_feature_loss_on_the_rows_trained(target):
    """``draft_loss`` is the distillation loss alone at weight 0 (and for a token draft), and adds
    weight x the mean feature loss of the selected, valid rows of both passes otherwise."""
    from learner.losses import SparseDist, feature_regression, forward_kl
    from learner.offline import draft_loss, passes_loss

    H = target.config.hidden_size
    draft = feature_draft(target)
    with torch.no_grad():  # a draft that reads the features (the starting one ignores them)
        draft.fc.weight[:, :H].normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    batch = [_sample(12, 4, H, rows=11, seed=0), _sample(9, 3, H, rows=7, seed=1)]
    g = torch.Generator().manual_seed(3)
    rows = torch.rand(14, generator=g) < 0.6
    rows[-1] = True  # the invalid row is selected and still left out of the feature loss
    n = int(rows.sum())
    target_d = SparseDist(ids=torch.randint(0, 100, (n, 4), generator=g), probs=torch.full((n, 4), 0.2), tail=torch.full((n,), 0.2))
    draft.train()
    logits, pred, tgt, valid = draft.teacher_forced(batch)
    base = passes_loss(forward_kl, logits[:, rows], target_d, 0)
    keep = rows & valid
    reg = feature_regression(pred[:, keep], tgt[keep]).mean()
    assert reg > 0
    torch.testing.assert_close(draft_loss(draft, batch, forward_kl, target_d, 0, rows=rows), base)
    torch.testing.assert_close(draft_loss(draft, batch, forward_kl, target_d, 0, feature_loss=0.5, rows=rows), base + 0.5 * reg)
    from drafts.build import truncated_draft
    from learner.offline import student_logits_for

    token = truncated_draft(target, 1)  # a token draft has no features to regress: its loss is the plain one
    plain = [_sample(12, 4, H, rows=None, seed=0), _sample(9, 3, H, rows=None, seed=1)]
    torch.testing.assert_close(draft_loss(token, plain, forward_kl, target_d, 0, feature_loss=0.5, rows=rows),
                               passes_loss(forward_kl, student_logits_for(token, plain)[rows], target_d, 0))
    loss = draft_loss(draft, batch, forward_kl, target_d, 0, feature_loss=1.0, rows=rows) - base
    loss.backward()  # the feature loss alone trains the layer and fc, not the head
    assert draft.fc.weight.grad.abs().sum() > 0 and draft.layer.self_attn.q_proj.weight.grad.abs().sum() > 0
    assert draft.lm_head.weight.grad is None or draft.lm_head.weight.grad.abs().sum() == 0


def test_distilling_with_the_feature_loss_brings_predicted_features_to_the_targets(trained_target, tok):
    """Seeded, on held-out toy prompts: the same steps with the feature loss leave the draft's
    predicted features closer to the target's than without it, and it still learns the tokens."""
    from learner.losses import feature_regression
    from learner.offline import DistillConfig, collect_teacher_data, distill
    from drafts.build import build_draft_model

    rng = random.Random(4)
    prompts = [tok(digits(rng, 4))["input_ids"] for _ in range(40)]
    data = collect_teacher_data(trained_target, tok, prompts, max_tokens=20, top_k=8, features=True)
    train, held = data[:30], data[30:]

    def run(weight):
        draft, _ = build_draft_model(DraftConfig(kind="feature"), trained_target, tok)
        hist = distill(draft, train, DistillConfig(lr=1e-3, top_k=8, batch_positions=128, max_steps=100, epochs=100,
                                                   warmup_steps=5, feature_loss=weight), log=None, heldout=held)
        with torch.no_grad():
            _, pred, tgt, valid = draft.teacher_forced(held)
        return float(feature_regression(pred[valid], tgt[valid]).mean()), hist

    without, _ = run(0.0)
    with_, hist1 = run(1.0)
    assert with_ < 0.75 * without, (with_, without)  # 0.21 against 0.33 when written
    assert _fewer_misses(hist1["agreement_before"], hist1["agreement_after"]), hist1
