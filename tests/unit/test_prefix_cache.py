"""Prefix caching in the paged KV pool (speculative.kvcache): a prompt starts after the longest
prefix cached for an earlier request of the same salt, and its logits are bitwise those of a
prefill from scratch."""

from __future__ import annotations

import torch

from config import EngineConfig, KPolicyConfig, SamplingParams
from conftest import _char_tokenizer, tiny_llama
from speculative import ForwardCall, SpeculativeEngine
from speculative.fast import FastRunner
from speculative.kvcache import BlockPool, KVCacheFull, SeqCache

B = 16  # the pool's block of positions


def _ids(n, seed=0):
    return torch.randint(2, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _runner(model, caching=True, kv_tokens=1024):
    r = FastRunner(model, bits=4, kv_tokens=kv_tokens, block_tokens=B)
    r.prefix_caching = caching
    return r


def _serve(runner, sid, prompt, decode=(5, 6, 7), salt=None):
    """The prompt in chunks of 20, then one-token steps: the calls of a served request."""
    out, pos = None, runner.attach_prefix(sid, prompt, salt)
    while pos < len(prompt):
        n = min(20, len(prompt) - pos)
        out = runner.forward(sid, pos, prompt[pos : pos + n])
        pos += n
    for t in decode:
        out = runner.forward(sid, pos, [t])
        pos += 1
    return out


def test_a_prompt_sharing_a_settled_prefix_skips_it_and_its_logits_are_bitwise_a_fresh_prefills():
    model = tiny_llama(2, seed=0)
    cached, fresh = _runner(model), _runner(model, caching=False)
    system = _ids(40, seed=1)
    _serve(cached, "a", system + _ids(9, seed=2))
    cached.release("a")
    prompt = system + _ids(12, seed=3)
    before = dict(cached.pool.prefix_stats)
    n = cached.attach_prefix("b", prompt)
    assert n == 40  # two whole blocks shared, then the 8 matching positions of the third copied
    got = cached.forward("b", n, prompt[n:], len(prompt) - n)
    want = fresh.forward("b", 0, prompt, len(prompt))[n:]
    assert torch.equal(got, want)
    stats = cached.pool.prefix_stats
    assert stats["hit"] - before["hit"] == 40 and stats["looked_up"] - before["looked_up"] == len(prompt) - 1


def test_greedy_output_with_prefixes_cached_equals_output_without_in_conversations():
    """Three-turn conversations re-send their history: each turn reuses the last one's cache, and
    the greedy output is the same as with nothing cached."""
    target, tok = tiny_llama(2, seed=0), _char_tokenizer()
    cfg = EngineConfig(chat_template=False, k=KPolicyConfig(k_max=4, fixed_k=4))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    runs = {}
    for caching in (True, False):
        runner = _runner(target, caching)
        engine = SpeculativeEngine(runner, tok, None, cfg)
        outs = []
        for conv in range(2):
            history = _ids(30, seed=10 + conv)
            for turn in range(3):
                g = engine.generate(history, params)
                outs.append(g.token_ids)
                history = history + g.token_ids + _ids(7, seed=100 * conv + turn)
        runs[caching] = (outs, dict(runner.pool.prefix_stats))
    assert runs[True][0] == runs[False][0]
    assert runs[True][1]["hit"] > 0.5 * runs[True][1]["looked_up"] - 60  # later turns come mostly from the cache
    assert runs[False][1]["hit"] == 0


def test_requests_of_different_salts_never_share_a_block():
    model = tiny_llama(2, seed=0)
    r = _runner(model)
    prompt = _ids(50, seed=4)
    _serve(r, "a", prompt, salt="tenant-a")
    r.release("a")
    assert r.attach_prefix("b", prompt, salt="tenant-b") == 0
    assert r.attach_prefix("c", prompt, salt="tenant-a") == 48


def test_a_sequence_stepping_back_into_a_cached_block_copies_it_first():
    """Positions already indexed are never written: a crop back into them (a rejected verify)
    works on a copy, and a later prompt still finds the original, bitwise."""
    model = tiny_llama(2, seed=0)
    cached, fresh = _runner(model), _runner(model, caching=False)
    prompt = _ids(40, seed=5)
    for r in (cached, fresh):
        r.forward("a", 0, prompt)
        r.forward("a", 40, [9])  # settles (indexes) blocks 0 and 1
        r.forward("a", 20, [11, 12, 13])  # back into block 1
    assert torch.equal(cached.forward("a", 23, [14]), fresh.forward("a", 23, [14]))
    n = cached.attach_prefix("b", prompt + [3])
    assert n == 32  # blocks 0 and 1 as first written (block 2 never settled)
    assert torch.equal(cached.forward("b", n, prompt[n:] + [3], 9), fresh.forward("c", 0, prompt + [3], 41)[n:])


def test_cached_blocks_no_one_holds_are_taken_back_least_recently_used_first():
    pool = BlockPool(1, 1, 4, max_tokens=4 * B, block_tokens=B)
    seqs = []
    for i in range(2):  # two sequences, each with one full settled block
        s = SeqCache(pool)
        s.reserve(B + 1)
        s.write(0, _ids(B + 1, seed=i))
        s.write(B + 1, [5])  # a later call: block 0 settled, indexed
        seqs.append(s)
    assert pool.cached_blocks == 2
    for s in seqs:
        s.free()
    assert pool.free_blocks == 4 and pool.cached_blocks == 2  # idle cached blocks count as free
    pool.take(3)  # the two free blocks, then the least recently used cached one
    assert pool.cached_blocks == 1
    assert SeqCache(pool).attach(_ids(B + 1, seed=0)) == 0 and SeqCache(pool).attach(_ids(B + 1, seed=1)) == B
    try:
        pool.take(2)
        raise AssertionError("took more blocks than the pool has")
    except KVCacheFull:
        pass


def test_idle_cached_blocks_past_the_bound_leave_least_recently_used_first_and_their_pages_are_reused():
    """With ``max_idle_blocks`` the idle cache keeps the newest blocks only; a freed block goes back
    on top of the free list, so the next sequence takes written pages, never one not yet resident."""
    pool = BlockPool(1, 1, 4, max_tokens=8 * B, block_tokens=B)
    pool.max_idle_blocks = 1
    written = set()
    for i in range(6):  # six sequences in turn, each leaving one settled (indexed) block
        s = SeqCache(pool)
        s.reserve(B + 1)
        s.write(0, _ids(B + 1, seed=i))
        s.write(B + 1, [5])
        written.update(s.blocks)
        s.free()
        assert pool.cached_blocks == 1 and pool.free_blocks == 8  # the bound holds after every release
    assert SeqCache(pool).attach(_ids(B + 1, seed=5)) == B  # the newest prefix stayed
    assert all(SeqCache(pool).attach(_ids(B + 1, seed=i)) == 0 for i in range(5))
    assert len(written) == 3  # pages ever written: the 2 a sequence holds + the 1 idle, of 8
    pool.max_idle_blocks = None
    s = SeqCache(pool)
    s.reserve(B + 1)
    s.write(0, _ids(B + 1, seed=6))
    s.write(B + 1, [5])
    s.free()
    assert pool.cached_blocks == 2  # unbounded: the idle cache grows again


def test_a_runners_prefix_cache_bound_is_in_tokens():
    r = _runner(tiny_llama(), kv_tokens=1024)
    r.limit_prefix_cache(5 * B + 3)
    assert r.pool.max_idle_blocks == 5
    r.limit_prefix_cache(None)
    assert r.pool.max_idle_blocks is None


def test_a_batch_of_requests_sharing_a_prefix_is_exact_and_the_pool_returns_to_empty():
    model = tiny_llama(2, seed=0)
    cached, fresh = _runner(model), _runner(model, caching=False)
    system = _ids(35, seed=6)
    _serve(cached, "warm", system + _ids(20, seed=7))  # blocks 0-2 settled: the system prompt's 35 positions among them
    cached.release("warm")
    prompts = [system + _ids(3 + 4 * i, seed=20 + i) for i in range(4)]
    starts = [cached.attach_prefix(f"s{i}", p) for i, p in enumerate(prompts)]
    assert min(starts) >= 35  # (one more where a random token happens to match)
    got = cached.forward_batch([ForwardCall(f"s{i}", s, p[s:], len(p) - s) for i, (p, s) in enumerate(zip(prompts, starts))])
    for i, (p, s) in enumerate(zip(prompts, starts)):
        assert torch.equal(got[i], fresh.forward(f"s{i}", 0, p, len(p))[s:])
    for i in range(4):
        cached.release(f"s{i}")
    assert cached.pool.free_blocks == cached.pool.num_blocks


def test_forgetting_a_tenant_drops_its_cached_prefixes_and_no_one_elses():
    model = tiny_llama(2, seed=0)
    r = _runner(model)
    prompt = _ids(50, seed=8)
    for tenant in ("alice", "bob"):
        _serve(r, tenant, prompt, salt=tenant)
    r.release("alice")  # bob's request still holds its blocks
    cached = r.pool.cached_blocks
    assert r.forget_prefixes("alice") == 3 and r.forget_prefixes("bob") == 3 and r.pool.cached_blocks == cached - 6
    assert r.attach_prefix("a2", prompt, salt="alice") == 0 and r.attach_prefix("b2", prompt, salt="bob") == 0
    for sid in ("bob", "a2", "b2"):
        r.release(sid)
    assert r.pool.free_blocks == r.pool.num_blocks  # the forgotten held blocks were freed when let go


def test_new_weights_forget_every_cached_prefix():
    """Keys and values cached under the old weights are stale: a runner given new weights finds
    nothing cached, and its logits are the new model's."""
    r = _runner(tiny_llama(2, seed=0))
    prompt = _ids(50, seed=9)
    _serve(r, "a", prompt)
    r.release("a")
    assert r.pool.cached_blocks > 0
    other = tiny_llama(2, seed=1)
    r.load_state_dict({k: v.clone() for k, v in other.state_dict().items()})
    assert r.pool.cached_blocks == 0 and r.attach_prefix("b", prompt) == 0
    assert torch.equal(r.forward("b", 0, prompt, 1), _runner(other, caching=False).forward("c", 0, prompt, 1))
    r.release("b")
    assert r.pool.free_blocks == r.pool.num_blocks


def test_the_look_up_without_attaching_finds_what_attaching_would_and_touches_nothing():
    """``cached_prefix`` answers, for prompts that share whole blocks, part of one, the prompt
    exactly to a block's end, two tokens or nothing, the positions ``attach_prefix`` then takes;
    it counts no look-up and holds no block. Another salt, or caching off, finds nothing."""
    r = _runner(tiny_llama(2, seed=0))
    warm = _ids(3 * B + 9, seed=1)
    _serve(r, "warm", warm, salt="t")
    r.release("warm")
    other = _ids(40, seed=2)
    cases = [warm + [7], warm[:2 * B + 1], warm[:B + 5] + [(warm[B + 5] + 1) % 128] + other[:9], warm[:2], warm[:1],
             other, warm[: 3 * B + 9]]
    stats, free = dict(r.pool.prefix_stats), r.pool.free_blocks
    looked = [r.cached_prefix(p, "t") for p in cases]
    assert r.pool.prefix_stats == stats and r.pool.free_blocks == free
    assert looked == [r.attach_prefix(f"s{i}", p, "t") for i, p in enumerate(cases)]
    assert looked == [3 * B, 2 * B, B + 5, 1, 0, 0, 3 * B]  # (block 3 is not settled: the warm request ended in it)
    assert r.cached_prefix(warm + [7], "u") == 0
    r.prefix_caching = False
    assert r.cached_prefix(warm + [7], "t") == 0 == r.attach_prefix("off", warm + [7], "t")
