"""Start the application on a local Ray instance, as ``osd serve`` / ``make run`` do.

Reads ``serve_config.yaml`` (the same file ``serve run`` / ``serve deploy`` take): the first
application's ``args`` become the typed :class:`config.AppConfig`, its ``deployments`` entries the
per-deployment options. Every Ray and Serve listener binds 127.0.0.1. Blocks until SIGINT or
SIGTERM, then shuts Serve and Ray down.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable, TypeVar

import yaml

from config import AppConfig

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "serve_config.yaml"

#: Ray on this kind of machine (see the README): loopback only, no auth token file, no usage stats.
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # every Ray listener on 127.0.0.1
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
    "TRANSFORMERS_VERBOSITY": "error",
    # OpenMP threads spin a while after each parallel region before they sleep: a target step is
    # ~1,000 small ops, each a parallel region, and a pool that sleeps at once (OMP_WAIT_POLICY=PASSIVE)
    # pays a wake-up for each (a 1-token step 15 -> 33 ms, `python -m bench.step_batch`). libgomp's
    # own count (300,000) against a short one (10,000), fresh servers in turn over HTTP, 24 prompts a
    # level: 27.7 / 28.3 / 30.3 against 23.3 / 25.7 tokens/s at concurrency 1, 44.1 / 40.4 / 47.7
    # against 39.3 / 36.2 at 8; 3,000,000 no better (results/serving/gomp_spincount/)
    "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "300000"),
    # Ray starts its workers at nice 15; here the replicas are the service, and a client or another
    # server on the same cores would otherwise take them first
    "RAY_worker_niceness": os.environ.get("RAY_worker_niceness", "0"),
    # glibc gives each thread that allocates an arena of its own (64 MiB reserved, pages kept once
    # touched); a replica's many threads (Ray's, the learner's, OpenMP's) then hold freed memory in
    # a dozen of them. Two arenas: the same allocations, fewer pages kept (docs/faults.md)
    "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2"),
}


def read_config(path: str | Path = DEFAULT_CONFIG) -> tuple[dict, AppConfig, dict[str, dict]]:
    """(the whole YAML, the first application's typed args, deployment name -> options)."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    apps = (doc.get("applications") if isinstance(doc, dict) else None) or []
    if not apps:
        raise ValueError(f"{path}: no application")
    app = apps[0]
    cfg = AppConfig.model_validate(app.get("args") or {})
    options = {d["name"]: {k: v for k, v in d.items() if k != "name"} for d in app.get("deployments") or []}
    return doc, cfg, options


def convert_once(model: str, say: Callable[[str], None] = print) -> None:
    """Dequantise a GGUF target into the cache before the replicas start, in a child process (the
    launcher itself never imports torch), saying so: the one slow step of a first start."""
    from speculative.locate import complete, locate

    path, gguf = locate(model)
    if gguf is None or complete(Path(path)):
        return
    say(f"converting {gguf.name} to safetensors once (about 30 s; cached in {path})")
    code = "import sys; from speculative.models import resolve_model_folder; resolve_model_folder(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, model], check=True, cwd=ROOT)


def start(config: str | Path = DEFAULT_CONFIG, port: int | None = None, num_cpus: int = 4,
          placement: str | None = None, temp_dir: str | None = None, ready_timeout_s: float = 600.0,
          verbose: bool = True, say: Callable[[str], None] = print) -> str:
    """Start Ray and the app; return the base URL once ``/ready`` answers 200. Without ``verbose``
    the replicas' output (Serve's per-call lines, progress bars, warnings) goes to Ray's log files
    only, and the console gets the stages through ``say``."""
    os.environ.update(RAY_ENV)
    doc, cfg, options = read_config(config)
    convert_once(cfg.engine.model.name, say)
    import ray
    from ray import serve

    from .app import build

    if placement:
        cfg = cfg.model_copy(update={"placement": placement})
    http = dict(doc.get("http_options") or {})
    http["host"] = "127.0.0.1"
    http["port"] = port or http.get("port", 8000)
    app_doc = doc["applications"][0]
    temp_dir = temp_dir or tempfile.mkdtemp(prefix="osd-ray-")
    # more logical CPUs than cores: replicas are mostly idle, waiting on each other
    if not verbose:  # the driver's own "Started Serve in namespace ..."
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level="warning",
             log_to_driver=verbose, _temp_dir=temp_dir)
    say(f"starting the application on Ray ({num_cpus} logical CPUs, {cfg.placement} placement); "
        f"replica logs in {temp_dir}/session_latest/logs")
    serve.start(http_options=http)
    if not verbose:  # the driver's own "Connecting to ...", "Application ... is ready" (the stages say it)
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    serve.run(build(cfg, options), name=app_doc.get("name", "osd"), route_prefix=app_doc.get("route_prefix", "/"),
              logging_config=app_doc.get("logging_config"))
    url = f"http://127.0.0.1:{http['port']}"
    deadline = time.monotonic() + ready_timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=10) as r:
                if r.status == 200:
                    return url
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the app did not become ready within {ready_timeout_s:.0f} s")
        time.sleep(0.5)


def examples(url: str, model: str, open_: bool) -> str:
    """What ``osd serve`` prints once ready; ``open_``: no API key is configured (said only then)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Write a haiku about the sea."}], "max_tokens": 48})
    auth = "" if open_ else " -H \"Authorization: Bearer $OSD_KEY\""
    key = "'none'" if open_ else "os.environ['OSD_KEY']"
    imports = "import openai" if open_ else "import openai, os"
    keys = ("No API keys are configured: the server is open to anyone on this machine (it listens on 127.0.0.1 only).\n"
            if open_ else "API keys are required (Authorization: Bearer <key>); OSD_KEY above stands for one of yours.\n")
    return f"""osd-serve is ready at {url}  (OpenAI-compatible: {url}/v1)

  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
       -d '{body}'

  python -c "{imports}; c = openai.OpenAI(base_url='{url}/v1', api_key={key}); \\
print(c.completions.create(model='{model}', prompt='def fib(n):', max_tokens=32, temperature=0).choices[0].text)"

{keys}Stop with Ctrl-C (or SIGTERM)."""


def load_line(before: dict | None, now: dict, seconds: float) -> str | None:
    """What the console says about ``seconds`` of served load, from two of the Metrics replica's
    ``totals`` (requests, errors, generation_tokens); None when nothing was answered."""
    b = before or {"requests": 0, "errors": 0, "generation_tokens": 0}
    n = now["requests"] - b["requests"]
    if n <= 0 or seconds <= 0:
        return None
    tokens, errors = now["generation_tokens"] - b["generation_tokens"], now["errors"] - b["errors"]
    return (f"{time.strftime('%H:%M:%S')}  last {seconds:.0f} s: {n:.0f} requests, {tokens / seconds:.1f} tokens/s, "
            f"{errors:.0f} errors")


def health_lines(before: dict[str, str], now: dict[str, tuple[str, str]]) -> list[str]:
    """Deployments that fell ill or recovered since ``before`` (name -> status), each said once
    with Serve's reason. ``now``: name -> (status, message)."""
    bad = ("UNHEALTHY", "DEPLOY_FAILED")
    out = []
    for name, (status, message) in sorted(now.items()):
        was = before.get(name)
        if status in bad and was != status:
            out.append(f"{time.strftime('%H:%M:%S')}  {name} is {status}: {message.strip() or 'no reason given'}")
        elif was in bad and status not in bad:
            out.append(f"{time.strftime('%H:%M:%S')}  {name} is {status} again")
    return out


T = TypeVar("T")


def bounded(fn: Callable[[], T], timeout_s: float) -> T:
    """``fn()`` in a daemon thread: its result (or its exception), or TimeoutError after
    ``timeout_s`` (the thread is left to finish on its own). A call into Ray that never answers
    then cannot keep the console from stopping."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, name="osd-bounded-call", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _serve_statuses(app: str) -> dict[str, tuple[str, str]]:
    from ray import serve

    return {n: (str(getattr(d.status, "value", d.status)), d.message or "")
            for n, d in serve.status().applications[app].deployments.items()}


def _served_totals(app: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle("Metrics", app).stats.remote(None, True).result(timeout_s=10)["totals"]


def watch(app: str, stop: threading.Event, every_s: float = 60.0, say: Callable[[str], None] = print,
          statuses_of: Callable[[str], dict] = _serve_statuses, totals_of: Callable[[str], dict] = _served_totals,
          call_timeout_s: float = 15.0, poll_s: float = 5.0) -> None:
    """Until ``stop``: every ``every_s`` one line of served load (when there was any), and at once
    (polled every ``poll_s``) a deployment that fails or recovers. Each call into Serve waits at
    most ``call_timeout_s``, so ``stop`` is seen within that however Serve behaves."""
    totals, t_totals, statuses = None, time.monotonic(), {}
    next_load = time.monotonic() + every_s
    while not stop.wait(min(poll_s, every_s)):
        try:
            now = bounded(lambda: statuses_of(app), call_timeout_s)
        except Exception:  # noqa: BLE001 - Serve shutting down, or not answering
            continue
        for line in health_lines(statuses, now):
            say(line)
        statuses = {n: st for n, (st, _) in now.items()}
        if time.monotonic() < next_load or "Metrics" not in now:
            continue
        next_load += every_s
        try:
            got = bounded(lambda: totals_of(app), call_timeout_s)
        except Exception:  # noqa: BLE001 - the metrics replica restarting: the next minute says it
            continue
        t = time.monotonic()
        line = load_line(totals, got, t - t_totals)
        if line:
            say(line)
        totals, t_totals = got, t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="osd serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="a Serve config file (serve_config.yaml)")
    ap.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's, 8000)")
    ap.add_argument("--num-cpus", type=int, default=4, help="logical CPUs Ray schedules replicas on")
    ap.add_argument("--placement", choices=["split", "colocated"], default=None)
    ap.add_argument("--verbose", action="store_true",
                    help="the replicas' output on the console too (Serve's per-call lines, progress bars)")
    ap.add_argument("--report-s", type=float, default=60.0, help="seconds between lines of served load")
    args = ap.parse_args(argv)
    doc, cfg, _ = read_config(args.config)
    from .tenants import load_keys

    open_ = not load_keys(cfg.auth)  # the replicas read the same config and environment
    t0 = time.perf_counter()

    def say(line: str) -> None:
        print(line, flush=True)

    url = start(args.config, args.port, args.num_cpus, args.placement, verbose=args.verbose, say=say)
    say(f"ready after {time.perf_counter() - t0:.0f} s\n")
    say(examples(url, cfg.ingress.model_name, open_))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    watch(doc["applications"][0].get("name", "osd"), stop, args.report_s, say)
    from ray import serve
    import ray

    try:
        bounded(serve.shutdown, 60.0)
    except TimeoutError:  # the replicas are stopped with Ray below either way
        say("Serve did not stop within 60 s; stopping Ray")
    ray.shutdown()
    return 0
