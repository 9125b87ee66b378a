"""Exact-distribution harness for the lossless tests (``tests/unit/test_lossless.py``).

The promise under test: speculative sampling emits sequences distributed exactly as target-only
sampling under the request's temperature, top_p and top_k. With a vocabulary of V = 8 the exact
joint distribution of the first m = k_max + 2 output tokens (every token of a fully accepted step,
its bonus token, and the token after it) can be enumerated, so we compare the engine's samples with
the exact law by Pearson chi-square tests instead of eyeballing one marginal.

Independence of the reference: the exact law is computed here from the target's raw logits
(a full, uncached forward over each prefix) with the warp written out below in float64 numpy,
*not* with ``speculative.sampling.warp_logits``; the samples come from the real
``SpeculativeEngine`` / ``ModelRunner`` / proposers.

Views and significance: each case is tested on several views of its samples (the joint over the m
tokens and every adjacent pair of positions), each a chi-square test at ``ALPHA / views``
(Bonferroni), so a case fails by chance with probability at most ``ALPHA`` = 1e-4 per seed. Cells
whose expected count is below 5 are pooled into one "rest" cell; an outcome the target can never
produce (exact probability 0) fails the case outright.

Power: N, the number of sampled sequences of a case, is the smallest N for which each view's test
has power >= ``POWER`` (0.95) against an alternative at Cohen's effect size w = ``W`` (0.25), using
the noncentral chi-square with lambda = N w^2 and the view's degrees of freedom. By Cauchy-Schwarz
w >= 2 TV, so every alternative whose total-variation distance from the target law over a view's
cells is >= 0.125 is detected with probability >= 0.95.

The models are tiny second-order Markov LMs (:class:`MarkovLM`): logits over the next token from
the last two tokens and the position, driven through the real ``ModelRunner`` (their context lives
in its ``DynamicCache``), so a sequence of 6 tokens costs about 3 ms and a case takes seconds. One
case runs the tiny random Llama of ``conftest`` instead, to keep the transformer path honest too.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
from scipy import optimize, stats

ALPHA = 1e-4  # per case (all views together)
POWER = 0.95
W = 0.25  # Cohen's effect size the power is computed against (>= 2 TV)
MIN_EXPECTED = 5.0
V = 8  # vocabulary of the Markov LMs


# -- models ---------------------------------------------------------------------------------------------
class MarkovLM(torch.nn.Module):
    """A tiny causal LM: logits(next | context) = A[x_t] + B[x_{t-1}] + C[t] over ``out_vocab`` outputs.

    ``base`` + ``noise``: a draft close to ``base`` (its tables plus Gaussian noise); otherwise the
    tables are drawn from ``seed``. ``keep`` ([out] target ids) restricts the output head to those
    tokens (the tables' columns are the base's columns for them): pair it with ``vocab_map=keep``.
    With ``past_key_values`` the input ids are appended to the cache (stored as its "keys"), so the
    runner's cropping and lengths work as for a transformer.
    """

    def __init__(self, seed: int, scale: float = 0.6, base: "MarkovLM | None" = None, noise: float = 0.0,
                 keep: list[int] | None = None, vocab: int = V, positions: int = 64):
        super().__init__()
        from transformers import GenerationConfig, LlamaConfig

        g = torch.Generator().manual_seed(seed)
        shapes = {"A": (vocab, vocab), "B": (vocab, vocab), "C": (positions, vocab)}
        for name, shape in shapes.items():
            table = torch.randn(*shape, generator=g, dtype=torch.float64) * scale
            if base is not None:
                table = getattr(base, name).detach().double() + noise * torch.randn(*shape, generator=g, dtype=torch.float64)
            if keep is not None:
                table = table[:, keep]
            self.register_parameter(name, torch.nn.Parameter(table.float(), requires_grad=False))
        out = vocab if keep is None else len(keep)
        self.config = LlamaConfig(vocab_size=out, num_hidden_layers=1, hidden_size=2, num_attention_heads=1,
                                  num_key_value_heads=1, max_position_embeddings=positions)
        self.generation_config = GenerationConfig(eos_token_id=None)

    def context_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, L] -> logits [B, L, out] (row t scores the token after ids[:, :t+1])."""
        prev = torch.cat([ids[:, :1], ids[:, :-1]], 1)  # [B, L]
        return self.A[ids] + self.B[prev] + self.C[: ids.shape[1]][None]

    def forward(self, input_ids, past_key_values=None, use_cache=True, logits_to_keep=0, **_):
        if past_key_values is None:
            logits = self.context_logits(input_ids)
        else:
            new = input_ids.float()[:, None, :, None]  # [1, 1, T, 1]: the ids as the cache's "keys"
            context = past_key_values.update(new, new, 0)[0][:, 0, :, 0].long()  # [1, L] the whole context
            logits = self.context_logits(context)[:, -input_ids.shape[1]:]
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def next_logits(model: torch.nn.Module, prefixes: np.ndarray) -> np.ndarray:
    """The target's raw logits for the token after each prefix: [B, L] -> [B, V] float64 (no cache)."""
    ids = torch.as_tensor(prefixes, dtype=torch.long)
    with torch.inference_mode():
        if hasattr(model, "forward_batch"):  # a runner (the int4 fast path): each prefix whole, uncached,
            # 256 at a time in one batched pass (its rows are bitwise the same as alone: tests/unit/test_fast.py)
            from speculative.runner import ForwardCall

            rows = []
            for lo in range(0, len(ids), 256):
                calls = [ForwardCall(f"__law__{i}", 0, row.tolist(), 1) for i, row in enumerate(ids[lo : lo + 256])]
                rows += [r[0] for r in model.forward_batch(calls)]
                for c in calls:
                    model.release(c.seq_id)
            out = torch.stack(rows)
        elif isinstance(model, MarkovLM):
            out = model.context_logits(ids)[:, -1]
        else:  # a Hugging Face causal LM
            out = model(input_ids=ids).logits[:, -1]
    return out.double().numpy()


# -- the reference law ------------------------------------------------------------------------------------
def reference_warp(logits: np.ndarray, temperature: float, top_p: float, top_k: int) -> tuple[np.ndarray, float]:
    """OpenAI / Hugging Face sampling semantics, written out: divide by the temperature, keep the
    top_k largest logits (0 = all) and every logit tied with the k-th (Hugging Face's and vLLM's
    top-k: a threshold at the k-th value; the int4 runtime's logits are bfloat16-rounded, so ties
    happen), renormalise, keep the smallest set of most likely tokens whose mass reaches top_p,
    renormalise. logits [B, V] -> (probs [B, V], the largest probability of a token whose keep/drop
    decision is within 1e-5 of the top_p boundary: a float32 implementation may decide it either way)."""
    z = logits / temperature
    order = np.argsort(-z, axis=1, kind="stable")  # [B, V] most likely first
    zs = np.take_along_axis(z, order, 1)
    k = min(top_k, z.shape[1]) if top_k else z.shape[1]
    kept = zs >= zs[:, k - 1 : k]  # [B, V] sorted order: every logit at least the k-th
    ps = np.where(kept, np.exp(zs - zs[:, :1]), 0.0)
    ps /= ps.sum(1, keepdims=True)
    ambiguous = 0.0
    if top_p < 1.0:
        before = np.cumsum(ps, 1) - ps  # mass strictly before each token
        kept &= before < top_p
        near = np.abs(before - top_p) < 1e-5
        ambiguous = float(ps[near].max()) if near.any() else 0.0
        ps = np.where(kept, ps, 0.0)
        ps /= ps.sum(1, keepdims=True)
    probs = np.zeros_like(ps)
    np.put_along_axis(probs, order, ps, 1)
    return probs, ambiguous


def reference_process(logits: np.ndarray, prompt: list[int], outputs: np.ndarray, process: dict) -> np.ndarray:
    """vLLM's logits processors, written out for each prefix: logit bias; repetition penalty over
    the prompt's and the output's tokens (a positive logit divided by it, a negative one
    multiplied); frequency (times the count in the output) and presence (once) penalties; then
    min-p as a floor on the logit relative to the largest (``min_p`` travels to the warp, where it
    applies after the temperature). logits [S, V], outputs [S, t] -> [S, V]."""
    z = logits.copy()
    for s in range(len(z)):
        out = outputs[s].tolist()
        if "grammar" in process:  # ALTERNATING: '1'-'4' at even output positions, '2'-'5' at odd ones
            assert process["grammar"] == ALTERNATING, "the reference knows one grammar"
            lo = 3 if len(out) % 2 == 0 else 4  # the character tokenizer: "<eos>", "<unk>", "0", "1", ...
            z[s, [v for v in range(z.shape[1]) if not lo <= v < lo + 4]] = -np.inf
        for tok, b in process.get("logit_bias", {}).items():
            z[s, tok] += b
        r, n = process.get("repetition_penalty", 1.0), process.get("penalty_last_n")
        if n is not None:  # llama.cpp's: all three over the last n tokens of prompt and output (-1: all)
            window = (list(prompt) + out)[-n:] if n > 0 else (list(prompt) + out if n < 0 else [])
            for tok in set(window):
                z[s, tok] = z[s, tok] / r if z[s, tok] > 0 else z[s, tok] * r
                z[s, tok] -= process.get("frequency_penalty", 0.0) * window.count(tok) + process.get("presence_penalty", 0.0)
            continue
        for tok in set(prompt) | set(out):
            z[s, tok] = z[s, tok] / r if z[s, tok] > 0 else z[s, tok] * r
        for tok in set(out):
            z[s, tok] -= process.get("frequency_penalty", 0.0) * out.count(tok) + process.get("presence_penalty", 0.0)
    return z


#: the keys of a case's ``process`` that make its warp llama.cpp's sampler chain (:func:`reference_chain`)
CHAIN_KEYS = ("samplers", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "dynatemp_range",
              "dynatemp_exponent", "min_keep")
#: the serving order when a request names none (``config.DEFAULT_ORDER``), written out here
CHAIN_DEFAULT = ("temperature", "min_p", "top_k", "top_p", "top_n_sigma", "typ_p", "xtc")


def reference_chain(z: np.ndarray, temperature: float, top_p: float, top_k: int, process: dict) -> np.ndarray:
    """llama.cpp's samplers (``src/llama-sampler.cpp``) transcribed as it runs them: a list of
    candidates (id, logit) that each sampler of the order shrinks or rescales, then the law of the
    final draw; XTC tosses its coin, so the law sums both outcomes. top_k keeps the logits tied
    with the k-th (this server's top-k). z [V] -> probs [V], float64."""
    order = tuple(process.get("samplers", CHAIN_DEFAULT))
    min_keep = process.get("min_keep", 0)

    def probs_of(c):  # softmax over the candidates, most likely first
        c = sorted(c, key=lambda t: -t[1])
        w = np.exp(np.array([l for _, l in c]) - c[0][1])
        return c, w / w.sum()

    def run(c, stages) -> dict:
        for i, stage in enumerate(stages):
            if stage == "temperature":
                t = temperature
                r = process.get("dynatemp_range", 0.0)
                if r > 0:
                    if len(c) <= 1:
                        continue
                    _, p = probs_of(c)
                    h = -sum(x * np.log(x) for x in p if x > 0)
                    lo, hi = max(0.0, t - r), t + r
                    t = lo + (hi - lo) * (h / np.log(len(c))) ** process.get("dynatemp_exponent", 1.0)
                if t <= 0:
                    c = [max(c, key=lambda x: x[1])]
                else:
                    c = [(v, l / t) for v, l in c]
            elif stage == "min_p" and process.get("min_p", 0.0) > 0:
                c = sorted(c, key=lambda t: -t[1])
                floor = c[0][1] + np.log(process["min_p"])
                c = [x for j, x in enumerate(c) if x[1] >= floor or j < min_keep]
            elif stage == "top_k" and top_k:
                kth = sorted((l for _, l in c), reverse=True)[min(top_k, len(c)) - 1]
                c = [x for x in c if x[1] >= kth]
            elif stage == "top_p" and top_p < 1.0:
                c, p = probs_of(c)
                cum, last = 0.0, len(c)
                for j, x in enumerate(p):
                    cum += x
                    if cum >= top_p and j + 1 >= min_keep:
                        last = j + 1
                        break
                c = c[:last]
            elif stage == "top_n_sigma" and process.get("top_n_sigma", -1.0) > 0 and len(c) > 1:
                ls = np.array([l for _, l in c])
                floor = ls.max() - process["top_n_sigma"] * ls.std()
                c = [x for x in c if x[1] >= floor]
            elif stage == "typ_p" and process.get("typical_p", 1.0) < 1.0:
                c, p = probs_of(c)
                h = -sum(x * np.log(x) for x in p)
                ranked = sorted(range(len(c)), key=lambda j: abs(-np.log(p[j]) - h))
                cum, last = 0.0, len(ranked)
                for n, j in enumerate(ranked):
                    cum += p[j]
                    if cum > process["typical_p"] and (min_keep == 0 or n >= min_keep - 1):
                        last = n + 1
                        break
                c = [c[j] for j in ranked[:last]]
            elif stage == "xtc" and process.get("xtc_probability", 0.0) > 0 and process.get("xtc_threshold", 0.1) <= 0.5 and len(c) >= 2:
                c, p = probs_of(c)
                last = 0
                for j, x in enumerate(p):
                    if x < process.get("xtc_threshold", 0.1):
                        break
                    last = j
                if len(c) - last >= min_keep and last > 0:
                    pr, rest = process["xtc_probability"], stages[i + 1:]
                    kept, fired = run(c, rest), run(c[last:], rest)
                    return {v: (1 - pr) * kept.get(v, 0.0) + pr * fired.get(v, 0.0) for v in kept.keys() | fired.keys()}
        c, p = probs_of(c)
        return {v: float(x) for (v, _), x in zip(c, p)}

    law = run([(v, float(l)) for v, l in enumerate(z) if np.isfinite(l)], order)
    out = np.zeros(len(z))
    for v, x in law.items():
        out[v] = x
    return out


def exact_law(model, prompt: list[int], m: int, temperature: float, top_p: float, top_k: int,
              process: dict | None = None) -> dict[tuple, float]:
    """The exact joint law of the first m tokens of target-only sampling: {sequence: probability},
    enumerated breadth first over prefixes of non-zero probability. ``process``: the request's
    penalties, logit bias and min_p (:func:`reference_process`)."""
    process = process or {}
    seqs = np.zeros((1, 0), dtype=np.int64)
    probs = np.ones(1)
    worst = 0.0
    for _ in range(m):
        ctx = np.concatenate([np.tile(np.asarray(prompt)[None], (len(seqs), 1)), seqs], 1)
        z = reference_process(next_logits(model, ctx), prompt, seqs, process) if process else next_logits(model, ctx)
        if any(key in process for key in CHAIN_KEYS):  # llama.cpp's samplers: their chain, row by row
            p = np.stack([reference_chain(row, temperature, top_p, top_k, process) for row in z])
            parent, tok = np.nonzero(p)
            probs = probs[parent] * p[parent, tok]
            seqs = np.concatenate([seqs[parent], tok[:, None]], 1)
            continue
        if process.get("min_p"):  # after the temperature: keep p(v) >= min_p * max p
            t = z / temperature
            z = np.where(t - t.max(1, keepdims=True) >= np.log(process["min_p"]), z, -np.inf)
        p, amb = reference_warp(z, temperature, top_p, top_k)  # [S, V]
        worst = max(worst, amb)
        parent, tok = np.nonzero(p)
        probs = probs[parent] * p[parent, tok]
        seqs = np.concatenate([seqs[parent], tok[:, None]], 1)
    if worst > 1e-3:
        raise AssertionError(f"reference ill-posed: a token of probability {worst:.4f} sits on the top_p boundary")
    return {tuple(s): float(q) for s, q in zip(seqs.tolist(), probs)}


# -- chi-square views --------------------------------------------------------------------------------------
@dataclass
class ViewResult:
    name: str
    cells: int
    statistic: float
    pvalue: float
    impossible: int  # samples of outcomes with exact probability 0


def _pearson(name: str, exact: dict, observed: dict, n: int) -> ViewResult:
    impossible = sum(c for key, c in observed.items() if exact.get(key, 0.0) == 0.0)
    keys = sorted(exact, key=exact.get, reverse=True)
    big = [key for key in keys if exact[key] * n >= MIN_EXPECTED]
    e = [exact[key] * n for key in big]
    o = [observed.get(key, 0) for key in big]
    rest_e = n - sum(e)
    if rest_e > 1e-9 * n:  # pool the small cells into one
        rest_o = n - sum(o) - impossible
        if rest_e >= MIN_EXPECTED or not big:
            e.append(rest_e), o.append(rest_o)
        else:  # too small to stand alone: merge into the smallest kept cell
            e[-1] += rest_e
            o[-1] += rest_o
    e_arr, o_arr = np.asarray(e), np.asarray(o, dtype=float)
    stat = float(((o_arr - e_arr) ** 2 / e_arr).sum())
    df = len(e) - 1
    pvalue = 0.0 if impossible else (float(stats.chi2.sf(stat, df)) if df > 0 else 1.0)
    return ViewResult(name, len(e), stat, pvalue, impossible)


_LAW_CACHE: dict = {}  # the last law _marginal saw: its arrays and marginals (8^m sequences: 262,144 at m = 6)


def _marginal(law: dict[tuple, float], positions: tuple[int, ...]) -> dict[tuple, float]:
    """The law of the tokens at ``positions``: {their values: summed probability}."""
    if _LAW_CACHE.get("law") is not law:
        seqs = np.asarray(list(law), dtype=np.int64)  # [S, m]
        _LAW_CACHE.update(law=law, seqs=seqs, probs=np.fromiter(law.values(), float, len(law)), marginals={})
    seqs, probs, done = _LAW_CACHE["seqs"], _LAW_CACHE["probs"], _LAW_CACHE["marginals"]
    positions = tuple(positions)
    if positions == tuple(range(seqs.shape[1])):
        return law  # the joint: every sequence is a cell of its own
    if positions not in done:
        shape = (int(seqs.max()) + 1,) * len(positions)
        cell = np.ravel_multi_index(tuple(seqs[:, list(positions)].T), shape)  # [S]
        sums = np.bincount(cell, weights=probs, minlength=int(np.prod(shape)))
        seen = np.flatnonzero(np.bincount(cell, minlength=len(sums)))
        done[positions] = {k: float(q) for k, q in zip(zip(*(c.tolist() for c in np.unravel_index(seen, shape))), sums[seen])}
    return done[positions]


def view_positions(m: int) -> list[tuple[int, ...]]:
    """The joint over all m positions, then each adjacent pair."""
    return [tuple(range(m))] + [(i, i + 1) for i in range(m - 1)]


def chi_square_views(law: dict[tuple, float], samples: list[tuple]) -> list[ViewResult]:
    n = len(samples)
    results = []
    for pos in view_positions(len(next(iter(law)))):
        exact = _marginal(law, pos)
        observed: dict[tuple, int] = {}
        for s in samples:
            key = tuple(s[i] for i in pos)
            observed[key] = observed.get(key, 0) + 1
        name = "joint" if len(pos) > 2 else f"x{pos[0]}x{pos[1]}"
        results.append(_pearson(name, exact, observed, n))
    return results


def power(n: int, df: int, alpha: float, w: float = W) -> float:
    """Power of a chi-square test with df degrees of freedom at level alpha against effect size w."""
    return float(stats.ncx2.sf(stats.chi2.isf(alpha, df), df, n * w * w)) if df > 0 else 1.0


def required_n(df: int, alpha: float, w: float = W, target: float = POWER) -> int:
    """The smallest N with power(N, df, alpha, w) >= target."""
    crit = stats.chi2.isf(alpha, df)
    lam = optimize.brentq(lambda lam: stats.ncx2.sf(crit, df, lam) - target, 1e-6, 1e5)
    return int(np.ceil(lam / (w * w)))


def choose_n(law: dict[tuple, float], m: int, n0: int = 1500, cap: int = 4000) -> tuple[int, int]:
    """(N, the largest view df at N): iterate N -> df of the pooled views at N -> required N."""
    views = view_positions(m)
    alpha = ALPHA / len(views)
    n = n0
    for _ in range(4):
        df = max(sum(1 for q in _marginal(law, pos).values() if q * n >= MIN_EXPECTED) for pos in views)
        new = min(cap, required_n(max(df, 1), alpha))
        if new == n:
            break
        n = new
    return n, df


# -- the cases ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    temperature: float
    top_p: float
    top_k: int
    k: int  # fixed k, or k_max when adaptive
    adaptive: bool
    #: "close" | "far" | "ngram" | "chain" (prompt lookup, then the close draft) | "suffix" (a suffix tree
    #: over the case's earlier samples) | "controller" (suffix tree, lookup, close draft: chosen per step) |
    #: "feature" (a feature-conditioned draft reading the target's hidden states; llama models) |
    #: "feature-fused" (one that fuses layer 0's output with the final feature, both read) | "none"
    draft: str
    restricted: bool = False  # draft head restricted to part of the vocabulary (vocab_map)
    model: str = "markov"  # "markov" | "llama" | "llama-int4" (target and draft on the int4 fast path)
    seeded: bool = False  # requests with a seed: the exponential race instead of rejection sampling
    #: requests sampled at a time: 1 = one request alone (generate), > 1 = that many with their
    #: verifications batched into one target forward (step_many: a co-located server's loop)
    batch: int = 1
    #: the request's penalties, logit bias and min_p, as (name, value) pairs (SamplingParams' names)
    process: tuple = ()

    @property
    def m(self) -> int:
        return self.k + 2

    @property
    def name(self) -> str:
        mode = "adaptive" if self.adaptive else "fixed"
        head = "+head" if self.restricted else ""
        seeded = " seeded" if self.seeded else ""
        batch = f" x{self.batch}" if self.batch > 1 else ""
        process = "".join(f" {name}={value}" for name, value in self.process)
        return (f"{self.model}:{self.draft}{head} T={self.temperature} top_p={self.top_p} top_k={self.top_k} "
                f"k={self.k} {mode}{seeded}{batch}{process}")


FACTORS = {
    "temperature": (0.3, 0.7, 1.0, 1.5),
    "top_p": (1.0, 0.8, 0.5),
    "top_k": (0, 3),
    "k": (1, 2, 4),
    "adaptive": (False, True),
    "draft": ("close", "far"),
    "restricted": (False, True),
}


def pairwise_cases(factors: dict[str, tuple] = FACTORS) -> list[Case]:
    """A covering array of strength 2: every pair of levels of every two factors appears in some case
    (greedy, deterministic: 14 cases instead of the 576 of the full product)."""
    names = list(factors)
    uncovered = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2) for x in factors[a] for y in factors[b]}
    rows: list[dict] = []
    candidates = [dict(zip(names, values)) for values in itertools.product(*factors.values())]

    def covers(row):
        return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)} & uncovered

    while uncovered:
        best = max(candidates, key=lambda r: len(covers(r)))  # first maximum: deterministic
        uncovered -= covers(best)
        rows.append(best)
    return [Case(**r) for r in rows]


#: Prompt lookup and chained cases (their own factors: a deterministic proposer, q one-hot).
PROPOSER_CASES = [
    Case(0.7, 1.0, 0, 2, False, "ngram"),
    Case(1.5, 0.8, 3, 4, False, "ngram"),
    Case(1.0, 0.5, 0, 4, True, "ngram"),
    Case(0.3, 1.0, 3, 1, False, "ngram"),
    Case(1.0, 0.8, 0, 4, False, "chain", restricted=True),
    Case(1.0, 0.8, 0, 4, False, "suffix"),
    Case(0.7, 1.0, 3, 3, True, "controller", restricted=True),
]
#: The transformer path: the tiny random Llama target and a 1-layer Llama draft (k = 2), batched
#: 16 requests at a time (the seeded Llama cases below run them one at a time).
LLAMA_CASES = [Case(1.0, 0.8, 0, 3, False, "feature", model="llama", batch=16),
               Case(0.7, 1.0, 2, 2, True, "feature", model="llama-int4", restricted=True),
               Case(1.0, 0.8, 0, 3, False, "feature-fused", model="llama-int4", batch=16),
               Case(1.0, 0.8, 0, 2, False, "far", model="llama", batch=16),
               # the int4 fast path (speculative.fast): the law is that runtime's own, as served
               Case(0.7, 1.0, 0, 3, False, "far", model="llama-int4", batch=16),
               Case(1.0, 0.8, 2, 2, True, "far", model="llama-int4", batch=16)]
#: Target-only decoding (no proposer): the warp itself, over every (temperature, top_p, top_k).
TARGET_ONLY_CASES = [
    Case(t, p, tk, 0, False, "none")
    for t, p, tk in itertools.product(FACTORS["temperature"], FACTORS["top_p"], FACTORS["top_k"])
]

#: Seeded requests (the exponential race): draft kinds, heads, k and warps, target-only, the Llama path.
SEEDED_CASES = [
    Case(0.7, 1.0, 0, 2, False, "close", seeded=True),
    Case(1.5, 0.8, 3, 4, True, "far", restricted=True, seeded=True),
    Case(1.0, 0.5, 0, 1, False, "close", restricted=True, seeded=True),
    Case(0.3, 0.8, 3, 4, True, "close", seeded=True),
    Case(1.0, 1.0, 0, 4, False, "chain", restricted=True, seeded=True),
    Case(0.7, 0.8, 0, 2, False, "ngram", seeded=True),
    Case(1.0, 0.8, 0, 3, False, "suffix", seeded=True),
    Case(1.0, 0.8, 3, 0, False, "none", seeded=True),
    Case(0.3, 1.0, 0, 0, False, "none", seeded=True),
    Case(1.0, 0.8, 0, 2, False, "far", model="llama", seeded=True),
    Case(1.0, 0.8, 0, 2, False, "feature", model="llama", seeded=True),
]

#: Penalties, logit bias, min_p and a grammar (each row verified with the draft's tokens before it in its history):
#: target-only, drafts near and far, the controller, seeded, and the int4 runtime batched (the Markov
#: models take no ragged batches: their positions ignore the padding).
PROCESS = (("frequency_penalty", 0.6), ("presence_penalty", 0.4), ("repetition_penalty", 1.4),
           ("logit_bias", ((2, 1.2), (5, -1.5))), ("min_p", 0.08))
#: a grammar whose mask depends on the output so far (and that never ends: '6' has no token)
ALTERNATING = ("regex", "([1-4][2-5])*6")
PROCESSED_CASES = [
    Case(0.8, 1.0, 0, 0, False, "none", process=PROCESS),
    Case(0.8, 1.0, 0, 4, False, "close", process=PROCESS),
    Case(1.0, 0.8, 0, 3, False, "far", restricted=True, process=(("frequency_penalty", -0.8), ("repetition_penalty", 0.7))),
    Case(1.0, 1.0, 3, 4, True, "controller", process=PROCESS),
    Case(1.0, 0.8, 0, 3, False, "far", model="llama-int4", batch=16, process=PROCESS),
    Case(0.7, 1.0, 0, 4, False, "close", seeded=True, process=PROCESS),
    # llama.cpp's penalties: a window of the last 3 tokens, the prompt's first, sliding over the draft's
    Case(0.8, 1.0, 0, 4, False, "close", process=(("repetition_penalty", 1.6), ("frequency_penalty", 0.6),
                                                 ("presence_penalty", 0.3), ("penalty_last_n", 3))),
    # structured output: each row masked by the grammar after the draft's tokens before it
    Case(1.0, 1.0, 0, 4, False, "close", process=(("grammar", ALTERNATING),)),
    Case(0.7, 0.8, 0, 3, True, "controller", process=(("grammar", ALTERNATING), ("frequency_penalty", 0.5))),
    Case(1.0, 1.0, 0, 4, False, "far", restricted=True, seeded=True, process=(("grammar", ALTERNATING),)),
]

PROMPT = [1, 2, 3, 1, 2, 4, 1, 2]  # repeats, so that prompt lookup finds continuations
#: target ids the restricted draft heads keep (5 of 8): the others come only from the residual
RESTRICTED = [0, 2, 3, 5, 6]


@dataclass
class Models:
    target: torch.nn.Module
    drafts: dict = field(default_factory=dict)


def build_models(model: str) -> Models:
    if model == "llama":
        from conftest import tiny_llama

        small = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                     num_key_value_heads=1, initializer_range=0.5, eos_token_id=None, pad_token_id=None)
        return Models(tiny_llama(2, seed=3, **small), {"far": tiny_llama(1, seed=4, **small)})
    if model == "llama-int4":
        from conftest import tiny_llama
        from speculative.fast import FastRunner

        small = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                     num_key_value_heads=1, initializer_range=0.5, eos_token_id=None, pad_token_id=None)
        return Models(FastRunner(tiny_llama(2, seed=3, **small), name="target", bits=4),
                      {"far": FastRunner(tiny_llama(1, seed=4, **small), name="draft", bits=4)})
    target = MarkovLM(seed=0)
    return Models(target, {
        "close": MarkovLM(seed=1, base=target, noise=0.3),
        "far": MarkovLM(seed=2),
        "close+head": MarkovLM(seed=1, base=target, noise=0.3, keep=RESTRICTED),
        "far+head": MarkovLM(seed=2, keep=RESTRICTED),
    })


def build_engine(case: Case, models: Models):
    from config import EngineConfig, KPolicyConfig, NgramConfig, SuffixConfig
    from conftest import _char_tokenizer
    from speculative import ChainedProposer, DraftModelProposer, ModelRunner, NgramProposer, SpeculativeEngine
    from speculative.proposers import ControllerProposer
    from speculative.suffix import SuffixProposer

    def draft(kind: str):
        key = kind + ("+head" if case.restricted else "")
        vmap = torch.tensor(RESTRICTED) if case.restricted else None
        model = models.drafts[key]
        return DraftModelProposer(model if isinstance(model, ModelRunner) else ModelRunner(model, vmap, name="draft"), V)

    ngram = NgramProposer(NgramConfig(max_n=2, min_n=1))
    # the suffix tree learns from every sample before: its proposals depend on the case's history
    suffix = SuffixProposer(SuffixConfig(max_depth=8, spec_factor=2.0, min_token_prob=0.05))
    def feature(layers=()):
        from speculative.feature import FeatureDraftProposer, FeatureRunner
        from speculative.feature_draft import feature_draft

        base = models.target.model if isinstance(models.target, ModelRunner) else models.target
        keep = torch.tensor(RESTRICTED) if case.restricted else None
        model = feature_draft(base, keep, layers)
        if layers:  # a fusion that reads the layer and an fc that reads the feature: proposals depend on both
            g, H = torch.Generator().manual_seed(11), base.config.hidden_size
            with torch.no_grad():
                model.fuse.weight.normal_(0, H**-0.5, generator=g)
                model.fc.weight[:, :H].normal_(0, H**-0.5, generator=g)
        return FeatureDraftProposer(FeatureRunner(model, keep), V)

    proposer = {"none": lambda: None, "ngram": lambda: ngram, "chain": lambda: ChainedProposer(ngram, draft("close")),
                "suffix": lambda: suffix, "feature": feature, "feature-fused": lambda: feature((0,)),
                "controller": lambda: ControllerProposer(suffix, ngram, draft("close"), probe_every=3)}.get(
        case.draft, lambda: draft(case.draft))()
    # adaptive: costs seeded below and frozen (ema ~ 0: the microsecond timings of these tiny models
    # must not move them), under which the best k follows the acceptance estimate through 0..k_max
    kcfg = (KPolicyConfig(k_max=case.k, ema=1e-12) if case.adaptive
            else KPolicyConfig(k_max=max(case.k, 1), fixed_k=case.k))
    target = models.target if isinstance(models.target, ModelRunner) else ModelRunner(models.target, name="target")
    engine = SpeculativeEngine(target, _char_tokenizer(), proposer,
                               EngineConfig(chat_template=False, k=kcfg, record_top_k=4))
    if case.adaptive:
        engine.costs.verify_s.update({j: 1.0 + 0.02 * (j - 1) for j in range(1, case.k + 2)})  # a GPU's v(j)
        engine.costs.draft_s.update({"draft": 0.01, "feature": 0.01, "ngram": 0.001, "suffix": 0.001})
    return engine


@dataclass
class CaseResult:
    case: Case
    n: int
    views: list[ViewResult]
    seconds: float
    ks: dict[int, int]  # proposed k -> steps
    full: int  # steps whose k >= 1 draft tokens were all accepted (a bonus token was drawn)
    rejected: int  # steps with a rejection (a recovered token was drawn)

    @property
    def pvalue(self) -> float:
        return min(v.pvalue for v in self.views)

    @property
    def passed(self) -> bool:
        return self.pvalue >= ALPHA / len(self.views)

    @property
    def power(self) -> float:
        alpha = ALPHA / len(self.views)
        return min(power(self.n, v.cells - 1, alpha) for v in self.views)

    def summary(self) -> str:
        worst = min(self.views, key=lambda v: v.pvalue)
        return (f"{self.case.name}: N={self.n} power={self.power:.3f} min p={self.pvalue:.2e} ({worst.name}, "
                f"{worst.cells} cells, {worst.impossible} impossible) k={dict(sorted(self.ks.items()))} "
                f"bonus={self.full} recovered={self.rejected} {self.seconds:.1f}s")


def sample(engine, case: Case, n: int, seed: int = 0) -> tuple[list[tuple], dict, int, int]:
    """N sequences of m tokens through the engine: seeded requests (seeds seed*1_000_003 + i) for a
    seeded case, else unseeded requests drawing from one generator seeded by ``seed``."""
    from config import SamplingParams

    ks: dict[int, int] = {}
    full = rejected = 0
    out = []
    gen = torch.Generator().manual_seed(seed)
    for lo in range(0, n, case.batch):
        rids = []
        for i in range(lo, min(lo + case.batch, n)):
            params = SamplingParams(max_tokens=case.m, temperature=case.temperature, top_p=case.top_p, top_k=case.top_k,
                                    seed=seed * 1_000_003 + i if case.seeded else None,
                                    ignore_eos="grammar" not in case_process(case),  # a grammar decides the end
                                    **engine_process(case))
            rids.append(engine.add_request(list(PROMPT), params, generator=gen))
        live = rids
        while live:
            for s in engine.step_many(live):  # one request: exactly step()
                ks[s.proposed] = ks.get(s.proposed, 0) + 1
                full += s.proposed > 0 and s.accepted == s.proposed
                rejected += s.accepted < s.proposed
            live = [r for r in live if not engine.requests[r].finished]
        for r in rids:
            out.append(tuple(engine.requests[r].output))
            engine.release(r)
    return out, ks, full, rejected


def case_process(case: Case) -> dict:
    """The case's processing: {name: value} (logit_bias a dict)."""
    return {name: dict(value) if name == "logit_bias" else value for name, value in case.process}


def engine_process(case: Case) -> dict:
    """The case's processing as SamplingParams' keyword arguments."""
    from config import Grammar

    kw = case_process(case)
    if "grammar" in kw:
        kind, source = kw["grammar"]
        kw["grammar"] = Grammar(kind=kind, source=source)
    return kw


def run_case(case: Case, models: Models | None = None, seed: int = 0, n: int | None = None,
             law: dict[tuple, float] | None = None) -> CaseResult:
    """Sample the case through the engine and test it against ``law`` (its exact law, computed
    here unless given)."""
    models = models or build_models(case.model)
    if law is None:
        law = exact_law(models.target, PROMPT, case.m, case.temperature, case.top_p, case.top_k, case_process(case))
    n = n or choose_n(law, case.m)[0]
    engine = build_engine(case, models)
    t0 = time.perf_counter()
    samples, ks, full, rejected = sample(engine, case, n, seed)
    return CaseResult(case, n, chi_square_views(law, samples), time.perf_counter() - t0, ks, full, rejected)


#: llama-server's order (its own endpoint's default): the cut-offs first, the temperature last
LLAMA_CHAIN = ("top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
#: llama.cpp's samplers, in its order and in the default one: typical-p, top-n-sigma, XTC (a coin
#: each row: the law is the mixture), dynamic temperature, min_keep; drafts near and far, seeded,
#: the controller, and with penalties before them
CHAIN_CASES = [
    Case(0.8, 0.9, 0, 4, False, "close", process=(("samplers", LLAMA_CHAIN), ("typical_p", 0.7), ("top_n_sigma", 1.5),
                                                  ("min_p", 0.05))),
    Case(1.0, 1.0, 0, 3, False, "far", process=(("samplers", LLAMA_CHAIN), ("xtc_probability", 0.5),
                                                ("xtc_threshold", 0.12), ("dynatemp_range", 0.5))),
    Case(0.9, 1.0, 0, 4, False, "close", seeded=True, process=(("xtc_probability", 0.6), ("xtc_threshold", 0.1),
                                                               ("typical_p", 0.8), ("min_keep", 2))),
    Case(1.0, 1.0, 2, 4, True, "controller", process=(("samplers", LLAMA_CHAIN), ("typical_p", 0.75),
                                                      ("dynatemp_range", 0.6), ("dynatemp_exponent", 2.0),
                                                      ("frequency_penalty", 0.5), ("penalty_last_n", 3))),
]


def all_cases() -> list[Case]:
    return pairwise_cases() + PROPOSER_CASES + LLAMA_CASES + TARGET_ONLY_CASES + SEEDED_CASES + PROCESSED_CASES + CHAIN_CASES


def main() -> int:
    """``python tests/lossless.py``: run every case and print N, power, p-values and time."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    failed = 0
    for case in all_cases():
        res = run_case(case)
        failed += not res.passed
        print(("ok   " if res.passed else "FAIL ") + res.summary(), flush=True)
    print(f"{len(all_cases())} cases, {failed} failed, alpha {ALPHA} per case, power >= {POWER} at w = {W}, "
          f"{time.perf_counter() - t0:.0f} s")
    return int(failed > 0)


if __name__ == "__main__":
    raise SystemExit(main())
