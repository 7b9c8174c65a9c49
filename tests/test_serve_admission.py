"""Admission past capacity in ``feather-serve`` (scheduler_runtime/serving/admission_http.py) and in the
proxy of ``--replicas N``.

Without an engine: the middleware in front of a fake ASGI application (the reject form, never fits,
the per-request SLO headers, the bookkeeping of first bytes, ends and disconnects, the deadline
abort), the command line's usage errors and the vLLM caps it passes on, and the proxy rerouting a shed
request over in-process stand-in replicas. One end-to-end test (``engine``) bursts long prompts at a
real ``feather-serve --admission slo``.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
import sys
import time
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from serving import REPO, SMALL_SERVER, feather_serve_command, get, metric, running_server, wait_until_idle
from test_serve_cli import usage_error

from scheduler_runtime.hardware import PROFILES_DIR, machine_profile
from scheduler_runtime.router_base import ReplicaRouter
from scheduler_runtime.serving.admission_http import (
    DEFAULT_PROFILE,
    ENV_VAR,
    WATCH_PERIOD_S,
    AdmissionMiddleware,
    AdmissionSettings,
    load_tokenizer,
    prompt_tokens,
)
from scheduler_runtime.serving.proxy import ReplicaProxy
from scheduler_runtime.serving.replicas import Replica, free_port
from scheduler_runtime.serving.serve import ADMISSION_MIDDLEWARE, DEFAULT_MODEL, vllm_arguments

PROMPT = 3000  # tokens: ~0.19 s of prefill alone by cpu-tiny-llama.json's step model, at a budget of 2,048


def settings(rule: str = "slo", ttft_ms: float = 300.0, **kw: Any) -> AdmissionSettings:
    """Settings as feather-serve computes them for its default engine (budget 2,048, block 128), with
    the step model of ``cpu-tiny-llama.json`` (:data:`DEFAULT_PROFILE`, whatever this machine's is)."""
    args, _ = vllm_arguments(["--scheduler", "fcfs"])
    base = AdmissionSettings.for_server(rule, {"ttft": ttft_ms, "tpot": 100.0}, 503, args,
                                        profile=DEFAULT_PROFILE)
    return AdmissionSettings(**{**base.__dict__, **kw})


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """A fake vLLM server: each request answers once :attr:`go` is set, its body chunk by chunk (SSE) or
    whole; it stops at its client's disconnect, and records whether it was cancelled (vLLM's abort)."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.cancelled = 0
        self.disconnected = 0
        self.bodies: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        body = json.loads((await receive())["body"])
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})  # before any token
        try:
            gone = asyncio.ensure_future(receive())
            go = asyncio.ensure_future(self.go.wait())
            done, _ = await asyncio.wait({gone, go}, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:  # the client went away: vLLM aborts the request
                go.cancel()
                self.disconnected += 1
                return
            gone.cancel()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if body.get("stream"):
            await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b'{"choices": []}', "more_body": False})


class Client:
    """One request to the middleware: its messages sent, and its disconnect when asked."""

    def __init__(self, middleware: AdmissionMiddleware, body: dict, headers: dict[str, str] | None = None,
                 path: str = "/v1/completions") -> None:
        self.sent: list[dict] = []
        self.leave = asyncio.Event()
        scope = {"type": "http", "method": "POST", "path": path,
                 "headers": [(k.encode(), v.encode()) for k, v in (headers or {}).items()]}
        self.task = asyncio.ensure_future(middleware(scope, self.receive, self.send))
        self._body = json.dumps(body).encode()

    async def receive(self) -> dict:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.sent if m["type"] == "http.response.start"), None)

    @property
    def headers(self) -> dict[str, str]:
        start = next(m for m in self.sent if m["type"] == "http.response.start")
        return {k.decode(): v.decode() for k, v in start["headers"]}

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


def prompt(n: int = PROMPT, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 8000, n).tolist()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def counter(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


class FakeTokenizer:
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + [3 + (ord(c) % 50) for c in text]


def middleware(engine: FakeEngine, **kw: Any) -> AdmissionMiddleware:
    return AdmissionMiddleware(engine, settings(**kw), tokenizer=FakeTokenizer(), clock=FakeClock())


# ------------------------------------------------------------------------------------ the middleware


def test_a_request_past_capacity_is_rejected_with_retry_after_and_an_overloaded_body():
    async def main():
        engine = FakeEngine()
        mw = middleware(engine)
        rejected_before = counter("feather_admission_rejected_total", reason="slo")
        first = Client(mw, {"prompt": prompt(seed=1), "stream": True})
        await asyncio.sleep(0.01)
        assert mw.controller.num_queued == 1 and first.sent == []  # nothing before its first token
        second = Client(mw, {"prompt": prompt(seed=2)})
        await second.task
        assert second.status == 503 and engine.bodies == [{"prompt": prompt(seed=1), "stream": True}]
        assert int(second.headers["retry-after"]) >= 1 and "x-should-retry" not in second.headers
        assert second.headers["x-feather-admission"] == "slo"
        error = json.loads(second.body)["error"]
        assert error["type"] == "overloaded" and error["code"] == 503 and error["param"] is None
        assert "predicted time to first token" in error["message"] and "reason: slo" in error["message"]
        assert counter("feather_admission_rejected_total", reason="slo") == rejected_before + 1
        engine.go.set()
        await first.task
        assert first.status == 200 and first.body == b"data: {}\n\ndata: [DONE]\n\n"
        assert len(mw.controller) == 0 and mw.controller.stats.admitted == 1

    run(main())


def test_429_when_asked():
    async def main():
        mw = middleware(FakeEngine(), status=429)
        Client(mw, {"prompt": prompt(seed=1)})
        await asyncio.sleep(0.01)
        second = Client(mw, {"prompt": prompt(seed=2)})
        await second.task
        assert second.status == 429 and json.loads(second.body)["error"]["code"] == 429

    run(main())


def test_a_request_that_can_never_fit_is_told_not_to_retry():
    async def main():
        engine = FakeEngine()
        mw = middleware(engine)
        client = Client(mw, {"prompt": prompt(10_000)})  # ~1.5 s of prefill alone, over 300 ms
        await client.task
        assert client.status == 503 and client.headers["x-should-retry"] == "false"
        assert "retry-after" not in client.headers and client.headers["x-feather-admission"] == "never-fits"
        assert "cannot meet its SLOs even on an idle server" in json.loads(client.body)["error"]["message"]
        assert engine.bodies == [] and len(mw.controller) == 0

    run(main())


def test_slo_headers_only_tighten_and_a_malformed_one_is_a_400():
    async def main():
        engine = FakeEngine()
        engine.go.set()
        mw = middleware(engine)
        tight = Client(mw, {"prompt": prompt()}, {"x-slo-ttft-ms": "100"})  # under its 0.19 s alone
        await tight.task
        assert tight.status == 503 and tight.headers["x-feather-admission"] == "never-fits"
        loose = Client(mw, {"prompt": prompt(10_000)}, {"x-slo-ttft-ms": "60000"})  # does not loosen
        await loose.task
        assert loose.status == 503 and loose.headers["x-feather-admission"] == "never-fits"
        ok = Client(mw, {"prompt": prompt()}, {"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "500"})
        await ok.task
        assert ok.status == 200
        for headers in ({"x-slo-ttft-ms": "soon"}, {"x-slo-tpot-ms": "-1"}, {"x-slo-ttft-ms": "nan"}):
            bad = Client(mw, {"prompt": prompt()}, headers)
            await bad.task
            error = json.loads(bad.body)["error"]
            assert bad.status == 400 and error["type"] == "BadRequestError"
            assert re.search(r"header x-slo-t\w+-ms must be a finite number of milliseconds >= 0",
                             error["message"])
        assert len(engine.bodies) == 1 and len(mw.controller) == 0

    run(main())


def test_started_at_the_first_body_chunk_finished_at_the_end_or_disconnect():
    async def main():
        engine = FakeEngine()
        mw = middleware(engine, ttft_ms=5000.0)
        streamed = Client(mw, {"prompt": prompt(seed=1), "stream": True})
        gone = Client(mw, {"prompt": prompt(seed=2), "stream": True})
        await asyncio.sleep(0.01)
        assert mw.controller.num_queued == 2 and mw.controller.num_running == 0
        gone.leave.set()  # its client disconnects before its first token
        await gone.task
        assert engine.disconnected == 1 and gone.sent == [] and len(mw.controller) == 1
        engine.go.set()
        await streamed.task
        assert len(mw.controller) == 0 and mw.controller.stats.admitted == 2
        assert mw.controller.stats.false_admits == 0

        class Failing:
            async def __call__(self, scope, receive, send):
                await receive()
                raise RuntimeError("the engine failed")

        mw.app = Failing()
        failed = Client(mw, {"prompt": prompt(seed=3)})
        with pytest.raises(RuntimeError):
            await failed.task
        assert len(mw.controller) == 0  # nothing leaks on an error

    run(main())


def test_other_paths_and_bodies_without_a_prompt_pass_through():
    async def main():
        engine = FakeEngine()
        engine.go.set()
        mw = middleware(engine)
        for body, path in (({"prompt_embeds": "AAAA"}, "/v1/completions"),
                           ({"messages": "x"}, "/v1/chat/completions"),
                           ({"prompt": prompt(10_000)}, "/v1/embeddings")):
            client = Client(mw, body, path=path)
            await client.task
            assert client.status == 200
        assert len(engine.bodies) == 3 and mw.controller.stats.admitted == 0

    run(main())


def test_deadline_aborts_a_waiting_stream_with_an_sse_error_and_a_plain_request_with_a_504():
    async def main():
        engine = FakeEngine()
        mw = middleware(engine, rule="deadline", ttft_ms=2000.0)
        aborted_before = counter("feather_admission_aborted_total", reason="deadline")
        stream = Client(mw, {"prompt": prompt(seed=1), "stream": True})
        plain = Client(mw, {"prompt": prompt(seed=2)})
        await asyncio.sleep(0.1)  # the watcher runs: nothing is late yet
        assert not stream.task.done() and mw.controller.num_queued == 2
        mw.clock.now += 2.0  # past their latest start (deadline less their prefill alone)
        await asyncio.wait_for(asyncio.gather(stream.task, plain.task), 5)
        assert engine.cancelled == 2  # the downstream calls were cancelled: vLLM aborts them
        assert stream.status == 200 and stream.headers["content-type"].startswith("text/event-stream")
        events = stream.body.decode().split("\n\n")
        assert events[1:] == ["data: [DONE]", ""] and events[0].startswith("data: ")
        assert json.loads(events[0][6:])["error"]["type"] == "deadline"
        assert plain.status == 504 and json.loads(plain.body)["error"]["type"] == "deadline"
        stats = mw.controller.stats
        assert len(mw.controller) == 0 and stats.aborted == 2 and stats.false_admits == 2
        assert counter("feather_admission_aborted_total", reason="deadline") == aborted_before + 2
        await asyncio.sleep(2 * WATCH_PERIOD_S)
        assert mw._watcher is None  # it stops once nothing waits

    run(main())


def test_prompts_are_tokenized_as_the_engine_sees_them():
    tokenizer = load_tokenizer(str(DEFAULT_MODEL))
    text = "The quick brown fox jumps over the lazy dog. " * 20
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert prompt_tokens({"prompt": text}, False, tokenizer) == [ids]
    assert prompt_tokens({"prompt": text, "add_special_tokens": False}, False, tokenizer) == [ids[1:]]
    assert prompt_tokens({"prompt": [text, [5, 6]]}, False, tokenizer) == [ids, [5, 6]]
    assert prompt_tokens({"prompt": [[1, 2], True]}, False, tokenizer) is None
    # no chat template: the messages' contents, an approximation
    chat = prompt_tokens({"messages": [{"role": "user", "content": text}]}, True, tokenizer)
    assert chat == [ids]


def test_settings_travel_in_the_environment():
    s = settings("slo:0.5+deadline")
    assert AdmissionSettings.from_env({ENV_VAR: s.to_json()}) == s
    assert AdmissionSettings.from_env({}) is None
    assert s.block_size == 128 and s.token_budget == 2048 and s.kv_capacity_tokens > 100_000
    # without a profile named: the shipped profile of this kind of machine (else the fallback)
    args, _ = vllm_arguments(["--scheduler", "fcfs"])
    default = AdmissionSettings.for_server("slo", {"ttft": 300.0}, 503, args)
    assert default.step_model == json.loads(machine_profile().read_text())["step_model"]
    assert DEFAULT_PROFILE.parent == PROFILES_DIR and DEFAULT_PROFILE.is_file()


# ------------------------------------------------------------------------------------ the command line


@pytest.mark.parametrize("args, message", [
    (["--admission", "slo"], "needs a TTFT SLO"),
    (["--admission", "deadline", "--slo", "tpot:50"], "needs a TTFT SLO"),
    (["--admission", "slo+tpot", "--slo", "ttft:5000"], "needs a TPOT SLO"),
    (["--admission", "bogus"], "--admission: unknown admission rule 'bogus'"),
    (["--admission", "slo:0"], "slo factor must be a finite number > 0"),
    (["--admission", "queued-reqs:x"], "'x' is not an integer"),
    (["--admission", "slo", "--slo", "ttft:soon"], "--slo: goodput SLO 'ttft:soon' is not NAME:MILLISECONDS"),
    (["--admission", "slo", "--slo", "ttft:5 ttft:6"], "given twice"),
    (["--slo", "ttft:500"], "--slo is read by the slo and deadline admission rules only"),
    (["--admission-status", "500"], "invalid choice: 500"),
    (["--scheduler", "lpm~slo", "--admission", "deadline", "--slo", "ttft:1"], "give one"),
    (["--admission", "queued-reqs:3", "--max-num-queued-reqs", "4"], "sets --max-num-queued-reqs 3"),
])
def test_bad_admission_options_are_usage_errors(capsys, args, message):
    line = usage_error(["--scheduler", "fcfs", *args] if "--scheduler" not in args else args, capsys)
    assert line.startswith("feather-serve: error: ") and message in line, line


def test_admission_profile_names_the_step_model_and_a_bad_one_is_a_usage_error(capsys, tmp_path):
    base = ["--scheduler", "fcfs", "--admission", "slo", "--slo", "ttft:2000 tpot:100"]
    chosen = sorted(PROFILES_DIR.glob("*.json"))[0]
    with pytest.raises(SystemExit) as exit_info:
        vllm_arguments([*base, "--admission-profile", str(chosen), "--print-command"])
    assert exit_info.value.code == 0
    env, *_ = shlex.split(capsys.readouterr().out)
    name, value = env.split("=", 1)
    s = AdmissionSettings.from_env({name: value})
    assert s is not None and s.step_model == json.loads(chosen.read_text())["step_model"]
    not_json = tmp_path / "not.json"
    not_json.write_text("{step_model")
    no_model = tmp_path / "no-model.json"
    no_model.write_text(json.dumps({"measured_on": {}}))
    no_coef = tmp_path / "no-coef.json"
    no_coef.write_text(json.dumps({"step_model": {"features": ["const"], "coef": [0.1]}}))
    for path, message in ((tmp_path / "missing.json", "no such file"), (tmp_path, "no such file"),
                          (not_json, "cannot be read"), (no_model, "has no step_model"),
                          (no_coef, "no coefficients of the simulator's features")):
        with pytest.raises(SystemExit) as exit_info:
            vllm_arguments([*base, "--admission-profile", str(path)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        errors = [line for line in err if line.startswith("feather-serve: error: ")]
        assert errors == [err[-1]], err  # one line
        assert errors[0].startswith("feather-serve: error: --admission-profile: "), err
        assert message in errors[0], err
    line = usage_error(["--scheduler", "fcfs", "--admission-profile", str(chosen)], capsys)
    assert "--admission-profile is read by the slo and deadline admission rules only" in line, line
    # feather-serve itself, in a fresh interpreter: the error comes before vLLM is imported
    code = ("import sys\nfrom scheduler_runtime.serving.serve import main\n"
            f"try:\n    main([*{base!r}, '--admission-profile', {str(tmp_path / 'missing.json')!r}])\n"
            "except SystemExit as e:\n    print(e.code, 'vllm' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.stdout.split() == ["2", "False"], run.stdout + run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("feather-serve: error: --admission-profile: no such file"), run.stderr


def test_the_rule_reaches_vllm_as_its_caps_or_the_middleware(capsys):
    for argv in (["--admission", "queued-reqs:8+queued-tokens:9000"],
                 ["--scheduler", "lpm~queued-reqs:8+queued-tokens:9000"]):
        args, _ = vllm_arguments(["--scheduler", "lpm", *argv])
        assert args[args.index("--max-num-queued-reqs") + 1] == "8"
        assert args[args.index("--max-num-queued-tokens") + 1] == "9000" and "--middleware" not in args
    # the same rule twice is fine; --scheduler NAME@TOKENS is the rule's budget
    args, _ = vllm_arguments(["--scheduler", "group-cap-8@256~slo:0.5", "--admission", "slo:0.5",
                              "--slo", "ttft:2000 tpot:100", "--admission-status", "429"])
    assert args[args.index("--middleware") + 1] == ADMISSION_MIDDLEWARE
    with pytest.raises(SystemExit) as exit_info:
        vllm_arguments(["--scheduler", "group-cap-8@256~slo:0.5", "--slo", "ttft:2000 tpot:100",
                        "--max-num-seqs", "32", "--print-command"])
    assert exit_info.value.code == 0
    env, *command = shlex.split(capsys.readouterr().out)
    name, value = env.split("=", 1)
    s = AdmissionSettings.from_env({name: value})
    assert s is not None and s.rule == "slo:0.5" and s.token_budget == 256 and s.max_num_seqs == 32
    assert s.slos == {"ttft": 2000.0, "tpot": 100.0} and s.status == 503
    assert command[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--middleware") + 1] == ADMISSION_MIDDLEWARE


# ------------------------------------------------------------------------------------ the proxy


def _replica_app(answer: str, seen: list[dict[str, str]]) -> web.Application:
    """A stand-in replica: ``shed`` (503 and Retry-After), ``never`` (never fits) or ``ok``."""
    async def complete(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        await request.read()
        if answer == "ok":
            return web.json_response({"choices": [{"text": "hi"}]})
        headers = {"x-feather-admission": "slo", "retry-after": "4"} if answer == "shed" else \
            {"x-feather-admission": "never-fits", "x-should-retry": "false"}
        body = {"error": {"message": answer, "type": "overloaded", "code": 503, "param": None}}
        return web.json_response(body, status=503, headers=headers)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    return app


class InRankOrder(ReplicaRouter):
    """The lowest-ranked replica not avoided: the order the proxy tries them in, fixed."""

    name = "in-rank-order"

    def choose(self, hashes, loads, avoid=(), *, tokens=None) -> str:
        return min(self._allowed(loads, avoid), key=int)


async def _proxy_post(answers: list[str], headers: dict[str, str] | None = None, reroute_shed: bool = False
                      ) -> tuple[int, dict[str, str], dict, list[list[dict[str, str]]], ReplicaProxy, str]:
    """Start stand-ins answering ``answers`` and the proxy over them (tried in rank order), send one
    request; its answer, the headers each stand-in saw, the proxy and its ``/metrics``."""
    runners, replicas, seen = [], [], []
    for k, answer in enumerate(answers):
        seen.append([])
        runner = web.AppRunner(_replica_app(answer, seen[-1]))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        replicas.append(Replica(rank=k, url=f"http://127.0.0.1:{port}"))
    proxy = ReplicaProxy(replicas, InRankOrder(), ttft_slo_ms=2000.0, reroute_shed=reroute_shed)
    port = free_port()
    stop = asyncio.Event()
    serving = asyncio.ensure_future(proxy.serve("127.0.0.1", port, stop))
    try:
        while not all(r.healthy for r in replicas):
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": [1, 2, 3]},
                                    headers=headers or {}) as resp:
                status, out, body = resp.status, dict(resp.headers), await resp.json()
            async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                metrics = await resp.text()
    finally:
        stop.set()
        await serving
        for runner in runners:
            await runner.cleanup()
    return status, out, body, seen, proxy, metrics


def test_with_reroute_shed_the_proxy_sends_a_shed_request_to_another_replica_with_the_deadline_left():
    status, headers, body, seen, proxy, metrics = run(_proxy_post(["shed", "ok"], {"X-SLO-TTFT-MS": "1500"},
                                                                  reroute_shed=True))
    assert status == 200 and body == {"choices": [{"text": "hi"}]} and headers["x-feather-attempts"] == "2"
    assert [len(s) for s in seen] == [1, 1]
    assert seen[0][0]["X-SLO-TTFT-MS"] == "1500"  # the client's, as it sent it
    carried = [v for k, v in seen[1][0].items() if k.lower() == "x-slo-ttft-ms"]
    assert len(carried) == 1 and 1000 < float(carried[0]) <= 1500  # less the time spent
    assert proxy.stats.shed == {"rerouted": 1} and proxy.stats.counts[("0", "shed")] == 1
    assert not proxy.stats.errors and proxy.stats.counts[("1", "ok")] == 1
    assert metric(metrics, "feather_cluster_shed_total", outcome="rerouted") == 1


def test_with_reroute_shed_the_proxy_rejects_only_when_every_replica_sheds():
    status, headers, body, seen, proxy, metrics = run(_proxy_post(["never", "shed"], reroute_shed=True))
    assert status == 503 and headers["Retry-After"] == "4" and headers["x-feather-attempts"] == "2"
    assert body["error"]["type"] == "overloaded" and body["error"]["message"] == "shed"
    assert [len(s) for s in seen] == [1, 1] and "x-slo-ttft-ms" not in {k.lower() for k in seen[0][0]}
    assert 1000 < float(seen[1][0]["x-slo-ttft-ms"]) <= 2000  # the configured SLO less the time spent
    assert not proxy.stats.errors  # sheds are not replica errors
    assert proxy.stats.counts == {("0", "shed"): 1, ("1", "shed"): 1} and proxy.stats.shed == {"rejected": 1}
    assert metric(metrics, "feather_cluster_shed_total", outcome="rejected") == 1
    assert metric(metrics, "feather_cluster_errors_total") == 0


def test_by_default_the_proxy_answers_the_first_replicas_rejection():
    status, headers, body, seen, proxy, metrics = run(_proxy_post(["shed", "ok"]))  # the default
    assert status == 503 and headers["x-feather-attempts"] == "1" and body["error"]["type"] == "overloaded"
    assert [len(s) for s in seen] == [1, 0]  # the second replica never saw it
    assert proxy.stats.shed == {"rejected": 1} and proxy.stats.counts == {("0", "shed"): 1}
    assert metric(metrics, "feather_cluster_shed_total", outcome="rejected") == 1


# ------------------------------------------------------------------------------------ end to end

BURST = 40  # requests of ~3,000 tokens within a second, on one core: far past capacity
MAX_TOKENS = 4


async def _burst(base: str) -> list[tuple[int, dict[str, str], dict]]:
    import httpx

    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 8000, PROMPT).tolist() for _ in range(BURST)]
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        async def one(k: int) -> tuple[int, dict[str, str], dict]:
            await asyncio.sleep(k * 0.9 / BURST)
            resp = await client.post("/v1/completions", json={
                "model": "tiny-llama", "prompt": prompts[k], "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "min_tokens": MAX_TOKENS})
            return resp.status_code, dict(resp.headers), resp.json()

        async def healthy() -> list[int]:
            codes = []
            for _ in range(10):
                codes.append((await client.get("/health")).status_code)
                await asyncio.sleep(0.1)
            return codes

        *answers, health = await asyncio.gather(*(one(k) for k in range(BURST)), healthy())
    assert health == [200] * len(health)  # /health stays 200 while shedding
    return answers


@pytest.mark.engine
def test_a_burst_past_capacity_is_served_or_shed_with_retry_after(tmp_path):
    command = [*feather_serve_command(), "--scheduler", "fcfs", "--admission", "slo",
               "--slo", "ttft:2000 tpot:100", *SMALL_SERVER]
    with running_server(command, tmp_path / "server.log") as (base, _):
        start = time.monotonic()
        answers = asyncio.run(_burst(base))
        elapsed = time.monotonic() - start
        served = [a for a in answers if a[0] == 200]
        shed = [a for a in answers if a[0] != 200]
        for _, _, body in served:
            assert body["usage"]["completion_tokens"] == MAX_TOKENS and body["choices"][0]["finish_reason"]
        for status, headers, body in shed:
            assert status == 503, (status, body)
            assert int(headers["retry-after"]) >= 1 and headers["x-feather-admission"] == "slo"
            assert body["error"]["type"] == "overloaded" and body["error"]["code"] == 503
        assert served and shed, [a[0] for a in answers]
        text = wait_until_idle(base)
        get(base + "/health", timeout=5.0)  # still healthy (an error status raises)
        assert metric(text, "feather_admission_rejected_total") == len(shed)
        assert metric(text, "feather_admission_rejected_total", reason="slo") == len(shed)
        assert metric(text, "feather_admission_admitted_total") == len(served)
        print(f"{len(served)} served, {len(shed)} shed in {elapsed:.1f} s", file=sys.stderr)
