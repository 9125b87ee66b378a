"""A bounded load test of a running server (``osd bench-serve --load SECONDS``), loopback only.

``clients`` threads send a mixed workload for ``seconds``: chat and plain completions, streamed
and not, in turn, each request's prompt the next record of the workload (all its domains). A
client that is told 429/503 waits what ``Retry-After`` says (at most 2 s) and goes on, as a
well-behaved client does. Every 200 is checked for completeness (a finish reason and the usage;
a stream ends with ``[DONE]``). The server's memory (the resident set of every Ray Serve replica
process on this machine) is sampled every ``sample_s``; "flat" compares its mean over the last
quarter of the run with its mean over the second quarter (after warm-up).

Then, with ``burst`` > 0, one overload phase: ``burst`` requests at once (more than the ingress's
``max_in_flight`` and the tenant's concurrency), each answered 200, or refused at once with 429 or
503 and a ``Retry-After``, never queued without bound nor failed otherwise.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import threading
import time
from collections import defaultdict

import numpy as np
import psutil
import requests


def replica_rss_bytes(only: str | None = None) -> int:
    """The resident memory of the Ray Serve replica processes (and the proxy) on this machine;
    ``only``: of the replicas of that deployment (e.g. ``DraftPool``)."""
    total = 0
    for p in psutil.process_iter(["cmdline", "name"]):
        try:
            cmd = " ".join(p.info["cmdline"] or []) + " " + (p.info["name"] or "")
            if only is not None and f":{only}" not in cmd:
                continue
            if "ServeReplica" in cmd or "ProxyActor" in cmd or "ServeController" in cmd:
                total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def _request(session: requests.Session, url: str, key: str, model: str, text: str, max_tokens: int,
             chat: bool, stream: bool) -> dict:
    """One request: status, whether the answer was complete, latency, tokens, Retry-After."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if stream:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.perf_counter()
    try:
        r = session.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}, stream=stream, timeout=300)
    except requests.RequestException as e:
        return {"status": "connection", "seconds": time.perf_counter() - t0, "error": type(e).__name__}
    out = {"status": r.status_code, "stream": stream, "chat": chat, "retry_after": r.headers.get("Retry-After")}
    if r.status_code != 200:
        r.close()
        out["seconds"] = time.perf_counter() - t0
        return out
    complete, tokens, ttft = False, 0, None
    if stream:
        finish = usage = done = False
        try:
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    done = True
                    break
                ev = json.loads(line[6:])
                if "error" in ev:
                    out["status"] = "stream-error"
                    break
                if ttft is None and ev.get("choices"):
                    ttft = time.perf_counter() - t0
                finish = finish or any(c.get("finish_reason") for c in ev.get("choices", []))
                if ev.get("usage"):
                    usage, tokens = True, ev["usage"]["completion_tokens"]
        except requests.RequestException:
            out["status"] = "stream-cut"
        complete = bool(finish and usage and done)
    else:
        data = r.json()
        tokens = data.get("usage", {}).get("completion_tokens", 0)
        complete = bool(data.get("choices") and data["choices"][0].get("finish_reason") and data.get("usage"))
    out.update(seconds=time.perf_counter() - t0, complete=complete, tokens=tokens, ttft=ttft)
    return out


def run_load(url: str, key: str, model: str, texts: list[str], clients: int, seconds: float, max_tokens: int,
             burst: int = 0, sample_s: float = 5.0) -> dict:
    """The load test described in the module docstring; returns its figures."""
    results: list[dict] = []
    memory: list[tuple[float, int]] = []
    lock, stop = threading.Lock(), threading.Event()
    counter = itertools.count()
    t_start = time.perf_counter()
    deadline = t_start + seconds

    def sampler():
        while not stop.is_set():
            memory.append((time.perf_counter() - t_start, replica_rss_bytes()))
            stop.wait(sample_s)

    def client():
        session = requests.Session()
        while time.perf_counter() < deadline:
            with lock:
                i = next(counter)
            res = _request(session, url, key, model, texts[i % len(texts)], max_tokens, chat=bool(i % 2), stream=bool((i // 2) % 2))
            res["at"] = time.perf_counter() - t_start
            with lock:
                results.append(res)
            if res["status"] in (429, 503):
                time.sleep(min(2.0, float(res.get("retry_after") or 1)))

    mem_thread = threading.Thread(target=sampler, daemon=True)
    mem_thread.start()
    with cf.ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(client) for _ in range(clients)]:
            f.result()
    wall = time.perf_counter() - t_start
    out = summarise(results, memory, wall, clients, seconds, max_tokens)
    if burst:
        out["burst"] = run_burst(url, key, model, texts, burst, max_tokens)
    stop.set()
    mem_thread.join(timeout=10)
    return out


def run_burst(url: str, key: str, model: str, texts: list[str], n: int, max_tokens: int) -> dict:
    """``n`` requests at once: how many were served, how many refused (and how fast, with which
    Retry-After), and anything else."""
    def one(i):
        return _request(requests.Session(), url, key, model, texts[i % len(texts)], max_tokens, chat=False, stream=False)

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(n) as pool:
        res = list(pool.map(one, range(n)))
    statuses: dict[str, int] = defaultdict(int)
    for r in res:
        statuses[str(r["status"])] += 1
    refused = [r for r in res if r["status"] in (429, 503)]
    return {
        "requests": n, "wall_s": time.perf_counter() - t0, "by_status": dict(statuses),
        "refused_with_retry_after": sum(1 for r in refused if r.get("retry_after")),
        "refusal_ms_p99": 1e3 * float(np.percentile([r["seconds"] for r in refused], 99)) if refused else None,
        "served_complete": sum(1 for r in res if r["status"] == 200 and r.get("complete")),
    }


def summarise(results: list[dict], memory: list[tuple[float, int]], wall: float, clients: int, seconds: float,
              max_tokens: int) -> dict:
    by_status: dict[str, int] = defaultdict(int)
    for r in results:
        by_status[str(r["status"])] += 1
    ok = [r for r in results if r["status"] == 200]
    lat = [r["seconds"] for r in ok]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    pct = (lambda xs, q: 1e3 * float(np.percentile(xs, q)) if xs else None)
    mem = [m for _, m in memory]
    q = max(1, len(mem) // 4)
    warm, last = mem[q:2 * q], mem[-q:]
    return {
        "clients": clients, "seconds": seconds, "max_tokens": max_tokens, "wall_s": wall,
        "requests": len(results), "served": len(ok),
        "complete": sum(1 for r in ok if r.get("complete")),
        "streamed": sum(1 for r in ok if r.get("stream")),
        "by_status": dict(by_status),
        "server_errors": sum(v for k, v in by_status.items() if k.isdigit() and int(k) >= 500),
        "output_tokens": sum(r.get("tokens", 0) for r in ok),
        "tokens_per_s": sum(r.get("tokens", 0) for r in ok) / wall if wall else None,
        "latency_ms": {"p50": pct(lat, 50), "p99": pct(lat, 99)},
        "ttft_ms_stream": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
        "memory_mib": {
            "peak": max(mem) / 2**20 if mem else None,
            "after_warmup_mean": float(np.mean(warm)) / 2**20 if warm else None,
            "last_quarter_mean": float(np.mean(last)) / 2**20 if last else None,
            "samples": [(round(t, 1), round(m / 2**20, 1)) for t, m in memory],
        },
    }


def format_load(res: dict) -> str:
    m = res["memory_mib"]
    lines = [
        f"{res['clients']} clients for {res['seconds']:.0f} s (max_tokens {res['max_tokens']}): {res['requests']} requests, "
        f"{res['served']} served ({res['complete']} complete, {res['streamed']} streamed), by status {res['by_status']}",
        f"latency p50 {res['latency_ms']['p50']:.0f} ms, p99 {res['latency_ms']['p99']:.0f} ms; "
        f"TTFT (streams) p50 {res['ttft_ms_stream']['p50']:.0f} ms, p99 {res['ttft_ms_stream']['p99']:.0f} ms; "
        f"{res['tokens_per_s']:.1f} output tok/s" if res["served"] else "nothing served",
        f"server memory: peak {m['peak']:.0f} MiB; mean after warm-up {m['after_warmup_mean']:.0f} MiB, "
        f"last quarter {m['last_quarter_mean']:.0f} MiB" if m["peak"] else "server memory: not seen (not on this machine?)",
    ]
    if "burst" in res:
        b = res["burst"]
        lines.append(f"burst of {b['requests']} at once: by status {b['by_status']}, {b['refused_with_retry_after']} refusals "
                     f"with Retry-After, {b['served_complete']} served complete")
    return "\n".join(lines)


def run_long_prompts(url: str, key: str, model: str, texts: list[str], n: int, prompt_chars: int, max_tokens: int,
                     sample_s: float = 0.5) -> dict:
    """``n`` completions at once, each a prompt of about ``prompt_chars`` characters (workload texts
    joined) and ``max_tokens`` tokens out (EOS ignored): the time they take, and the replicas' memory
    growth per cached position, (peak RSS - RSS before) / sum(prompt + completion tokens)."""
    joined = "\n\n".join(texts)
    prompts = [(joined[i * 997 % len(joined):] + joined)[:prompt_chars] for i in range(n)]  # n different prompts
    before, engine_before = replica_rss_bytes(), replica_rss_bytes("DraftPool")
    memory, engine, stop = [], [], threading.Event()

    def sampler():
        while not stop.is_set():
            memory.append(replica_rss_bytes())
            engine.append(replica_rss_bytes("DraftPool"))
            stop.wait(sample_s)

    def one(i):
        body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        r = requests.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=3600)
        out = {"status": r.status_code, "seconds": time.perf_counter() - t0}
        if r.status_code == 200:
            out.update(r.json()["usage"])
        return out

    mem_thread = threading.Thread(target=sampler, daemon=True)
    mem_thread.start()
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(n) as pool:
        res = list(pool.map(one, range(n)))
    wall = time.perf_counter() - t0
    stop.set()
    mem_thread.join(timeout=10)
    ok = [r for r in res if r["status"] == 200]
    cached = sum(r["prompt_tokens"] + r["completion_tokens"] for r in ok)
    peak, engine_peak = max(memory + [before]), max(engine + [engine_before])
    return {"requests": n, "ok": len(ok), "by_status": [r["status"] for r in res], "wall_s": wall,
            "prompt_tokens": [r.get("prompt_tokens") for r in res], "completion_tokens": sum(r.get("completion_tokens", 0) for r in ok),
            "rss_before_mib": before / 2**20, "rss_peak_mib": peak / 2**20, "cached_tokens": cached,
            "kb_per_cached_token": (peak - before) / cached / 1e3 if cached else None,
            # the engine replicas alone (the target's KV cache lives there)
            "engine_rss_before_mib": engine_before / 2**20, "engine_rss_peak_mib": engine_peak / 2**20,
            "engine_kb_per_cached_token": (engine_peak - engine_before) / cached / 1e3 if cached else None}


def format_long_prompts(res: dict) -> str:
    return (f"{res['requests']} long prompts at once ({res['prompt_tokens']} prompt tokens), {res['ok']} ok in "
            f"{res['wall_s']:.0f} s; replicas' RSS {res['rss_before_mib']:.0f} -> peak {res['rss_peak_mib']:.0f} MiB for "
            f"{res['cached_tokens']} cached tokens: {res['kb_per_cached_token'] or float('nan'):.1f} KB per cached token; "
            f"engine replicas {res['engine_rss_before_mib']:.0f} -> {res['engine_rss_peak_mib']:.0f} MiB: "
            f"{res['engine_kb_per_cached_token'] or float('nan'):.1f} KB per cached token")
