"""llama.cpp as a baseline: plain greedy decoding of the same GGUF file, through the optional
``llama-cpp-python`` package (``pip install 'osd-serve[llamacpp]'``: it builds llama.cpp from source,
about 6 minutes on 2 cores). Token ids are shared: the target's tokenizer is read from that GGUF."""

from __future__ import annotations

import time
from pathlib import Path

INSTALL = ("pip install 'osd-serve[llamacpp]' (or pip install llama-cpp-python==0.3.36; it builds llama.cpp "
           "from source with the machine's gcc and cmake, about 6 min on 2 cores; on a virtual machine whose CPU "
           "lists AMX, set CFLAGS and CXXFLAGS to '-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' for the build, or "
           "llama.cpp dies with SIGILL at its first token)")


class BackendUnavailable(RuntimeError):
    """An optional runtime is not installed or cannot serve this model; the message says what to do."""


def gguf_of(model_name: str) -> Path:
    """The GGUF file behind a target spec (the embedded default, a .gguf path, or a folder holding one)."""
    from config import EMBEDDED_TARGET
    from speculative.locate import embedded_gguf_path

    if model_name == EMBEDDED_TARGET:
        return embedded_gguf_path()
    p = Path(model_name)
    if p.suffix == ".gguf" and p.is_file():
        return p
    if p.is_dir() and sorted(p.glob("*.gguf")):
        return sorted(p.glob("*.gguf"))[0]
    raise BackendUnavailable(f"llama.cpp runs GGUF files; target {model_name!r} is not one")


def load_llamacpp(gguf: str | Path, threads: int = 2, n_ctx: int = 4096, logits_all: bool = False,
                  flash_attn: bool = False):
    """A ``llama_cpp.Llama`` on ``threads`` threads, or :class:`BackendUnavailable` saying how to
    install it. ``logits_all``: logits for every evaluated position (to time verification).
    ``flash_attn``: llama.cpp's fused attention (float16 queries and sums), which llama-server
    turns on by default on a CPU and llama-cpp-python does not: its logits differ from the other
    path's by up to about 0.1 in log-probability."""
    try:
        import llama_cpp
    except ImportError:
        raise BackendUnavailable(f"llama.cpp is not installed: {INSTALL}") from None
    return llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                           n_batch=512, logits_all=logits_all, flash_attn=flash_attn, verbose=False)


def llamacpp_greedy(llm, ids: list[int], max_tokens: int, eos: set[int]) -> tuple[list[int], float]:
    """Greedy decoding of ``ids`` (prompt token ids): (new tokens, cut before the first EOS; seconds,
    prompt evaluation included)."""
    out: list[int] = []
    t0 = time.perf_counter()
    llm.reset()  # no prefix reuse from the previous prompt: every method pays its prompt's prefill
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if tok in eos:
            break
        out.append(int(tok))
        if len(out) >= max_tokens:
            break
    return out, time.perf_counter() - t0


def llamacpp_verify_times(llm, context: list[int], extra: list[int], repeats: int) -> dict[int, float]:
    """Median seconds for llama.cpp to evaluate j = 1..len(extra) new tokens after ``context``, logits
    for every new position (what verifying j tokens would cost it)."""
    import statistics

    out = {}
    for j in range(1, len(extra) + 1):
        times = []
        for _ in range(repeats + 1):
            llm.reset()
            llm.eval(context)
            t0 = time.perf_counter()
            llm.eval(extra[:j])
            times.append(time.perf_counter() - t0)
        out[j] = statistics.median(times[1:])
    return out
