"""The engine loop (speculative.scheduler): every running request's step in one target forward.

Hand-made cases (admission against the KV budget, the queue's timeout, cancellation, chunked
prefill's per-step budget) and exactness under concurrency: a request's greedy output equals the
target's own target-only output, and a seeded sample equals the seed's sample, whichever requests
share its steps, join or leave."""

from __future__ import annotations

import pytest
import torch

from config import EngineConfig, KPolicyConfig, LoopConfig, SamplingParams
from conftest import _char_tokenizer, tiny_llama
from speculative import RequestError, SpeculativeEngine
from speculative.fast import FastRunner
from speculative.proposers import DraftModelProposer, NgramProposer
from speculative.scheduler import (DraftSwitch, EngineLoop, Failed, Finished, Overloaded, Sequence, Started, Step, StepCost,
                                   calibrate_step_cost, common_prefix, shared_k_cap)

K = 3


def _setup(budget: int = 4096, draft: bool = True, **loop):
    target = FastRunner(tiny_llama(2, seed=0), name="target", bits=4, kv_tokens=budget + 64, block_tokens=8)
    tok = _char_tokenizer()
    cfg = EngineConfig(chat_template=False, k=KPolicyConfig(k_max=K, fixed_k=K))
    proposer = DraftModelProposer(FastRunner(tiny_llama(1, seed=7), name="draft", bits=4), 128) if draft else NgramProposer()
    spec = SpeculativeEngine(target, tok, proposer, cfg)
    alone = SpeculativeEngine(target, tok, None, cfg)  # target-only, the reference
    return EngineLoop(target, LoopConfig(**loop), budget, K), spec, alone


def _prompts(n: int, seed: int = 0, lo: int = 4, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 128, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


class Client:
    """What a request's sink sees, in order."""

    def __init__(self):
        self.events = []

    def __call__(self, ev):
        self.events.append(ev)

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events if isinstance(e, Step) for t in e.result.emitted]

    @property
    def done(self) -> bool:
        return any(isinstance(e, (Finished, Failed)) for e in self.events)


def _submit(loop, engine, prompt, params, rid, **kw) -> tuple[Sequence, Client]:
    c = Client()
    seq = Sequence(engine, rid, prompt, params, c, **kw)
    loop.submit(seq)
    return seq, c


def _drain(loop, clients, limit=2000):
    for _ in range(limit):
        if all(c.done for c in clients):
            return
        loop.step()
    raise AssertionError("the loop did not finish its requests")


def test_greedy_output_under_any_concurrency_equals_target_only():
    """1, 4 and 8 requests at once, joining at different steps: each equals target-only decoding;
    every step verifies all running requests in one forward."""
    loop, spec, alone = _setup()
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = _prompts(8)
    want = [alone.generate(p, params).token_ids for p in prompts]
    for conc in (1, 4, 8):
        clients, batches = [], []
        for i, p in enumerate(prompts[:conc]):
            clients.append(_submit(loop, spec, p, params, f"c{conc}-{i}")[1])
            loop.step()  # the next one joins a step later, mid-stream
            batches.append(loop.last_batch)
        _drain(loop, clients)
        for i, c in enumerate(clients):
            assert isinstance(c.events[0], Started) and isinstance(c.events[-1], Finished)
            assert c.tokens == want[i], (conc, i)
        assert max(batches) == conc  # they shared steps
    assert sum(s.stats.proposed for c in clients for s in [c.events[-1].state]) > 0  # the draft proposed
    assert loop.reserved == 0 and loop.target.pool.free_blocks == loop.target.pool.num_blocks


def test_a_seeded_sample_does_not_depend_on_its_batch():
    loop, spec, alone = _setup()
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    prompt = _prompts(1, seed=3)[0]
    want = alone.generate(prompt, params).token_ids
    _, solo = _submit(loop, spec, prompt, params, "solo")
    _drain(loop, [solo])
    others = [_submit(loop, spec, p, SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True), f"o{i}")[1]
              for i, p in enumerate(_prompts(5, seed=4))]
    loop.step()
    _, mixed = _submit(loop, spec, prompt, params, "mixed")
    _drain(loop, others + [mixed])
    assert solo.tokens == mixed.tokens == want


def test_requests_leaving_mid_batch_change_nobody_elses_output():
    loop, spec, alone = _setup()
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompts = _prompts(4, seed=5)
    want = [alone.generate(p, params).token_ids for p in prompts]
    seqs = [_submit(loop, spec, p, params, f"r{i}") for i, p in enumerate(prompts)]
    short = _submit(loop, spec, prompts[0], SamplingParams(max_tokens=3, ignore_eos=True), "short")[1]
    for _ in range(4):
        loop.step()
    gone_seq, gone = seqs[1]
    loop.cancel(gone_seq)  # its client left
    _drain(loop, [c for i, (_, c) in enumerate(seqs) if i != 1] + [short])
    for i, (_, c) in enumerate(seqs):
        if i != 1:
            assert c.tokens == want[i]
    assert short.tokens == want[0][:3]
    assert not gone.done and gone.tokens == want[1][: len(gone.tokens)]
    assert "r1" not in spec.requests and loop.target.cached_length("r1") == 0  # freed at the step boundary
    assert loop.reserved == 0 and loop.target.pool.free_blocks == loop.target.pool.num_blocks


def test_a_long_prompt_is_prefilled_in_chunks_within_the_step_budget():
    """A 180-token prompt joins two decoding requests: it is cached over several steps of at most
    ``prefill_chunk`` tokens; the decoding requests get a step every time, and no step feeds the
    target more than its budget; the long request's output is still target-only's."""
    loop, spec, alone = _setup(step_tokens=48, prefill_chunk=24)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    short = [_submit(loop, spec, p, params, f"s{i}")[1] for i, p in enumerate(_prompts(2, seed=6))]
    for _ in range(3):
        loop.step()
    long_prompt = _prompts(1, seed=7, lo=180, hi=181)[0]
    _, long_c = _submit(loop, spec, long_prompt, SamplingParams(max_tokens=8, ignore_eos=True), "long")
    fed, steps_of_short = [], []
    while not long_c.tokens:
        before = [len(c.events) for c in short]
        loop.step()
        fed.append(loop.last_tokens)
        steps_of_short.append([len(c.events) - b for c, b in zip(short, before)])
    assert len(fed) >= 180 // 24  # spread over several steps
    assert max(fed) <= 48 + 2 * (K + 1)  # the step's budget (decoders first; each at most 1 + k)
    assert all(s == [1, 1] for s in steps_of_short)  # nobody stalled
    _drain(loop, short + [long_c])
    assert long_c.tokens == alone.generate(long_prompt, SamplingParams(max_tokens=8, ignore_eos=True)).token_ids


def test_requests_beyond_the_kv_budget_wait_then_time_out_with_503():
    """Budget 120 positions, each request needs 4 + 40 + k + 1 = 48: two run, the third waits (and
    runs once one finishes); with a clock past the queue's timeout a waiting one fails Overloaded."""
    now = [0.0]
    loop, spec, _ = _setup(budget=120, queue_timeout_s=5.0)
    loop.clock = lambda: now[0]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    clients = [_submit(loop, spec, [5, 6, 7, 8], params, f"q{i}", enqueued=0.0)[1] for i in range(3)]
    loop.step()
    assert [isinstance(c.events[0], Started) if c.events else None for c in clients] == [True, True, None]
    assert loop.reserved == 96 and len(loop.waiting) == 1
    _drain(loop, clients)  # the third ran after the first two finished
    assert [len(c.tokens) for c in clients] == [40, 40, 40]
    assert loop.reserved == 0

    late = [_submit(loop, spec, [5, 6, 7, 8], params, f"t{i}", enqueued=now[0])[1] for i in range(3)]
    loop.step()
    now[0] += 6.0
    loop.step()
    failed = [c.events[-1] for c in late if isinstance(c.events[-1], Failed)]
    assert len(failed) == 1 and isinstance(failed[0].error, Overloaded)
    _drain(loop, [c for c in late if not c.done])
    assert loop.reserved == 0 and loop.target.pool.free_blocks == loop.target.pool.num_blocks


def test_positions_reserved_beside_the_sequences_hold_back_admission_until_given_back():
    """``reserve``: KV positions held for work beside the running sequences (a prompt scored
    between steps) count against the budget as a running sequence's do: a request that no longer
    fits waits, and runs once they are given back; a reservation past the budget holds nothing."""
    loop, spec, _ = _setup(budget=120)
    assert loop.reserve(80) and loop.reserved == 80
    assert not loop.reserve(41) and loop.reserved == 80  # 121 > 120: refused, nothing held
    assert loop.reserve(40) and loop.reserved == 120  # exactly the budget
    loop.unreserve(40)
    params = SamplingParams(max_tokens=40, ignore_eos=True)  # needs 48 positions: 80 + 48 > 120
    _, c = _submit(loop, spec, [5, 6, 7, 8], params, "r")
    loop.step()
    assert not c.events and len(loop.waiting) == 1
    loop.unreserve(80)
    _drain(loop, [c])
    assert len(c.tokens) == 40 and loop.reserved == 0


def test_past_max_waiting_the_newest_requests_are_turned_away():
    loop, spec, _ = _setup(max_running=2, max_waiting=1)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    clients = [_submit(loop, spec, [5, 6, 7], params, f"w{i}")[1] for i in range(5)]
    loop.step()
    assert [type(c.events[-1]).__name__ if c.events else None for c in clients] == \
        ["Step", "Step", None, "Failed", "Failed"]  # two run, one waits, the newest two are refused
    assert all(isinstance(c.events[-1].error, Overloaded) for c in clients[3:])
    _drain(loop, clients[:3])
    assert clients[2].tokens and loop.reserved == 0


def test_a_request_larger_than_the_whole_budget_is_refused_at_once():
    loop, spec, _ = _setup(budget=64)
    _, c = _submit(loop, spec, list(range(5, 40)), SamplingParams(max_tokens=40), "huge")
    loop.step()
    assert isinstance(c.events[-1], Failed) and isinstance(c.events[-1].error, RequestError)
    assert "KV cache" in str(c.events[-1].error)
    assert loop.reserved == 0 and not loop.running


def test_only_the_loop_thread_runs_torch_on_several_threads():
    """A second OpenMP team in the process throttles every team's spinning (libgomp), so the loop's
    thread takes its count and every other thread, the caller and those started later, runs on one."""
    import threading

    loop, _, _ = _setup(draft=False)
    before = torch.get_num_threads()
    try:
        loop.start(threads=2)
        on_loop = loop.call(lambda: (torch.get_num_threads(), torch.ones(4096).cumsum(0)[-1].item())).result(5)
        later = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert on_loop == (2, 4096.0)  # torch's once-per-thread default did not undo the loop's count
        assert torch.get_num_threads() == 1 and later == [1]
    finally:
        loop.stop()
        torch.set_num_threads(before)


@pytest.mark.parametrize("switch_s", [0.0005, None])
def test_a_started_loop_sets_the_processs_gil_switch_interval_as_configured(switch_s):
    """The loop's thread lets the GIL go in every native kernel; the configured switch interval
    bounds how long another thread of the replica keeps it (None: Python's own left as it is)."""
    import sys

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    loop, _, _ = _setup(draft=False, gil_switch_s=switch_s)
    try:
        loop.start()
        assert sys.getswitchinterval() == pytest.approx(0.004 if switch_s is None else switch_s)
    finally:
        loop.stop()
        sys.setswitchinterval(before)


def test_the_loop_thread_serves_requests_and_runs_calls_between_steps():
    loop, spec, alone = _setup(draft=False)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    loop.start()
    try:
        clients = [_submit(loop, spec, p, params, f"th{i}")[1] for i, p in enumerate(_prompts(3, seed=9))]
        assert loop.call(lambda: len(spec.requests)).result(5) in range(0, 4)
        for _ in range(500):
            if all(c.done for c in clients):
                break
            loop.call(lambda: None).result(5)
        for c, p in zip(clients, _prompts(3, seed=9)):
            assert c.tokens == alone.generate(p, params).token_ids
    finally:
        loop.stop()


def test_the_shared_k_cap_by_hand():
    """Expected tokens per second of the shared step: cheap rows and high acceptance draft deep,
    dear rows or low acceptance decode plain, and more sequences mean less drafting."""
    cheap, dear = StepCost(0.030, 0.0005, 0.002), StepCost(0.010, 0.004, 0.002)
    assert shared_k_cap([0.8, 0.8], 2, cheap, 6) == 6
    assert shared_k_cap([0.01, 0.01], 2, cheap, 6) == 0
    assert shared_k_cap([0.4] * 8, 8, dear, 6) == 0
    assert 0 < shared_k_cap([0.6] * 2, 2, dear, 6) < 6
    # by hand: B = 2, a = 0.5, cost 0.01 + 0.004 T + 0.002 B: k = 0 gives 2 / 0.022 = 90.9 tokens/s,
    # k = 1 gives 3 / 0.030 = 100, k = 2 gives 3.5 / 0.038 = 92.1: the cap is 1
    assert shared_k_cap([0.5, 0.5], 2, dear, 6) == 1


def test_a_shared_step_caps_drafting_and_keeps_every_output_exact():
    """With a cost model where rows are dear, a full batch decodes plain (cap 0: nothing proposed
    while it is shared), and every output still equals target-only; the calibration measures a
    positive cost per token on the real runner."""
    loop, spec, alone = _setup()
    fitted = calibrate_step_cost(loop.target, context=16, repeats=1)
    assert fitted.per_token > 0 and fitted(8, 1) > fitted(1, 1)
    assert loop.target.pool.free_blocks == loop.target.pool.num_blocks  # its sequences released
    loop.step_cost = StepCost(0.0, 1.0, 0.0)  # every row costs a second: drafting never pays in a shared step
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = _prompts(4, seed=11)
    clients = [_submit(loop, spec, p, params, f"cap{i}")[1] for i, p in enumerate(prompts)]
    seen, capped = [0] * len(clients), 0
    while not all(c.done for c in clients):
        loop.step()
        new = [e for c, n in zip(clients, seen) for e in c.events[n:] if isinstance(e, Step)]
        seen = [len(c.events) for c in clients]
        if loop.last_k_cap == 0:  # shared: plain decoding
            capped += 1
            assert new and all(e.result.proposed == 0 for e in new)
    assert capped >= 8
    for c, p in zip(clients, prompts):
        assert c.tokens == alone.generate(p, params).token_ids


def test_the_draft_switch_by_hand():
    """Drafting is measured first, then plain decoding; the faster kind runs, the other every 8th
    turn of its batch-size class; rates are moving averages, and the classes are apart."""
    sw = DraftSwitch(explore=8, decay=0.9)
    assert [DraftSwitch.size_class(n) for n in (2, 3, 4, 7, 8, 15, 16, 100)] == [2, 2, 3, 3, 4, 4, 5, 5]
    assert sw.plain(8) is False  # nothing measured: draft
    assert sw.plain(8) is False  # still nothing
    sw.observe(8, False, 16, 0.1)  # drafting: 160 tokens/s
    assert sw.plain(9) is True  # the same class: plain decoding is measured next
    sw.observe(9, True, 8, 0.04)  # plain: 200 tokens/s
    turns = [sw.plain(8) for _ in range(12)]  # turns 4..15 of the class: the 8th tries drafting
    assert turns == [True] * 4 + [False] + [True] * 7
    assert sw.plain(2) is False and sw.plain(3) is False  # another class knows nothing yet
    sw.observe(8, False, 40, 0.1)  # drafting got faster: 0.9 * 160 + 0.1 * 400 = 184, still below 200
    assert sw.rate[(4, False)] == pytest.approx(184.0)
    assert sw.plain(8) is False  # turn 16: an exploring turn
    assert sw.plain(8) is True  # 184 < 200: plain
    for _ in range(10):
        sw.observe(8, False, 40, 0.1)
    assert sw.plain(8) is False  # now drafting measures faster: it drafts, and plain is the one tried
    sw.observe(8, True, 8, 0.0)  # a step that took no time is not a measurement
    assert sw.rate[(4, True)] == pytest.approx(200.0)
    tie = DraftSwitch()
    tie.rate = {(2, False): 150.0, (2, True): 150.0}
    assert tie.plain(2) is False  # as fast drafting as plain: it drafts


def test_a_full_batch_decodes_plain_where_plain_measured_faster_and_stays_exact():
    """With plain decoding measured faster for its batch size, a shared step drafts only on the
    switch's exploring turns; outputs stay equal to target-only and the steps keep being measured."""
    loop, spec, alone = _setup()
    loop.step_cost = StepCost(0.010, 0.0001, 0.0)  # rows nearly free beside the base: the cap alone would draft deep
    loop.switch.rate = {(3, False): 100.0, (3, True): 1e9}  # 4-7 sequences: plain measured faster
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = _prompts(4, seed=31)
    clients = [_submit(loop, spec, p, params, f"sw{i}")[1] for i, p in enumerate(prompts)]
    shared = drafted = 0
    while not all(c.done for c in clients):
        before = [len(c.events) for c in clients]
        loop.step()
        if loop.last_k_cap is not None:
            shared += 1
            drafted += any(e.result.proposed for c, n in zip(clients, before) for e in c.events[n:] if isinstance(e, Step))
    assert shared >= 8 and 0 < drafted <= shared // 8 + 1
    assert loop.switch.rate[(3, False)] != 100.0  # the exploring turns were measured
    for c, p in zip(clients, prompts):
        assert c.tokens == alone.generate(p, params).token_ids


def test_the_cap_and_the_switch_apply_to_shared_steps_only():
    """A request alone drafts as its own k policy says however dear rows are (no cap, nothing
    measured); two sharing a step are capped; a prefill chunk in the step counts in its cost."""
    loop, spec, alone = _setup()
    loop.step_cost = StepCost(0.0, 1.0, 0.0)  # every row a second: a shared step never drafts
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    p1, p2, p3, long = _prompts(3, seed=41) + _prompts(1, seed=42, lo=200, hi=201)
    _, solo = _submit(loop, spec, p1, params, "alone")
    _drain(loop, [solo])
    assert [e.result.proposed for e in solo.events if isinstance(e, Step)][0] == K  # the first step: k = K
    assert loop.last_k_cap is None and loop.switch.rate == {}
    clients = [_submit(loop, spec, p, params, f"two{i}")[1] for i, p in enumerate((p2, p3))]
    loop.step()  # both prefill
    before = [len(c.events) for c in clients]
    loop.step()
    assert loop.last_k_cap == 0
    assert [e.result.proposed for c, n in zip(clients, before) for e in c.events[n:] if isinstance(e, Step)] == [0, 0]
    decode = list(loop.running)
    loop.step_cost, loop.switch = StepCost(0.010, 0.004, 0.002), None  # the cap alone
    a = [spec.acceptance(s.request_id) for s in decode]
    rid = spec.add_request(long, params)
    chunk = [(None, spec.prefill_call(rid, 150))]
    assert loop._k_cap(decode, []) == shared_k_cap(a, 2, loop.step_cost, K)
    assert loop._k_cap(decode, chunk) == shared_k_cap(a, 2 + 150, loop.step_cost, K) > loop._k_cap(decode, [])
    spec.release(rid)
    _drain(loop, clients)


def test_each_shared_step_says_why_it_drafted_or_not():
    """last_decision: None alone, "cap_zero" where the cost model allows no drafts, "drafting"
    where it allows some, "plain_measured" where the switch chose plain."""
    loop, spec, _ = _setup()
    loop.step_cost = StepCost(0.0, 1.0, 0.0)  # every row a second: the cap allows nothing
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    a, b = _prompts(2, seed=61, lo=1, hi=2)  # one token each: a step feeds one row a request
    rid = spec.add_request(a, params)
    decode = [Sequence(spec, rid, a, params, Client())]
    assert loop._k_cap(decode, []) is None and loop.last_decision is None  # alone
    rid2 = spec.add_request(b, params)
    decode.append(Sequence(spec, rid2, b, params, Client()))
    assert loop._k_cap(decode, []) == 0 and loop.last_decision == "cap_zero"  # nothing measured yet: the cap
    loop.step_cost = StepCost(0.010, 0.0001, 0.0)  # rows nearly free beside the base
    assert loop._k_cap(decode, []) > 0 and loop.last_decision == "drafting"
    loop.switch.rate = {(2, False): 100.0, (2, True): 1e9}
    assert loop._k_cap(decode, []) == 0 and loop.last_decision == "plain_measured"
    spec.release(rid)
    spec.release(rid2)


def test_a_consumer_that_fails_drops_its_request_only():
    """A sink that raises (its event loop closed) cancels that request: the step does not raise,
    the others finish equal to target-only, and the budget and the pool come back to empty."""
    loop, spec, alone = _setup()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = _prompts(3, seed=51)

    class Gone(Client):
        def __call__(self, ev):
            super().__call__(ev)
            if sum(isinstance(e, Step) for e in self.events) == 2:
                raise RuntimeError("Event loop is closed")

    gone = Gone()
    loop.submit(Sequence(spec, "gone", prompts[0], params, gone))
    others = [_submit(loop, spec, p, params, f"ok{i}")[1] for i, p in enumerate(prompts[1:])]
    _drain(loop, others)
    for _ in range(3):
        loop.step()
    assert sum(isinstance(e, Step) for e in gone.events) == 2 and not gone.done
    assert "gone" not in spec.requests and loop.running == [] and loop.reserved == 0
    assert loop.target.pool.free_blocks == loop.target.pool.num_blocks
    for c, p in zip(others, prompts[1:]):
        assert c.tokens == alone.generate(p, params).token_ids


def test_requests_sharing_a_system_prompt_reuse_its_cache_in_the_loop_and_stay_exact():
    """With prefix caching on, requests that share a system prompt start after it (once an
    earlier request settled it), each still equals target-only decoding without any cache shared,
    tenants never share, and the budget and the pool come back to empty."""
    loop, spec, alone = _setup()
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    system = _prompts(1, seed=9, lo=40, hi=41)[0]
    prompts = [system + p for p in _prompts(6, seed=5, lo=3, hi=12)]
    want = [alone.generate(p, params).token_ids for p in prompts]  # prefix caching still off: nothing shared
    loop.target.prefix_caching = True
    stats = loop.target.pool.prefix_stats
    first = _submit(loop, spec, prompts[0], params, "first", cache_salt="t1")[1]
    _drain(loop, [first])
    hit = stats["hit"]
    clients = [_submit(loop, spec, p, params, f"r{i}", cache_salt="t1")[1] for i, p in enumerate(prompts[1:4], 1)]
    _drain(loop, clients)
    assert stats["hit"] - hit >= 3 * 40 // 8 * 8  # each took at least the system prompt's whole blocks
    hit = stats["hit"]
    others = [_submit(loop, spec, p, params, f"o{i}", cache_salt="t2")[1] for i, p in enumerate(prompts[4:], 4)]
    _drain(loop, others)
    assert stats["hit"] == hit  # another tenant: nothing found
    for c, w in zip([first] + clients + others, want):
        assert c.tokens == w
    assert loop.reserved == 0 and loop.target.pool.free_blocks == loop.target.pool.num_blocks


def _choices(loop, spec, prompt, count: int, salts=None, max_tokens: int = 12):
    """``count`` seeded requests of one prompt submitted together (the choices of one request)."""
    out = []
    for j in range(count):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=40 + j, ignore_eos=True)
        out.append(_submit(loop, spec, prompt, params, f"c{j}", cache_salt=(salts or [None] * count)[j]))
    return out


def test_common_prefix_by_hand():
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4, 7], 10) == 2
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 5, 6, 8], 10) == 3
    assert common_prefix([5, 2], [1, 2], 10) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], 10) == 3 == common_prefix([1, 2, 3, 4], [1, 2, 3], 10)
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 4], 2) == 2  # at most the limit
    assert common_prefix([1], [1], 0) == 0 == common_prefix([1], [1], -1) == common_prefix([], [1], 5)


@pytest.mark.parametrize("margin", [0, 1])
def test_a_sequence_waits_for_exactly_share_prompt_min_positions_not_fewer(margin):
    """The bound is inclusive: 59 shared positions not cached make a sequence wait when the bound is
    59, not when it is 60."""
    prompt = _prompts(1, seed=3, lo=60, hi=61)[0]
    loop, spec, _ = _setup(share_prompt_min=59 + margin, prefill_chunk=16, step_tokens=64)
    loop.target.prefix_caching = True
    subs = _choices(loop, spec, prompt, 2)
    loop.step()
    assert subs[1][0].shared == 59 and subs[1][0].started == bool(margin)


def test_choices_of_one_prompt_wait_for_the_first_and_start_from_its_cached_prompt():
    """Four requests of one 60-token prompt submitted together: the first computes the prompt while
    the others wait, then they take its blocks from the prefix cache, so the target computes the
    prompt about once instead of four times; every output is still the seed's own sample, as
    without sharing (and as alone)."""
    prompt = _prompts(1, seed=3, lo=60, hi=61)[0]
    runs = {}
    for share in (0, 16):
        loop, spec, alone = _setup(share_prompt_min=share, prefill_chunk=16, step_tokens=64)
        loop.target.prefix_caching = True
        subs = _choices(loop, spec, prompt, 4)
        loop.step()
        assert [seq.started for seq, _ in subs] == [True] + [share == 0] * 3
        overlap = False  # the waiting ones start once the prompt is cached, while the first still decodes
        while not all(c.done for _, c in subs):
            loop.step()
            overlap = overlap or (all(seq.started for seq, _ in subs) and not subs[0][1].done)
        assert overlap
        runs[share] = ([c.tokens for _, c in subs], loop.tokens, [seq.shared for seq, _ in subs])
        assert loop.reserved == 0 and loop.target.pool.free_blocks == loop.target.pool.num_blocks
    (free, fed_free, _), (shared, fed_shared, lengths) = runs[0], runs[16]
    want = [alone.generate(prompt, SamplingParams(max_tokens=12, temperature=0.9, seed=40 + j, ignore_eos=True)).token_ids
            for j in range(4)]
    assert free == shared == want and len({tuple(t) for t in want}) > 1
    assert lengths == [0, 59, 59, 59]  # each later one's twin: the first, sharing all but the last prompt token
    assert fed_free - fed_shared >= 3 * 48  # three prompts' whole cached blocks not computed again


def test_a_sequence_waits_only_for_its_own_tenants_prompt_and_never_for_a_twin_that_left():
    """Another tenant's identical prompt is no twin (nothing is shared across salts); a sequence
    whose twin is cancelled before its prompt is cached starts by itself; with the prefix cache off
    nothing waits."""
    prompt = _prompts(1, seed=4, lo=50, hi=51)[0]
    loop, spec, _ = _setup(share_prompt_min=16, prefill_chunk=16, step_tokens=64)
    loop.target.prefix_caching = True
    subs = _choices(loop, spec, prompt, 2, salts=["t1", "t2"])
    loop.step()
    assert all(seq.started for seq, _ in subs)
    _drain(loop, [c for _, c in subs])
    loop, spec, _ = _setup(share_prompt_min=16, prefill_chunk=16, step_tokens=64)
    loop.target.prefix_caching = True
    (first, _), (second, c2) = _choices(loop, spec, prompt, 2)
    loop.step()
    assert not second.started and second.twin is first
    loop.cancel(first)
    loop.step()
    assert second.started and loop.target.pool.prefix_stats["hit"] <= 16  # at most the one chunk it had settled
    _drain(loop, [c2])
    loop, spec, _ = _setup(share_prompt_min=16, prefill_chunk=16, step_tokens=64)  # prefix caching off
    subs = _choices(loop, spec, prompt, 2)
    loop.step()
    assert all(seq.started for seq, _ in subs)


def test_sequences_on_one_draft_model_share_its_forwards_and_propose_what_they_would_alone():
    """Six requests on one learned draft: each round of their proposals is one forward of the draft
    over all of them (fewer draft forwards than calls), and each request's steps (draft tokens,
    accepted, emitted) are those it takes alone, since the draft's rows are batch-invariant too."""
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = _prompts(6, seed=5)

    def steps_of(client):
        return [(e.result.draft_tokens, e.result.accepted, e.result.emitted) for e in client.events if isinstance(e, Step)]

    alone = []
    for i, p in enumerate(prompts):
        loop, spec, _ = _setup()
        _, c = _submit(loop, spec, p, params, f"r{i}")
        _drain(loop, [c])
        assert loop.draft_forwards == loop.draft_calls  # alone: one call a forward
        alone.append(steps_of(c))
    loop, spec, _ = _setup()
    clients = [_submit(loop, spec, p, params, f"r{i}")[1] for i, p in enumerate(prompts)]
    _drain(loop, clients)
    assert [steps_of(c) for c in clients] == alone
    assert loop.draft_calls == sum(len(d) for s in alone for d, _, _ in s)  # a round a draft token, one call each
    assert loop.draft_forwards <= loop.draft_calls / 3  # shared: most rounds ran several sequences at once


def test_sequences_of_drafts_with_other_adapters_on_one_base_share_its_forwards():
    """Six requests on three drafts whose adapters sit on one packed base (a replica's domain
    drafts): each round is one forward over all of them, each request's steps are those it takes
    alone on its own draft, and the drafts propose differently (their adapters count)."""
    import copy

    from test_adapters import _adapted, _start

    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = _prompts(6, seed=5)
    start = _start()
    versions = [_adapted(40 + i) for i in range(3)]

    def engines(spec):  # three drafts, copies of one start sharing its base, each with its adapter version
        out = []
        for v in versions:
            d = copy.deepcopy(start, start.runner.share_memo())
            d.load_state_dict(v, 1)
            out.append(SpeculativeEngine(spec.target, spec.tokenizer, d, spec.cfg))
        return out

    def steps_of(client):
        return [(e.result.draft_tokens, e.result.accepted, e.result.emitted) for e in client.events if isinstance(e, Step)]

    alone = []
    for i, p in enumerate(prompts):
        loop, spec, _ = _setup(draft=False)
        _, c = _submit(loop, engines(spec)[i % 3], p, params, f"r{i}")
        _drain(loop, [c])
        alone.append(steps_of(c))
    loop, spec, _ = _setup(draft=False)
    mixed = engines(spec)
    clients = [_submit(loop, mixed[i % 3], p, params, f"r{i}")[1] for i, p in enumerate(prompts)]
    _drain(loop, clients)
    assert [steps_of(c) for c in clients] == alone
    assert loop.draft_forwards <= loop.draft_calls / 3  # one forward per round across the three drafts
    loop, spec, _ = _setup(draft=False)  # one prompt through each draft: what they propose differs
    on_each = []
    for i, e in enumerate(engines(spec)):
        _, c = _submit(loop, e, prompts[0], params, f"p{i}")
        _drain(loop, [c])
        on_each.append([d for d, _, _ in steps_of(c)])
    assert len({str(x) for x in on_each}) > 1


def test_a_failing_draft_forward_fails_its_sequences_only():
    """The draft's forward raises for one request's call: that request fails, the ones on a
    model-free proposer in the same step go on and finish with target-only output."""
    loop, spec, alone = _setup()
    ngram = SpeculativeEngine(spec.target, spec.tokenizer, NgramProposer(), spec.cfg)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = _prompts(3, seed=9)

    def broken(calls):
        raise RuntimeError("draft forward failed")

    spec.proposer.runner.forward = lambda *a, **kw: broken(None)
    spec.proposer.runner.forward_batch = broken
    _, bad = _submit(loop, spec, prompts[0], params, "bad")
    good = [_submit(loop, ngram, p, params, f"g{i}")[1] for i, p in enumerate(prompts[1:])]
    _drain(loop, [bad, *good])
    assert isinstance(bad.events[-1], Failed) and "draft forward failed" in str(bad.events[-1].error)
    assert [c.tokens for c in good] == [alone.generate(p, params).token_ids for p in prompts[1:]]
