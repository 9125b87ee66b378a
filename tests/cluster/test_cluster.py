"""The same application on a two-node Ray cluster (both nodes on this machine, loopback only):
custom resources put the target on the head node and the learner on the second node, with one
draft replica on each. Requests cross nodes; a published update reaches both draft replicas."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import urllib.request

import pytest

from conftest import free_port
from config import AppConfig
from deployments.launch import RAY_ENV

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def cluster():
    os.environ.update(RAY_ENV)
    # short: Ray's socket paths under it must stay below AF_UNIX's 107 bytes (pytest's tmp_path under
    # xdist, /tmp/pytest-of-<user>/pytest-N/popen-gwN/..., leaves too little room)
    tmp = tempfile.mkdtemp(prefix="osdray")
    os.environ["RAY_TMPDIR"] = tmp
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    # ray.cluster_utils gives each node a 150 MiB object store by default, less than one draft's
    # weights (255 MB): the broadcast would spill to disk and fail when the disk is 95% full.
    store = 1 << 30
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"tgt": 1, "pool": 1},
                                                       "include_dashboard": False, "object_store_memory": store})
    c.add_node(num_cpus=2, resources={"drf": 1, "pool": 1}, object_store_memory=store)
    c.wait_for_nodes()
    ray.init(address=c.address)
    yield c
    serve.shutdown()
    ray.shutdown()
    c.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


def test_two_nodes_requests_and_broadcast(cluster, tmp_path):
    import ray
    from ray import serve

    from deployments.app import build

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cfg = AppConfig(placement="split", learner={"state_dir": str(tmp_path / "learner")})  # the target on a node of its own
    options = {
        "Target": {"ray_actor_options": {"num_cpus": 0.5, "resources": {"tgt": 0.5}}},
        "DraftPool": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.25, "resources": {"pool": 1}}},
        "Learner": {"ray_actor_options": {"num_cpus": 0.25, "resources": {"drf": 0.5}}},
        "Router": {"ray_actor_options": {"num_cpus": 0.25}},
        "Ingress": {"ray_actor_options": {"num_cpus": 0.25}},
    }
    serve.run(build(cfg, options), name="osd", route_prefix="/")

    # where the replicas landed
    handle = serve.get_deployment_handle
    pool_nodes = set(handle("DraftPool", "osd").broadcast("node_id").results())
    target_node = handle("Target", "osd").node_id.remote().result()
    learner_node = handle("Learner", "osd").node_id.remote().result()
    assert len(pool_nodes) == 2  # one draft replica per node
    assert target_node != learner_node and {target_node, learner_node} == pool_nodes

    body = json.dumps({"prompt": "def square(x):", "max_tokens": 12, "temperature": 0}).encode()
    for _ in range(3):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        assert out["choices"][0]["text"] and out["usage"]["speculative"]["steps"] >= 1

    pool = serve.get_deployment_handle("DraftPool", "osd")
    state = _draft_state(cfg)
    assert pool.broadcast("load_weights", "general", [ray.put(state)], 5).results() == [5, 5]
    with urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}),
            timeout=120) as r:
        assert json.loads(r.read())["usage"]["speculative"]["draft_version"] == 5


def _draft_state(cfg: AppConfig) -> dict:
    """The base draft's weights as numpy arrays (what a learner would publish)."""
    from drafts.build import build_proposer
    from speculative.models import load_tokenizer, load_weights

    target = load_weights(cfg.engine.model)
    proposer = build_proposer(cfg.engine.draft, target, load_tokenizer(cfg.engine.model.name))
    return {k: v.numpy() for k, v in proposer.draft.runner.model.state_dict().items()}
