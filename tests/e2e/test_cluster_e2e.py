"""Several models on a two-node Ray cluster, deployed the way `serve_config.cluster.yaml` lays it
out (each model its own Serve application, the gateway naming them) with the `serve deploy`
CLI: every protocol lists both models and routes by name, replicas land on the nodes their
resources name, the autoscaled model goes up under a burst and back down after it, and a
redeploy that removes one model costs the other no failed request and no restart. The deploys,
the status and the listing are the README's own commands (``tests.readme_cluster``).

The cluster runs in a subprocess (``tests.e2e.cluster_models``) so it never meets the test
session's Ray instance; the replica counts it saw are printed into the test log."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.cluster_models import A, B


@pytest.fixture(scope="module")
def cluster_run() -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.e2e.cluster_models"],
                          capture_output=True, text=True, timeout=1200)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.stdout[-2000:], done.stderr[-4000:])
    result = json.loads(lines[-1].removeprefix("RESULT "))
    print("cluster run:", json.dumps({k: v for k, v in result.items() if k != "asks"}))
    return result


def test_two_nodes_and_both_models_listed_by_every_protocol(cluster_run):
    """Deployed, checked and listed with the README's own commands ("On a Ray cluster")."""
    asks = cluster_run["asks"]
    assert cluster_run["nodes"] == 2
    assert cluster_run["readme_status"] == {"model-tiny-a": "RUNNING",
                                            "model-tiny-b": "RUNNING", "gateway": "RUNNING"}
    assert asks["openai_models"] == asks["lmi_models"] == sorted([A, B])
    assert asks[A]["mindie_listing"] == asks[B]["mindie_listing"] == 200


def test_every_protocol_routes_by_model_name(cluster_run):
    """Greedy continuations: each protocol gives a model's own text (the same on OpenAI,
    MindIE, LMI and, for the model it serves, TGI), and the two random models differ."""
    asks = cluster_run["asks"]
    for model in (A, B):
        got = asks[model]
        assert got["openai"] == got["mindie"] == got["lmi"], got
        assert got["openai"], got
        assert got["lmtp_tokens"] >= 1
    assert asks[A]["openai"] != asks[B]["openai"]
    assert asks["tgi"] == asks[A]["openai"]
    status, keys = asks["unknown_model"]
    assert status == 404 and keys == ["error"]


def test_replicas_and_stages_land_where_their_resources_are(cluster_run):
    placement = cluster_run["placement"]
    head = placement["head"]
    # llm_gateway_cpu_engine: the head only. Every replica of A there; how many there are is
    # the autoscaler's (the requests before this snapshot may have added one; CI saw two).
    assert placement["a_replicas"] and set(placement["a_replicas"]) == {head}
    assert len(placement["b_replicas"]) == 2           # two fixed replicas
    # pipeline_stage: the worker only; 2 replicas x 2 stages.
    assert len(placement["b_stages"]) == 4
    assert all(node != head for node in placement["b_stages"])


def test_the_autoscaled_model_goes_up_under_a_burst_and_back_down(cluster_run, request):
    scaling = cluster_run["autoscaling"]
    counts = [n for _, n in scaling["timeline"]]
    # Into the test log itself (not captured): when the count changed, per Serve's status.
    changes = [(t, n) for i, (t, n) in enumerate(scaling["timeline"])
               if i == 0 or n != scaling["timeline"][i - 1][1]]
    request.config.pluginmanager.get_plugin("terminalreporter").write_line(
        f"\nmodel {A} RUNNING replicas (seconds since the burst began, count) at each change: "
        f"{changes}; burst ended at {scaling['burst_end_s']} s, "
        f"{scaling['burst_requests']} requests; all replica states at each change: "
        f"{scaling['states']}")
    assert scaling["burst_statuses"] == [200] and scaling["burst_requests"] > 0
    assert counts[0] == 1
    assert max(counts) == 2
    up_at = next(t for t, n in scaling["timeline"] if n == 2)
    assert up_at < scaling["burst_end_s"]
    assert counts[-1] == 1


def test_removing_a_model_costs_the_other_nothing(cluster_run):
    redeploy = cluster_run["redeploy"]
    # Model A's replica and stage actor live through the redeploy (none restarted). The client
    # asking A meanwhile may make A's autoscaler add a replica, which is not a cost of removing B.
    assert redeploy["a_actors_before"] and set(redeploy["a_actors_before"]) <= set(
        redeploy["a_actors_after"])
    assert set(redeploy["a_statuses"]) == {"200"}, (redeploy["a_statuses"], redeploy["a_odd"])
    # The gateway itself was redeployed (its args changed): a new ingress replica.
    assert len(redeploy["ingress_after"]) == 1
    assert redeploy["ingress_before"] != redeploy["ingress_after"]
    assert redeploy["b_after"][0] == 404
