"""Unit tests for learner.losses (sparse-target distillation losses)."""

import math

import pytest
import torch
import torch.nn.functional as F

from learner.losses import (
    LOSSES,
    SparseDist,
    forward_kl,
    get_loss,
    jsd,
    reverse_kl,
    sparse_from_logits,
    top1_agreement,
    tvd,
)

LN2 = math.log(2.0)


# --- plain-python references on explicit bin lists --------------------------


def _kl(a, b):
    return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)


def _jsd(p, q, beta):
    m = [beta * x + (1 - beta) * y for x, y in zip(p, q)]
    return beta * _kl(p, m) + (1 - beta) * _kl(q, m)


def _tvd(p, q):
    return 0.5 * sum(abs(x - y) for x, y in zip(p, q))


# --- tiny hand examples -------------------------------------------------------

# V = 4, student q = [0.1, 0.2, 0.3, 0.4]; target names ids [3, 1] with probs
# [0.5, 0.3] and tail 0.2.  Student bins: q[3] = 0.4, q[1] = 0.2, tail = q[0] + q[2] = 0.4.
SPARSE_LOGITS = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
SPARSE_TARGET = SparseDist(
    ids=torch.tensor([[3, 1]]), probs=torch.tensor([[0.5, 0.3]]), tail=torch.tensor([0.2])
)
SPARSE_P = [0.5, 0.3, 0.2]
SPARSE_Q = [0.4, 0.2, 0.4]

# V = 3, full target (K = V): p = [0.6, 0.3, 0.1] stored in the order ids [0, 2, 1].
FULL_LOGITS = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
FULL_TARGET = SparseDist(
    ids=torch.tensor([[0, 2, 1]]), probs=torch.tensor([[0.6, 0.1, 0.3]]), tail=torch.tensor([0.0])
)
FULL_P = [0.6, 0.3, 0.1]
FULL_Q = [0.2, 0.5, 0.3]


@pytest.mark.parametrize(
    "logits, target, p, q",
    [
        (SPARSE_LOGITS, SPARSE_TARGET, SPARSE_P, SPARSE_Q),
        (FULL_LOGITS, FULL_TARGET, FULL_P, FULL_Q),
    ],
    ids=["sparse_V4_K2", "full_V3"],
)
def test_hand_computed_values(logits, target, p, q):
    assert forward_kl(logits, target).item() == pytest.approx(_kl(p, q), rel=1e-5)
    assert reverse_kl(logits, target).item() == pytest.approx(_kl(q, p), rel=1e-5)
    for beta in (0.1, 0.5, 0.9):
        assert jsd(logits, target, beta=beta).item() == pytest.approx(_jsd(p, q, beta), rel=1e-4)
    assert tvd(logits, target).item() == pytest.approx(_tvd(p, q), rel=1e-5)


def test_explicit_numbers_sparse_example():
    # Written-out values for the sparse example, independent of the helpers.
    fkl = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.2) + 0.2 * math.log(0.2 / 0.4)
    rkl = 0.4 * math.log(0.4 / 0.5) + 0.2 * math.log(0.2 / 0.3) + 0.4 * math.log(0.4 / 0.2)
    assert forward_kl(SPARSE_LOGITS, SPARSE_TARGET).item() == pytest.approx(fkl, rel=1e-5)
    assert reverse_kl(SPARSE_LOGITS, SPARSE_TARGET).item() == pytest.approx(rkl, rel=1e-5)
    assert tvd(SPARSE_LOGITS, SPARSE_TARGET).item() == pytest.approx(0.2, rel=1e-5)


def test_temperature_applies_to_student_only():
    t = 2.0
    q = torch.softmax(SPARSE_LOGITS[0] / t, dim=-1).tolist()
    q_bins = [q[3], q[1], q[0] + q[2]]
    got = forward_kl(SPARSE_LOGITS, SPARSE_TARGET, temperature=t).item()
    assert got == pytest.approx(_kl(SPARSE_P, q_bins), rel=1e-5)


# --- zero at equality, K = V exactness ---------------------------------------


@pytest.mark.parametrize("k", [16, 5, 1])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_zero_when_student_equals_target(name, k):
    torch.manual_seed(0)
    logits = torch.randn(6, 16) * 2.0
    target = sparse_from_logits(logits, k)
    loss = LOSSES[name](logits, target)
    assert loss.shape == (6,)
    assert torch.allclose(loss, torch.zeros(6), atol=1e-5)


def test_k_equals_v_matches_full_vocabulary_kl():
    torch.manual_seed(1)
    vocab = 32
    student = torch.randn(8, vocab) * 1.5
    teacher = torch.randn(8, vocab) * 1.5
    target = sparse_from_logits(teacher, vocab)
    log_p = torch.log_softmax(teacher, dim=-1)
    log_q = torch.log_softmax(student, dim=-1)
    full_fkl = F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    full_rkl = F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)
    assert torch.allclose(forward_kl(student, target), full_fkl, atol=1e-5)
    assert torch.allclose(reverse_kl(student, target), full_rkl, atol=1e-5)
    # Also with a target tail that is rounding noise rather than exactly 0.
    noisy = SparseDist(ids=target.ids, probs=target.probs, tail=torch.full((8,), 1e-6))
    assert torch.allclose(forward_kl(student, noisy), full_fkl, atol=1e-5)


def test_coarsened_kl_is_below_full_kl():
    # Merging bins can only lose information (data-processing inequality).
    torch.manual_seed(2)
    student, teacher = torch.randn(8, 32), torch.randn(8, 32)
    full = forward_kl(student, sparse_from_logits(teacher, 32))
    sparse = forward_kl(student, sparse_from_logits(teacher, 4))
    assert torch.all(sparse <= full + 1e-6)


# --- asymmetry, bounds, JSD endpoints -----------------------------------------


def test_forward_reverse_asymmetry():
    fkl = forward_kl(SPARSE_LOGITS, SPARSE_TARGET).item()
    rkl = reverse_kl(SPARSE_LOGITS, SPARSE_TARGET).item()
    assert fkl > 0 and rkl > 0
    assert abs(fkl - rkl) > 1e-2


def test_jsd_and_tvd_bounds():
    torch.manual_seed(3)
    student = torch.randn(64, 20) * 4.0
    target = sparse_from_logits(torch.randn(64, 20) * 4.0, 6)
    j = jsd(student, target, beta=0.5)
    t = tvd(student, target)
    assert torch.all(j >= -1e-6) and torch.all(j <= LN2 + 1e-6)
    assert torch.all(t >= -1e-6) and torch.all(t <= 1 + 1e-6)
    # Disjoint supports reach the upper bounds.
    disjoint = SparseDist(
        ids=torch.tensor([[0]]), probs=torch.tensor([[1.0]]), tail=torch.tensor([0.0])
    )
    far = torch.tensor([[-100.0, 100.0, 100.0]])
    assert jsd(far, disjoint).item() == pytest.approx(LN2, rel=1e-5)
    assert tvd(far, disjoint).item() == pytest.approx(1.0, rel=1e-5)


def test_jsd_symmetric_at_half():
    # Swap the roles on full distributions: JSD_0.5(p, q) == JSD_0.5(q, p).
    torch.manual_seed(4)
    a, b = torch.randn(8, 10), torch.randn(8, 10)
    ab = jsd(a, sparse_from_logits(b, 10), beta=0.5)
    ba = jsd(b, sparse_from_logits(a, 10), beta=0.5)
    assert torch.allclose(ab, ba, atol=1e-5)


def test_jsd_endpoints_and_limits():
    fkl = forward_kl(SPARSE_LOGITS, SPARSE_TARGET)
    rkl = reverse_kl(SPARSE_LOGITS, SPARSE_TARGET)
    assert torch.allclose(jsd(SPARSE_LOGITS, SPARSE_TARGET, beta=0.0), fkl)
    assert torch.allclose(jsd(SPARSE_LOGITS, SPARSE_TARGET, beta=1.0), rkl)
    # The endpoints are the limits of the scaled divergence.
    eps = 1e-3
    near0 = jsd(SPARSE_LOGITS, SPARSE_TARGET, beta=eps) / eps
    near1 = jsd(SPARSE_LOGITS, SPARSE_TARGET, beta=1 - eps) / eps
    assert torch.allclose(near0, fkl, rtol=2e-2)
    assert torch.allclose(near1, rkl, rtol=2e-2)
    with pytest.raises(ValueError, match="beta"):
        jsd(SPARSE_LOGITS, SPARSE_TARGET, beta=1.5)


# --- zero-probability bins and gradients --------------------------------------


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_finite_values_and_grads_with_zero_bins(name, beta):
    # V = 4, K = 3: every row has a zero-probability named id and a zero tail;
    # row 2's student is so peaked that its probabilities underflow in float32.
    target = SparseDist(
        ids=torch.tensor([[2, 0, 1], [3, 1, 0], [0, 1, 2]]),
        probs=torch.tensor([[0.7, 0.3, 0.0], [0.7, 0.3, 0.0], [1.0, 0.0, 0.0]]),
        tail=torch.tensor([0.0, 0.0, 0.0]),
    )
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0], [300.0, -300.0, 0.0, 5.0]])
    logits = logits.clone().requires_grad_(True)
    kw = {"beta": beta} if name == "jsd" else {}
    loss = get_loss(name, **kw)(logits, target)
    assert torch.isfinite(loss).all()
    loss.sum().backward()
    assert torch.isfinite(logits.grad).all()

    # K = V with exactly zero probabilities and zero tail.
    full = SparseDist(
        ids=torch.tensor([[0, 1, 2]]),
        probs=torch.tensor([[1.0, 0.0, 0.0]]),
        tail=torch.tensor([0.0]),
    )
    x = torch.tensor([[0.5, -1.0, 2.0]], requires_grad=True)
    loss = get_loss(name, **kw)(x, full)
    assert torch.isfinite(loss).all()
    loss.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_bf16_logits_supported():
    torch.manual_seed(5)
    logits = torch.randn(4, 12).to(torch.bfloat16).requires_grad_(True)
    target = sparse_from_logits(torch.randn(4, 12), 3)
    loss = forward_kl(logits, target)
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


# --- optimisation, helpers, registry ------------------------------------------


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_adamw_steps_reduce_loss(name):
    torch.manual_seed(6)
    target = sparse_from_logits(torch.randn(16, 50) * 3.0, 8)
    student = torch.nn.Parameter(torch.randn(16, 50))
    opt = torch.optim.AdamW([student], lr=0.1)
    loss_fn = get_loss(name)
    first = loss_fn(student, target).mean().item()
    for _ in range(30):
        opt.zero_grad()
        loss = loss_fn(student, target).mean()
        loss.backward()
        opt.step()
    last = loss_fn(student, target).mean().item()
    assert last < 0.5 * first


def test_sparse_from_logits():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    sd = sparse_from_logits(logits, 2)
    assert sd.ids.tolist() == [[3, 2]]
    assert torch.allclose(sd.probs, torch.tensor([[0.4, 0.3]]))
    assert torch.allclose(sd.tail, torch.tensor([0.3]))
    full = sparse_from_logits(logits, 4)
    assert full.tail.tolist() == [0.0]
    with pytest.raises(ValueError, match="k must be"):
        sparse_from_logits(logits, 5)
    with pytest.raises(ValueError, match="k must be"):
        sparse_from_logits(logits, 0)  # no named id: nothing to distil towards
    one = sparse_from_logits(torch.tensor([[2.0], [-1.0]]), 1)  # a one-token vocabulary: k = V = 1
    assert one.ids.tolist() == [[0], [0]] and one.probs.tolist() == [[1.0], [1.0]] and one.tail.tolist() == [0.0, 0.0]


def test_malformed_targets_and_options_are_refused():
    """A SparseDist whose probabilities do not match its ids (ids 2-D, probs another shape), a
    temperature of 0 and a reverse-KL floor of 0 are errors, not silent infs or NaNs."""
    ids = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        SparseDist(ids=ids, probs=torch.full((2, 3), 0.2), tail=torch.zeros(2))
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        SparseDist(ids=ids[0], probs=torch.full((2,), 0.2), tail=torch.zeros(2))
    with pytest.raises(ValueError, match="tail"):
        SparseDist(ids=ids, probs=torch.full((2, 2), 0.2), tail=torch.zeros(3))
    for fn in (forward_kl, reverse_kl, jsd, tvd):
        with pytest.raises(ValueError, match="temperature"):
            fn(SPARSE_LOGITS, SPARSE_TARGET, temperature=0.0)
    with pytest.raises(ValueError, match="min_target_prob"):
        reverse_kl(SPARSE_LOGITS, SPARSE_TARGET, min_target_prob=0.0)
    with pytest.raises(ValueError, match="min_target_prob"):
        jsd(SPARSE_LOGITS, SPARSE_TARGET, beta=1.0, min_target_prob=0.0)


def test_top1_agreement():
    target = SparseDist(
        ids=torch.tensor([[2, 0], [1, 3]]),
        probs=torch.tensor([[0.6, 0.2], [0.1, 0.5]]),
        tail=torch.tensor([0.2, 0.4]),
    )
    student = torch.tensor([[0.0, 0.0, 5.0, 0.0], [0.0, 5.0, 0.0, 0.0]])
    # Row 1's top-1 is id 3 (prob 0.5), not the first stored id.
    assert top1_agreement(student, target).tolist() == [True, False]


def test_get_loss():
    assert get_loss("tvd") is tvd
    bound = get_loss("jsd", beta=0.2)
    expected = jsd(SPARSE_LOGITS, SPARSE_TARGET, beta=0.2)
    assert torch.allclose(bound(SPARSE_LOGITS, SPARSE_TARGET), expected)
    with pytest.raises(ValueError, match="forward_kl") as exc:
        get_loss("kl_forward")
    for name in ("forward_kl", "reverse_kl", "jsd", "tvd"):
        assert name in str(exc.value)
    with pytest.raises(ValueError, match=r"unexpected options \['beta'\]; accepts \['temperature'\]"):
        get_loss("tvd", beta=0.5)  # the message names what the loss does accept


def test_draft_opd_is_forward_kl_where_the_draft_was_right_and_weighted_reverse_kl_where_it_was_wrong():
    from learner.losses import draft_opd

    logits = torch.cat([SPARSE_LOGITS, SPARSE_LOGITS])
    target = SparseDist(ids=SPARSE_TARGET.ids.repeat(2, 1), probs=SPARSE_TARGET.probs.repeat(2, 1),
                        tail=SPARSE_TARGET.tail.repeat(2))
    got = draft_opd(logits, target, wrong=torch.tensor([False, True]), reverse_weight=0.5)
    assert got[0].item() == pytest.approx(_kl(SPARSE_P, SPARSE_Q))  # right: forward KL(p || q)
    assert got[1].item() == pytest.approx(0.5 * _kl(SPARSE_Q, SPARSE_P))  # wrong: half of KL(q || p)
    assert torch.equal(draft_opd(logits, target), forward_kl(logits, target))  # no rows known wrong: forward KL
    bound = get_loss("draft_opd", reverse_weight=2.0)
    assert bound(logits, target, wrong=torch.tensor([True, True]))[0].item() == pytest.approx(2 * _kl(SPARSE_Q, SPARSE_P))
