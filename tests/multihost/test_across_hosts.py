"""pdserve across hosts: the disaggregated app on a testbed of namespace hosts (1 head + prefill
hosts + decode hosts, each its own Ray node at its own address), deployed through the head's
dashboard like `serve deploy`, used through the head's ingress like a client would.

- a loopback redis_url is refused at start-up on a multi-node cluster, saying what to change;
- each pool's replicas run only on its own hosts (Serve's replica -> node placement);
- greedy output through the head's ingress equals transformers, streamed and not;
- the head's Redis index is written by the workers on the other hosts, and a shared prefix is
  routed to the prefill host that holds it;
- a transfer's bytes cross the decode host's link (and not the head's): the KV goes host to host
  over the pair group's own addresses;
- the prefill host's link goes down during transfers and comes back: every request in flight
  completes (by recompute) with the same text, then transfers resume over a recreated pair group.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.integration.conftest import wait_idle
from tests.multihost.conftest import APP, MODEL_NAME
from tests.unit.engine_helpers import hf_greedy, random_prompts

pytestmark = pytest.mark.timeout(900)
MAX_TOKENS = 12


def expected_text(model_dir: str, prompt: list[int], n: int = MAX_TOKENS) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).decode(
        hf_greedy(model_dir, tuple(prompt), n), skip_special_tokens=True
    )


def complete(base: str, prompt, max_tokens: int = MAX_TOKENS, timeout: float = 180, **extra) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=timeout)


def all_decode_pairs(base: str, wait_s: float = 30.0) -> list[dict]:
    """The status's pair rows, read once every decode replica answers its stats call.

    A pair's counters live on its decode replica, and the status leaves out the rows of a replica
    whose stats call did not answer in time (a loaded machine): a read then would lose counters,
    so it is read again until all answer, up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        status = httpx.get(f"{base}/v1/cluster/status", timeout=30).json()
        decode = status["pools"].get("decode") or []
        unread = {r.get("worker_id"): r.get("error") for r in decode if not r.get("healthy")}
        if not unread:
            return status["pairs"]
        assert time.monotonic() < deadline, f"decode replicas' stats unreadable for {wait_s:.0f}s: {unread}"
        time.sleep(0.5)


def pair_totals(base: str, prefill_ids: set[str] | None = None) -> dict[str, int]:
    """Transfers, failures and recomputes over the prefill -> decode pairs (decode's counters),
    all of them or those of the prefill replicas `prefill_ids`."""
    pairs = all_decode_pairs(base)
    pairs = [p for p in pairs if prefill_ids is None or p["prefill"] in prefill_ids]
    return {
        key: sum(p.get(key, 0) for p in pairs)
        for key in ("transfers", "transfer_failures", "recomputed_prefills", "pair_groups")
    }


def pair_rows(base: str, prefill_ids: set[str] | None = None) -> dict[tuple[str, str], dict]:
    """{(prefill id, decode id): that pair's counters} from the cluster status."""
    pairs = all_decode_pairs(base)
    return {(p["prefill"], p["decode"]): p for p in pairs if prefill_ids is None or p["prefill"] in prefill_ids}


def replica_placement(testbed) -> dict[str, dict[str, str]]:
    """{deployment: {replica id: node IP}} from Serve's replica actors (the state API over the
    head's dashboard)."""
    from ray.util.state import list_actors, list_nodes

    nodes = {
        n.node_id: n.node_ip
        for n in list_nodes(
            address=testbed.dashboard_url, raise_on_missing_output=False, filters=[("state", "=", "ALIVE")]
        )
    }
    placed: dict[str, dict[str, str]] = {}
    for actor in list_actors(
        address=testbed.dashboard_url, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False
    ):
        if actor.class_name.startswith(f"ServeReplica:{APP}:"):
            deployment = actor.class_name.rsplit(":", 1)[1]
            placed.setdefault(deployment, {})[actor.name.rsplit("#", 1)[1]] = nodes[actor.node_id]
    return placed


@pytest.fixture(scope="module")
def app(testbed, wide_tiny_model) -> str:
    """The app, pools pinned to their hosts, Redis on the head's address; its base URL."""
    config = testbed.serve_config(
        wide_tiny_model, served_model_name=MODEL_NAME, num_kv_blocks=256, transfer_timeout_s=5.0, lease_ttl_s=20.0
    )
    started = time.monotonic()
    testbed.deploy(config)  # replaces whatever was deployed (the loopback app of the first test)
    print(f"\napp running in {time.monotonic() - started:.1f}s at {testbed.http_url}")
    yield testbed.http_url
    wait_idle(testbed.http_url, timeout_s=60)  # every replica's blocks back to free once traffic stops


def test_a_loopback_redis_url_is_refused_on_a_multi_node_cluster(testbed, wide_tiny_model):
    config = testbed.serve_config(wide_tiny_model, redis_url="redis://127.0.0.1:6380/0")
    config["applications"][0].update(name="loopback", route_prefix="/loopback")
    status = testbed.deploy(config, "loopback", want=("DEPLOY_FAILED",), timeout_s=240)
    message = status["message"]
    assert "redis_url redis://127.0.0.1:6380/0 names the loopback address" in message, message[-2000:]
    assert f"this Ray cluster has {len(testbed.hosts)} nodes" in message
    assert "Set redis_url to an address every node can reach" in message


def test_each_pool_runs_only_on_its_own_hosts(app, testbed):
    placed = replica_placement(testbed)
    print(f"\nreplica placement: {placed}")
    for role in ("prefill", "decode"):
        hosts = sorted(h.ip for h in testbed.role(role))
        assert sorted(placed[role].values()) == hosts, (role, placed)  # one replica per host of its role, nowhere else
    assert set(placed["ingress"].values()) <= {h.ip for h in testbed.hosts}
    status = httpx.get(f"{app}/v1/cluster/status", timeout=30).json()
    assert {r["worker_id"] for r in status["pools"]["prefill"]} == set(placed["prefill"])
    for role in ("prefill", "decode"):  # status shows each replica at its node's address
        assert {r["worker_id"]: r["node_ip"] for r in status["pools"][role]} == placed[role]


def test_greedy_output_through_the_heads_ingress_equals_transformers(app, wide_tiny_model):
    client = openai.OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0, timeout=180)
    prompts = random_prompts((5, 37, 150, 16, 64, 90, 211, 33), seed=61)
    for prompt in prompts:
        expected_ids = hf_greedy(wide_tiny_model, tuple(prompt), MAX_TOKENS)
        expected = expected_text(wide_tiny_model, prompt)
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].text == expected
        assert out.usage.completion_tokens == len(expected_ids) and out.usage.prompt_tokens == len(prompt)
        chunks = list(
            client.completions.create(
                model=MODEL_NAME,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        assert chunks[-1].usage.completion_tokens == len(expected_ids)


def test_a_shared_prefix_routes_to_the_prefill_host_that_holds_it(app, testbed, wide_tiny_model):
    """The prefill workers on the prefill hosts publish their blocks to the head's Redis; the
    router reads them there and sends every prompt sharing a cached prefix to its holder."""
    import redis

    placement = replica_placement(testbed)["prefill"]
    clients = redis.Redis(host=testbed.head.ip, port=6380).client_list()
    client_ips = {c["addr"].rsplit(":", 1)[0] for c in clients}
    print(f"\nthe index's Redis ({testbed.redis_url}) has clients from {sorted(client_ips)}")
    assert {h.ip for h in testbed.hosts if h.role != "head"} <= client_ips  # every worker host writes to it

    def prefill_rows() -> dict[str, dict]:
        status = httpx.get(f"{app}/v1/cluster/status", timeout=30).json()
        return {r["worker_id"]: r for r in status["pools"]["prefill"]}

    prefix = random_prompts((160,), seed=65)[0]  # 10 blocks
    # 64-token suffixes: the decode replica that ran the first request holds 10 of the next one's
    # 14 blocks, below the share at which decode skips prefill (SKIP_PREFILL_FRACTION).
    suffixes = random_prompts((64,) * 5, seed=66)
    before = prefill_rows()
    resp = complete(app, prefix + suffixes[0])
    assert resp.status_code == 200, resp.text
    after = prefill_rows()
    ran = [rid for rid in after if after[rid]["prefix_queries"] > before.get(rid, {}).get("prefix_queries", 0)]
    assert len(ran) == 1, (before, after)
    holder = ran[0]
    deadline = time.monotonic() + 30
    while prefill_rows()[holder]["index"]["buffered_events"] and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # the publisher's flush reaches Redis
    for suffix in suffixes[1:]:
        before = prefill_rows()
        resp = complete(app, prefix + suffix)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == expected_text(wide_tiny_model, prefix + suffix)
        after = prefill_rows()
        hits = {rid: after[rid]["prefix_hits"] - before[rid]["prefix_hits"] for rid in after}
        queries = {rid: after[rid]["prefix_queries"] - before[rid]["prefix_queries"] for rid in after}
        assert hits[holder] >= len(prefix), (holder, hits, queries)
        assert all(q == 0 for rid, q in queries.items() if rid != holder), (holder, queries)
    print(f"4 prompts sharing a 160-token prefix all went to {holder} on {placement[holder]}")


def test_a_transfer_crosses_the_decode_hosts_link_not_the_heads(app, testbed, wide_tiny_model):
    prompt = random_prompts((300,), seed=62)[0]  # 19 blocks of 128 KiB: ~2.4 MB to move
    expected = expected_text(wide_tiny_model, prompt)
    before = {h.name: testbed.link_bytes(h) for h in testbed.hosts}
    resp = complete(app, prompt, return_timing=True)
    after = {h.name: testbed.link_bytes(h) for h in testbed.hosts}
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"][0]["text"] == expected
    moved = int(body["usage"]["timing"]["transfer_bytes"])
    delta = {h.name: {k: after[h.name][k] - before[h.name][k] for k in ("rx", "tx")} for h in testbed.hosts}
    print(f"\ntransfer {moved} B; link counters during the request: {delta}")
    assert moved >= 18 * 128 * 1024
    # The KV left one prefill host and reached one decode host over their own links...
    assert max(delta[h.name]["tx"] for h in testbed.role("prefill")) >= moved
    assert max(delta[h.name]["rx"] for h in testbed.role("decode")) >= moved
    # ...and not through the head: host to host, at the addresses the KVHandle advertised.
    assert delta[testbed.head.name]["rx"] < moved


@pytest.mark.slow
def test_prefill_link_down_during_transfers_recomputes_then_transfers_resume(app, testbed, wide_tiny_model):
    # Distinct prompts: every one needs a transfer. The clients go on until a cut has made a
    # transfer fail (or the prompts run out), so a cut that lands between transfers is tried again.
    prompts = random_prompts((300,) * 40, seed=63)
    placement = replica_placement(testbed)
    prefill_ids, decode_before = placement["prefill"], set(placement["decode"])
    host_ids = {host.ip: {rid for rid, ip in prefill_ids.items() if ip == host.ip} for host in testbed.role("prefill")}
    totals_before = {ip: pair_totals(app, ids) for ip, ids in host_ids.items()}
    rows_before = pair_rows(app)
    results: dict[int, tuple[float, float, int, str]] = {}
    queue = iter(range(len(prompts)))
    lock = threading.Lock()
    enough = threading.Event()

    def client() -> None:
        while not enough.is_set():
            with lock:
                i = next(queue, None)
            if i is None:
                return
            start = time.monotonic()
            resp = complete(app, prompts[i])
            text = resp.json()["choices"][0]["text"] if resp.status_code == 200 else resp.text
            results[i] = (start, time.monotonic(), resp.status_code, text)

    prefill_hosts = testbed.role("prefill")
    for host in prefill_hosts:
        testbed.set_rate(host, "40mbit")  # ~0.5 s a transfer: the cut lands inside one
    threads = [threading.Thread(target=client) for _ in range(3)]
    cut, cut_at, restored_at, attempts = None, 0.0, 0.0, 0
    try:
        for t in threads:
            t.start()
        while attempts < 4:
            attempts += 1
            # Cut the prefill host whose link is sending at transfer speed: a transfer is on the wire.
            deadline = time.monotonic() + 60
            last = {h.name: testbed.link_bytes(h)["tx"] for h in prefill_hosts}
            cut = None
            while cut is None and time.monotonic() < deadline:
                time.sleep(0.05)
                for host in prefill_hosts:
                    now = testbed.link_bytes(host)["tx"]
                    if now - last[host.name] > 100_000:
                        cut = host
                    last[host.name] = now
            assert cut is not None, "no transfer seen on a prefill host's link within 60 s"
            testbed.set_link(cut, False)
            cut_at = time.monotonic()
            time.sleep(7.0)  # past transfer_timeout_s (5 s): the pulls in flight fail
            testbed.set_link(cut, True)
            restored_at = time.monotonic()
            # Decode counts a failure when its own wait ends; the tail of a transfer may also have
            # left just before the cut, and then nothing failed: cut again at the next transfer.
            settle = time.monotonic() + 5
            while time.monotonic() < settle:
                if pair_totals(app, host_ids[cut.ip])["transfer_failures"] > totals_before[cut.ip]["transfer_failures"]:
                    break
                time.sleep(0.2)
            else:
                print(f"\ncut {attempts} of {cut.name}: no transfer of it failed; cutting again")
                continue
            break
        enough.set()
    finally:
        enough.set()
        for host in prefill_hosts:
            testbed.set_link(host, True)
            testbed.set_rate(host, "1gbit")
        for t in threads:
            t.join(timeout=300)
    assert cut is not None
    assert results, "no request completed"
    failed = {i: r for i, r in results.items() if r[2] != 200}
    assert not failed, failed
    for i, (_, _, _, text) in results.items():
        assert text == expected_text(wide_tiny_model, prompts[i]), f"prompt {i} differs from transformers"
    in_flight = [i for i, (start, end, _, _) in results.items() if start < cut_at < end]
    assert in_flight, "no request was in flight when the link went down"
    # The pair counters live on the decode replicas: a prefill host's link must not cost one.
    decode_after = set(replica_placement(testbed)["decode"])
    assert decode_after == decode_before, f"decode replicas replaced during the cut: {decode_before} -> {decode_after}"
    cut_ids = host_ids[cut.ip]
    before = totals_before[cut.ip]
    pairs_before = {key: pair for key, pair in rows_before.items() if key[0] in cut_ids}
    during_pairs = pair_rows(app, cut_ids)
    during = pair_totals(app, cut_ids)
    print(
        f"\n{cut.name}'s link down {restored_at - cut_at:.1f}s (cut {attempts}); {len(in_flight)} requests in flight "
        f"at the cut, {len(results)} completed with the reference text; its pairs before {before}, after {during}"
    )
    assert during["transfer_failures"] > before["transfer_failures"]
    assert during["recomputed_prefills"] > before["recomputed_prefills"]
    # Transfers resume on the pairs that failed: a failed pair is torn down on both sides, so the
    # next transfer over it runs over a new group (new epoch, new rendezvous), which the pair counts
    # in `pair_groups_since_failure` (the clients above may already have made it).
    failed_pairs = {
        key
        for key, pair in during_pairs.items()
        if pair["transfer_failures"] > pairs_before.get(key, {}).get("transfer_failures", 0)
    }
    assert failed_pairs

    def regrouped(pairs: dict) -> set:
        return {key for key in failed_pairs if pairs[key]["pair_groups_since_failure"] >= 1}

    # Bursts of concurrent requests: with two prefill hosts, idle replicas tie on load and a lone
    # request may keep going to the other one.
    deadline = time.monotonic() + 90
    resumed_pairs = during_pairs
    fresh = iter(random_prompts((300,) * 60, seed=64))

    def answer(answers: dict[int, httpx.Response], i: int, prompt) -> None:
        answers[i] = complete(app, prompt)

    while not regrouped(resumed_pairs) and time.monotonic() < deadline:
        burst = [next(fresh) for _ in range(4)]
        answers: dict[int, httpx.Response] = {}
        # A sender still running after its join timeout writes into its own burst's answers.
        senders = [threading.Thread(target=answer, args=(answers, i, prompt)) for i, prompt in enumerate(burst)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(timeout=300)
        for i, prompt in enumerate(burst):
            assert answers[i].status_code == 200, answers[i].text
            assert answers[i].json()["choices"][0]["text"] == expected_text(wide_tiny_model, prompt)
        resumed_pairs = pair_rows(app, cut_ids)
    print(
        f"failed pairs {sorted(failed_pairs)}: before {[pairs_before.get(k) for k in sorted(failed_pairs)]}, "
        f"now {[resumed_pairs[k] for k in sorted(failed_pairs)]} ({time.monotonic() - restored_at:.1f}s after the "
        f"link came back)"
    )
    assert regrouped(resumed_pairs), "no failed pair transferred again over a new group after its link came back"
