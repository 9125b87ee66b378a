"""Unit tests for learner.offline (offline distillation from the target's own generations).

Tiny random Llama models only (vocab 96, hidden 32): no real model, no downloads.
"""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import tiny_llama

from drafts.build import load_draft, restrict_head, save_draft, truncated_draft
from learner.losses import SparseDist, forward_kl, sparse_from_logits
from learner.offline import (
    DistillConfig,
    Sample,
    _batches,
    collect_teacher_data,
    distill,
    learning_rate,
    load_samples,
    pad_placeholders,
    save_samples,
    shared_prefix_len,
    student_logits_for,
    to_student_space,
    top1_agreement_on,
    top1_hits_on,
    with_prompt_positions,
)

VOCAB, EOS, TOP_K, MAX_TOKENS = 96, 2, 16, 12


def tiny_target(layers: int = 4, seed: int = 0) -> LlamaForCausalLM:
    # peakier than the default 0.02 init: a target with a learnable top-1
    return tiny_llama(layers, seed, vocab_size=VOCAB, bos_token_id=1, eos_token_id=EOS, initializer_range=0.1)


def random_prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def data():
    torch.set_num_threads(1)
    target = tiny_target()
    samples = collect_teacher_data(target, None, random_prompts(56), max_tokens=MAX_TOKENS, top_k=TOP_K)
    return target, samples[:44], samples[44:]


def fast_cfg(**kw) -> DistillConfig:
    base = dict(top_k=TOP_K, lr=3e-3, seconds=20, epochs=5, batch_positions=128, warmup_steps=2, log_every=1000)
    return DistillConfig(**{**base, **kw})


# --- teacher data -----------------------------------------------------------------------------


def test_collect_shapes_and_greedy_outputs(data):
    target, train, held = data
    prompts = random_prompts(56)
    assert len(train) + len(held) == 56
    for s, p in zip(train + held, prompts):
        assert s.tokens[: s.prompt_len].tolist() == p
        assert 1 <= s.n_out <= MAX_TOKENS
        out = s.output
        assert EOS not in out[:-1]  # cut at the first EOS (kept as the last output token)
        assert out[-1] == EOS or s.n_out == MAX_TOKENS
        assert s.ids.shape == (s.n_out, TOP_K) and s.ids.dtype == torch.int32
        assert s.probs.shape == (s.n_out, TOP_K) and s.tail.shape == (s.n_out,)
        # greedy: the target's top-1 at each output position is the emitted token
        assert s.ids[:, 0].tolist() == out


def test_sparse_probs_match_softmax_of_target_logits(data):
    target, train, _ = data
    for s in train[:5]:
        with torch.no_grad():
            logits = target(input_ids=s.tokens[None]).logits[0]  # [L, V]
        probs = torch.softmax(logits[s.prompt_len - 1 : -1].float(), dim=-1)  # [T, V] rows predicting the outputs
        assert torch.allclose(probs.gather(1, s.ids.long()), s.probs, atol=1e-5)
        top = torch.topk(probs, TOP_K, dim=-1)
        assert torch.equal(top.indices, s.ids.long())
        assert torch.allclose(s.tail, 1 - top.values.sum(-1), atol=1e-5)


def test_collect_text_prompts_use_chat_template_and_unwraps_engine():
    target = tiny_target(layers=2)
    seen = []

    class StubTok:
        chat_template = "stub"
        eos_token_id = EOS
        pad_token_id = 0

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            seen.append((messages, add_generation_prompt, tokenize))
            return {"input_ids": [5, 6, 7, len(messages[0]["content"])], "attention_mask": [1, 1, 1, 1]}

    engine = SimpleNamespace(target=SimpleNamespace(model=target), tokenizer=StubTok())
    (s,) = collect_teacher_data(engine, None, ["hello"], max_tokens=4, top_k=8)
    assert seen == [([{"role": "user", "content": "hello"}], True, True)]
    assert s.tokens[: s.prompt_len].tolist() == [5, 6, 7, 5] and s.prompt == "hello"
    assert s.ids.shape == (s.n_out, 8)


def _engine(target, quantize: str):
    from config import DraftConfig, EngineConfig, ModelConfig
    from speculative.engine import SpeculativeEngine
    from speculative.runtime import make_runner

    tok = SimpleNamespace(eos_token_id=EOS, pad_token_id=0)
    cfg = EngineConfig(model=ModelConfig(quantize=quantize), draft=DraftConfig(proposers=[]), chat_template=False)
    return SpeculativeEngine(make_runner(target, quantize, name="target"), tok, None, cfg)


def test_served_outputs_are_the_served_runtimes_greedy_tokens_with_their_eos():
    """The outputs the served runtime writes, batched: on the float runtime Hugging Face's
    ``generate`` outputs (EOS kept as the last token); on int4, that runtime's own one-at-a-time
    greedy outputs; and the distributions are still the float model's."""
    from learner.offline import _greedy_outputs, served_greedy
    from speculative.sampling import SamplingParams

    target = tiny_target()
    prompts = random_prompts(24, seed=1)  # one of them ends at EOS
    float_out = served_greedy(_engine(target, "none"), batch_size=5)(prompts, MAX_TOKENS)
    assert float_out == _greedy_outputs(target, prompts, MAX_TOKENS, {EOS}, 0)
    assert any(o[-1] == EOS and len(o) < MAX_TOKENS for o in float_out)  # an EOS met and kept

    int4 = _engine(target, "int4")
    alone = []
    for p in prompts:
        rid = int4.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        while not int4.requests[rid].finished:
            int4.step(rid)
        st = int4.requests[rid]
        alone.append(list(st.output) + ([st.eos_token] if st.eos_token is not None else []))
        int4.release(rid)
    assert served_greedy(int4, batch_size=4)(prompts, MAX_TOKENS) == alone
    assert not int4.requests  # every request released

    samples = collect_teacher_data(target, None, prompts, max_tokens=MAX_TOKENS, top_k=TOP_K, greedy=served_greedy(int4, 4))
    assert [s.output for s in samples] == alone
    s = samples[0]
    with torch.no_grad():
        logits = target(input_ids=s.tokens[None]).logits[0]
    probs = torch.softmax(logits[s.prompt_len - 1 : -1].float(), dim=-1)
    assert torch.allclose(probs.gather(1, s.ids.long()), s.probs, atol=1e-5)


def test_samples_round_trip(tmp_path, data):
    _, train, _ = data
    save_samples(train[:3], tmp_path / "t.pt")
    back = load_samples(tmp_path / "t.pt")
    for a, b in zip(train[:3], back):
        assert torch.equal(a.tokens, b.tokens) and a.prompt_len == b.prompt_len
        assert torch.equal(a.ids, b.ids) and torch.equal(a.probs, b.probs) and torch.equal(a.tail, b.tail)


# --- restricted head: id mapping --------------------------------------------------------------


def test_to_student_space_folds_dropped_ids_into_tail():
    target = SparseDist(
        ids=torch.tensor([[7, 3, 9], [2, 8, 5]]),
        probs=torch.tensor([[0.5, 0.2, 0.1], [0.6, 0.3, 0.05]]),
        tail=torch.tensor([0.2, 0.05]),
    )
    keep = torch.tensor([2, 3, 5, 7])  # 9 and 8 are not in the head
    mapped, n_ph = to_student_space(target, keep)
    assert n_ph == 1
    # kept ids -> their column in keep; a dropped id -> placeholder column len(keep) + rank, prob 0
    assert mapped.ids.tolist() == [[3, 1, 4], [0, 4, 2]]
    assert torch.allclose(mapped.probs, torch.tensor([[0.5, 0.2, 0.0], [0.6, 0.0, 0.05]]))
    assert torch.allclose(mapped.tail, torch.tensor([0.3, 0.35]))
    # nothing dropped: no placeholders, same probabilities
    mapped2, n2 = to_student_space(target, torch.arange(10))
    assert n2 == 0 and torch.equal(mapped2.ids, target.ids) and torch.equal(mapped2.tail, target.tail)


def test_an_empty_head_folds_everything_into_the_tail():
    target = SparseDist(ids=torch.tensor([[7, 3]]), probs=torch.tensor([[0.5, 0.2]]), tail=torch.tensor([0.3]))
    mapped, n_ph = to_student_space(target, torch.tensor([], dtype=torch.long))
    assert n_ph == 2 and mapped.ids.tolist() == [[0, 1]] and mapped.probs.tolist() == [[0.0, 0.0]]
    assert torch.allclose(mapped.tail, torch.tensor([1.0]))


def test_a_row_that_drops_two_ids_needs_two_placeholder_columns():
    target = SparseDist(ids=torch.tensor([[8, 9], [1, 2]]), probs=torch.tensor([[0.5, 0.3], [0.5, 0.3]]),
                        tail=torch.tensor([0.2, 0.2]))
    mapped, n_ph = to_student_space(target, torch.tensor([1, 2, 3]))  # row 0 drops both of its ids, row 1 none
    assert n_ph == 2 and mapped.ids.tolist() == [[3, 4], [0, 1]]


def _with_rows(n: int):
    return Sample(tokens=torch.arange(10), prompt_len=10 - n, ids=torch.zeros((n, 1), dtype=torch.int32),
                  probs=torch.ones(n, 1), tail=torch.zeros(n))


def test_batches_close_when_their_rows_reach_the_bound():
    sizes = [3, 1, 1, 4, 1]
    got = _batches([_with_rows(n) for n in sizes], 5)
    assert [[x.n_out for x in b] for b in got] == [[3, 1, 1], [4, 1]]  # a batch closes at exactly 5 rows
    assert [[x.n_out for x in b] for b in _batches([_with_rows(n) for n in sizes], 100)] == [sizes]
    assert _batches([], 5) == []


def test_agreement_counts_every_output_row_even_of_a_one_row_sample(data):
    target, samples, _ = data
    s = samples[0]
    one = Sample(tokens=s.tokens[: s.prompt_len + 1], prompt_len=s.prompt_len, ids=s.ids[:1], probs=s.probs[:1],
                 tail=s.tail[:1])
    draft = truncated_draft(target, 1)
    hits = top1_hits_on(draft, [one, samples[1]], batch_positions=4)
    assert hits.shape == (1 + samples[1].n_out,)
    assert torch.equal(hits[:1], top1_hits_on(draft, [s])[:1])  # the same row as in the whole sample
    assert top1_hits_on(draft, []).shape == (0,) and math.isnan(top1_agreement_on(draft, []))


def test_shared_prefix_len_by_hand():
    t = torch.tensor
    assert shared_prefix_len([]) == 0
    assert shared_prefix_len([t([1, 2, 3])]) == 3
    assert shared_prefix_len([t([1, 2, 3]), t([1, 2, 4]), t([1, 5])]) == 1
    assert shared_prefix_len([t([9, 1]), t([1, 1]), t([1, 1])]) == 0  # the first differs from the rest
    assert shared_prefix_len([t([1, 2]), t([3, 4]), t([1, 2])]) == 0  # the second differs
    assert shared_prefix_len([t([1, 2, 3]), t([1, 2])]) == 2  # a sequence that is all prefix


def test_restricted_loss_equals_loss_on_kept_bins():
    torch.manual_seed(0)
    keep = torch.tensor([0, 2, 4, 5, 7, 9, 11, 12])
    teacher = sparse_from_logits(torch.randn(6, 14), 4)
    student = torch.randn(6, len(keep), requires_grad=True)
    mapped, n_ph = to_student_space(teacher, keep)
    got = forward_kl(pad_placeholders(student, n_ph), mapped)
    assert torch.isfinite(got).all()
    got.sum().backward()
    assert torch.isfinite(student.grad).all()
    # reference: bins = named ids that the head has + one bin for everything else
    q = torch.softmax(student.detach(), -1)
    for r in range(6):
        col = {int(t): j for j, t in enumerate(keep)}
        named = [(col[int(i)], float(p)) for i, p in zip(teacher.ids[r], teacher.probs[r]) if int(i) in col]
        p_bins = [p for _, p in named]
        q_bins = [float(q[r, j]) for j, _ in named]
        p_bins.append(1 - sum(p_bins))
        q_bins.append(1 - sum(q_bins))
        ref = sum(p * torch.log(torch.tensor(p / qq)).item() for p, qq in zip(p_bins, q_bins) if p > 0)
        assert got[r].item() == pytest.approx(ref, rel=1e-4, abs=1e-6)


def test_prompt_positions_are_the_targets_distributions_there():
    """Widened samples: rows for the prompt's positions from ``start`` on are the target's top-k there
    (as an uncached forward gives them, up to the features' float16), the output rows are untouched,
    and a shorter prompt is kept as it is."""
    target = tiny_target(layers=2)
    prompts = [[5, 6, 7] + p for p in random_prompts(6, seed=3)]  # a shared 3-token prefix, like a chat template's
    samples = collect_teacher_data(target, None, prompts, max_tokens=6, top_k=TOP_K, features=True)
    start = shared_prefix_len([s.tokens[: s.prompt_len] for s in samples])
    assert start == 3
    wide = with_prompt_positions(samples, target.get_output_embeddings(), start)
    for s, w in zip(samples, wide):
        L = int(s.tokens.shape[0])
        assert w.prompt_len == start and w.ids.shape == (L - start, TOP_K) and torch.equal(w.tokens, s.tokens)
        n = s.prompt_len - start
        assert torch.equal(w.ids[n:], s.ids) and torch.equal(w.probs[n:], s.probs)  # output rows as collected
        with torch.no_grad():
            probs = torch.softmax(target(input_ids=s.tokens[None]).logits[0, start - 1 : s.prompt_len - 1].float(), -1)
        top = torch.topk(probs, TOP_K, dim=-1)
        assert (w.ids[:n].long() == top.indices).float().mean() > 0.95  # fp16 features may swap near-ties
        assert torch.allclose(w.probs[:n], top.values, atol=2e-3)
        assert torch.allclose(w.tail[:n], 1 - top.values.sum(-1), atol=2e-3)
    short = with_prompt_positions(samples, target.get_output_embeddings(), 64)
    assert all(a is b for a, b in zip(short, samples))
    from_one = with_prompt_positions(samples, target.get_output_embeddings(), 1)  # row 1 reads the feature at 0
    assert all(w.prompt_len == 1 and w.ids.shape[0] == int(s.tokens.shape[0]) - 1 for s, w in zip(samples, from_one))
    assert all(torch.equal(a.ids[start - 1:], b.ids) for a, b in zip(from_one, wide))
    with pytest.raises(ValueError, match="start must be >= 1"):
        with_prompt_positions(samples, target.get_output_embeddings(), 0)
    # a prompt no longer than start, or features that stop before the prompt's last position, is kept
    # as it is; features that reach exactly that position are enough
    s = samples[0]
    p0 = s.prompt_len
    assert with_prompt_positions([s], target.get_output_embeddings(), p0)[0] is s
    enough = dataclasses.replace(s, features=s.features[: p0 - 1])
    too_few = dataclasses.replace(s, features=s.features[: p0 - 2])
    got, = with_prompt_positions([enough], target.get_output_embeddings(), start)
    assert got.prompt_len == start and torch.equal(got.ids, wide[0].ids)
    assert with_prompt_positions([too_few], target.get_output_embeddings(), start)[0] is too_few
    with pytest.raises(ValueError, match="features"):
        with_prompt_positions(collect_teacher_data(target, None, prompts[:1], max_tokens=4, top_k=TOP_K),
                              target.get_output_embeddings(), start)


def test_training_on_prompt_positions_reaches_more_positions_and_trains(data):
    """The token draft trains on widened samples (each trains on its prompt as well), and held-out
    agreement is still measured on output positions."""
    target, _, held = data
    prompts = random_prompts(44)
    train = collect_teacher_data(target, None, prompts, max_tokens=MAX_TOKENS, top_k=TOP_K, features=True)
    wide = with_prompt_positions(train, target.get_output_embeddings(), 2)
    draft = truncated_draft(target, 1)
    hist = distill(draft, wide, fast_cfg(), log=None, heldout=held)
    assert hist["n_train_positions"] == sum(int(s.tokens.shape[0]) - 2 for s in train)
    assert hist["n_train_positions"] > sum(s.n_out for s in train) + 100
    assert hist["n_eval_positions"] == sum(s.n_out for s in held)
    assert hist["agreement_after"] > hist["agreement_before"] + 0.05


# --- training ---------------------------------------------------------------------------------


def test_distill_raises_heldout_agreement(data):
    target, train, held = data
    draft = truncated_draft(target, 1)
    before = top1_agreement_on(draft, held)
    hist = distill(draft, train, fast_cfg(), log=None, heldout=held)
    assert hist["agreement_before"] == pytest.approx(before)
    assert hist["agreement_on"] == "heldout"
    assert hist["steps"] >= 5 and len(hist["loss_curve"]) == hist["steps"]
    assert hist["seconds"] < 20
    assert hist["loss_curve"][-1] < hist["loss_curve"][0]
    assert hist["agreement_after"] > hist["agreement_before"] + 0.05
    assert hist["agreement_after"] == pytest.approx(top1_agreement_on(draft, held))
    # the target is untouched by training its truncated copy
    assert all(p.grad is None for p in target.parameters())


def test_distill_respects_max_steps_and_freezing(data):
    target, train, _ = data
    draft = truncated_draft(target, 1)
    emb = draft.get_input_embeddings().weight.detach().clone()
    layer = draft.model.layers[0].mlp.up_proj.weight.detach().clone()
    hist = distill(draft, train, fast_cfg(max_steps=3, train_head=False), log=None)
    assert hist["steps"] == 3 and hist["stop_reason"] == "max_steps" and hist["agreement_on"] == "train"
    assert torch.equal(draft.get_input_embeddings().weight, emb)  # tied head frozen -> embeddings frozen
    assert not torch.equal(draft.model.layers[0].mlp.up_proj.weight, layer)
    assert all(p.requires_grad for p in draft.parameters())  # flags restored


def test_learning_rate_warms_up_then_holds_or_follows_a_cosine_to_zero():
    const = DistillConfig(lr=0.01, warmup_steps=4)
    assert [learning_rate(const, s, 0.0) for s in range(5)] == pytest.approx([0.0025, 0.005, 0.0075, 0.01, 0.01])
    assert learning_rate(const, 100, 0.9) == 0.01
    cos = DistillConfig(lr=0.01, warmup_steps=0, lr_schedule="cosine")
    assert learning_rate(cos, 0, 0.0) == pytest.approx(0.01)
    assert learning_rate(cos, 50, 0.5) == pytest.approx(0.005)
    assert learning_rate(cos, 75, 0.75) == pytest.approx(0.01 * (1 + math.cos(0.75 * math.pi)) / 2)
    assert learning_rate(cos, 99, 1.0) == pytest.approx(0.0, abs=1e-12)
    assert learning_rate(cos, 120, 1.3) == pytest.approx(0.0, abs=1e-12)  # past the budget: stays at 0
    # the warm-up and the cosine multiply: a step early in the warm-up of a cosine run
    assert learning_rate(DistillConfig(lr=0.01, warmup_steps=4, lr_schedule="cosine"), 0, 0.5) == pytest.approx(0.00125)


def test_a_cosine_run_ends_its_step_budget_near_a_zero_rate(data):
    target, train, _ = data
    hist = {sched: distill(truncated_draft(target, 1), train, fast_cfg(max_steps=8, lr_schedule=sched), log=None)
            for sched in ("constant", "cosine")}
    assert hist["constant"]["lr_last"] == pytest.approx(3e-3)
    # the 8th step (index 7) is 7/8 of the way: the rate there is (1 + cos(7 pi / 8)) / 2 of the peak
    assert hist["cosine"]["lr_last"] == pytest.approx(3e-3 * (1 + math.cos(7 * math.pi / 8)) / 2, rel=1e-6)
    # the epochs bound the run too: one epoch's batches are the whole budget
    one = distill(truncated_draft(target, 1), train, fast_cfg(epochs=1, batch_positions=64, warmup_steps=0, lr_schedule="cosine"), log=None)
    n = len(_batches(train, 64))
    assert n >= 4 and one["steps"] == n and one["lr_last"] == pytest.approx(3e-3 * (1 + math.cos((n - 1) / n * math.pi)) / 2, rel=1e-6)


def test_a_bfloat16_autocast_run_trains_as_the_float_run_does_and_keeps_float_weights(data):
    """Under bf16 autocast the steps' losses follow the float32 run's closely (same batches, same
    start), the draft learns, and its weights stay float32 (only the forward is cast)."""
    target, train, held = data
    runs = {}
    for mode in ("off", "bf16"):
        draft = truncated_draft(target, 1)
        runs[mode] = distill(draft, train, fast_cfg(max_steps=6, autocast=mode), log=None, heldout=held)
        assert {p.dtype for p in draft.parameters()} == {torch.float32}
    off, bf16 = runs["off"]["loss_curve"], runs["bf16"]["loss_curve"]
    assert len(off) == len(bf16) == 6
    assert bf16[0] == pytest.approx(off[0], rel=0.02) and bf16[0] != off[0]  # cast, but the same loss
    assert bf16 == pytest.approx(off, rel=0.1)
    assert runs["bf16"]["agreement_after"] > runs["bf16"]["agreement_before"]


def test_student_logits_rows_match_plain_forward(data):
    target, train, _ = data
    draft = truncated_draft(target, 2)
    batch = train[:4]
    got = student_logits_for(draft, batch)  # [sum T, V]
    with torch.no_grad():
        ref = torch.cat([draft(input_ids=s.tokens[None, :-1]).logits[0, s.prompt_len - 1 :] for s in batch])
    assert got.shape == ref.shape
    assert torch.allclose(got.detach(), ref, atol=1e-5)


def test_restricted_head_distill_and_save_load_round_trip(tmp_path, data):
    target, train, held = data
    keep = torch.arange(3, 3 + 64)  # 64 of 96 ids
    draft = restrict_head(truncated_draft(target, 1), keep)
    hist = distill(draft, train, fast_cfg(), keep_ids=keep, log=None, heldout=held)
    assert hist["agreement_after"] > hist["agreement_before"]
    agree = top1_agreement_on(draft, held, keep)
    assert agree == pytest.approx(hist["agreement_after"])
    # the head can only emit kept ids
    pred = keep[student_logits_for(draft, held).argmax(-1)]
    assert set(pred.tolist()) <= set(keep.tolist())

    save_draft(draft, tmp_path / "d", keep, meta={"agreement_after": agree})
    back, keep2, meta = load_draft(tmp_path / "d")
    assert torch.equal(keep2, keep) and meta["agreement_after"] == agree
    assert top1_agreement_on(back, held, keep2) == pytest.approx(agree)


def test_save_load_round_trip_tied_draft(tmp_path, data):
    target, train, held = data
    draft = truncated_draft(target, 1)
    distill(draft, train, fast_cfg(max_steps=4), log=None)
    agree = top1_agreement_on(draft, held)
    save_draft(draft, tmp_path / "d")
    back, keep, _ = load_draft(tmp_path / "d")
    assert keep is None
    assert top1_agreement_on(back, held) == pytest.approx(agree)


def test_config_validation():
    with pytest.raises(ValueError):
        DistillConfig(loss="nope")
    with pytest.raises(ValueError):
        DistillConfig(top_k=0)
    with pytest.raises(ValueError):
        distill(truncated_draft(tiny_target(layers=2), 1), [], fast_cfg(), log=None)


def _sample(prompt: str, top_k: int = 4, width: int | None = None, out: int = 3) -> Sample:
    n = len(prompt)
    feats = torch.arange((n + out - 1) * width, dtype=torch.float32).reshape(n + out - 1, width) if width else None
    return Sample(tokens=torch.arange(n + out), prompt_len=n, ids=torch.zeros(out, top_k, dtype=torch.int32),
                  probs=torch.full((out, top_k), 1.0 / top_k), tail=torch.zeros(out), prompt=prompt, features=feats)


def test_teacher_data_for_a_subset_of_its_prompts_in_the_runs_order():
    """A file of every prompt serves a run on some of them, in the run's order; a prompt it lacks,
    another top_k, missing features or features of another width are refused."""
    from learner.offline import samples_for

    every = [_sample(p) for p in ("aa", "bbb", "c", "dddd")]
    got = samples_for(every, ["dddd", "aa"], 4)
    assert [s.prompt for s in got] == ["dddd", "aa"] and got[0] is every[3]
    assert samples_for(every, [], 4) == []
    with pytest.raises(ValueError, match=r"^collected for other prompts \(1 of this run's missing, of 2; the first: 'zz'\)$"):
        samples_for(every, ["aa", "zz"], 4)
    with pytest.raises(ValueError, match="another top_k than 8"):
        samples_for(every, ["aa"], 8)
    with pytest.raises(ValueError, match="no target features"):
        samples_for(every, ["aa"], 4, features=6)
    assert samples_for(every, ["aa"], 4, features=0)[0].features is None


def test_a_teacher_file_grown_by_a_run_keeps_other_prompts_first_and_the_runs_held_out_last():
    """Samples of prompts the run does not use come first (as they were), then the run's own in its
    order, old and new alike, so the file's last samples are its held-out ones; a prompt is never
    held twice."""
    from learner.offline import extended_samples

    old = [_sample(p) for p in ("aa", "bbb", "c")]
    new = [_sample(p, out=5) for p in ("zz", "y")]
    got = extended_samples(old, new, ["c", "zz", "aa", "y"])  # training: c, zz, aa; held-out: y
    assert [s.prompt for s in got] == ["bbb", "c", "zz", "aa", "y"]
    assert got[0] is old[1] and got[1] is old[2] and got[2] is new[0] and got[4] is new[1]
    assert [s.prompt for s in extended_samples(old, [], ["aa", "aa"])] == ["bbb", "c", "aa"]
    assert [s.prompt for s in extended_samples([], new, ["y", "zz"])] == ["y", "zz"]


def test_teacher_features_are_cut_to_the_final_feature_only_when_that_is_all_the_run_needs():
    """A fused feature [.., 3 H] serves a run on the final feature (its last H columns); a run on the
    fused width needs that width exactly; a width that is no multiple of H is refused."""
    from learner.offline import samples_for

    fused = [_sample("ab", width=6), _sample("xyz", width=6)]  # H = 2, three layers fused
    cut = samples_for(fused, ["xyz", "ab"], 4, features=2, final=True)
    assert [s.prompt for s in cut] == ["xyz", "ab"]
    for s, whole in zip(cut, [fused[1], fused[0]]):
        assert s.features.shape == (whole.features.shape[0], 2) and torch.equal(s.features, whole.features[:, -2:])
    assert fused[0].features.shape[-1] == 6  # the loaded samples are not changed
    same = samples_for(fused, ["ab"], 4, features=6)
    assert torch.equal(same[0].features, fused[0].features)
    exact = samples_for([_sample("ab", width=2)], ["ab"], 4, features=2, final=True)
    assert torch.equal(exact[0].features, _sample("ab", width=2).features)
    for bad, kw in ((fused, {"features": 4}), (fused, {"features": 4, "final": True}), (fused, {"features": 2}),
                    ([_sample("ab", width=6), _sample("xyz", width=4)], {"features": 6})):
        with pytest.raises(ValueError, match="another width"):
            samples_for(bad, ["ab", "xyz"], 4, **kw)
