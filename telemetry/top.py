"""``osd top``: the live figures of a running server on a terminal (reads ``/v1/stats``).

    osd top [--url http://127.0.0.1:8000] [--key KEY | $OSD_API_KEY] [--interval 2] [--once]

An admin key (or an open server) shows everything; a tenant's key shows that tenant's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime


def fetch(url: str, key: str | None, timeout: float = 10.0) -> dict:
    req = urllib.request.Request(url.rstrip("/") + "/v1/stats", headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _last(xs: list) -> float | None:
    return next((x for x in reversed(xs) if x is not None), None)


def _f(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def render(s: dict, url: str, max_rows: int | None = None):
    """One frame (a rich renderable) from a ``/v1/stats`` answer: the domains busiest first (most
    draft tokens), at most ``max_rows`` rows of them, the last saying how many more there are."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    series = s["series"]
    head = Text.assemble(("osd top ", "bold"), f"{url}  scope {s['scope']}  ",
                         datetime.fromtimestamp(s["t"]).strftime("%H:%M:%S"), f"  (rates over {s['window_s']:.0f} s)")
    t = s["totals"]
    overview = Table(box=None, show_header=True, header_style="bold")
    for col in ("requests", "errors", "output tokens", "req/s", "tok/s", "latency p50", "p95", "TTFT p50"):
        overview.add_column(col, justify="right")
    overview.add_row(_f(t["requests"], "{:.0f}"), _f(t["errors"], "{:.0f}"), _f(t["generation_tokens"], "{:.0f}"),
                     _f(_last(series["requests_per_s"])), _f(_last(series["tokens_per_s"]), "{:.1f}"),
                     _f(_last(series["latency_p50_s"]), "{:.2f} s"), _f(_last(series["latency_p95_s"]), "{:.2f} s"),
                     _f(_last(series["ttft_p50_s"]), "{:.2f} s"))
    domains = Table(title="acceptance per domain", box=None, header_style="bold", title_justify="left")
    for col in ("domain", "alpha", "alpha (recent)", "drafted", "accepted", "tokens/step", "est. speed-up"):
        if col == "domain":  # the id first (what a row is found by), then the name, cut to one line
            domains.add_column(col, justify="left", no_wrap=True, overflow="ellipsis", max_width=44)
        else:
            domains.add_column(col, justify="right")
    per = s.get("domains", {})
    busiest = sorted(s["acceptance"].items(), key=lambda da: (-da[1]["drafted"], da[0]))
    if max_rows is not None and len(busiest) > max_rows:  # (max_rows >= 1) the last row counts the rest
        shown, rest = busiest[: max_rows - 1], busiest[max_rows - 1 :]
    else:
        shown, rest = busiest, []
    for d, a in shown:
        domains.add_row(f"{d}  {a['name']}" if a.get("name") else d, _f(a["alpha"], "{:.3f}"),
                        _f(_last(series["acceptance"].get(d, [])), "{:.3f}"),
                        _f(a["drafted"], "{:.0f}"), _f(a["accepted"], "{:.0f}"),
                        _f(per.get(d, {}).get("tokens_per_step"), "{:.2f}"), _f(per.get(d, {}).get("speedup"), "{:.2f}x"))
    if rest:
        drafted, accepted = sum(a["drafted"] for _, a in rest), sum(a["accepted"] for _, a in rest)
        domains.add_row(f"+{len(rest)} more domains", _f(accepted / drafted if drafted else None, "{:.3f}"), "",
                        _f(drafted, "{:.0f}"), _f(accepted, "{:.0f}"), "", "")
    # the learner's lines above the table, whose length grows with the domains: a terminal too short
    # even for one domain row (see fit) loses the frame's last lines (the oldest events), not them
    parts = [head, overview]
    if "learner" in s:
        r, lr = s["running"], s["learner"]
        parts.append(Text(f"running {r['ingress']:.0f}  draft pool {r['draft_pool']:.0f}  target queue "
                          f"{r['target_queue']:.0f}  KV caches {r['kv_caches']:.0f}"))
        drafts = ", ".join(f"{d} v{v['version']}" for d, v in s["drafts"].items()) or "-"
        parts.append(Text(f"learner {'paused' if lr['paused'] else 'active'}: {lr['records']:.0f} records, "
                          f"{lr['rounds']:.0f} rounds, {lr['published']:.0f} published, {lr['rejected']:.0f} rejected, "
                          f"step {_f(lr['step_seconds'], '{:.3f} s')}; drafts {drafts}"))
    parts.append(domains)
    for e in s.get("events", [])[-5:][::-1]:
        when = datetime.fromtimestamp(e["t"]).strftime("%H:%M:%S")
        detail = f"v{e['version']}" if "version" in e else e.get("reason", "")
        parts.append(Text(f"  {when} {e['kind']} {e.get('draft') or ''} {detail}"))
    return Group(*parts)


def fit(s: dict, url: str, console):
    """The frame of ``s`` cut to the console's height: as many domain rows as leave room for the
    rest (the others counted on one row), so that redrawing in place never loses a line."""
    frame = render(s, url)
    # one line to spare: a frame as tall as the terminal scrolls it when the cursor moves past its end
    excess = len(console.render_lines(frame)) - (console.size.height - 1)
    return frame if excess <= 0 else render(s, url, max_rows=max(1, len(s["acceptance"]) - excess))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="osd top", description="live figures of a running osd-serve")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--key", default=os.environ.get("OSD_API_KEY"), help="API key (default $OSD_API_KEY)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--iterations", type=int, default=None, help="stop after this many refreshes")
    args = p.parse_args(argv)
    if args.interval <= 0:
        p.error("--interval must be > 0")
    from rich.console import Console
    from rich.live import Live

    console = Console()

    def frame(live: bool = True):  # redrawn in place: cut to the terminal; printed once: whole
        try:
            s = fetch(args.url, args.key)
            return fit(s, args.url, console) if live else render(s, args.url)
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")
            try:
                body = json.loads(body)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            return f"{args.url}: HTTP {e.code}: {body}"
        except (urllib.error.URLError, OSError) as e:
            return f"{args.url}: not reachable ({e})"

    if args.once:
        console.print(frame(live=False))
        return 0
    n = 0
    try:
        with Live(frame(), console=console, refresh_per_second=4, screen=False) as live:
            while args.iterations is None or n < args.iterations:
                time.sleep(args.interval)
                live.update(frame())
                n += 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
