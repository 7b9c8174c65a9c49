"""A replica that slows down and recovers, on real engines: what ours learns, where it routes, what it costs.

    flock /tmp/feather-engine.lock python -m benchmarks.drift_loopback \\
        --json results/drift_loopback.json
    python -m benchmarks.drift_loopback --standin --end 12 --slow-at 4 --recover-at 8   # seconds: a test

The simulator's drift must-show (``benchmarks.unequal_replicas --drift-share``) on two real engines: two
equal plain ``feather-serve`` replicas, one core each, with vLLM's per-request metrics
(:func:`benchmarks.frontend_loopback.plain_replicas`, :data:`~benchmarks.cluster_loopback.SERVER_ARGS`),
behind ``feather-serve --worker-urls`` (:func:`benchmarks.unequal_loopback.ours_over`), told nothing:

* ``feather-learned`` (ours): ``--router prefix-learned``, learning each replica's speed;
* ``feather-prefix`` (ours as today): ``--router prefix``, which learns nothing.

A closed loop keeps :data:`~benchmarks.frontend_loopback.CONCURRENCY` (8) requests in flight for ``--end``
seconds, the L-Eval questions of :func:`benchmarks.frontend_loopback.requests_for` (``--documents``
documents x 6 questions, answers of at most 32 tokens) again and again in their order: the same
documents every pass, cached where they were first placed, or with ``--fresh`` new ones every pass
(:class:`FreshPasses`: each prompt opens with its pass's number). From
``--slow-at`` to ``--recover-at`` seconds replica 1 shares its core with a busy neighbour
(:func:`benchmarks.unequal_loopback.noisy_neighbour`: about half speed). Every ``--poll`` seconds the
proxy's ``/metrics`` gives the requests each replica has answered, and for ours ``/replicas`` its learned
prefill speeds.

Per ``--window`` (10 s) of the run: replica 1's share of the requests answered; for ours replica 1's
learned prefill speed over replica 0's (the last reading of the window); the requests sent in the window
and their attainment (``--slo``, TTFT <= 5 s and TPOT <= 50 ms, the issue's pair: nearly every request
meets it here, so it flags failures) and median TTFT. Per phase (before, slowed, after the recovery):
the same over the phase. And the seconds after each change until replica 1's learned speed ratio is
within 25% of where the phase ends up (the mean of the phase's last two readings) and stays there.
Front ends alternate over ``--repeats`` rounds, fresh replicas and proxy for each.

``--standin``: paced stand-in workers (:mod:`benchmarks.standin`) and a small text workload; replica 1 is
slowed by ``POST /standin/pace`` (``--standin-factor``, 3 x) in place of a neighbour. Seconds; its
figures mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shlex
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks import measured
from benchmarks.admission_burst import tpot_s
from benchmarks.cluster_server import http_get
from benchmarks.frontend_loopback import (
    CONCURRENCY,
    chosen_front_ends,
    drive,
    plain_replicas,
    replica_cores,
    requests_for,
)
from benchmarks.standin import MODEL as STANDIN_MODEL
from benchmarks.standin import standin_command
from benchmarks.unequal_loopback import noisy_neighbour, ours_over, standin_requests
from feather_env.evaluation.endpoint import parse_prometheus
from feather_env.reporting import format_table, machine_info, write_json
from scheduler_runtime.admission import parse_slos
from scheduler_runtime.serving.cluster_base import PER_REQUEST_METRICS

OURS, TODAY = "feather-learned", "feather-prefix"
#: ``--fresh``: how many passes of new documents the closed loop can draw (far more than a run sends).
FRESH_PASSES = 10_000
#: Each front end's ``--router``.
ROUTERS = {OURS: "prefix-learned", TODAY: "prefix"}
ISSUE_SLO = "ttft:5000 tpot:50"
PHASES = ("before", "slowed", "after")
#: Stand-in mode's pace (both replicas; replica 1 slowed by ``--standin-factor`` while it lasts).
STANDIN_PACE = ("--prefill-ms-per-1k", "20", "--decode-ms", "2", "--kv-blocks", "4096", "--block-size", "16")


@contextlib.contextmanager
def slowdown(url: str, core: str, standin: bool, factor: float) -> Iterator[None]:
    """Replica 1 slowed while inside: a busy neighbour on ``core``, or a stand-in's pace x ``factor``."""
    if not standin:
        with noisy_neighbour(core):
            yield
        return
    _pace(url, factor)
    try:
        yield
    finally:
        _pace(url, 1.0)


class FreshPasses(Sequence[tuple[str, int]]):
    """``requests`` again and again, each pass's prompts opening with ``Pass N.``: every pass's documents
    are new to every prefix cache and to the router (a stream of new documents), its questions still
    sharing their document within the pass."""

    def __init__(self, requests: Sequence[tuple[str, int]], passes: int = FRESH_PASSES) -> None:
        self.requests, self.passes = list(requests), passes

    def __len__(self) -> int:
        return len(self.requests) * self.passes

    def __getitem__(self, i: int) -> tuple[str, int]:  # type: ignore[override]
        if not 0 <= i < len(self):
            raise IndexError(i)
        text, tokens = self.requests[i % len(self.requests)]
        return f"Pass {i // len(self.requests)}. {text}", tokens


def _pace(url: str, factor: float) -> None:
    req = urllib.request.Request(url + "/standin/pace", data=json.dumps({"factor": factor}).encode(),
                                 headers={"content-type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


class Poller:
    """A thread reading the proxy every ``period_s`` seconds until :meth:`stop`: the requests each replica
    has answered (``feather_cluster_requests_total``, outcome ``ok``) and, ``learned``, each replica's
    learned prefill speed (``/replicas``); :attr:`readings` ``(seconds from start, answered by rank,
    prefill tok/s by rank or None)``."""

    def __init__(self, url: str, start: float, period_s: float, learned: bool) -> None:
        self.url, self.start, self.period_s, self.learned = url, start, period_s, learned
        self.readings: list[tuple[float, dict[str, float], dict[str, float | None] | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        with contextlib.suppress(OSError, ValueError):  # a last reading, after every request has ended
            self.readings.append((time.monotonic() - self.start, *self.read()))

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                self.readings.append((time.monotonic() - self.start, *self.read()))
            self._stop.wait(self.period_s)

    def read(self) -> tuple[dict[str, float], dict[str, float | None] | None]:
        answered: dict[str, float] = {}
        for name, labels, value in parse_prometheus(http_get(self.url + "/metrics")):
            if name == "feather_cluster_requests_total" and labels.get("outcome") == "ok":
                answered[labels["replica"]] = answered.get(labels["replica"], 0.0) + value
        speeds = None
        if self.learned:
            speeds = {str(r["rank"]): (r.get("estimates") or {}).get("prefill_tok_s")
                      for r in json.loads(http_get(self.url + "/replicas"))}
        return answered, speeds


def run_once(front_end: str, requests: Sequence[tuple[str, int]], log_dir: Path, *, end_s: float,
             slow_at: float, recover_at: float, poll_s: float, standin: bool,
             factor: float) -> dict[str, Any]:
    """One front end over two fresh equal replicas; replica 1 slowed from ``slow_at`` to ``recover_at``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    own = [()] * 2 if standin else [[PER_REQUEST_METRICS]] * 2
    command = ((lambda k, port: [*standin_command((), port), *STANDIN_PACE, PER_REQUEST_METRICS])
               if standin else None)
    with plain_replicas(log_dir, own, command) as urls, \
            ours_over(urls, log_dir / "proxy.log", router=ROUTERS[front_end]) as url:
        start = time.monotonic()
        phases: list[tuple[str, float]] = []

        def drift() -> None:  # replica 1 slowed from slow_at to recover_at (seconds from start)
            time.sleep(max(0.0, slow_at - (time.monotonic() - start)))
            with slowdown(urls[1], replica_cores()[1], standin, factor):
                phases.append(("slowed", time.monotonic() - start))
                time.sleep(max(0.0, recover_at - (time.monotonic() - start)))
            phases.append(("after", time.monotonic() - start))

        changer = threading.Thread(target=drift, daemon=True)
        with Poller(url, start, poll_s, front_end == OURS) as poller:
            changer.start()
            result = asyncio.run(drive(url, requests, model=STANDIN_MODEL if standin else "unknown",
                                       until_s=end_s))
            changer.join(timeout=max(0.0, recover_at - end_s) + 60)
    return {"front_end": front_end, **result, "changes": phases,
            "readings": [{"t": t, "answered": a, "prefill_tok_s": s} for t, a, s in poller.readings]}


def _good(r: Mapping[str, Any], slo: Mapping[str, float]) -> bool:
    tpot = tpot_s(r)
    return bool(r.get("completed") and r["ttft_s"] is not None and 1000 * r["ttft_s"] <= slo["ttft"]
                and (tpot is None or 1000 * tpot <= slo["tpot"]))


def _ratio(reading: Mapping[str, Any]) -> float | None:
    s = reading.get("prefill_tok_s") or {}
    return s["1"] / s["0"] if s.get("0") and s.get("1") else None


def _share(readings: Sequence[Mapping[str, Any]], lo: float, hi: float) -> float | None:
    """Replica 1's share of the requests answered between the last reading before ``lo`` and the last
    before ``hi`` (``None``: no reading in between, or nothing answered)."""
    inside = [r for r in readings if lo <= r["t"] < hi]
    if not inside:
        return None
    before = [r for r in readings if r["t"] < lo]
    a0, a1 = (before[-1]["answered"] if before else {}), inside[-1]["answered"]
    got = {k: a1.get(k, 0.0) - a0.get(k, 0.0) for k in ("0", "1")}
    return got["1"] / (got["0"] + got["1"]) if got["0"] + got["1"] > 0 else None


def _sent(run: Mapping[str, Any], lo: float, hi: float, slo: Mapping[str, float]) -> dict[str, Any]:
    """The requests sent in ``[lo, hi)``: how many, their attainment and median TTFT (ms)."""
    sent = [r for r in run["requests"] if lo <= r["sent_s"] < hi]
    ttfts = [1000 * r["ttft_s"] for r in sent if r.get("ttft_s") is not None]
    return {"sent": len(sent), "attainment": sum(_good(r, slo) for r in sent) / len(sent) if sent else None,
            "median_ttft_ms": statistics.median(ttfts) if ttfts else None}


def windows(run: Mapping[str, Any], window_s: float, slo: Mapping[str, float]) -> list[dict[str, Any]]:
    """Per window ``[t, t + window_s)`` of the run: replica 1's share of the requests answered in it (from
    the readings), its learned speed ratio (the window's last reading), the requests sent in it, their
    attainment and median TTFT (ms)."""
    out = []
    t = 0.0
    while t < run["wall_s"] - 1e-9:
        ratios = [x for r in run["readings"] if t <= r["t"] < t + window_s and (x := _ratio(r)) is not None]
        out.append({"t": t, "share_1": _share(run["readings"], t, t + window_s),
                    "speed_ratio": ratios[-1] if ratios else None, **_sent(run, t, t + window_s, slo)})
        t += window_s
    return out


def phase_bounds(run: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """Each phase's ``[start, end)`` in seconds of the run, at the times it really changed (a change that
    did not happen: ``inf``)."""
    marks = dict(run["changes"])
    slowed, after = marks.get("slowed", math.inf), marks.get("after", math.inf)
    return {"before": (0.0, slowed), "slowed": (slowed, after), "after": (after, math.inf)}


def phase_figures(run: Mapping[str, Any], slo: Mapping[str, float]) -> dict[str, dict[str, Any]]:
    """Per phase (:func:`phase_bounds`): replica 1's share of the requests answered, attainment and median
    TTFT of the requests sent."""
    return {phase: {"share_1": _share(run["readings"], lo, hi), **_sent(run, lo, hi, slo)}
            for phase, (lo, hi) in phase_bounds(run).items()}


def settle_after(run: Mapping[str, Any], tol: float = 0.25) -> dict[str, float | None]:
    """Seconds after the slowdown and after the recovery until replica 1's learned speed ratio is within
    ``tol`` (relative) of where that phase ends up (the mean of its last two readings) and stays so to the
    phase's end; ``None``: never, or nothing learned."""
    bounds = phase_bounds(run)
    out: dict[str, float | None] = {}
    for phase in ("slowed", "after"):
        lo, hi = bounds[phase]
        series = [(r["t"], x) for r in run["readings"] if lo <= r["t"] < hi and (x := _ratio(r)) is not None]
        settled = None
        if len(series) >= 3:
            target = statistics.fmean(x for _, x in series[-2:])
            for t, x in reversed(series):
                if abs(x - target) > tol * target:
                    break
                settled = t - lo
        out[phase] = settled
    return out


def summarize(runs: Sequence[dict[str, Any]], window_s: float, slo: Mapping[str, float]) -> dict[str, Any]:
    """Each run's windows, phases and settle times; per front end the medians of the phases' figures."""
    for run in runs:
        run["windows"] = windows(run, window_s, slo)
        run["phases"] = phase_figures(run, slo)
        run["settle_s"] = settle_after(run) if run["front_end"] == OURS else None
    median: dict[str, dict[str, Any]] = {}
    for f in dict.fromkeys(r["front_end"] for r in runs):
        mine = [r for r in runs if r["front_end"] == f]
        median[f] = {"completed": sum(r["completed"] for r in mine),
                     "sent": sum(r["submitted"] for r in mine),
                     "output_throughput": statistics.median(r["output_throughput"] for r in mine),
                     **{f"{phase}_{k}": _median([r["phases"][phase][k] for r in mine])
                        for phase in PHASES for k in ("share_1", "attainment", "median_ttft_ms")}}
    return {"median": median}


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def render(res: Mapping[str, Any]) -> str:
    """The figures in markdown."""
    how = f"stand-in pace x{res['factor']:g}" if res["standin"] else "a busy neighbour on its core"
    what = ("a stand-in text workload" if res["standin"]
            else f"L-Eval, {res['documents']} documents x 6 questions")
    what += ", new documents every pass" if res.get("fresh") else ", the same documents every pass"
    head = (f"Two equal `feather-serve` replicas, one core each, behind `feather-serve --worker-urls`, told "
            f"nothing; {res['concurrency']} requests in flight for {res['end_s']:g} s ({what}, again and "
            "again); replica 1 slowed "
            f"({how}) "
            f"from {res['slow_at_s']:g} s to {res['recover_at_s']:g} s; SLO {res['slo']}; {measured(res)}; "
            f"`{res['command']}`.")
    rows = [[f, str(m["completed"]) + " / " + str(m["sent"]), _f(m["output_throughput"], "{:.1f}")]
            + [f"{_f(m[f'{p}_share_1'])} / {_f(m[f'{p}_attainment'])} / "
               f"{_f(m[f'{p}_median_ttft_ms'], '{:.0f}')}"
               for p in PHASES] for f, m in res["median"].items()]
    table = format_table(["front end", "completed / sent", "output tok/s",
                          *(f"{p}: replica 1's share / attainment / median TTFT ms" for p in PHASES)], rows)
    out = [head, "", "Medians over the rounds:", "", table]
    for run in res["runs"]:
        if run["front_end"] != OURS:
            continue
        settle = run["settle_s"] or {}
        out += ["", f"Ours, round {run['round']}: replica 1's learned prefill speed over replica 0's within "
                "25% "
                f"of the phase's end from {_f(settle.get('slowed'), '{:.0f} s')} after the slowdown and "
                f"{_f(settle.get('after'), '{:.0f} s')} after the recovery. Per window (start s: replica 1's "
                "share answered, its learned speed ratio, attainment of the requests sent):", "",
                "; ".join(f"{w['t']:g}: {_f(w['share_1'])}, {_f(w['speed_ratio'])}, {_f(w['attainment'])}"
                          for w in run["windows"])]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--front-ends", default=f"{OURS},{TODAY}", help=f"of {OURS},{TODAY}")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--documents", type=int, default=12,
                   help="L-Eval documents (6 questions each; at most 30)")
    p.add_argument("--end", type=float, default=240.0, help="seconds of load")
    p.add_argument("--slow-at", type=float, default=60.0)
    p.add_argument("--recover-at", type=float, default=150.0)
    p.add_argument("--window", type=float, default=10.0)
    p.add_argument("--poll", type=float, default=1.0)
    p.add_argument("--slo", default=ISSUE_SLO)
    p.add_argument("--fresh", action="store_true",
                   help="every pass over the questions with new documents (FreshPasses), where by default "
                        "the same documents come back, cached where they were placed")
    p.add_argument("--standin", action="store_true", help="stand-in workers and a small workload (a test)")
    p.add_argument("--standin-factor", type=float, default=3.0)
    p.add_argument("--out", default="runs/drift-loopback")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    chosen = chosen_front_ends(p, args.front_ends, list(ROUTERS), args.repeats)
    if not 0 < args.slow_at < args.recover_at < args.end or not 1 <= args.documents <= 30:
        p.error("0 < --slow-at < --recover-at < --end, --documents from 1 to 30")
    if not (args.window > 0 and args.poll > 0 and args.standin_factor > 0):
        p.error("--window, --poll and --standin-factor must be > 0")
    try:
        slo = parse_slos(args.slo)
    except ValueError as exc:
        p.error(f"--slo: {exc}")
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    requests: Sequence[tuple[str, int]] = (standin_requests(args.seed) if args.standin
                                           else requests_for(args.seed, args.documents))
    if args.fresh:
        requests = FreshPasses(requests)
    runs = []
    for i in range(args.repeats):
        for f in chosen:
            say(f"round {i}: {f}")
            run = run_once(f, requests, Path(args.out) / f"{f}-{i}", end_s=args.end, slow_at=args.slow_at,
                           recover_at=args.recover_at, poll_s=args.poll, standin=args.standin,
                           factor=args.standin_factor)
            runs.append({"round": i, **run})
    res = {"benchmark": "drift_loopback", "machine": machine_info(),
           "command": "python -m benchmarks.drift_loopback "
                      + shlex.join(argv if argv is not None else sys.argv[1:]),
           "standin": args.standin, "factor": args.standin_factor, "documents": args.documents,
           "fresh": args.fresh,
           "concurrency": CONCURRENCY, "end_s": args.end, "slow_at_s": args.slow_at,
           "recover_at_s": args.recover_at,
           "window_s": args.window, "slo": args.slo, **summarize(runs, args.window, slo), "runs": runs}
    print(render(res))
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
