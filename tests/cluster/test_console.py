"""`osd serve` as a user starts it, in a process of its own: the console up to ready is a few
stage lines and the examples (the replicas' output goes to Ray's log files), one line per period
of served load, and Ctrl-C stops it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import free_port
from deployments.launch import DEFAULT_CONFIG

pytestmark = pytest.mark.serve
ROOT = Path(__file__).resolve().parents[2]


def test_the_console_says_the_stages_the_url_and_a_line_per_period_of_load(tmp_path):
    doc = yaml.safe_load(DEFAULT_CONFIG.read_text())
    doc["applications"][0]["args"]["learner"]["state_dir"] = str(tmp_path / "state")
    cfg = tmp_path / "serve_config.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("OSD_API_KEYS", None)
    proc = subprocess.Popen([sys.executable, "-m", "osd.cli", "serve", "--config", str(cfg), "--port", str(port),
                             "--report-s", "6"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while not any(line.startswith("Stop with Ctrl-C") for line in lines):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "osd serve ended before it was ready:\n" + "".join(lines)
            lines.append(line)
            assert time.monotonic() < deadline, "".join(lines)
        text = "".join(lines)
        assert f"http://127.0.0.1:{port}" in text and "ready after" in text and "starting the application" in text
        # stages and examples only: no per-call lines, progress bars or replica warnings
        assert len(lines) <= 16, text
        assert not any(w in text for w in ("INFO", "Loading weights", "telemetry of", "(ServeReplica")), text
        body = json.dumps({"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}).encode()
        for _ in range(2):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                assert r.status == 200
        load = proc.stdout.readline()  # within a period or two
        assert "requests" in load and "tokens/s" in load and "0 errors" in load, load
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rest, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
    assert proc.returncode == 0, "".join(lines) + rest
