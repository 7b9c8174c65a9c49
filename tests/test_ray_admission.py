"""``feather-serve --replicas N --data-plane ray --admission RULE``: each engine replica decides with its
own rule before its engine sees the request, and the ingress sends a request one replica shed to
another, with what is left of its TTFT SLO. Ray's objects and vLLM's serving classes are stood in for
(nothing of Ray Serve runs, no engine starts)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="the [cluster] extra (ray[serve]) is not installed")

from scheduler_runtime.serving import cluster, cluster_base  # noqa: E402
from scheduler_runtime.serving.admission_http import (  # noqa: E402
    ADMISSION_HEADER,
    ENV_VAR,
    AdmissionGate,
    AdmissionSettings,
)

#: 1 ms per prompt token on an idle engine: a 900-token prompt takes ~0.9 s
STEP_MODEL = {"features": ["const", "requests", "tokens", "decode_kv", "prefill_attn"],
              "coef": [0.0, 0.0, 1e-3, 0.0, 0.0]}


def _settings(rule: str, ttft_ms: float = 2000) -> AdmissionSettings:
    return AdmissionSettings(rule=rule, slos={"ttft": ttft_ms}, token_budget=4096, step_model=STEP_MODEL)


class _Stream:
    """vLLM's stream of a completion, its first chunk held until ``go`` is set."""

    def __init__(self, go: asyncio.Event) -> None:
        self.go = go
        self.closed = False
        self.sent = 0

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> str:
        await self.go.wait()
        if self.sent == 2:
            raise StopAsyncIteration
        self.sent += 1
        return "data: {}\n\n" if self.sent == 1 else "data: [DONE]\n\n"

    async def aclose(self) -> None:
        self.closed = True


def _replica(gate: AdmissionGate, streams: list[_Stream], go: asyncio.Event) -> Any:
    async def create_completion(request: Any, raw: Any) -> _Stream:
        streams.append(_Stream(go))
        return streams[-1]

    serving = SimpleNamespace(create_completion=create_completion)
    return SimpleNamespace(replica_id="r0", rank=0, admission=gate,
                           state=SimpleNamespace(openai_serving_completion=serving))


async def _drain(replica: Any, token: int = 5, **kwargs: Any) -> list[Any]:
    """One streamed request of 900 tokens ``token`` (distinct tokens: no prefix shared)."""
    body = {"model": "tiny-llama", "prompt": [token] * 900, "max_tokens": 2, "stream": True}
    rendered = [{"prompt_token_ids": [token] * 900}]
    return [x async for x in cluster.EngineReplica.generate(replica, "completion", body, rendered, **kwargs)]


def test_a_replica_rejects_by_its_own_rule_before_its_engine_sees_the_request():
    async def main() -> None:
        gate, streams, go = AdmissionGate(_settings("slo")), [], asyncio.Event()
        replica = _replica(gate, streams, go)
        first = [asyncio.ensure_future(_drain(replica, t)) for t in (5, 6)]  # ~0.9 s and ~1.8 s predicted
        await asyncio.sleep(0.05)
        rejected = await asyncio.wait_for(_drain(replica, 7), 5.0)  # ~2.7 s > 2 s: rejected, never created
        assert len(streams) == 2 and rejected[0] == {"replica": "r0", "rank": 0}
        answer = rejected[1]
        assert answer["status"] == 503 and answer["headers"][ADMISSION_HEADER] == "slo"
        assert int(answer["headers"]["retry-after"]) >= 1 and answer["json"]["error"]["type"] == "overloaded"
        # a client's tighter SLO (what another replica left of it) rejects sooner
        tight = await asyncio.wait_for(_drain(replica, 8, slos={"ttft": 1000.0}), 5.0)
        assert tight[1]["headers"][ADMISSION_HEADER] == "slo"  # ~2.7 s > 1 s
        go.set()
        served = await asyncio.wait_for(asyncio.gather(*first), 5.0)
        assert all(s[1] == {"status": 200, "stream": True} and s[-1] == "data: [DONE]\n\n" for s in served)
        assert len(gate.controller) == 0 and gate.controller.stats.admitted == 2
        assert gate.controller.stats.rejected["slo"] == 2

    asyncio.run(main())


def test_the_deadline_rule_aborts_a_waiting_stream_with_an_error_event_and_closes_it():
    async def main() -> None:
        gate, streams, go = AdmissionGate(_settings("deadline", ttft_ms=1000)), [], asyncio.Event()
        out = await asyncio.wait_for(_drain(_replica(gate, streams, go)), 5.0)  # its first token never comes
        assert out[1] == {"status": 200, "stream": True}
        error = json.loads(out[2].split("\n\n")[0].removeprefix("data: "))
        assert error["error"]["type"] == "deadline" and out[2].endswith("data: [DONE]\n\n")
        assert streams[0].closed and gate.controller.stats.aborted == 1 and len(gate.controller) == 0

    asyncio.run(main())


class _Handle:
    """The engine deployment's handle: each call goes to the next replica of ``answers`` (a rank's
    answer after its header), and records its keyword arguments."""

    def __init__(self, answers: list[dict[str, Any]]) -> None:
        self.answers = answers
        self.calls: list[dict[str, Any]] = []

    def options(self, **_: Any) -> _Handle:
        return self

    @property
    def generate(self) -> _Handle:
        return self

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        rank = len(self.calls)
        self.calls.append(kwargs)
        items = [{"replica": f"r{rank}", "rank": rank}, self.answers[rank]]

        class Gen:
            def __aiter__(self) -> Gen:
                return self

            async def __anext__(self) -> Any:
                if not items:
                    raise StopAsyncIteration
                return items.pop(0)

            def cancel(self) -> None:
                items.clear()

        return Gen()


def _shed(retry_after: int) -> dict[str, Any]:
    return {"status": 503, "json": {"error": {"type": "overloaded", "message": f"retry {retry_after}"}},
            "headers": {"retry-after": str(retry_after), ADMISSION_HEADER: "slo"}}


def _ingress(answers: list[dict[str, Any]], replicas: int, reroute_shed: bool = False) -> Any:
    async def render_completion(request: Any) -> Any:
        return [{"prompt_token_ids": [5] * 64}]

    ingress = SimpleNamespace(state=SimpleNamespace(online_renderer=SimpleNamespace(
        render_completion=render_completion)), hasher=cluster.PrefixHasher(16), learns=False,
        reads_wait=False, router_name="prefix", engine=_Handle(answers), stats=cluster_base.FrontEndStats(),
        replicas=replicas, ttft_slo_ms=2000.0, reroute_shed=reroute_shed)
    ingress._shed_answer = lambda shed, attempts: cluster.FeatherIngress._shed_answer(ingress, shed, attempts)
    return ingress


def test_with_reroute_shed_the_ingress_sends_a_shed_request_to_another_replica_with_what_is_left_of_ttft():
    ok = {"status": 200, "json": {"choices": [{"text": "hi"}]}}
    ingress = _ingress([_shed(3), ok], replicas=2, reroute_shed=True)
    body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 1}
    answer = asyncio.run(cluster.FeatherIngress.serve_request(ingress, "completion", body, {"ttft": 1500.0}))
    assert answer.status_code == 200 and answer.headers["x-feather-attempts"] == "2"
    first, second = ingress.engine.calls
    assert first["slos"] == {"ttft": 1500.0} and first["avoid"] == []
    assert 0 < second["slos"]["ttft"] <= 1500.0 and second["avoid"] == ["r0"]
    assert ingress.stats.shed == {"rerouted": 1} and ingress.stats.counts[("0", "shed")] == 1
    assert not ingress.stats.errors  # a shed is not an error

    # every replica sheds it: the rejection that lets it retry soonest, once
    ingress = _ingress([_shed(5), _shed(2)], replicas=2, reroute_shed=True)
    answer = asyncio.run(cluster.FeatherIngress.serve_request(ingress, "completion", body))
    assert answer.status_code == 503 and answer.headers["retry-after"] == "2"
    assert answer.headers["x-feather-attempts"] == "2"
    assert json.loads(answer.body)["error"]["message"] == "retry 2"
    assert ingress.stats.shed == {"rejected": 1} and not ingress.stats.errors


def test_by_default_the_first_replicas_rejection_is_the_answer():
    ok = {"status": 200, "json": {"choices": [{"text": "hi"}]}}
    ingress = _ingress([_shed(3), ok], replicas=2)  # the default
    body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 1}
    answer = asyncio.run(cluster.FeatherIngress.serve_request(ingress, "completion", body))
    assert answer.status_code == 503 and answer.headers["retry-after"] == "3"
    assert answer.headers["x-feather-attempts"] == "1" and len(ingress.engine.calls) == 1
    assert ingress.stats.shed == {"rejected": 1} and ingress.stats.counts[("0", "shed")] == 1


def test_the_settings_reach_every_deployment_through_the_environment():
    assert ENV_VAR in cluster.FORWARDED_ENV
