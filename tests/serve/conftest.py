"""The live application, started once for the tests of this folder (loopback only): the shipped
serve_config.yaml (engine replicas: the co-located placement) with keys for three tenants and two
replicas, and the split placement (draft replicas calling a Target deployment) as a second
application under /split. Helpers to call it over plain HTTP."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest
import yaml

from conftest import free_port
from config import DraftConfig, EngineConfig, SamplingParams
from deployments import launch
from deployments.tenants import digest
from drafts.build import build_engine


MODEL = "smollm2-135m-instruct-osd"
PROMPTS = [
    "def fibonacci(n):\n",
    "The capital of France is",
    "用一句话介绍一下长城。",
    "SELECT name FROM users WHERE",
    "Once upon a time, there was a",
    "import numpy as np\nx = np.",
    "Le chat est",
    "1, 1, 2, 3, 5, 8,",
]
MAX_TOKENS = 20
STATE: dict = {}  # what the tests may look at behind the app (the learner's state folder)
KEY, TINY_KEY, ADMIN_KEY, SOLO_KEY, ISO_KEY = "sk-test-alice", "sk-test-tiny", "sk-test-ops", "sk-test-solo", "sk-test-iso"


@pytest.fixture(scope="package")
def server(tmp_path_factory):
    """The shipped serve_config.yaml with two draft replicas (to see a broadcast reach both) and a
    max_tokens limit above the model's context (to reach the engine's own context check)."""
    doc = yaml.safe_load(launch.DEFAULT_CONFIG.read_text())
    app = doc["applications"][0]
    app["args"]["ingress"]["max_tokens_limit"] = 9000
    app["args"]["ingress"]["max_in_flight"] = 12  # the shedding test goes past it; the others stay below
    app["args"]["learner"]["state_dir"] = STATE["learner_dir"] = str(tmp_path_factory.mktemp("learner"))
    # rounds of 2 steps after every 8 records, and a gate that publishes any finite update: what is
    # tested here is the path (records -> rounds -> object store -> every replica), not the gate
    app["args"]["learner"]["trainer"].update(train_every=8, steps_per_round=2, gate_margin=1.0, holdout_fraction=0.2)
    app["args"]["learner"]["background"]["quiet_s"] = 0  # rounds as records come, not in gaps of traffic
    # at nice 19 the learner thread waits whenever the other core's tests keep it busy: the rounds these
    # tests wait for could take minutes (its niceness is tested in tests/unit/test_background.py)
    app["args"]["learner"]["background"]["nice"] = 0
    app["args"]["router_save_s"] = 5.0
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # the other core runs the in-process tests meanwhile: two OpenMP threads would stall
        # whenever it is busy (as the module-level note in tests/conftest.py says), so the target takes one
        app["args"]["target"]["num_threads"] = 1
    app["args"]["auth"] = {"keys": [
        {"tenant": "alice", "key_sha256": digest(KEY), "limits": {"requests_per_minute": 10_000, "max_concurrent": 16}},
        {"tenant": "tiny", "key_sha256": digest(TINY_KEY), "limits": {"requests_per_minute": 1}},
        {"tenant": "ops", "key_sha256": digest(ADMIN_KEY), "admin": True},
        {"tenant": "solo", "key_sha256": digest(SOLO_KEY), "limits": {"max_concurrent": 1}},
        {"tenant": "iso", "key_sha256": digest(ISO_KEY), "isolate_training": True},
    ], "isolate_training": False}  # tenants share drafts but for iso (isolation is the default)
    for d in app["deployments"]:
        if d["name"] == "DraftPool":
            d.pop("autoscaling_config", None)
            d["num_replicas"] = 2
    cfg_path = tmp_path_factory.mktemp("serve") / "serve_config.yaml"
    cfg_path.write_text(yaml.safe_dump(doc))
    url = launch.start(cfg_path, port=free_port(), temp_dir=str(tmp_path_factory.mktemp("ray")))
    # the split placement as a second application on the same cluster, under /split
    from ray import serve

    from config import AppConfig
    from deployments.app import build

    # ... whose drafts are the other proposers: suffix tree, prompt lookup and a feature-conditioned
    # draft (reading the target's features in the replica), chosen per step by the controller
    engine = {**app["args"]["engine"], "draft": {"kind": "feature", "proposers": ["suffix", "ngram", "draft"],
                                                 "select": "controller", "controller": {"probe_every": 2}}}
    split = AppConfig.model_validate({**app["args"], "engine": engine, "placement": "split", "learner": {"enabled": False}})
    small = {"ray_actor_options": {"num_cpus": 0.1}}
    serve.run(build(split, {"Ingress": small, "Router": small, "DraftPool": small, "Target": small}), name="split",
              route_prefix="/split")
    yield url
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="package")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def reference():
    """The in-process target alone (no draft), raw prompts as /v1/completions takes them."""
    engine = build_engine(EngineConfig(draft=DraftConfig(proposers=[]), chat_template=False), calibrate=False)
    return engine


def _target_only(engine, prompt: str) -> str:
    return engine.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS)).text


def _call(url: str, body=None, raw: bool = False, key: str | None = KEY, method: str | None = None) -> tuple[int, dict, dict]:
    """(status, JSON body, headers: case-insensitive); GET without a body, POST with one."""
    data = None if body is None else body if raw else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def _post(url: str, body, raw: bool = False) -> tuple[int, dict]:
    return _call(url, body, raw)[:2]



def scrape(url: str, key: str = ADMIN_KEY) -> dict[tuple, float]:
    """``/metrics`` as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **where) -> float:
    """The sum of a sample's series whose labels match ``where``."""
    return sum(v for (n, labels), v in samples.items() if n == name
               and all(dict(labels).get(k) == w for k, w in where.items()))
