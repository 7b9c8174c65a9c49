"""End to end: ``feather-serve`` with FeatherScheduler on loopback, 240 concurrent L-Eval requests.

The server runs as a subprocess (``python -m scheduler_runtime.serving.serve``, what the
``feather-serve`` console script calls), with its engine core in a process of its own, as in
production. Prompts are L-Eval questions (documents cut to 1,024 tokens so the test stays
fast), sent as token ids so that every question of a document shares the document exactly.
Two structured-output requests (a choice grammar) go with them (Feather holds and releases
those too), and ten streaming clients that disconnect after their first chunks (aborted by the
server, they leave nothing in Feather's queues).
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time

import pytest
from serving import SMALL_SERVER, Prompts, get, metric, run_completions, running_server, wait_until_idle

from feather_env.workloads import load_leval

pytestmark = pytest.mark.engine

NUM_REQUESTS = 240
CHOICES = ["yes", "no"]
NUM_STRUCTURED = 2
NUM_DISCONNECTING = 10


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    log_path = tmp / "server.log"
    # 64-token chunks: a 1,024-token document is 16 chunks, so the heuristic STOPs before
    # another document once its floor is reached, and requests are really held back.
    config = tmp / "scheduler.yaml"
    config.write_text("chunk_size: 64\nmax_wait: 20\n")
    cmd = [sys.executable, "-m", "scheduler_runtime.serving.serve", "--scheduler", "feather-heuristic+svf",
           "--scheduler-config", str(config), *SMALL_SERVER]
    with running_server(cmd, log_path) as (base, proc):
        yield base, proc, log_path


def _requests(data_dir):
    workload = load_leval(data_dir, tasks=["tpo", "quality"], max_prompt_tokens=1024)
    sample = workload.sample(NUM_REQUESTS, seed=0)
    # 2..16 tokens each, from the reference answer's length
    return [(r.request_id, r.prompt_token_ids.tolist(), min(max(r.output_len, 2), 16), r.source)
            for r in sample]


async def _send_all(base: str, reqs):
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(rid, prompt, max_tokens, source):
        resp = await client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
            extra_body={"ignore_eos": True, "min_tokens": max_tokens,
                        "vllm_xargs": {"feather_source": source, "feather_output_len": max_tokens}})
        return rid, resp

    async def structured(i):
        resp = await client.completions.create(
            model="tiny-llama", prompt=f"Question {i}: is the answer yes or no? Answer:", max_tokens=8,
            temperature=0.0, extra_body={"structured_outputs": {"choice": CHOICES}})
        return f"structured-{i}", resp

    held: list[float] = []  # Feather's held gauge while the requests run
    done = asyncio.Event()

    async def poll():
        while not done.is_set():
            text = await asyncio.to_thread(get, base + "/metrics")
            held.append(metric(text, "feather_scheduler_held_requests"))
            await asyncio.sleep(0.2)

    poller = asyncio.create_task(poll())
    try:
        prompts = Prompts(seed=5)
        gone = [("disconnect", f"gone-{i}", prompts.next(), 200, 200) for i in range(NUM_DISCONNECTING)]
        *results, disconnected = await asyncio.gather(*(one(*r) for r in reqs),
                                                      *(structured(i) for i in range(NUM_STRUCTURED)),
                                                      run_completions(base, gone))
    finally:
        done.set()
        await poller
        await client.close()
    return results, held, disconnected


def test_serve_completes_every_concurrent_request_once_and_stops_cleanly(server, data_dir):
    base, proc, log_path = server
    reqs = _requests(data_dir)
    assert len(reqs) == NUM_REQUESTS and len({tuple(p[:64]) for _, p, _, _ in reqs}) < 40  # shared docs
    before = get(base + "/metrics")

    start = time.monotonic()
    results, held, disconnected = asyncio.run(_send_all(base, reqs))
    elapsed = time.monotonic() - start
    assert list(disconnected.values()) == [("disconnected", 2)] * NUM_DISCONNECTING

    wanted = {rid: n for rid, _, n, _ in reqs}
    total = NUM_REQUESTS + NUM_STRUCTURED
    assert len(results) == total
    assert len({resp.id for _, resp in results}) == total  # one completion per request
    for rid, resp in results:
        assert len(resp.choices) == 1
        if rid.startswith("structured-"):  # the grammar decided the text, and the request ended there
            assert resp.choices[0].text in CHOICES and resp.choices[0].finish_reason == "stop", resp
            continue
        assert resp.usage.completion_tokens == wanted[rid], rid
        assert resp.choices[0].finish_reason == "length"

    after = wait_until_idle(base)  # the disconnected ones too are gone from the engine
    served = metric(after, "vllm:request_success_total") - metric(before, "vllm:request_success_total")
    assert served == total  # the engine finished each request exactly once, and no disconnected one
    name = "feather-heuristic+svf"
    released = metric(after, "feather_scheduler_released_total", scheduler=name)
    # the structured-output requests went through Feather too; a disconnected request was
    # released before it went away, or removed while held
    assert total <= released <= total + NUM_DISCONNECTING
    decisions = metric(after, "feather_scheduler_decisions_total", scheduler=name)
    adds = metric(after, "feather_scheduler_add_total", scheduler=name)
    stops = metric(after, "feather_scheduler_stop_total", scheduler=name)
    assert decisions == adds + stops and adds > 0 and stops > 0
    assert metric(after, "feather_scheduler_decision_seconds_total", scheduler=name) > 0
    assert metric(after, "feather_scheduler_held_requests", scheduler=name) == 0
    assert metric(after, "feather_scheduler_batch_requests", scheduler=name) == 0  # nothing left behind
    assert metric(after, "feather_scheduler_faults_total", scheduler=name) == 0
    assert re.search(r"^feather_scheduler_batch_requests\{", after, re.M)
    assert max(held) > 0, held  # requests were really held back (that vLLM counts them as
    # waiting is checked against the engine's front end in test_vllm_scheduler)
    print(f"{total} requests in {elapsed:.1f} s; decisions {decisions:.0f} "
          f"(ADD {adds:.0f}, STOP {stops:.0f})")

    # clean stop: SIGINT, as Ctrl-C
    proc.send_signal(signal.SIGINT)
    try:
        rc = proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"server did not stop within 90 s:\n{log_path.read_text()[-3000:]}")
    assert rc == 0, log_path.read_text()[-3000:]
    with pytest.raises(OSError):
        get(base + "/health", timeout=2.0)
