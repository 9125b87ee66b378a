"""Low-rank adapters on a draft (speculative.adapters): a fresh adapter is the base draft, what an
adapter learns reaches the served int4 draft's proposals (a whole-weight update of the same size is
rounded away by the packing), adapters load without packing the base again, rows stay
batch-invariant, and speculative output with an adapted draft equals target-only."""

from __future__ import annotations

import copy

import pytest
import torch

from config import EngineConfig, KPolicyConfig, SamplingParams
from conftest import _char_tokenizer, tiny_llama
from test_fast import _on_int4_grid
from speculative import ForwardCall, ModelRunner, SpeculativeEngine
from speculative.adapters import LoRALinear, adapter_parameters, adapter_state, add_adapters, has_adapters
from speculative.fast import FastRunner, Int4Linear
from speculative.lean import LeanRunner
from speculative.proposers import DraftModelProposer


def _ids(n, seed=1):
    return torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _teacher_labels(ids):
    """What the 'target' of these tests predicts at each position: the signal a draft learns."""
    with torch.no_grad():
        return tiny_llama(2, seed=11)(input_ids=torch.tensor([ids])).logits[0].argmax(-1)


def _learn(model, ids, steps=30, lr=1e-2):
    """A few AdamW steps of distillation toward the teacher's tokens at ``ids``: on the adapters
    if the model has them, else on every projection weight (the whole-draft learner)."""
    params = adapter_parameters(model) if has_adapters(model) else [p for n, p in model.named_parameters() if "proj" in n]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    x, y = torch.tensor([ids]), _teacher_labels(ids)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(input_ids=x).logits[0], y).backward()
        opt.step()
    model.eval()
    return model


def test_a_fresh_adapter_is_the_base_draft_exactly():
    base = tiny_llama(2, seed=3)
    adapted = add_adapters(copy.deepcopy(base), rank=4)
    assert has_adapters(adapted) and isinstance(adapted.model.layers[0].self_attn.q_proj, LoRALinear)
    ids = _ids(20)
    with torch.no_grad():
        assert torch.equal(adapted(input_ids=torch.tensor([ids])).logits, base(input_ids=torch.tensor([ids])).logits)
    for bits in (4, 8):
        assert torch.equal(FastRunner(adapted, bits=bits).forward("s", 0, ids, 20), FastRunner(base, bits=bits).forward("s", 0, ids, 20))


def test_what_an_adapter_learns_reaches_the_served_int4_draft():
    """A draft whose weights sit on the int4 grid (as the truncated GGUF target's do): an adapter's
    update is added in float after the packed product and moves the served draft's proposals
    exactly as it moves the float draft's."""
    base = _on_int4_grid(tiny_llama(2, seed=3))
    ids = _ids(64, seed=2)
    served_base = FastRunner(base, bits=4).forward("s", 0, ids, len(ids))
    with torch.no_grad():
        float_base = base(input_ids=torch.tensor([ids])).logits[0]
    assert torch.equal(float_base.argmax(-1), served_base.argmax(-1))

    adapted = _learn(add_adapters(copy.deepcopy(base), rank=4), ids, steps=30, lr=1e-2)
    served = FastRunner(add_adapters(copy.deepcopy(base), rank=4), bits=4)
    served.load_state_dict(adapter_state(adapted))  # what an adapter learner publishes
    with torch.no_grad():
        float_after = adapted(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
    served_after = served.forward("s", 0, ids, len(ids)).argmax(-1)
    assert (float_after != float_base.argmax(-1)).sum() >= len(ids) // 2  # the learning moved the draft
    # and the served draft with it (up to near-ties: the packed kernel rounds activations to bfloat16)
    assert (served_after == float_after).float().mean() >= 0.95


def test_an_update_under_half_a_4bit_step_is_rounded_away_when_packed():
    """Why a whole-draft learner's versions can leave the served int4 draft where it was: weights on
    the grid, moved by a quarter step (a group's minimum and maximum kept), pack to the same codes."""
    base = _on_int4_grid(tiny_llama(1, seed=3))
    lin = base.model.layers[0].mlp.up_proj
    w = lin.weight.data.view(lin.out_features, -1, 32)  # [N, K/32, 32]
    step = (w.amax(-1, keepdim=True) - w.amin(-1, keepdim=True)) / 15
    interior = (w > w.amin(-1, keepdim=True)) & (w < w.amax(-1, keepdim=True))
    moved = copy.deepcopy(lin)
    moved.weight.data = (w + interior * step / 4).view_as(lin.weight)  # every interior weight up a quarter step
    x = torch.randn(5, lin.in_features)
    assert not torch.equal(moved(x), lin(x))  # the float layer changed
    assert torch.equal(Int4Linear(moved)(x), Int4Linear(lin)(x))  # the packed one did not


def test_adapters_load_without_packing_the_base_again():
    model = add_adapters(tiny_llama(2, seed=1), rank=4)
    r = FastRunner(model, bits=4)
    packed = [layer[1].weight for layer in r.layers]
    learned = _learn(copy.deepcopy(model), _ids(30), steps=5)
    r.load_state_dict(adapter_state(learned))
    assert all(layer[1].weight is w for layer, w in zip(r.layers, packed))  # the same packed tensors
    fresh = FastRunner(learned, bits=4)
    assert torch.equal(r.forward("s", 0, _ids(12), 12), fresh.forward("s", 0, _ids(12), 12))
    assert sum(v.numel() for v in adapter_state(learned).values()) < 0.2 * sum(p.numel() for p in model.parameters())


def test_rows_stay_batch_invariant_with_adapters():
    model = _learn(add_adapters(tiny_llama(3, seed=0), rank=4), _ids(30), steps=5)
    r = FastRunner(model, bits=4)
    ids = _ids(40, seed=4)
    whole = r.forward("a", 0, ids, len(ids))
    one = [r.forward("c", 0, ids[:1])[0]] + [r.forward("c", i, [ids[i]])[0] for i in range(1, len(ids))]
    assert torch.equal(whole, torch.stack(one))
    r.forward("x", 0, ids[:10])
    got = r.forward_batch([ForwardCall("x", 10, ids[10:15], 5), ForwardCall("y", 0, ids[:7], 7)])
    assert torch.equal(got[0], whole[10:15]) and torch.equal(got[1], whole[:7])


def test_the_lean_path_adds_the_adapters_too():
    model = _learn(add_adapters(tiny_llama(2, seed=0), rank=4), _ids(30), steps=5)
    ref = ModelRunner(model)
    lean = LeanRunner(model, dtype="float32", kv_dtype="float32", buckets=True)
    ids = _ids(20, seed=5)
    torch.testing.assert_close(lean.forward("s", 0, ids, 20), ref.forward("s", 0, ids, 20), rtol=1e-4, atol=2e-4)
    other = _learn(copy.deepcopy(model), _ids(30, seed=7), steps=5)
    lean.load_state_dict(adapter_state(other))  # in place: the graphs' tensors
    ref.load_state_dict(adapter_state(other))
    torch.testing.assert_close(lean.forward("t", 0, ids, 20), ref.forward("t", 0, ids, 20), rtol=1e-4, atol=2e-4)


def test_greedy_speculative_with_an_adapted_draft_equals_target_only():
    target = tiny_llama(3, seed=0)
    draft = _learn(add_adapters(tiny_llama(1, seed=7), rank=4), _ids(30), steps=5)
    tok = _char_tokenizer()
    runner = FastRunner(target, name="target", bits=4)
    cfg = EngineConfig(chat_template=False, k=KPolicyConfig(k_max=3, fixed_k=3))
    alone = SpeculativeEngine(runner, tok, None, cfg)
    spec = SpeculativeEngine(runner, tok, DraftModelProposer(FastRunner(draft, name="draft", bits=4), 128), cfg)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for prompt in ([5, 6, 7, 8], list(range(20, 45))):
        assert spec.generate(prompt, params).token_ids == alone.generate(prompt, params).token_ids


def test_adapter_learners_of_several_domains_share_one_base():
    """Each domain's trainer owns its adapters and their optimiser state; the base is the draft's
    own storage in all of them (not a copy), and training one domain moves neither the base nor
    the other domain's adapters."""
    from learner.trainer import DraftTrainer, LearnerConfig

    draft = tiny_llama(1, seed=7)
    base = {n: (p.data_ptr(), p.detach().clone()) for n, p in draft.named_parameters()}
    cfg = LearnerConfig(adapter_rank=4, lr=1e-2)
    sql, code = DraftTrainer("sql", draft, cfg), DraftTrainer("code", draft, cfg)
    for t in (sql, code):
        for n, p in t.model.named_parameters():
            if n in base:  # a base tensor: the draft's storage, frozen
                assert p.data_ptr() == base[n][0] and not p.requires_grad, n
        assert {id(p) for p in t.params} == {id(p) for n, p in t.model.named_parameters() if n.endswith(("lora_A", "lora_B"))}
    before = {k: v.clone() for k, v in adapter_state(code.model).items()}
    _learn(sql.model, _ids(24))
    assert any(not torch.equal(v, before[k]) for k, v in adapter_state(sql.model).items())  # sql learned
    assert all(torch.equal(v, before[k]) for k, v in adapter_state(code.model).items())  # code did not move
    for n, p in draft.named_parameters():
        assert torch.equal(p, base[n][1]), n  # nor did the shared base


def test_a_draft_that_takes_no_adapters_learns_whole_under_an_adapter_config(caplog):
    """The feature draft is not a Llama-style decoder: with adapter_rank set (the server's default)
    its trainer says so and trains the whole draft instead of failing; a truncated draft gets them."""
    from learner.trainer import DraftTrainer, LearnerConfig
    from speculative.adapters import takes_adapters
    from speculative.feature_draft import feature_draft

    target = tiny_llama(2, seed=3)
    feature = feature_draft(target)
    assert not takes_adapters(feature) and takes_adapters(tiny_llama(1, seed=7))
    cfg = LearnerConfig(adapter_rank=4, lr=1e-2)
    with caplog.at_level("WARNING", logger="learner.trainer"):
        t = DraftTrainer("f", feature, cfg)
    assert "takes no adapters" in caplog.text and t.cfg.adapter_rank == 0 and not has_adapters(t.model)
    assert t.params and all(p.requires_grad for p in t.params)
    assert has_adapters(DraftTrainer("d", tiny_llama(1, seed=7), cfg).model)


def test_a_whole_draft_given_to_an_adapted_draft_replaces_it_adapters_and_all():
    """An operator's whole draft (no adapters) sent to a served draft that has learned adapters:
    it serves exactly those weights (adapters zeroed); a state with keys missing is refused before
    anything is written."""
    served = FastRunner(_learn(add_adapters(tiny_llama(1, seed=7), rank=4), _ids(24)), bits=4)
    other = tiny_llama(1, seed=9)
    whole = {k: v.clone() for k, v in other.state_dict().items()}
    ids = _ids(12, seed=4)
    served.load_state_dict(whole)
    assert torch.equal(served.forward("s", 0, ids, 12), FastRunner(tiny_llama(1, seed=9), bits=4).forward("s", 0, ids, 12))
    assert all(not v.any() for k, v in adapter_state(served.model).items() if k.endswith("lora_B"))
    before = {k: v.clone() for k, v in served.model.state_dict().items()}
    broken = dict(whole)
    broken.pop(next(iter(broken)))
    try:
        served.load_state_dict({k: v + 1 for k, v in broken.items()})
        raise AssertionError("a state with a key missing was loaded")
    except KeyError:
        pass
    assert all(torch.equal(v, before[k]) for k, v in served.model.state_dict().items())


def test_an_adapter_learner_skips_a_whole_draft_checkpoint_and_keeps_the_shared_base(tmp_path):
    """A checkpoint without adapters (a whole-draft learner's, from before adapters were turned
    on) is not a version of an adapter draft: the trainer moves it aside and starts above it, and
    the base it shares with the other domains is not written."""
    from drafts.build import save_draft
    from learner.checkpoints import LATEST, draft_folder
    from learner.trainer import DraftTrainer, LearnerConfig

    draft = tiny_llama(1, seed=7)
    base = {k: v.clone() for k, v in draft.state_dict().items()}
    root = tmp_path / draft_folder("sql")
    root.mkdir(parents=True)
    save_draft(tiny_llama(1, seed=9), root / "v5")
    (root / LATEST).write_text("v5\n")
    t = DraftTrainer("sql", draft, LearnerConfig(adapter_rank=4, checkpoint_dir=tmp_path))
    assert t.skipped == [5] and t.version == 6
    assert all(torch.equal(v, base[k]) for k, v in draft.state_dict().items())


def _adapted(seed: int, rank: int = 4) -> dict:
    """An adapter version on ``tiny_llama(1, seed=7)``: B drawn at random (a trained adapter's
    size), so that it changes the draft's rows."""
    model = add_adapters(copy.deepcopy(tiny_llama(1, seed=7)), rank)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.5)
    return adapter_state(model)


def _start() -> DraftModelProposer:
    """A replica's starting draft: int4, with (zero) adapters, as the shipped general adapter is."""
    return DraftModelProposer(FastRunner(add_adapters(tiny_llama(1, seed=7), 4), name="draft", bits=4), 128)


def test_engines_of_several_draft_ids_share_the_starting_drafts_base():
    """A replica's engines copy their start with its base's tensors shared, float and packed: each
    owns its adapters (and caches). A whole draft loaded into one takes the parameters' places, packs
    a base of its own and leaves the start and the other engines as they were."""
    start = _start()
    base = {k: (v.data_ptr(), v.clone()) for k, v in start.runner.model.state_dict().items() if "lora" not in k}
    a, b = (copy.deepcopy(start, start.runner.share_memo()) for _ in range(2))
    for p in (a, b):
        assert all(v.data_ptr() == base[k][0] for k, v in p.runner.model.state_dict().items() if k in base)
        assert p.runner.layers[0][1].weight.data_ptr() == start.runner.layers[0][1].weight.data_ptr()  # one packed base
        assert p.runner.batch_key == start.runner.batch_key
    ids = _ids(10, seed=6)
    want = b.runner.forward("s", 0, ids, 10)
    a.load_state_dict(_adapted(3), 1)  # adapters only: the packed base stays shared
    assert a.runner.batch_key == b.runner.batch_key
    a.load_state_dict({k: v.clone() for k, v in tiny_llama(1, seed=9).state_dict().items()}, 2)
    assert a.runner.batch_key != b.runner.batch_key  # a whole draft: a base of its own
    for k, v in start.runner.model.state_dict().items():
        if k in base:
            assert torch.equal(v, base[k][1]) and v.data_ptr() == base[k][0], k
    assert torch.equal(b.runner.forward("s2", 0, ids, 10), want)
    assert not torch.equal(a.runner.forward("s", 0, ids, 10), want)


def test_drafts_of_several_adapters_on_one_base_run_in_one_forward_each_row_with_its_own_adapter():
    """Three drafts (adapter versions) on one packed base: their calls, interleaved, in one forward
    give each call bitwise the rows its own draft gives it alone, and the drafts' rows differ; a
    draft with a base of its own is refused."""
    start = _start()
    drafts = [copy.deepcopy(start, start.runner.share_memo()) for _ in range(3)]
    for i, d in enumerate(drafts):
        d.load_state_dict(_adapted(20 + i), 1)
    prompts = [_ids(6 + 3 * i, seed=30 + i) for i in range(6)]
    pairs = [(drafts[i % 3].runner, ForwardCall(f"s{i}", 0, p, 2)) for i, p in enumerate(prompts)]
    alone = [r.forward(f"alone{i}", 0, c.tokens, 2) for i, (r, c) in enumerate(pairs)]
    together = drafts[0].runner.forward_with(pairs)
    assert all(torch.equal(x, y) for x, y in zip(together, alone))
    # the next step of each sequence, from its cache, batched again
    nxt = [(r, ForwardCall(c.seq_id, len(c.tokens), [5, 6], 1)) for r, c in pairs]
    again = [r.forward(f"alone{i}", len(c.tokens), [5, 6], 1) for i, (r, c) in enumerate(pairs)]
    assert all(torch.equal(x, y) for x, y in zip(drafts[1].runner.forward_with(nxt[::-1]), again[::-1]))
    # another draft's calls alone, through this one: its own adapters still
    lone = drafts[0].runner.forward_with([(drafts[2].runner, ForwardCall("lone", 0, prompts[1], 2))])[0]
    assert torch.equal(lone, drafts[2].runner.forward("lone2", 0, prompts[1], 2))
    # each adapter counts: the same prompt through the three drafts gives three different rows
    rows = [d.runner.forward("same", 0, prompts[0], 1) for d in drafts]
    assert not torch.equal(rows[0], rows[1]) and not torch.equal(rows[1], rows[2])
    other = DraftModelProposer(FastRunner(add_adapters(tiny_llama(1, seed=7), 4), name="other", bits=4), 128)
    with pytest.raises(ValueError, match="packed base"):
        drafts[0].runner.forward_with([(drafts[0].runner, ForwardCall("x", 0, [3, 4], 1)),
                                       (other.runner, ForwardCall("y", 0, [3, 4], 1))])


def test_a_whole_draft_keeps_the_served_drafts_device_and_dtype():
    """A learner's version is float32 on the CPU; the served draft's weights stay where and as they
    are served (a draft on a GPU in bfloat16 stays there, in bfloat16) and take the new values."""
    served = LeanRunner(tiny_llama(1, seed=7).to(torch.bfloat16), name="draft")
    new = {k: v.float() for k, v in tiny_llama(1, seed=9).state_dict().items()}
    served.load_state_dict(new)
    state = served.model.state_dict()
    assert {v.dtype for v in state.values()} == {torch.bfloat16} and {v.device for v in state.values()} == {served.device}
    assert all(torch.equal(state[k], v.to(torch.bfloat16)) for k, v in new.items())
    served.forward("s", 0, _ids(6))  # the packed copy reads the same tensors: no mixed devices or dtypes
