"""What a request changes in the target's logits before a token is chosen, as a pure function.

Penalties, logit biases and min_tokens make the law of the next token depend on the tokens before
it. A verification scores k + 1 positions at once, row j after the draft's first j tokens, so each
row is processed with the history it would have had if decoded alone: the sequence so far plus
d_1..d_j. Greedy and sampled acceptance then run on the processed rows, and the output is exactly
the processed target's, whatever the draft proposed (drafts are not processed: that can only cost
acceptance, never change an output).

Order, as in vLLM: a grammar's mask, min_tokens, logit bias, repetition penalty, frequency and
presence penalties. The penalties count as vLLM's (repetition over prompt and output, frequency and
presence over the output) or, with ``penalty_last_n``, as llama.cpp's (all three over the last n
tokens of prompt and output);
the warp (temperature, min-p, top-k, top-p and llama.cpp's samplers, in the request's order) follows in
:func:`speculative.sampling.warp_logits`.
"""

from __future__ import annotations

import torch

from config import SamplingParams


def process_rows(logits: torch.Tensor, params: SamplingParams, tokens: list[int], prompt_len: int,
                 draft: list[int], stop_ids: set[int], allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The request's processed logits of one verification.

    logits: [k+1, V] raw target rows; row j scores the token after ``tokens`` + ``draft[:j]``.
    tokens: the sequence so far (prompt, then ``len(tokens) - prompt_len`` output tokens).
    draft: [k] proposed tokens. stop_ids: the ids min_tokens keeps out (EOS and stop_token_ids).
    allowed: [k+1, V] bool, a grammar's tokens for each row (``speculative.grammar``), or None.
    Returns [k+1, V] float32; the input is not changed.
    """
    rows, vocab = logits.shape
    out = logits.float().clone()  # [k+1, V]
    if allowed is not None:  # structured output first: what the grammar forbids has no mass at all
        out.masked_fill_(~allowed, float("-inf"))
    generated = len(tokens) - prompt_len
    window = params.penalty_last_n if params.penalised else None
    size = max(vocab, max(tokens, default=-1) + 1, max(draft, default=-1) + 1)  # ids past the rows' width count too
    if window is None:  # vLLM's: frequency and presence over the output, repetition over everything
        counts = _counts(tokens[prompt_len:], size)  # [V+] output tokens so far
        seen = torch.zeros(size, dtype=torch.bool)  # [V+] in the prompt or the output
        if params.repetition_penalty != 1.0:
            seen[torch.tensor(tokens, dtype=torch.long)] = True
    else:  # llama.cpp's: each penalty counts the last ``window`` tokens (-1: all), the prompt's too
        history = tokens + draft[: rows - 1]
        lo = 0 if window < 0 else max(0, len(tokens) - window)
        counts = _counts(tokens[lo:], size)
    if params.logit_bias:
        bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
    banned = torch.tensor(sorted(t for t in stop_ids if t < vocab), dtype=torch.long)
    for j in range(rows):
        row = out[j]  # [V], a view
        if j:  # the history of row j holds d_1..d_j
            d = draft[j - 1]
            counts[d] += 1
            if window is None:
                seen[d] = True
            elif window > 0 and len(tokens) + j > window:  # the oldest token leaves the window
                counts[history[len(tokens) + j - 1 - window]] -= 1
        if generated + j < params.min_tokens:
            row[banned] = float("-inf")
        if params.logit_bias:
            row.index_add_(0, bias_ids, bias)
        if not params.penalised:
            continue
        if window is not None:
            seen = counts > 0
        if params.repetition_penalty != 1.0:
            r = params.repetition_penalty
            row.copy_(torch.where(seen[:vocab], torch.where(row > 0, row / r, row * r), row))
        if params.frequency_penalty:
            row.sub_(params.frequency_penalty * counts[:vocab])
        if params.presence_penalty:
            row.sub_(params.presence_penalty * (counts[:vocab] > 0).float())
    return out


def _counts(ids: list[int], size: int) -> torch.Tensor:
    """[size] float: each id's count in ``ids`` (all below ``size``)."""
    return torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=size).float()
