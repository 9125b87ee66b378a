"""The row summary the engine keeps of each verification (speculative.summary): the native pass
against torch's ops, by hand-made rows (ties, NaN, masked values, k beyond the vocabulary) and
on rows of the real vocabulary's size, and each row's result alone against it in a batch."""

from __future__ import annotations

import pytest
import torch

from speculative.summary import MAX_K, load_summary, summarise, torch_summary

needs_kernel = pytest.mark.skipif(load_summary() is None, reason="the native row summary does not build here")


def _close(a, b, logits):
    """The same ids; probabilities each as near the exact (float64) softmax as float32 sums of a
    vocabulary's terms come (torch's own are 2e-7 to 2e-5 off, by the CPU's vector width), and no
    further from it than torch's are, with a margin."""
    (am, ai, ap, at), (bm, bi, bp, bt) = a, b
    assert torch.equal(am, bm) and torch.equal(ai, bi)
    exact = torch.softmax(logits.double(), -1).gather(-1, ai)
    if exact.numel():
        ours, theirs = ((ap.double() - exact).abs() / exact).max(), ((bp.double() - exact).abs() / exact).max()
        assert ours <= max(2e-5, 2 * theirs), (ours, theirs)
    tail = (1 - exact.sum(-1)).clamp(min=0)  # the mass past the top k
    ours, theirs = (at.double() - tail).abs().max(), (bt.double() - tail).abs().max()
    assert ours <= max(2e-5, 2 * theirs), (ours, theirs)


@needs_kernel
@pytest.mark.parametrize("rows,vocab,k", [(1, 49152, 16), (5, 49152, 16), (3, 1000, 64), (2, 37, 4), (1, 16, 16)])
def test_native_equals_torch_on_random_rows(rows, vocab, k):
    g = torch.Generator().manual_seed(rows * vocab + k)
    logits = torch.randn(rows, vocab, generator=g) * 4
    _close(summarise(logits, k), torch_summary(logits, k), logits)


@needs_kernel
def test_ties_take_the_first_index_as_torch_argmax_does():
    logits = torch.zeros(2, 100)
    logits[0, 5] = logits[0, 7] = logits[0, 90] = 1.0
    argmax, ids, probs, _ = summarise(logits, 4)
    assert argmax.tolist() == [5, 0] == logits.argmax(-1).tolist()
    assert ids[0].tolist() == [5, 7, 90, 0]  # equal values: smaller index first
    assert ids[1].tolist() == [0, 1, 2, 3]
    assert probs[0, 0] == probs[0, 1] == probs[0, 2] > probs[0, 3]


@needs_kernel
def test_a_peaked_row_keeps_its_mass_and_no_tail():
    logits = torch.full((1, 49152), -50.0)
    logits[0, 123] = 30.0
    argmax, ids, probs, tail = summarise(logits, 16)
    assert argmax.item() == 123 and ids[0, 0].item() == 123
    assert probs[0, 0].item() == pytest.approx(1.0, abs=1e-6) and tail.item() == pytest.approx(0.0, abs=1e-6)


def test_rows_it_does_not_take_go_to_torch():
    """A NaN, fewer than k values above -inf, k beyond the kernel's, strided or non-float32 rows:
    the same as torch's ops."""
    g = torch.Generator().manual_seed(1)
    nan = torch.randn(2, 37, generator=g)
    nan[1, 3] = float("nan")
    masked = torch.full((1, 50), float("-inf"))
    masked[0, :3] = torch.tensor([1.0, 2.0, 0.5])
    wide = torch.randn(2, 300, generator=g)
    for logits, k in ((nan, 4), (masked, 8), (wide, MAX_K + 1), (wide.t().contiguous().t(), 8), (wide.double(), 8)):
        for a, b in zip(summarise(logits, k), torch_summary(logits, k)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_k_beyond_the_vocabulary_keeps_every_id():
    argmax, ids, probs, tail = summarise(torch.randn(2, 6), 16)
    assert ids.shape == (2, 6) and sorted(ids[0].tolist()) == list(range(6))
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))
    assert (tail >= 0).all() and (tail < 1e-6).all()


@needs_kernel
def test_a_rows_summary_does_not_depend_on_the_rows_beside_it():
    """Bitwise: each row alone, then among 40 (the kernel splits rows between threads past 4)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(40, 4096, generator=g) * 3
    together = summarise(logits, 16)
    for r in (0, 7, 39):
        alone = summarise(logits[r : r + 1].clone(), 16)
        assert all(torch.equal(a[0], b[r]) for a, b in zip(alone, together))


@needs_kernel
def test_the_native_pass_takes_every_k_it_can(monkeypatch):
    """k from 1 to MAX_K goes to the kernel (the speed rests on it); beyond, and k = 0, to torch."""
    import speculative.summary as summary

    kernel, calls = load_summary(), []

    def counted(*args):
        calls.append(args[4])  # K
        return kernel(*args)

    monkeypatch.setattr(summary, "load_summary", lambda: counted)
    logits = torch.randn(2, 200)
    for k in (1, MAX_K, MAX_K + 1, 0):
        got, want = summarise(logits, k), torch_summary(logits, k)
        _close(got, want, logits)
    assert calls == [1, MAX_K]
    assert summarise(logits, 0)[1].shape == (2, 0)
