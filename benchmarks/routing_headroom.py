"""How much is there to win in the routing decision on unequal replicas? Ours and the tuned peers against a
lookahead oracle and a placebo, on ``feather/Routing-v0``.

    python -m benchmarks.routing_headroom [--fleet speed] [--load 0.8] [--seeds 0,1,2] [--horizon 30]
                                          [--others 1] [--tuning-from results/unequal_replicas.json]
                                          [--json results/routing_headroom.json]

The cell is one of ``benchmarks.unequal_replicas``' (default: the ``speed`` fleet, 8 replicas, every
other one 3x slower in prefill and 1.5x in decode, load 0.8 of the fleet's capacity, L-Eval, 16
documents per replica), its workloads those of :class:`~feather_env.routing_env.RoutingEnv` (the same
as that benchmark's: ``tests/test_routing_env.py``), on the held-out arrival seeds (0, 1, 2; the peers
were tuned on 10,000-10,002, workloads of their own). SLO TTFT <= 5 s and TPOT <= 50 ms; every figure
is SLO attainment, good requests over submitted. Per held-out seed:

a. ``prefix-learned``: ours, told nothing, learning each replica's speed and KV (the environment's
   advisor);
b. ``prefix``: ours as today; each peer at its defaults and, where its tuning on this fleet moved it,
   tuned (``"<peer> (tuned)"``): :func:`benchmarks.unequal_replicas.tune_peers` on the tuning seeds,
   read from ``--tuning-from`` (the JSON that benchmark wrote with that function; ``--retune`` calls it
   again here, about 4 minutes a fleet at one load). ``best rule``: the deployable router (ours and
   every peer row) of the highest mean held-out attainment, chosen in hindsight over the held-out
   seeds, which favours the rule: the headroom is measured against the strongest reference;
c. ``oracle``: a lookahead oracle (:func:`lookahead_oracle`), with foresight, not deployable: at each
   arrival it tries each candidate replica (ours' choice; the ``--others`` (1) replicas of least
   ``(in flight + 1) x`` true prefill slowdown; the owner of the request's longest known prefix) on a
   copy of the whole cluster (replicas, queues, caches, ours' learned state:
   :meth:`~feather_env.cluster_sim.ClusterRun.fork`), serves the next ``--horizon`` arrivals (the
   future arrivals known) with ours, then serves what was routed to its end with no further arrivals,
   and keeps the candidate whose copy has the most good requests (ours' choice on a tie). The horizon,
   30 arrivals, is 3.4 s at this cell's 8.8 req/s: of the order of the TTFT SLO (5 s) within which one
   request's placement delays those queued behind it; the copies' end, with no further arrivals, is
   what makes a longer horizon cost more than it tells. It is an *upper reference*, not a bound: a
   policy that knows the future a few seconds ahead and searches around ours reaches it, so
   ``oracle / best rule - 1`` is a floor on what routing with foresight could win over the best rule
   (one-step greedy search with a finite horizon is not the optimum, and it can lose to the rule it
   searches around); ``prefix-informed``: ours told each replica's true slowdowns and KV
   (hindsight-free, not deployable);
d. ``placebo``: the oracle's own candidates each arrival, one drawn at random (``--placebo-draws``
   draws, their median): the candidate set without the look ahead. Its ratio to the best rule should
   be <= 1, showing that the oracle's gain is the look ahead's, not the candidates'. And
   ``placebo (oracle's rate)`` (``--matched-placebo JSON``, added to a finished run's JSON with its own
   command): ours, moving off ours' choice at random decisions, as often as the oracle did on that seed,
   to a random other candidate of the oracle's (:func:`matched_placebo`): whether the oracle's gain is
   in *which* decisions it moves, or only in how many.

Reported: attainment (and output tok/s) per router and seed, the headroom ``oracle / best rule`` and
``oracle / prefix-learned``, ``placebo / best rule``, median over the seeds with their range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks import measured
from benchmarks.unequal_replicas import (
    LLMD_PER_POD,
    OURS_LEARNED,
    PEERS,
    router_factories,
    tune_peers,
)
from feather_env.cluster_sim import ClusterSim, ReplicaSim
from feather_env.evaluation.bound import prefill_attainment_bound
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.routing_env import TUNE_SEED_BASE, RoutingEnv
from feather_env.serving_metrics import meets_slos
from feather_env.workloads import Workload

__all__ = ["BOUND_INTERVALS", "add_bound", "add_matched_placebo", "candidates", "fleet_attainment_bound",
           "lookahead_oracle", "main", "matched_placebo", "placebo",
           "render", "run", "serve_router"]

DEFAULT_SLO = {"ttft": 5000.0, "tpot": 50.0}
#: Rows that are not deployable rules (not candidates for ``best rule``).
NOT_RULES = ("prefix-informed",)
#: ``benchmarks.unequal_replicas``' rows left out here (ours' dropped variant).
LEFT_OUT = ("prefix-learned-place",)


def _attainment(result: Any, submitted: int) -> float:
    m = result.metrics
    return (m.get("request_goodput") or 0.0) * m["duration"] / submitted


def serve_router(env: RoutingEnv, factory: Callable[[int], Any], seed: int) -> dict[str, float]:
    """One router on episode ``seed`` of ``env`` (``ClusterSim.run``, as ``benchmarks.unequal_replicas``
    runs it: metrics handed over at every arrival)."""
    timed = env.episode(seed)
    r = env.sim.run(timed, factory(seed), goodput=env.slos, scrape_s=0.0)
    return {"attainment": _attainment(r, len(timed)), "output_throughput": r.metrics["output_throughput"],
            "wall_s": r.wall_s}


def candidates(env: RoutingEnv, others: int) -> list[int]:
    """The oracle's candidates for the pending request: ours' choice, the ``others`` replicas of least
    ``(in flight + 1) x`` true prefill slowdown now, and the owner of its longest known prefix."""
    run, a = env.run, env.arrival
    assert run is not None and a is not None and env.rule is not None
    out = [env.rule]
    slow = [env.specs[i].slowdowns_at(a.clock)[0] for i in range(env.n)]
    ranked = sorted(range(env.n), key=lambda i: ((a.loads[env.names[i]] + 1) * slow[i], i))
    out += [i for i in ranked if i not in out][:others]
    prefix = env.features()[:, 0]
    owner = int(np.argmax(prefix))
    if prefix[owner] > 0 and owner not in out:
        out.append(owner)
    return out


def lookahead_score(env: RoutingEnv, replica: int, horizon: int) -> int:
    """Good requests of a copy of the cluster where the pending request goes to ``replica``, the next
    ``horizon`` arrivals are routed by ours (the copy's advisor) and what was routed is served to its end."""
    assert env.run is not None
    f = env.run.fork()
    f.route(env.names[replica])
    for _ in range(horizon):
        a = f.next_arrival()
        if a is None:
            break
        f.route(f.router.choose(a.hashes, a.loads, tokens=a.tokens))
    f.stop_arrivals()
    f.finish()
    return sum(1 for t in f.timelines() if t.completed and meets_slos(t, env.slos))


def lookahead_oracle(env: RoutingEnv, seed: int, *, horizon: int = 30, others: int = 1,
                     log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Episode ``seed`` routed by the lookahead oracle (module docstring, c); its figures."""
    t0 = time.perf_counter()
    env.reset(options={"episode_seed": seed})
    done, info, searched, moved = False, {}, 0, 0
    while not done:
        cands = candidates(env, others)
        best = cands[0]
        if len(cands) > 1:
            searched += 1
            scores = {c: lookahead_score(env, c, horizon) for c in cands}
            top = max(scores.values())
            best = cands[0] if scores[cands[0]] == top else next(c for c in cands if scores[c] == top)
            moved += best != cands[0]
        _, _, done, _, info = env.step(best)
        if log and env.run is not None and env.run.i % 100 == 0:
            log(f"    oracle seed {seed}: {env.run.i} decisions, {time.perf_counter() - t0:.0f} s")
    ep = info["episode"]
    return {"attainment": ep["attainment"], "output_throughput": ep["output_throughput"],
            "searched": searched, "moved_off_ours": moved, "wall_s": time.perf_counter() - t0}


def placebo(env: RoutingEnv, seed: int, *, others: int = 1, draw: int = 0) -> dict[str, Any]:
    """Episode ``seed`` routed by a uniform draw among the oracle's candidates (module docstring, d)."""
    rng = np.random.default_rng(1_000 * seed + draw)
    env.reset(options={"episode_seed": seed})
    done, info = False, {}
    while not done:
        cands = candidates(env, others)
        _, _, done, _, info = env.step(cands[int(rng.integers(len(cands)))])
    ep = info["episode"]
    return {"attainment": ep["attainment"], "output_throughput": ep["output_throughput"]}


def matched_placebo(env: RoutingEnv, seed: int, rate: float, *, others: int = 1,
                    draw: int = 0) -> dict[str, Any]:
    """Episode ``seed``: ours' choice, except that with probability ``rate`` per decision the request goes
    to another of the oracle's candidates drawn at random (module docstring, d)."""
    rng = np.random.default_rng(1_000 * seed + draw + 7)
    env.reset(options={"episode_seed": seed})
    done, info, moves = False, {}, 0
    while not done:
        cands = candidates(env, others)
        a = cands[0]
        if len(cands) > 1 and rng.random() < rate:
            a = cands[1 + int(rng.integers(len(cands) - 1))]
            moves += 1
        _, _, done, _, info = env.step(a)
    ep = info["episode"]
    return {"attainment": ep["attainment"], "output_throughput": ep["output_throughput"], "moves": moves}


def add_matched_placebo(path: str, draws: int = 3, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Add ``placebo (oracle's rate)`` to each cell of a finished run's JSON (its oracle's move rate per
    seed), with its ratios and this command; the payload."""
    with open(path) as f:
        payload = json.load(f)
    for c in payload["cells"]:
        env = RoutingEnv(c["fleet"], c["load"], episode_seeds=c["seeds"])
        rows = []
        for seed, o in zip(c["seeds"], c["rows"]["oracle"], strict=True):
            rate = o["moved_off_ours"] / o["searched"] if o["searched"] else 0.0
            ds = [matched_placebo(env, seed, rate, others=c["others"], draw=d) for d in range(draws)]
            med = sorted(ds, key=lambda r: r["attainment"])[len(ds) // 2]
            rows.append({**med, "rate": rate, "draws": ds})
            log(f"  {c['fleet']} {c['load']:g} seed {seed}: matched placebo {med['attainment']:.3f}")
        name = "placebo (oracle's rate)"
        c["rows"][name] = rows
        c["mean_attainment"][name] = statistics.fmean(r["attainment"] for r in rows)
        for ref in (c["best_rule"], OURS_LEARNED):
            c["ratios"][f"{name} / {ref}"] = _spread([a["attainment"] / b["attainment"]
                                                      for a, b in zip(rows, c["rows"][ref], strict=True)])
        c["matched_placebo_command"] = f"python -m benchmarks.routing_headroom --matched-placebo {path}"
    write_json(path, payload)
    return payload


#: The interval lengths (seconds of arrivals) of the attainment bound's interval form.
BOUND_INTERVALS = (2.5, 5.0, 10.0, 20.0, 40.0)


def fleet_attainment_bound(sim: ClusterSim, timed: Workload, ttft_s: float,
                           intervals: Sequence[float] = BOUND_INTERVALS) -> dict[str, Any]:
    """An upper bound on the requests of ``timed`` any router can serve within the TTFT SLO on ``sim``'s
    fleet: :func:`~feather_env.evaluation.bound.prefill_attainment_bound` with the fleet pooled.

    From the calibrated step model: a step's prefill part is ``c2 N + c5 A`` (its prompt tokens and
    their attention, ``A`` the sum of each computed token's position in its prompt, however the prompt
    is chunked) times the replica's prefill slowdown ``p_i`` (the least over the run, drift included;
    x its time scale), and the rest of the step is >= 0, so replica ``i`` does at most ``1 / p_i`` units
    of that work a second, and the fleet at most their sum. A request's own tokens (``n`` after its
    first ``start``) take at least the least over the replicas of ``ceil(n / B_i) d_i (c0 + c1) + p_i
    work`` (``B_i`` its token budget, ``d_i`` its least decode slowdown). The pooled server ignores which
    replica holds which prefix (one cache for all), so the bound holds for every router, told the
    future or not. It says nothing of the TPOT SLO.
    """
    replicas = [ReplicaSim(name, sim.engine, sim.config, sim.profile, spec)
                for name, spec in zip(sim.names, sim.specs, strict=True)]
    c0, c1, c2, _, _, c5 = (float(c) for c in replicas[0].model.coef)  # one profile; the specs scale it
    peaks = []
    for replica in replicas:
        times = [0.0, *(t for t, _ in replica.spec.drift)]
        pre = min(replica.spec.slowdowns_at(t)[0] for t in times) * replica.time_scale
        dec = min(replica.spec.slowdowns_at(t)[1] for t in times) * replica.time_scale
        peaks.append((replica.sim_config.max_num_batched_tokens, dec * (c0 + c1), pre))

    def work(start: int, n: int) -> float:
        return c2 * n + c5 * (n * start + n * (n + 1) / 2.0)

    def own_seconds(start: int, n: int) -> float:
        w = work(start, n)
        return min(-(-n // budget) * per_step + pre * w for budget, per_step, pre in peaks)

    rate = sum(1.0 / pre for _, _, pre in peaks)
    return prefill_attainment_bound(list(timed), sim.engine.block_size, rate, own_seconds, ttft_s, intervals,
                                    work)


def add_bound(path: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Add the ``bound`` row (:func:`fleet_attainment_bound` per seed: no router's attainment is above it)
    to each cell of a finished run's JSON, with the ratios ``bound / best rule`` (the most the routing
    decision can win over it) and ``oracle / bound``, and this command; the payload."""
    with open(path) as f:
        payload = json.load(f)
    for c in payload["cells"]:
        env = RoutingEnv(c["fleet"], c["load"], episode_seeds=c["seeds"])
        rows = []
        for seed in c["seeds"]:
            b = fleet_attainment_bound(env.sim, env.episode(seed), env.slos["ttft"] / 1000.0)
            rows.append({k: v for k, v in b.items() if k != "never_fits"})
            log(f"  {c['fleet']} {c['load']:g} seed {seed}: bound {b['attainment']:.3f} ({b['forms']})")
        c["rows"]["bound"] = rows
        c["mean_attainment"]["bound"] = statistics.fmean(r["attainment"] for r in rows)
        pairs = [("bound", c["best_rule"]), ("bound", OURS_LEARNED)]
        if "oracle" in c["rows"]:
            pairs.append(("oracle", "bound"))
        for a, b in pairs:
            c["ratios"][f"{a} / {b}"] = _spread([x["attainment"] / y["attainment"]
                                                 for x, y in zip(c["rows"][a], c["rows"][b], strict=True)])
        c["bound_command"] = f"python -m benchmarks.routing_headroom --bound {path}"
    write_json(path, payload)
    return payload


def load_tuning(path: str | None, fleet: str) -> dict[str, Any] | None:
    """``fleet``'s peers' tuning from a ``benchmarks.unequal_replicas`` JSON (``None``: none there)."""
    if not path:
        return None
    with open(path) as f:
        return (json.load(f).get("tuning") or {}).get(fleet)


def retune(env: RoutingEnv, tune_seeds: Sequence[int], log: Callable[[str], None]) -> dict[str, Any]:
    """The peers tuned on ``env``'s fleet (:func:`benchmarks.unequal_replicas.tune_peers`) on the tuning
    seeds' workloads at loads 0.8 and 1 (as that benchmark tunes them)."""
    runs = []
    for s in tune_seeds:
        w, cap = env.documents(s)
        runs += [(s, w.with_arrivals(f"poisson:{load * cap}", s)) for load in (0.8, 1.0)]
    return tune_peers(env.sim, runs, env.slos, log)


def _spread(xs: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def run(fleet: str = "speed", load: float = 0.8, seeds: Sequence[int] = (0, 1, 2), *, horizon: int = 30,
        others: int = 1, placebo_draws: int = 3, tuning_from: str | None = "results/unequal_replicas.json",
        retune_seeds: Sequence[int] = (), oracle: bool = True,
        log: Callable[[str], None] = print,
        partial: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every figure of the module docstring on one cell (``partial``: called with the rows after each
    seed, for a checkpoint)."""
    env = RoutingEnv(fleet, load, episode_seeds=seeds)
    tuned = retune(env, retune_seeds, log) if retune_seeds else load_tuning(tuning_from, fleet)
    factories = {name: f for name, f in router_factories(env.specs, env.engine, env.slos, tuned).items()
                 if name not in LEFT_OUT}
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in factories}
    rows["oracle"], rows["placebo"] = [], []
    for seed in seeds:
        t0 = time.perf_counter()
        for name, factory in factories.items():
            rows[name].append(serve_router(env, factory, seed))
        log(f"  seed {seed}: {len(factories)} routers in {time.perf_counter() - t0:.0f} s")
        draws = [placebo(env, seed, others=others, draw=d) for d in range(placebo_draws)]
        med = statistics.median(d["attainment"] for d in draws)
        tok_s = statistics.median(d["output_throughput"] for d in draws)
        rows["placebo"].append({"attainment": med, "draws": draws, "output_throughput": tok_s})
        if oracle:
            rows["oracle"].append(lookahead_oracle(env, seed, horizon=horizon, others=others, log=log))
            log(f"  seed {seed}: oracle {rows['oracle'][-1]['attainment']:.3f} in "
                f"{rows['oracle'][-1]['wall_s']:.0f} s")
        if partial is not None:
            partial({"fleet": fleet, "load": load, "seeds_done": seeds[:seeds.index(seed) + 1], "rows": rows})
    if not oracle:
        del rows["oracle"]
    means = {name: statistics.fmean(r["attainment"] for r in rs) for name, rs in rows.items()}
    deployable = [n for n in factories if n not in NOT_RULES]
    best = max(deployable, key=lambda n: means[n])
    peers = [n for n in deployable if n.split(" (")[0] in (*PEERS, LLMD_PER_POD)]
    best_peer = max(peers, key=lambda n: means[n])

    def ratio(a: str, b: str) -> dict[str, float]:
        return _spread([x["attainment"] / y["attainment"] for x, y in zip(rows[a], rows[b], strict=True)])

    ratios = {f"{a} / {b}": ratio(a, b) for a, b in
              [("oracle", best), ("oracle", OURS_LEARNED), ("placebo", best), ("placebo", OURS_LEARNED),
               (OURS_LEARNED, best), (OURS_LEARNED, best_peer), ("prefix", best_peer),
               ("prefix-informed", OURS_LEARNED)] if a in rows}
    return {"fleet": fleet, "load": load, "seeds": list(seeds), "replicas": env.n,
            "requests": len(env.episode(seeds[0])), "rate_req_s": load * env.documents(seeds[0])[1],
            "horizon": horizon, "others": others, "placebo_draws": placebo_draws, "tuning": tuned,
            "tuning_source": ("retuned here, seeds " + ",".join(map(str, retune_seeds))) if retune_seeds
            else tuning_from, "best_rule": best, "best_peer": best_peer, "rows": rows,
            "mean_attainment": means, "ratios": ratios}


def _r(x: dict[str, float]) -> str:
    return f"{x['median']:.3f} ({x['min']:.3f}-{x['max']:.3f})"


def render(payload: dict[str, Any]) -> str:
    """The figures in markdown."""
    out = []
    for c in payload["cells"]:
        seeds = c["seeds"]
        out += [f"**{c['fleet']} fleet, load {c['load']:g}** ({c['replicas']} replicas, {c['requests']} "
                f"requests at {c['rate_req_s']:.2f} req/s; held-out seeds {seeds}; best rule "
                f"`{c['best_rule']}`, best peer `{c['best_peer']}`; oracle horizon {c['horizon']} arrivals, "
                f"ours' choice + {c['others']} + the prefix owner; peers' tuning: {c['tuning_source']}):", ""]
        rows = [[name, f"{100 * c['mean_attainment'][name]:.1f}%"]
                + [f"{100 * r['attainment']:.1f}%" for r in rs]
                + [f"{statistics.fmean(r['output_throughput'] for r in rs):.0f}"
                   if all("output_throughput" in r for r in rs) else "-"]
                for name, rs in c["rows"].items()]
        headers = ["router", "mean attainment", *[f"seed {s}" for s in seeds], "mean tok/s"]
        out += [format_table(headers, rows),
                "", format_table(["ratio (attainment, per seed)", "median (min-max)"],
                                 [[k, _r(v)] for k, v in c["ratios"].items()]), ""]
        later = (("placebo (oracle's rate)", "matched_placebo_command"), ("bound", "bound_command"))
        added = [f"{what}: `{c[key]}`" for what, key in later if key in c]
        if added:
            out += ["Rows added to the run afterwards: " + "; ".join(added) + ".", ""]
    out.append(f"{measured(payload)}; `{payload['command']}`: {payload['wall_s'] / 60:.1f} min wall on one "
               "core.")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fleet", default="speed")
    p.add_argument("--loads", default="0.8")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--horizon", type=int, default=30)
    p.add_argument("--others", type=int, default=1)
    p.add_argument("--placebo-draws", type=int, default=3)
    p.add_argument("--tuning-from", default="results/unequal_replicas.json")
    p.add_argument("--retune", action="store_true",
                   help=f"tune the peers here on seeds {TUNE_SEED_BASE}-{TUNE_SEED_BASE + 2} instead")
    p.add_argument("--no-oracle", action="store_true")
    p.add_argument("--matched-placebo", default=None, metavar="JSON",
                   help="add the placebo at the oracle's rate to a finished run's JSON, and nothing else")
    p.add_argument("--bound", default=None, metavar="JSON",
                   help="add the attainment bound (no router above it) to a finished run's JSON, and nothing "
                        "else")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    start = time.perf_counter()
    if args.matched_placebo:
        print(render(add_matched_placebo(args.matched_placebo)))
        return 0
    if args.bound:
        print(render(add_bound(args.bound)))
        return 0

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    seeds = [int(s) for s in args.seeds.split(",")]
    cells: list[dict[str, Any]] = []
    command = "python -m benchmarks.routing_headroom " + " ".join(argv if argv is not None else sys.argv[1:])

    def checkpoint(rows: dict[str, Any]) -> None:
        write_json(args.json, {"benchmark": "routing_headroom", "partial": True, "command": command,
                               "machine": machine_info(), "cells": cells, "running": rows}, quiet=True)

    for load in (float(x) for x in args.loads.split(",")):
        log(f"{args.fleet} x load {load:g}")
        cells.append(run(args.fleet, load, seeds, horizon=args.horizon, others=args.others,
                         placebo_draws=args.placebo_draws, tuning_from=args.tuning_from,
                         retune_seeds=[TUNE_SEED_BASE + k for k in range(3)] if args.retune else (),
                         oracle=not args.no_oracle, log=log, partial=checkpoint))
    payload = {"benchmark": "routing_headroom", "machine": machine_info(), "slo": DEFAULT_SLO,
               "command": command, "cells": cells, "wall_s": time.perf_counter() - start}
    print(render(payload))
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

