"""``--data-plane ray --router prefix-learned``: the Ray Serve router that learns each replica's speed and
KV, fed by the replicas' routing stats and by the responses the ingress relays. Ray's objects are
stood in for (nothing of Ray Serve runs, no engine starts)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="the [cluster] extra (ray[serve]) is not installed")

from scheduler_runtime.learned_router import LearnedRouter  # noqa: E402
from scheduler_runtime.serving import cluster, cluster_base  # noqa: E402
from scheduler_runtime.serving.ray_router import LearnedRequestRouter  # noqa: E402
from scheduler_runtime.serving.serve import vllm_arguments  # noqa: E402

SAMPLE = Path(__file__).resolve().parent / "data" / "vllm_metrics_sample.txt"


def _replica(rid: str, blocks: int, seq: int = 1) -> Any:
    stats = {"seq": seq, "metrics": {"vllm:cache_config_info": {"num_gpu_blocks": blocks, "block_size": 16}}}
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats=stats)


def _request(rid: str, tokens: int = 600) -> Any:
    return SimpleNamespace(kwargs={"route": [11, 12], "rid": rid, "tokens": tokens},
                           metadata=SimpleNamespace(internal_request_id="internal-" + rid))


@pytest.fixture
def router():
    args, _ = vllm_arguments([])
    config = cluster.ClusterConfig(replicas=2, router="prefix-learned", data_plane="ray",
                                   vllm_args=tuple(args), scrape_period_s=10.0)
    app = cluster.build_app(config)  # nothing started
    engine = app._bound_deployment.init_args[0]._bound_deployment
    rc = engine._deployment_config.request_router_config
    assert rc.request_router_class.endswith("LearnedRequestRouter")
    assert rc.request_routing_stats_period_s == 10.0  # --scrape-period: Ray's routing-stats period
    assert "kv_tokens" not in rc.request_router_kwargs  # told nothing: it reads each replica's KV
    r = LearnedRequestRouter.__new__(LearnedRequestRouter)  # Ray's constructor needs a running Serve
    r.initialize_state(**rc.request_router_kwargs)
    try:
        yield r
    finally:
        cluster_base.LIVE_ROUTERS.remove(r)


def test_it_reads_each_replicas_kv_from_its_routing_stats_and_learns_from_the_relayed_responses(router):
    assert isinstance(router.affinity, LearnedRouter)
    replicas = [_replica("a", 1024), _replica("b", 256)]
    ranks = asyncio.run(router.choose_replicas(replicas, _request("r1")))
    choice = ranks[0][0].replica_id.unique_id
    est = router.estimates()
    assert est["a"]["kv_tokens"] == 1024 * 16 and est["b"]["kv_tokens"] == 256 * 16
    router.on_request_routed(_request("r1"), ranks[0][0].replica_id, None)
    assert router.affinity._requests["r1"][0] == choice and router.in_flight[choice] == 1
    # the ingress saw its first token, then its end with 8 output tokens (its loop is gone: direct)
    router.relayed("r1", first_token=True)
    router.relayed("r1", finished=True, output_tokens=8)
    est = router.estimates()[choice]
    assert est["prefill_samples"] == 1 and est["decode_samples"] == 1 and est["decode_tok_s"] > 0
    router.relayed("unknown", finished=True, output_tokens=3)  # not one of its requests: ignored
    # the same stats again are not read again; a new reading is (a replica that grew, say)
    router.affinity._set_kv = lambda *a: pytest.fail("read twice")  # type: ignore[method-assign]
    asyncio.run(router.choose_replicas(replicas, _request("r2")))
    del router.affinity._set_kv
    asyncio.run(router.choose_replicas([_replica("a", 2048, seq=2), replicas[1]], _request("r3")))
    assert router.estimates()["a"]["kv_tokens"] == 2048 * 16


def test_what_the_ingress_relays_reaches_the_router_in_its_own_loop(router):
    """Ray runs the router in a loop of its own thread: a call from the ingress's thread is handed over."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        replicas = [_replica("a", 64), _replica("b", 64)]
        chosen = asyncio.run_coroutine_threadsafe(router.choose_replicas(replicas, _request("r1")), loop)
        ranks = chosen.result(5)
        loop.call_soon_threadsafe(router.on_request_routed, _request("r1"), ranks[0][0].replica_id, None)
        seen: list[str] = []
        prefilled = router.affinity.prefilled
        router.affinity.prefilled = lambda rid: (seen.append(threading.current_thread().name), prefilled(rid))
        router.relayed("r1", first_token=True)  # from this thread
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(5)  # let the loop run it
        assert seen == [thread.name]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_an_engine_replica_publishes_its_metrics_as_routing_stats(monkeypatch):
    replica = SimpleNamespace(rank=1, _stats_seq=0, _prom_dir="", _own_registry=False)  # no engine
    monkeypatch.setattr(cluster, "_metrics_text", lambda *_: SAMPLE.read_text())
    record = cluster.EngineReplica.record_routing_stats
    first, second = record(replica), record(replica)
    assert first["seq"] == 1 and second["seq"] == 2 and first["rank"] == 1
    assert first["metrics"]["vllm:cache_config_info"] == {"num_gpu_blocks": 4095, "block_size": 128}
    learned = LearnedRouter()
    learned.scraped("x", first["metrics"])
    assert learned.estimates()["x"]["kv_tokens"] == 4095 * 128


def test_the_ingress_counts_a_relayed_streams_output_tokens(router):
    """The ingress's relay tells the learning router the end of a stream and its tokens (the usage block,
    else the events), and nothing of a stream that failed."""
    told: list[tuple[str, dict[str, Any]]] = []
    router.relayed = lambda rid, **what: told.append((rid, what))  # type: ignore[method-assign]
    ingress = SimpleNamespace(stats=cluster_base.FrontEndStats(), reads_wait=False)  # its relay alone

    async def stream(chunks: list[Any]) -> Any:
        for chunk in chunks:
            if isinstance(chunk, Exception):
                raise chunk
            yield chunk

    async def relay(chunks: list[Any], first: str, rid: str) -> list[str]:
        relayed = cluster.FeatherIngress._relay(ingress, stream(chunks), first, "0", rid, False, 1)
        return [c async for c in relayed]

    tokens = [f'data: {{"choices":[{{"text":"x{i}"}}]}}\n\n' for i in range(5)]
    usage = 'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":5,"total_tokens":14}}\n\n'
    out = asyncio.run(relay([*tokens[1:], usage, "data: [DONE]\n\n"], tokens[0], "with-usage"))
    assert out[0] == tokens[0] and out[-1] == "data: [DONE]\n\n"
    asyncio.run(relay([*tokens[1:], "data: [DONE]\n\n"], tokens[0], "by-events"))
    failed = asyncio.run(relay([tokens[1], RuntimeError("broken")], tokens[0], "failed"))
    assert "failed mid-stream" in failed[-2] and failed[-1] == "data: [DONE]\n\n"  # told the client
    assert told[0] == ("with-usage", {"finished": True, "output_tokens": 5, "queued_s": None})
    assert told[1] == ("by-events", {"finished": True, "output_tokens": 5, "queued_s": None})
    assert told[2] == ("failed", {"finished": True, "output_tokens": None, "queued_s": None})


def test_the_ingress_reads_a_streams_reported_wait_and_strips_the_usage_it_asked_for(router):
    """``queue_time`` on Ray Serve: the engine replicas start with ``--enable-per-request-metrics``; the
    relay reads ``metrics.queue_time_ms`` from the usage chunk, tells the router the wait before the finish
    (which amends the request's provisional prefill sample), and leaves that chunk out where the ingress
    asked for it; a stream whose client asked keeps it."""
    args, _ = vllm_arguments([])
    for mode, on in (("service", True), ("off", False)):
        config = cluster.ClusterConfig(replicas=2, router="prefix-learned", data_plane="ray",
                                       vllm_args=tuple(args), queue_time=mode)
        app = cluster.build_app(config)  # nothing started
        engine_args = app._bound_deployment.init_args[0]._bound_deployment.init_args[0]
        assert ("--enable-per-request-metrics" in engine_args) is on
        *_, reads_wait, reroute_shed = app._bound_deployment.init_args
        assert reads_wait is on and reroute_shed is False  # the ingress reads the waits; no reroute
    told: list[tuple[str, dict[str, Any]]] = []
    relayed = router.relayed
    router.relayed = lambda rid, **what: (told.append((rid, what)), relayed(rid, **what))  # type: ignore
    ingress = SimpleNamespace(stats=cluster_base.FrontEndStats(), reads_wait=True)

    async def stream(chunks: list[str]) -> Any:
        for chunk in chunks:
            yield chunk

    async def relay(chunks: list[str], first: str, rid: str, strip: bool) -> list[str]:
        relayed = cluster.FeatherIngress._relay(ingress, stream(chunks), first, "0", rid, False, 1, strip)
        return [c async for c in relayed]

    tokens = [f'data: {{"choices":[{{"text":"x{i}"}}]}}\n\n' for i in range(4)]
    usage = ('data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4,"total_tokens":13},'
             '"metrics":{"queue_time_ms":1500.0}}\n\n')
    replicas = [_replica("a", 64), _replica("b", 64)]
    for rid, strip in (("asked-by-us", True), ("asked-by-the-client", False)):
        ranks = asyncio.run(router.choose_replicas(replicas, _request(rid)))
        router.on_request_routed(_request(rid), ranks[0][0].replica_id, None)
        router.relayed(rid, first_token=True)
        out = asyncio.run(relay([*tokens[1:], usage, "data: [DONE]\n\n"], tokens[0], rid, strip))
        assert "".join(out) == "".join(tokens) + ("" if strip else usage) + "data: [DONE]\n\n"
    assert [what.get("queued_s") for _, what in told if what.get("finished")] == [1.5, 1.5]
    assert router.affinity.counts["queue_reports"] == 2 and not router.affinity._held


def test_a_client_that_leaves_after_done_was_served_and_its_stream_still_teaches(router):
    """The client has the whole answer, its ``[DONE]`` included, and leaves while the relay waits for the
    replica's stream to end: the outcome is ``ok`` and the router hears the output tokens and the wait.
    A client that leaves before ``[DONE]`` is ``client_gone`` and teaches nothing."""
    told: list[tuple[str, dict[str, Any]]] = []
    router.relayed = lambda rid, **what: told.append((rid, what))  # type: ignore[method-assign]
    ingress = SimpleNamespace(stats=cluster_base.FrontEndStats(), reads_wait=True)
    usage = ('data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11},'
             '"metrics":{"queue_time_ms":250.0}}\n\n')
    chunks = ['data: {"choices":[{"text":"x"}]}\n\n', usage, "data: [DONE]\n\n"]

    class Stream:
        """Ray's response generator, stood in for: the replica's chunks, then no end yet; ``cancel``."""

        def __init__(self) -> None:
            self.rest, self.cancelled = list(chunks[1:]), False

        def __aiter__(self) -> Any:
            return self

        async def __anext__(self) -> str:
            if self.rest:
                return self.rest.pop(0)
            await asyncio.sleep(3600)  # the replica's stream has not ended yet
            raise StopAsyncIteration

        def cancel(self) -> None:
            self.cancelled = True

    streams: list[Stream] = []

    async def leave_after(marker: str, rid: str) -> None:
        streams.append(Stream())
        relayed = cluster.FeatherIngress._relay(ingress, streams[-1], chunks[0], "0", rid, False, 1, True)

        async def consume() -> None:
            async for chunk in relayed:
                if chunk.endswith(marker):
                    await asyncio.sleep(3600)  # the client stops reading here and goes away

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        task.cancel()  # as Starlette cancels a response whose client disconnected
        with pytest.raises(asyncio.CancelledError):
            await task
        await relayed.aclose()

    asyncio.run(leave_after("data: [DONE]\n\n", "served"))
    asyncio.run(leave_after('"x"}]}\n\n', "gone"))
    assert told[0] == ("served", {"finished": True, "output_tokens": 2, "queued_s": 0.25})
    assert told[1] == ("gone", {"finished": True, "output_tokens": None, "queued_s": None})
    assert ingress.stats.counts[("0", "ok")] == 1 and ingress.stats.counts[("0", "client_gone")] == 1
    assert [s.cancelled for s in streams] == [False, True]  # only an unserved request is aborted
