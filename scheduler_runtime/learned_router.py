"""Ours on unequal replicas: prefix affinity that learns each replica's speed and KV size from what it serves.

:class:`LearnedRouter` (``prefix-learned``) is :class:`~scheduler_runtime.router.PrefixAffinityRouter`
(ours: longest known prefix bounded by load, its prefix table and cache model) told nothing per
replica. It learns, per replica:

* **the KV size**, from what vLLM publishes: ``vllm:cache_config_info``'s ``num_gpu_blocks x
  block_size`` (:meth:`LearnedRouter.scraped`), shown in :meth:`LearnedRouter.estimates`. With
  ``cache_factor > 0`` it sizes that replica's part of ours' cache model (``cache_factor x`` its KV
  tokens, :meth:`PrefixHistory.set_limit <scheduler_runtime.router_base.PrefixHistory.set_limit>`;
  before it is known, the replica's cache model keeps everything). The default is 1 x, kept by the
  engine's clock (``cache_clock="prefilled"``, :data:`CACHE_CLOCKS`): a prompt enters its replica's LRU
  when its first token comes (when the engine computed it), not when it is routed, and a prefix that the
  replica's requests in flight hold counts as held meanwhile (:meth:`LearnedRouter.cache_holds`: the
  engine keeps the blocks its running requests use, and a queued request brings its prefix back when it
  runs). Entered at routing (``"routed"``, as ``prefix`` keeps it told the KV), the model lost attainment
  on ``benchmarks.unequal_replicas``' tuning seeds (10,000-10,002, disjoint from its evaluation's) on every
  fleet at loads 0.8 and 1 (the mixed-KV fleet most: 40.7% against 53.7% at 0.8, 32.8% against 44.4% at 1;
  the prefix hit rate 38% against 48%), and so did 2, 3 and 5 x KV, a size of at least the fleet's median
  KV, and keeping a document its owner's model had evicted on the owner while it was within 1 or 3
  requests of the least loaded: an LRU of what was *sent* runs ahead of the engine by the replica's
  queue (a small replica's queue of other documents is sent long before the engine runs it), so it
  declares documents evicted that the engine still holds, and a document it declares evicted goes to the
  least loaded replica and is prefilled there in full. Until 2026-12-07 the model was off by default. On
  the engine's clock at 1 x KV, on the evaluation's twelve held-out seeds, over the model off (median
  per-seed attainment ratio [90% interval]; ``benchmarks.unequal_replicas_cache --held-out --seeds 12``):
  L-Eval 1.056 [1.031-1.089] / 0.959 [0.925-0.986] on the KV fleet at loads 0.8 / 1, 1.070 / 1.020 on the
  equal fleet, 1.131 [1.093-1.151] / 0.921 [0.855-0.990] on the speed fleet; Zipf 1.004-1.092, every
  interval above 1; Mooncake 1.002-1.015. On ``benchmarks.router_peers``' equal grid it is within 2% of
  ``prefix`` told the KV in 17 of 17 cells (14 with the model off). It lost where L-Eval saturates an
  unequal fleet (load 1): two causes, found by taking its parts apart on 30 tuning seeds (the note of
  2026-12-06, twelfth session). (1) Its speeds' work, counted by the model, undercounts a prefill's
  uncached tokens where the fleet is saturated (2,543 predicted against 2,979 uncached per request on the
  speed fleet at load 1, twelve held-out seeds, ``benchmarks.cache_model_reading``; on the requests whose
  prefix the LRU held, 451 against
  1,332: the engine had evicted more than an LRU of prompts sized to its KV says), so a busy replica's
  prefill looks slow: the work is now counted by an LRU of what each replica was sent (``work_by="sent"``,
  :data:`WORK_BY`). (2) Moving a document the model declares evicted (correctly: the owner's engine held
  half of it in 1-7 of 59-78 per seed, ``benchmarks.cache_model_reading``) to the least loaded replica
  pays at load 0.8 and costs at 1, where that replica is barely less loaded and the document displaces
  its own: a
  document now moves only to a replica with at most ``move_room`` (2) requests in flight, and otherwise is
  prefilled again on its owner (:meth:`LearnedRouter._keep`). Relative rules lost there (moving only to a
  replica predicted to finish sooner, or at least as large and fast as the owner; a room in predicted
  seconds of queue or in vLLM's waiting requests).
* **the prefill speed**, seconds per uncached prompt token, from the first tokens the front end sees:
  a request's prefill is served from the later of its routing and the replica's previous first
  token, to its own first token (a single server's service time: the time the replica spent on the
  prefills in front of it is not counted again, so the replica's queue is not taken for slowness);
  its work is its uncached tokens by an LRU of ``work_cache_factor`` (1) times the replica's KV of what it
  was sent, which counts and never routes (``work_by="sent"``; ``"model"``: by ours' cache model, the
  default of the eleventh session; ``work_cache_factor`` 0: its whole prompt; then a replica that hits
  its cache more looks faster, and on the Zipf workload, whose popular documents make the hits uneven,
  ours fell to 0.93-0.97x ours informed; with the LRU of 1 x KV the median attainment over whole prompts
  was 0.973-1.066x on twelve held-out seeds of L-Eval and Zipf, the one under 1 within its interval, and
  1.000-1.003x on Mooncake, ``benchmarks.unequal_replicas_cache``), plus ``overhead_tokens`` for the step
  it costs anyway. The ratio of the two, each a sum decayed with time constant ``tau_s``
  (:class:`DecayedRate`).
* **the decode speed**, seconds per output token of one request (its TPOT), from each finish: the time
  from its first token to its finish over its further tokens, decayed alike.
* the mean output length (every replica's finishes together), which a request's decode is predicted by.

The queue, prefill and decode time histograms vLLM publishes are read too and shown beside the
learned speeds (``metrics_prefill_tok_s``: the uncached prompt tokens over the summed prefill time of
the requests finished between two scrapes, decayed as the others), but do not route: a request's
prefill time in vLLM counts every step it was in, so prefills that overlap are counted more than once,
where the front end's service times are not.

How it routes (:meth:`LearnedRouter.choose`): ours' rule (the owner of the longest known prefix while under
the load bounds, else the least loaded replica) on loads counted in a median replica's requests: a replica's
requests in flight ``l`` count ``(l + 1) x w - 1``, where ``w`` is its learned prefill time per token over
the fleet's median (:meth:`LearnedRouter.weights`; 1 when within ``band``, 35%, of it, so that the
estimates' noise leaves equal replicas equal, and ours routes exactly as it does). A slow replica is then
sent fewer new documents, and its hot documents spill sooner. The band alone does not hold on short runs: on
four equal replicas (L-Eval at load 0.8 in the simulator) a weight left 1 on 157 of 263 decisions, the first
seconds' estimates being a few samples each. ``fleet_z`` (off by default) adds a test of the estimates
against their own noise (:attr:`DecayedRate.relative_error`): the weights leave 1 only while the fleet's
estimates differ from their median beyond chi-square's quantile (1.645: 5%). It closes the equal grid's
Mooncake cells at 4 replicas (14 of 17 cells at >= 0.98x today's default, against 12) and ties or wins on
the unequal fleets' tuning seeds (L-Eval, Zipf, Mooncake), but on 24 held-out seeds of the speed fleet at
load 1 it gave 0.954x today's default (90% interval 0.932-1.003): a 3x slower replica's first samples are
informative where an equal replica's are noise, and waiting for the test costs the saturated fleet its first
seconds (the note of 2026-12-06, eighth session). What the first seconds' samples hold on equal replicas is
the replica's own queue, not its speed: a request held while the replica's batch decodes (its scheduler's
choice) waits before its first step, and the single-server service time counts that wait (on that cell, a
second request of 7,887 tokens took 3.1 s to its first token where 8,192 tokens alone take 1.03 s, the KV 9%
full). With ``queue_time="service"`` (the default since 2026-12-07; ``"off"``: from the routing, as before)
a prefill's service starts no earlier than its first scheduled step, where the server reports the wait
(:meth:`scheduled`): on router_peers' equal grid 14 of 17 cells within 2% of ours, against 12 without (both
with the cache model off, as it was then; 17 of 17 with it on, by the engine's clock).
vLLM keeps the wait per request and returns it with ``--enable-per-request-metrics``
(``metrics.queue_time_ms`` of a stream's final usage chunk), so it comes at the request's end: the prefill
sample is taken at the first token from the routing, as with ``"off"``, and amended when the report comes
(:meth:`DecayedRate.amend`); the simulator reports at the end too. (Holding the sample until the report
instead lets an overloaded replica keep a stale fast estimate: its corrections wait for finishes that its
own backlog delays; one replica then drew 630-723 of 2,499-2,580 requests on router_peers' Mooncake cell of
16 at load 1.) The proxy and the Ray ingress read it (they ask a stream's usage chunk where its client did
not, and strip it). With ``place_new``, a prefix that no replica holds (or holds no longer, by the cache
model) goes instead to the replica predicted to finish it first (:meth:`LearnedRouter.predicted_completion`:
its queue of uncached prefill tokens and the request's own
uncached tokens at its prefill speed, the mean output at its decode speed); ``benchmarks.unequal_replicas``
measures it as ``prefix-learned-place``. With ``kv_guard`` (off by default), on a fleet whose published KV
sizes differ, a new prefix is not placed where it would not fit: where ours' choice holds (by an LRU of what
it was sent, its KV in size) so many distinct prompt tokens that this prompt's would fill more than
``kv_fill`` (all) of its KV, and another replica still has room for it, it goes to the replica with room
that it fills least (its resident tokens with the prompt's over its KV; :meth:`LearnedRouter.kv_room`); once
every replica is full it says nothing, and on equal-KV fleets, never. On ``benchmarks.unequal_loopback``
(real engines; the quarter-KV replica at half speed), where ours without it gave that replica five documents
of twelve in 4 of 9 rounds (42/30 requests, 34-46 tok/s), with it ours gave it four or three in all nine
(48/24 or 54/18, 57-79 tok/s). A fill of 90% gave it three where the brim gave four (seeds 2 and 3) and lost
there (seed 3: 1.11x the tuned ``sglang-router``'s throughput and 0.89x its attainment, against 1.45x and
1.08x), so the guard fills to the brim (the note of 2026-12-06, sixth session). On
``benchmarks.unequal_replicas``' kv fleet with L-Eval (a quarter of the KV at equal speed; 128 documents,
more than the fleet holds) the guard loses attainment, 68.6% (fill 100%) and 72.9% (90%) against 76.5%
without it at load 0.8 over 12 held-out seeds, where with Zipf's popular documents it wins (91.8% and 90.2%
against 89.4%): hence off (the notes of the fifth and sixth sessions). Tried on
``benchmarks.unequal_replicas``' fleets and dropped, without a row of their own (the note of 2026-12-06 says
how they fared): the same prediction overriding ours on a known prefix whenever ours' choice is predicted to
finish 25% later, or to start more than 3, 5 or 8 s later, than the best replica (spilling documents lost on
every fleet, as the tighter load bounds of ``benchmarks.router_peers`` did); weights from the decode speed
too (a request's TPOT here is mostly the prefill steps it waits behind: load, not speed); and a small-KV
replica's load weighted up by its KV's shortfall from the median.

Adapting and exploring: with ``tau_s`` 20 s an estimate moves most of the way to a new speed within
two time constants of samples. A replica believed slow still gets the requests its weighted load makes
cheapest, and, where it has had no sample for a while, the estimate it is routed by relaxes towards
the fleet's median as its last sample ages (``explore_s``: optimism that grows with the estimate's
age), so that a replica that is fast again is noticed. :meth:`LearnedRouter.estimates` shows what it
learned; :meth:`LearnedRouter.forget` drops it with the replica (a restart).

An informed reference (``told``, for benchmarks): told each replica's true relative slowdowns and KV
tokens, it pools every replica's samples, each divided by its replica's slowdown at the time, into
one fleet speed, and predicts each replica at that speed times its slowdown.

Variants, selectable by name (:data:`VARIANTS`; measured by ``benchmarks.unequal_replicas --variants``,
none the default): :class:`SloRouter` (``prefix-slo``: ours' choice unless it is predicted to miss the
SLO's TTFT or TPOT, the TPOT from the context in flight, each document's once; a request no replica is
predicted to serve in time placed by its ``doomed`` rule), :class:`CostRouter` (``prefix-cost``:
LMetric's product of a prompt's uncached tokens and the replica's requests in flight, weighted by the
learned prefill speed), :class:`SecondsAffinityRouter` (``prefix-seconds``: Ray's affinity with the
imbalance in predicted seconds) and :class:`CostSloRouter` (``prefix-cost-slo``).

Engine-free (plain Python): it imports nothing from the environment or the agents.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scheduler_runtime.router import PrefixAffinityRouter
from scheduler_runtime.router_base import PrefixHistory, RequestLedger, chunk_spans, prompt_tokens

__all__ = ["CACHE_CLOCK", "CACHE_CLOCKS", "MOVE_ROOM", "VARIANTS", "WORK", "WORK_BY", "CostRouter",
           "CostSloRouter", "DecayedRate", "LearnedRouter", "ReplicaLearning", "SecondsAffinityRouter",
           "SloRouter", "Told", "chi2_quantile"]

#: Told slowdowns for the informed reference: ``(replica, now) -> (prefill, decode)`` slowdown factors.
Told = Callable[[str, float], tuple[float, float]]


def chi2_quantile(k: int, z: float) -> float:
    """Chi-square's quantile for ``k`` degrees of freedom at a normal deviate ``z`` (1.645: the 95th
    percentile), by Wilson and Hilferty's cube-root approximation (within 3% from ``k = 1``)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    c = 2.0 / (9.0 * k)
    return k * max(0.0, 1.0 - c + z * math.sqrt(c)) ** 3


#: What :class:`LearnedRouter` makes of each request's reported wait before its first step
#: (``queue_time``): ``"off"``, nothing (a prefill's service starts at its routing); ``"service"``, its
#: prefill speeds are measured from the first step. (A third mode, ``"gate"``, measured in commit d3d9057,
#: let the weights leave 1 only while the speeds from the first step differed beyond ``band``: 12 of 17
#: on the equal grid, as ``"off"``; removed.)
QUEUE_TIME_MODES = ("off", "service")
#: The default mode.
QUEUE_TIME = "service"

#: When a routed prompt enters ours' cache model (``cache_clock``): ``"routed"``, at its routing (as
#: :class:`~scheduler_runtime.router.PrefixAffinityRouter` keeps it); ``"prefilled"``, at its first token
#: (the engine's clock), a prefix that the replica's requests in flight hold counting as held meanwhile.
CACHE_CLOCKS = ("routed", "prefilled")
#: The default clock (since 2026-12-07, with the cache model on at 1 x each replica's KV).
CACHE_CLOCK = "prefilled"

#: What a prefill's uncached tokens are counted by for the learned speeds (``work_by``): ``"sent"``, an LRU
#: of ``work_cache_factor x`` the replica's KV of the prompts it was sent, which counts and never routes;
#: ``"model"``, ours' cache model (what the model and the replica's requests in flight hold), where the
#: model is on.
WORK_BY = ("sent", "model")
#: The default (since 2026-12-07, twelfth session; ``"model"`` from the eleventh).
WORK = "sent"
#: The default ``move_room``: a document the cache model declares evicted moves only to a replica with at
#: most this many requests in flight (2026-12-07, twelfth session).
MOVE_ROOM = 2


class DecayedRate:
    """Seconds per unit of work, as the ratio of two sums decayed with time constant ``tau_s``: a sample
    ``s`` seconds old weighs ``exp(-s / tau_s)``. It keeps the sums of the weights' squares too, for the
    ratio's standard error (:attr:`relative_error`)."""

    def __init__(self, tau_s: float) -> None:
        if not tau_s > 0:
            raise ValueError(f"tau_s must be > 0, got {tau_s}")
        self.tau_s = float(tau_s)
        self.seconds = 0.0
        self.work = 0.0
        # the squared weights' sums of seconds^2, seconds x work and work^2 (the ratio's error)
        self._ss = self._sw = self._ww = 0.0
        self.samples = 0
        self.last: float = -math.inf  # when the latest sample came

    def add(self, now: float, seconds: float, work: float) -> None:
        """``work`` units took ``seconds``, observed at ``now`` (a sample observed before the latest one,
        reported late, comes in at its own age)."""
        if work <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        if self.samples and now > self.last:
            keep = math.exp(-(now - self.last) / self.tau_s)
            self.seconds *= keep
            self.work *= keep
            keep2 = keep * keep
            self._ss *= keep2
            self._sw *= keep2
            self._ww *= keep2
        elif self.samples and now < self.last:  # older than the sums: weighed at its age
            age = math.exp(-(self.last - now) / self.tau_s)
            seconds, work = seconds * age, work * age
        self.seconds += seconds
        self.work += work
        self._ss += seconds * seconds
        self._sw += seconds * work
        self._ww += work * work
        self.samples += 1
        self.last = max(self.last, now)

    def amend(self, at: float, old_seconds: float, new_seconds: float, work: float) -> None:
        """The sample of ``work`` units observed at ``at`` and added as ``old_seconds`` took ``new_seconds``
        (a provisional figure corrected once the server reports it): the sums are those of the corrected
        sample added in the first place."""
        if work <= 0 or not self.samples or not math.isfinite(new_seconds) or new_seconds < 0:
            return
        w = math.exp(-max(0.0, self.last - at) / self.tau_s)
        d = new_seconds - old_seconds
        self.seconds = max(0.0, self.seconds + w * d)
        self._ss = max(0.0, self._ss + w * w * (new_seconds * new_seconds - old_seconds * old_seconds))
        self._sw += w * w * d * work

    @property
    def value(self) -> float | None:
        """Seconds per unit (``None`` before any sample)."""
        return self.seconds / self.work if self.work > 0 else None

    @property
    def relative_error(self) -> float:
        """The standard error of :attr:`value` over the value: the weighted residuals of the samples
        about the ratio (a ratio estimator's error), scaled by ``n / (n - 1)`` for ``n`` the samples'
        effective number (Kish's, by their weights and work); ``inf`` below two effective samples."""
        if self.work <= 0 or self.seconds <= 0:
            return math.inf
        n = self.work * self.work / self._ww if self._ww > 0 else 0.0
        if n <= 1.0 + 1e-9:
            return math.inf
        r = self.seconds / self.work
        residual = max(0.0, self._ss - 2.0 * r * self._sw + r * r * self._ww)
        return math.sqrt(residual * n / (n - 1.0)) / self.seconds


@dataclass
class ReplicaLearning:
    """What :class:`LearnedRouter` has learned of one replica."""

    prefill: DecayedRate
    decode: DecayedRate
    kv_tokens: int | None = None
    last_first_token: float = -math.inf
    #: uncached prefill tokens routed here and not yet prefilled (the queue)
    queued_tokens: float = 0.0
    #: the previous scrape's request-level sums (for the metrics' prefill speed)
    scraped: dict[str, float] = field(default_factory=dict)
    #: prefill seconds per uncached token by vLLM's histograms (the deltas between scrapes, decayed)
    metrics_prefill: DecayedRate | None = None


class LearnedRouter(PrefixAffinityRouter):
    """Ours, learning each replica's speed and KV size from what it serves (see the module docstring).

    Args:
        tau_s: the time constant of the learned speeds (seconds).
        explore_s: an estimate with no new sample relaxes towards the fleet's median speed with this
            time constant (seconds; ``inf``: never).
        band: a replica's load is weighted only where its prefill time per token is more than this
            fraction from the fleet's median.
        fleet_z: and only while the fleet's estimates differ beyond their noise (:meth:`weights`): a
            chi-square test of them about their median at this normal deviate (1.645: 5%); 0: off.
        queue_time: what the server's report of each request's wait before its first step
            (:meth:`scheduled`) does: one of :data:`QUEUE_TIME_MODES` (default :data:`QUEUE_TIME`).
        place_new: a new prefix goes to the replica predicted to finish it first (default off: ours'
            least weighted load; see the module docstring).
        kv_guard: a new prefix that would overflow ours' choice's KV goes to a replica with room for
            it, on a fleet of unequal KV (see the module docstring; default off).
        kv_fill: the share of a replica's KV the guard fills with distinct prompt tokens (default all;
            a smaller share keeps room for what the requests in flight add).
        overhead_tokens: work a prefill costs beyond its uncached tokens (a fully cached prompt still
            takes a step).
        prior_output_tokens: the predicted output before any request has finished.
        told: the informed reference's true slowdowns (``None``: learn them).
        told_kv_tokens: the informed reference's true KV tokens per replica (``None``: read them from
            the metrics).
        cache_factor: ours' cache model's size over each replica's KV (``prefix``, told the KV: 1.25);
            default 1; 0: off (see the module docstring).
        cache_clock: when a routed prompt enters the cache model (:data:`CACHE_CLOCKS`): ``"prefilled"``
            (default), at its first token, a prefix its replica's requests in flight hold counting as
            held meanwhile; ``"routed"``, at its routing.
        work_by: what counts a prefill's uncached tokens for the learned speeds (:data:`WORK_BY`):
            ``"sent"`` (default), an LRU of ``work_cache_factor x`` the KV of what each replica was sent;
            ``"model"``, the cache model (with ``cache_factor > 0``).
        move_room: a known document that the cache model declares evicted from its owner goes where a new
            prefix goes only if that replica has at most this many requests in flight; otherwise it stays
            on its owner (prefilled again there) while the owner is under the load bound (default 2;
            ``None``: it always goes).
        homogeneous_cache: with ``cache_factor > 0``, route by the cache model only while the fleet
            looks homogeneous (every replica's KV published and equal, every weight 1); otherwise the
            model only counts (default off: the model, when on, always routes).
        work_cache_factor: with ``work_by="sent"`` or the cache model off, the size over each replica's KV
            of the LRU that counts a prefill's uncached tokens for the learned speeds (it does not route);
            default 1; 0: whole prompts.
        **kwargs: ours' other knobs (:class:`~scheduler_runtime.router.PrefixAffinityRouter`).
    """

    name = "prefix-learned"
    tracks_requests = True
    observes_service = True

    def __init__(self, tau_s: float = 20.0, explore_s: float = 20.0, band: float = 0.35,
                 place_new: bool = False, kv_guard: bool = False, kv_fill: float = 1.0,
                 overhead_tokens: int = 256, prior_output_tokens: float = 64.0, told: Told | None = None,
                 told_kv_tokens: Mapping[str, int] | None = None, cache_factor: float = 1.0,
                 work_cache_factor: float = 1.0, homogeneous_cache: bool = False, fleet_z: float = 0.0,
                 queue_time: str = QUEUE_TIME, cache_clock: str = CACHE_CLOCK, work_by: str = WORK,
                 move_room: int | None = MOVE_ROOM, **kwargs: Any) -> None:
        if kwargs.get("kv_tokens") is not None:
            raise ValueError("the learned router is told no KV size (it reads vllm:cache_config_info)")
        if queue_time not in QUEUE_TIME_MODES:
            raise ValueError(f"queue_time must be one of {list(QUEUE_TIME_MODES)}, got {queue_time!r}")
        if cache_clock not in CACHE_CLOCKS:
            raise ValueError(f"cache_clock must be one of {list(CACHE_CLOCKS)}, got {cache_clock!r}")
        if work_by not in WORK_BY:
            raise ValueError(f"work_by must be one of {list(WORK_BY)}, got {work_by!r}")
        if move_room is not None and move_room < 0:
            raise ValueError(f"move_room must be >= 0 or None, got {move_room}")
        if band < 0 or fleet_z < 0 or overhead_tokens < 0 or not explore_s > 0 or not 0 < kv_fill <= 1:
            raise ValueError("band, fleet_z and overhead_tokens must be >= 0, explore_s > 0 and kv_fill in "
                             "(0, 1]")
        super().__init__(cache_factor=cache_factor, **kwargs)
        self.homogeneous_cache = bool(homogeneous_cache)
        self.tau_s, self.explore_s = float(tau_s), float(explore_s)
        self.place_new = bool(place_new)
        self.kv_fill = float(kv_fill)
        #: the guard's view of what each replica holds: an LRU of the prompts it was sent, its KV in size
        #: once that is known (:meth:`kv_room`); None with the guard off
        self.resident = PrefixHistory(self.chunk_size, 1 << 40, holders=False) if kv_guard else None
        self.overhead_tokens = int(overhead_tokens)
        self.prior_output_tokens = float(prior_output_tokens)
        self.told = told
        self.told_kv_tokens = dict(told_kv_tokens) if told_kv_tokens is not None else None
        # ours' cache model, one LRU per replica sized when its KV is known (unbounded until then)
        self.cached = PrefixHistory(self.chunk_size, 1 << 40) if cache_factor > 0 else None
        self.cache_clock = cache_clock
        #: with the cache model on the engine's clock: the prefixes of the requests in flight, and the
        #: prompts routed and not yet entered in the model (request id -> hashes, replica, tokens)
        self.in_flight = RequestLedger() if self.cached is not None and cache_clock == "prefilled" else None
        self._to_cache: dict[str, tuple[np.ndarray, str, int | None]] = {}
        #: what each replica holds for the learning's uncached tokens: the cache model with
        #: ``work_by="model"``, else an LRU of ``work_cache_factor x`` its KV that only counts (it never
        #: routes)
        self.work_cache_factor = float(work_cache_factor)
        self.work_by = work_by
        self.move_room = None if move_room is None else int(move_room)
        self.seen = self.cached if work_by == "model" else None
        if self.seen is None and work_cache_factor > 0:
            self.seen = PrefixHistory(self.chunk_size, 1 << 40, holders=False)
        self.replicas: dict[str, ReplicaLearning] = {}
        self._fleet = ReplicaLearning(DecayedRate(tau_s), DecayedRate(tau_s))  # the informed one's pool
        self._output = DecayedRate(tau_s * 10)  # output tokens per request (every replica)
        #: request id -> (replica, uncached tokens predicted, when routed)
        self._requests: dict[str, tuple[str, float, float]] = {}
        self._first: dict[str, float] = {}  # request id -> its first token's time
        self.band = float(band)
        self.fleet_z = float(fleet_z)
        self.queue_time = queue_time
        self._queued: dict[str, float] = {}  # request id -> seconds it waited at its replica (reported)
        #: request id -> its provisional prefill sample (replica, routed, the previous first token, its
        #: first token, work, seconds), amended when its wait is reported
        self._held: dict[str, tuple[str, float, float, float, float, float]] = {}
        self.counts.update({"placed": 0, "weighted": 0, "kv_guarded": 0, "queue_reports": 0, "kept": 0})

    @property
    def kv_guard(self) -> bool:
        """Whether the KV guard places new prefixes (see the module docstring)."""
        return self.resident is not None

    # -- what it learns -------------------------------------------------------------------------
    def _replica(self, name: str) -> ReplicaLearning:
        r = self.replicas.get(name)
        if r is None:
            r = self.replicas[name] = ReplicaLearning(DecayedRate(self.tau_s), DecayedRate(self.tau_s))
            kv = (self.told_kv_tokens or {}).get(name)
            if kv is not None:
                self._set_kv(name, r, kv)
        return r

    def _set_kv(self, name: str, r: ReplicaLearning, kv_tokens: int) -> None:
        if r.kv_tokens == kv_tokens:
            return
        r.kv_tokens = kv_tokens
        if self.resident is not None:
            self.resident.set_limit(name, max(1, kv_tokens))
        if self.cached is not None:
            self.cached.set_limit(name, max(1, round(self.cache_factor * kv_tokens)))
        if self.seen is not None and self.seen is not self.cached:  # the LRU that only counts
            self.seen.set_limit(name, max(1, round(self.work_cache_factor * kv_tokens)))

    def scraped(self, replica: str, metrics: Mapping[str, Any]) -> None:
        r = self._replica(replica)
        info = metrics.get("vllm:cache_config_info")
        if info and self.told_kv_tokens is None:
            self._set_kv(replica, r, int(info["num_gpu_blocks"]) * int(info["block_size"]))
        keys = ("vllm:request_prefill_time_seconds_sum", "vllm:request_prompt_tokens_sum",
                "vllm:prefix_cache_hits_total")
        if all(k in metrics for k in keys):
            now = {k: float(metrics[k]) for k in keys}
            if r.scraped:
                seconds = now[keys[0]] - r.scraped[keys[0]]
                tokens = (now[keys[1]] - r.scraped[keys[1]]) - (now[keys[2]] - r.scraped[keys[2]])
                if tokens > 0 and seconds > 0:
                    if r.metrics_prefill is None:
                        r.metrics_prefill = DecayedRate(self.tau_s)
                    r.metrics_prefill.add(self.clock(), seconds, tokens)
            r.scraped = now

    def _slowdowns(self, replica: str, now: float) -> tuple[float, float]:
        assert self.told is not None
        return self.told(replica, now)

    @property
    def reads_queue_time(self) -> bool:
        return self.queue_time != "off"

    def scheduled(self, request_id: str, queued_s: float) -> None:
        if not (self.reads_queue_time and math.isfinite(queued_s) and queued_s >= 0):
            return
        held = self._held.pop(request_id, None)
        if held is not None:  # its first token came first (vLLM reports the wait at the end)
            self.counts["queue_reports"] += 1
            replica, routed_at, floor, at, work, provisional = held
            seconds = self._service_s(routed_at + queued_s, floor, at)
            r = self._replica(replica)
            if self.told is not None:
                slowdown = self._slowdowns(replica, at)[0]
                self._fleet.prefill.amend(at, provisional / slowdown, seconds / slowdown, work)
            r.prefill.amend(at, provisional, seconds, work)
        elif request_id in self._requests and request_id not in self._first:
            self.counts["queue_reports"] += 1
            self._queued[request_id] = queued_s

    @staticmethod
    def _service_s(start: float, floor: float, at: float) -> float:
        """A prefill's service time: to its first token at ``at`` from the later of its ``start`` (its
        routing, or its first step where the wait is reported) and the replica's previous first token."""
        return at - max(start, floor)

    def caches_later(self, request_id: str | None) -> bool:
        return self.in_flight is not None and request_id is not None

    def cache_holds(self, cached: PrefixHistory, hashes: np.ndarray) -> dict[str, int]:
        """The cache model's holders, and on the engine's clock (``cache_clock="prefilled"``) each
        replica's requests in flight too: the engine keeps what they use, and a queued one brings its
        prefix back when it runs."""
        held = cached.match(hashes)
        if self.in_flight is not None:
            for r, depth in self.in_flight.match(hashes).items():
                held[r] = max(held.get(r, 0), depth)
        return held

    def _enter_cache(self, request_id: str) -> None:
        entry = self._to_cache.pop(request_id, None)
        if entry is not None and self.cached is not None:
            self.cached.insert(*entry)

    def prefilled(self, request_id: str) -> None:
        self._enter_cache(request_id)
        entry = self._requests.get(request_id)
        if entry is None or request_id in self._first:
            return
        replica, uncached, routed_at = entry
        now = self.clock()
        r = self._replica(replica)
        r.queued_tokens = max(0.0, r.queued_tokens - uncached)
        floor = r.last_first_token
        r.last_first_token = max(r.last_first_token, now)
        self._first[request_id] = now
        work = uncached + self.overhead_tokens
        reported = self._queued.pop(request_id, None)
        # from its first step where the wait is reported; provisionally from its routing until it is
        seconds = self._service_s(routed_at + (reported or 0.0), floor, now)
        if self.told is not None:
            self._fleet.prefill.add(now, seconds / self._slowdowns(replica, now)[0], work)
        r.prefill.add(now, seconds, work)
        if self.reads_queue_time and reported is None:
            self._held[request_id] = (replica, routed_at, floor, now, work, seconds)

    def finished(self, request_id: str, output_tokens: int | None = None) -> None:
        if self.in_flight is not None:
            self._enter_cache(request_id)  # never heard of its first token: it enters at its end
            self.in_flight.finished(request_id)
        self._held.pop(request_id, None)  # no wait reported: its sample stays as it was taken
        entry = self._requests.pop(request_id, None)
        first = self._first.pop(request_id, None)
        self._queued.pop(request_id, None)
        if entry is None:
            return
        replica = entry[0]
        if first is None:  # never heard of its first token: its prefill leaves the queue now
            r = self._replica(replica)
            r.queued_tokens = max(0.0, r.queued_tokens - entry[1])
            return
        if output_tokens is None:
            return
        now = self.clock()
        self._output.add(now, float(output_tokens), 1.0)
        if output_tokens > 1:
            seconds = now - first
            if self.told is not None:
                self._fleet.decode.add(now, seconds / self._slowdowns(replica, now)[1], output_tokens - 1)
            self._replica(replica).decode.add(now, seconds, output_tokens - 1)

    def forget(self, replica: str) -> None:
        super().forget(replica)
        if self.seen is not None and self.seen is not self.cached:
            self.seen.forget(replica)
        if self.resident is not None:
            self.resident.forget(replica)
        if self.in_flight is not None:
            self.in_flight.forget(replica)
            for rid in [rid for rid, e in self._to_cache.items() if e[1] == replica]:
                del self._to_cache[rid]
        self.replicas.pop(replica, None)
        for rid in [rid for rid, e in self._requests.items() if e[0] == replica]:
            del self._requests[rid]
            self._first.pop(rid, None)
            self._queued.pop(rid, None)
            self._held.pop(rid, None)

    # -- the speeds it predicts with ------------------------------------------------------------
    def _speeds(self, replicas: Collection[str], part: str, now: float,
                explore: bool = True) -> dict[str, float | None]:
        """Seconds per token of ``part`` (``"prefill"`` or ``"decode"``) on each of ``replicas`` now:
        its own estimate (the fleet's median before its first sample) relaxed, with ``explore``,
        towards the fleet's median as its last sample ages (or the informed pool's). One median for
        all of them: a decision costs O(replicas)."""
        if self.told is not None:
            pooled = getattr(self._fleet, part).value
            k = 0 if part == "prefill" else 1
            return {r: None if pooled is None else pooled * self._slowdowns(r, now)[k] for r in replicas}
        known = [v for v in (getattr(x, part).value for x in self.replicas.values()) if v is not None]
        if not known:
            return dict.fromkeys(replicas)
        median = statistics.median(known)
        out: dict[str, float | None] = {}
        learned = self.replicas
        for r in replicas:
            own = getattr(learned.get(r) or self._replica(r), part)
            value = own.value
            if value is None:
                out[r] = median
            elif value <= median or not explore:
                out[r] = value
            else:
                trust = math.exp(-max(0.0, now - own.last) / self.explore_s)  # optimism grows as it ages
                out[r] = trust * value + (1.0 - trust) * median
        return out

    def _speed(self, replica: str, part: str, now: float, explore: bool = True) -> float | None:
        return self._speeds((replica,), part, now, explore)[replica]

    def predicted_completion(self, replica: str, uncached: float, now: float) -> float | None:
        """Seconds from now to the finish of a request with ``uncached`` prompt tokens on ``replica``:
        its queue and its own prefill at its prefill speed, the mean output at its decode speed."""
        prefill, decode = self._speed(replica, "prefill", now), self._speed(replica, "decode", now)
        if prefill is None:
            return None
        output = self._output.value or self.prior_output_tokens
        queue = self._replica(replica).queued_tokens
        return (queue + uncached + self.overhead_tokens) * prefill + max(0.0, output - 1) * (decode or 0.0)

    def _uncached(self, hashes: np.ndarray | None, n: int, ok: Collection[str]) -> dict[str, float]:
        if hashes is None or len(hashes) == 0 or self.seen is None:
            return dict.fromkeys(ok, float(n))
        seen, chunk = self.seen, self.chunk_size
        if seen is self.cached:  # what the model (and, on the engine's clock, the requests in flight) hold
            held = self.cache_holds(seen, hashes)
            return {r: float(max(0, n - min(n, held.get(r, 0) * chunk))) for r in ok}
        return {r: float(max(0, n - min(n, seen.depth(hashes, r) * chunk))) for r in ok}

    def weights(self, replicas: Collection[str], now: float) -> dict[str, float]:
        """Each replica's prefill time per token over the fleet median's; 1 within ``band`` of it, and all 1
        with ``fleet_z`` unless the estimates' squared distances from their median (in log) over their
        squared standard errors sum past chi-square's quantile at ``fleet_z`` (:meth:`_separated`): equal
        replicas look equal through the estimates' noise. Prefill alone: a request's TPOT here is mostly
        the prefill steps it waits behind (its replica's load, which the loads count already), so the
        decode estimates say more about load than about speed."""
        prefill = self._speeds(replicas, "prefill", now)
        known = [p for p in prefill.values() if p is not None]
        if len(known) < len(prefill):
            return dict.fromkeys(replicas, 1.0)
        median = statistics.median(known)
        if self.fleet_z > 0 and median > 0 and not self._separated(prefill, median):
            return dict.fromkeys(replicas, 1.0)
        out = {}
        for r, p in prefill.items():
            w = p / median if median > 0 else 1.0
            out[r] = 1.0 if abs(w - 1.0) < self.band else w
        return out

    def _separated(self, prefill: Mapping[str, float | None], median: float) -> bool:
        """Whether the replicas' prefill estimates differ beyond their noise: the sum of each one's squared
        distance from the median (in log) over its squared standard error exceeds chi-square's quantile at
        ``fleet_z`` (a normal deviate, by Wilson and Hilferty) for as many replicas as have one, less one."""
        total, k = 0.0, -1
        for r, p in prefill.items():
            err = self._replica(r).prefill.relative_error
            if p and p > 0 and math.isfinite(err) and err > 0:
                total += (math.log(p / median) / err) ** 2
                k += 1
        return k >= 1 and total > chi2_quantile(k, self.fleet_z)

    def kv_room(self, replicas: Collection[str], tokens: int) -> dict[str, float]:
        """The replicas of ``replicas`` with room for a new prompt of ``tokens`` tokens, each with the share
        of its KV it would then hold (its resident distinct prompt tokens, by :attr:`resident`, and the
        prompt's, over its KV tokens). Empty, the guard silent, unless every one's KV is known and they
        differ (equal replicas are placed as ours places them), and with the guard off."""
        if self.resident is None:
            return {}
        kv = {r: self._replica(r).kv_tokens for r in replicas}
        sizes = [k for k in kv.values() if k is not None]
        if len(sizes) < len(kv) or len(set(sizes)) < 2:
            return {}
        fill = {r: (self.resident.size[r] + tokens) / k for r, k in kv.items() if k is not None}
        return {r: f for r, f in fill.items() if f <= self.kv_fill}

    def choose(self, hashes: np.ndarray | None, loads: Mapping[str, int],
               avoid: Collection[str] = (), *, tokens: int | None = None) -> str:
        now = self.clock()
        requests = loads  # in flight, before the weights
        w = self.weights(loads.keys(), now)
        if any(x != 1.0 for x in w.values()):  # ours on loads in units of a median replica's requests
            self.counts["weighted"] += 1
            loads = {r: (load + 1) * w[r] - 1 for r, load in loads.items()}
        new_before, evicted_before = self.counts["new"], self.counts["evicted"]
        choice = super().choose(hashes, loads, avoid, tokens=tokens)
        if self.counts["evicted"] != evicted_before and self.move_room is not None and hashes is not None:
            kept = self._keep(hashes, requests, avoid, choice)
            if kept is not None:
                return kept
        if self.counts["new"] == new_before or not (self.kv_guard or self.place_new):
            return choice  # a known prefix, or no option for a new one: ours
        ok = self._allowed(loads, avoid)
        n = self._length(hashes, tokens)
        if self.kv_guard:
            room = self.kv_room(ok, n)
            if room and choice not in room:
                self.counts["kv_guarded"] += 1
                choice = min(room, key=lambda r: (room[r], loads[r], r))
        if not self.place_new:
            return choice
        # a prefix no replica holds (or holds no longer) is prefilled in full wherever it goes:
        # the replica that is predicted to finish it first
        uncached = self._uncached(hashes, n, ok)
        cost = {r: self.predicted_completion(r, uncached[r], now) for r in ok}
        if any(c is None for c in cost.values()):
            return choice  # nothing learned yet: ours
        best = min(ok, key=lambda r: (cost[r], loads[r], r))
        if best != choice:
            self.counts["placed"] += 1
        return best

    def _keep(self, hashes: np.ndarray, requests: Mapping[str, int], avoid: Collection[str],
              choice: str) -> str | None:
        """The owner of a document the cache model declared evicted, where it stays: unless it moves to
        ``choice``, where a new prefix goes (:meth:`_moves`), while the owner is under the load bound
        (``requests``: each replica's requests in flight). ``None``: it goes to ``choice``."""
        _, owner = self.owner(hashes)
        if owner is None or owner not in requests or owner in avoid or self._moves(hashes, requests, choice,
                                                                                   owner):
            return None
        if requests[owner] >= self.bound(sum(requests.values()), len(requests)):
            return None
        self.counts["kept"] += 1
        return owner

    def _moves(self, hashes: np.ndarray, requests: Mapping[str, int], choice: str, owner: str) -> bool:
        """Whether a document the cache model declared evicted from ``owner`` moves to ``choice``: ``choice``
        has at most ``move_room`` requests in flight (always, with ``move_room=None``)."""
        return self.move_room is None or requests[choice] <= self.move_room

    def routing_cache(self, loads: Mapping[str, float]) -> PrefixHistory | None:
        """Ours' cache model, or with ``homogeneous_cache`` none (it only counts) unless the fleet looks
        homogeneous: every replica's KV published and the same, every weight 1."""
        if self.cached is None or not self.homogeneous_cache:
            return self.cached
        sizes = {self._replica(r).kv_tokens for r in loads}
        homogeneous = len(sizes) == 1 and None not in sizes and all(
            x == 1.0 for x in self.weights(loads.keys(), self.clock()).values())
        return self.cached if homogeneous else None

    def _length(self, hashes: np.ndarray | None, tokens: int | None) -> int:
        if hashes is None or len(hashes) == 0:
            return int(tokens or 0)
        return prompt_tokens(hashes, tokens, self.chunk_size)

    def routed(self, hashes: np.ndarray | None, replica: str, *, tokens: int | None = None,
               request_id: str | None = None) -> None:
        # before the prompt enters the cache model
        uncached = self._uncached(hashes, self._length(hashes, tokens), (replica,))[replica]
        super().routed(hashes, replica, tokens=tokens, request_id=request_id)
        if self.seen is not None and self.seen is not self.cached and hashes is not None:
            self.seen.insert(hashes, replica, tokens)
        if self.resident is not None and hashes is not None and len(hashes):
            # before its KV is known too: the LRU is cut to the KV once it is (PrefixHistory.set_limit)
            self.resident.insert(hashes, replica, tokens)
        if request_id is None:
            return
        if self.in_flight is not None and hashes is not None:
            keys = hashes.tolist()
            self.in_flight.add(request_id, replica, 0, keys, chunk_spans(len(keys), tokens, self.chunk_size))
            self._to_cache[request_id] = (hashes, replica, tokens)
        r = self._replica(replica)
        r.queued_tokens += uncached
        self._requests[request_id] = (replica, uncached, self.clock())

    # -- what it shows --------------------------------------------------------------------------
    def estimates(self) -> dict[str, dict[str, Any]]:
        """Per replica: the prefill and decode speeds it learned (tokens/s: uncached prompt tokens, and
        one request's output tokens), the prefill speed it routes by now (the learned one relaxed
        towards the fleet's median as it ages), its own samples of each, the KV tokens it read, its
        queue of uncached prefill tokens, and the prefill speed vLLM's histograms give (``None`` until
        two scrapes)."""
        now = self.clock()
        out = {}
        names = sorted(self.replicas)
        prefills, decodes = (self._speeds(names, part, now, explore=False) for part in ("prefill", "decode"))
        routeds = self._speeds(names, "prefill", now)
        for name in names:
            r = self.replicas[name]
            prefill, decode, routed = prefills[name], decodes[name], routeds[name]
            mp = r.metrics_prefill.value if r.metrics_prefill is not None else None
            out[name] = {"prefill_tok_s": 1.0 / prefill if prefill else None,
                         "decode_tok_s": 1.0 / decode if decode else None,
                         "routing_prefill_tok_s": 1.0 / routed if routed else None,
                         "kv_tokens": r.kv_tokens, "prefill_samples": r.prefill.samples,
                         "decode_samples": r.decode.samples, "queued_tokens": r.queued_tokens,
                         "metrics_prefill_tok_s": 1.0 / mp if mp else None}
        return out

    def state(self) -> dict[str, Any]:
        return {**super().state(), "learned_replicas": len(self.replicas)}


#: Where :class:`SloRouter` sends a request no replica is predicted to serve within the SLO.
DOOMED = ("ours", "worst", "sacrifice", "least")
#: How :class:`SloRouter` predicts a replica's TPOT.
TPOT_MODELS = ("tokens", "distinct", "observed")


class SloRouter(LearnedRouter):
    """Ours learned, routing by predicted SLO attainment (``prefix-slo``): told the SLO, not the replicas.

    For each candidate replica it predicts the request's TTFT (the replica's queue of uncached prefill
    tokens and the request's own, at the replica's learned prefill speed) and TPOT (``tpot_model``: by
    default the replica's learned TPOT per token of distinct context in flight, times that context with
    this request's added: a decode step's time is mostly its batch's KV reads, and a document's shared
    prefix is read once for all its questions). Ours' choice (:class:`LearnedRouter`, prefix affinity
    on speed-weighted loads) stands when it is predicted to meet both SLOs within ``ttft_margin`` /
    ``tpot_margin`` of them; else the feasible replica of the least predicted TTFT (the most slack);
    where none is feasible (the request is predicted to miss wherever it goes), ``doomed`` says where it
    goes: ``"ours"`` (ours' choice, its cache affinity kept), ``"worst"`` (the replica of the longest
    predicted TTFT: the overload is kept on the replicas already missing, and the others stay within
    their SLO), ``"sacrifice"`` (default: of the replicas already predicted past the TTFT SLO, the
    soonest; none: the longest, as ``"worst"``: the overload is spread over the replicas given up on,
    not piled on one), or ``"least"`` (the least predicted TTFT). ``scope="new"`` (default) applies the
    rule to new prefixes only (a known prefix stays with ours' choice, its cache). On
    ``benchmarks.unequal_replicas``' held-out seeds ``doomed="worst"`` (tuned) is 1.16x the best tuned
    peer's attainment on the speed fleet at load 1, at 0.84x its throughput: it gives a replica up, as
    Ray's rule does there (the note of 2026-12-06, third session).

    Args:
        ttft_slo_s, tpot_slo_s: the SLO (seconds).
        ttft_margin, tpot_margin: a replica is feasible when predicted within these fractions of them.
        doomed: where a request no replica is predicted to serve within the SLO goes (above).
        scope: ``"all"`` or ``"new"`` (above).
        tpot_model: ``"tokens"``: a replica's TPOT is predicted as its learned TPOT per token of
            context in flight (the prompts routed there and not finished) times those tokens with this
            request's (a decode step's time is mostly its batch's context reads); ``"distinct"``
            (default): the same with each document's context counted once (the requests of one
            document read its shared prefix from the CPU's cache, the calibrated step model's miss
            term); ``"observed"``: the TPOT its recent requests saw.
        **kwargs: :class:`LearnedRouter`'s.
    """

    name = "prefix-slo"

    def __init__(self, ttft_slo_s: float = 5.0, tpot_slo_s: float = 0.05, ttft_margin: float = 0.8,
                 tpot_margin: float = 0.9, doomed: str = "sacrifice", scope: str = "new",
                 tpot_model: str = "distinct", **kwargs: Any) -> None:
        if doomed not in DOOMED or scope not in ("all", "new"):
            raise ValueError(f"doomed must be one of {DOOMED} and scope all or new")
        if not (ttft_slo_s > 0 and tpot_slo_s > 0 and ttft_margin > 0 and tpot_margin > 0):
            raise ValueError("SLOs and margins must be > 0")
        super().__init__(**kwargs)
        self.ttft_slo_s, self.tpot_slo_s = float(ttft_slo_s), float(tpot_slo_s)
        self.ttft_margin, self.tpot_margin = float(ttft_margin), float(tpot_margin)
        self.doomed, self.scope = doomed, scope
        if tpot_model not in TPOT_MODELS:
            raise ValueError(f"tpot_model must be one of {TPOT_MODELS}")
        self.tpot_model = tpot_model
        #: per replica: its TPOT per token of context in flight (a fit through the origin, decayed)
        self._tpot_per_token: dict[str, DecayedRate] = {}
        self._inflight: dict[str, float] = {}  # replica -> prompt tokens of its requests in flight
        self._prompt: dict[str, tuple[str, float, int | None]] = {}  # request id -> (replica, tokens, doc)
        #: replica -> document (its first chunk key) -> [requests in flight, their prompt tokens]
        self._docs: dict[str, dict[int | None, list[float]]] = {}
        self._k_first: dict[str, float] = {}  # request id -> its replica's K at its first token
        self.counts.update({"slo_moved": 0, "doomed": 0})

    def _context(self, replica: str, doc: int | None = None, tokens: float = 0.0) -> float:
        """The context in flight on ``replica`` (with a request of ``tokens`` prompt tokens of document
        ``doc`` added): its prompt tokens, or with ``tpot_model="distinct"`` each document's once (the
        mean prompt of its requests in flight)."""
        if self.tpot_model != "distinct":
            return self._inflight.get(replica, 0.0) + tokens
        docs = self._docs.get(replica, {})
        k = self._inflight.get(replica, 0.0)  # the distinct sum, kept by _add_doc
        if tokens and (doc is None or doc not in docs):
            k += tokens
        return k

    def _add_doc(self, replica: str, doc: int | None, tokens: float, sign: int) -> None:
        if self.tpot_model != "distinct":
            self._inflight[replica] = max(0.0, self._inflight.get(replica, 0.0) + sign * tokens)
            return
        docs = self._docs.setdefault(replica, {})
        count, total = docs.get(doc, [0.0, 0.0])
        before = total / count if count else 0.0
        count, total = count + sign, total + sign * tokens
        after = total / count if count > 0 else 0.0
        if count > 0:
            docs[doc] = [count, total]
        else:
            docs.pop(doc, None)
        self._inflight[replica] = max(0.0, self._inflight.get(replica, 0.0) + after - before)

    def predicted(self, replicas: Collection[str], uncached: Mapping[str, float], now: float,
                  tokens: float = 0.0, doc: int | None = None) -> dict[str, tuple[float, float]] | None:
        """``{replica: (TTFT s, TPOT s)}`` predicted for a request of ``tokens`` prompt tokens, ``uncached``
        of them on each replica (``None`` before every replica's prefill speed is known; a TPOT of 0
        before the replica's first finish)."""
        prefill = self._speeds(replicas, "prefill", now)
        decode = self._speeds(replicas, "decode", now)
        out = {}
        for r in replicas:
            p = prefill[r]
            if p is None:
                return None
            queue = self._replica(r).queued_tokens
            tpot = decode[r] or 0.0
            if self.tpot_model != "observed":
                rate = self._tpot_per_token.get(r)
                k = self._context(r, doc, tokens)
                tpot = rate.value * k if rate is not None and rate.value is not None else 0.0
            out[r] = ((queue + uncached[r] + self.overhead_tokens) * p, tpot)
        return out

    def routed(self, hashes: np.ndarray | None, replica: str, *, tokens: int | None = None,
               request_id: str | None = None) -> None:
        super().routed(hashes, replica, tokens=tokens, request_id=request_id)
        if request_id is not None:
            n = float(self._length(hashes, tokens))
            doc = int(hashes[0]) if hashes is not None and len(hashes) else None
            self._prompt[request_id] = (replica, n, doc)
            self._add_doc(replica, doc, n, +1)

    def prefilled(self, request_id: str) -> None:
        super().prefilled(request_id)
        entry = self._prompt.get(request_id)
        if entry is not None:
            self._k_first[request_id] = self._context(entry[0])

    def finished(self, request_id: str, output_tokens: int | None = None) -> None:
        first = self._first.get(request_id)
        super().finished(request_id, output_tokens)
        entry = self._prompt.pop(request_id, None)
        k_first = self._k_first.pop(request_id, None)
        if entry is None:
            return
        replica, n, doc = entry
        k_now = self._context(replica)
        self._add_doc(replica, doc, n, -1)
        if first is None or k_first is None or output_tokens is None or output_tokens <= 1:
            return
        now = self.clock()
        rate = self._tpot_per_token.setdefault(replica, DecayedRate(self.tau_s))
        # TPOT over the mean context in flight during its decode: seconds per (token x context token)
        rate.add(now, (now - first) / (output_tokens - 1), (k_first + k_now) / 2)

    def forget(self, replica: str) -> None:
        super().forget(replica)
        self._tpot_per_token.pop(replica, None)
        self._inflight.pop(replica, None)
        self._docs.pop(replica, None)
        for rid in [rid for rid, e in self._prompt.items() if e[0] == replica]:
            del self._prompt[rid]
            self._k_first.pop(rid, None)

    def choose(self, hashes: np.ndarray | None, loads: Mapping[str, int],
               avoid: Collection[str] = (), *, tokens: int | None = None) -> str:
        new_before = self.counts["new"]
        choice = super().choose(hashes, loads, avoid, tokens=tokens)
        if self.scope == "new" and self.counts["new"] == new_before:
            return choice
        now = self.clock()
        ok = self._allowed(loads, avoid)
        n = self._length(hashes, tokens)
        uncached = dict.fromkeys(ok, float(n))
        if hashes is not None and len(hashes):
            level, owner = self.owner(hashes)
            if owner in uncached:
                uncached[owner] = float(max(0, n - (level + 1) * self.chunk_size))
        doc = int(hashes[0]) if hashes is not None and len(hashes) else None
        pred = self.predicted(ok, uncached, now, float(n), doc)
        if pred is None:
            return choice

        def feasible(r: str) -> bool:
            ttft, tpot = pred[r]
            return ttft <= self.ttft_margin * self.ttft_slo_s and tpot <= self.tpot_margin * self.tpot_slo_s

        if feasible(choice):
            return choice
        good = [r for r in ok if feasible(r)]
        if good:
            self.counts["slo_moved"] += 1
            return min(good, key=lambda r: (pred[r][0], loads[r], r))
        self.counts["doomed"] += 1
        if self.doomed == "worst":
            return max(ok, key=lambda r: (pred[r][0], -loads[r], r))
        if self.doomed == "sacrifice":
            late = [r for r in ok if pred[r][0] > self.ttft_slo_s]
            if late:  # already past the TTFT SLO: the soonest of them
                return min(late, key=lambda r: (pred[r][0], loads[r], r))
            return max(ok, key=lambda r: (pred[r][0], -loads[r], r))
        if self.doomed == "least":
            return min(ok, key=lambda r: (pred[r][0], loads[r], r))
        return choice


class SecondsAffinityRouter(LearnedRouter):
    """Ours learned with Ray's prefix affinity and an imbalance in predicted seconds of work
    (``prefix-seconds``): a known prefix goes to its owner unless the owner's predicted wait (its queue
    of uncached prefill tokens at its learned prefill speed) exceeds the least of the fleet's by more
    than ``imbalance_s`` seconds; a new prefix, or one spilled, goes to the replica of the least
    predicted completion of it (:meth:`LearnedRouter.predicted_completion`: queue, own prefill and the
    mean output, each at that replica's speeds). Before any speed is known, ours learned.

    Args:
        imbalance_s: the owner's predicted wait over the least one's that spills (``inf``: pure
            affinity, as Ray's rule at its defaults).
        **kwargs: :class:`LearnedRouter`'s.
    """

    name = "prefix-seconds"

    def __init__(self, imbalance_s: float = 5.0, **kwargs: Any) -> None:
        if not imbalance_s >= 0:
            raise ValueError("imbalance_s must be >= 0")
        super().__init__(**kwargs)
        self.imbalance_s = float(imbalance_s)

    def choose(self, hashes: np.ndarray | None, loads: Mapping[str, int],
               avoid: Collection[str] = (), *, tokens: int | None = None) -> str:
        now = self.clock()
        ok = self._allowed(loads, avoid)
        prefill = self._speeds(ok, "prefill", now)
        if hashes is None or len(hashes) == 0 or any(p is None for p in prefill.values()):
            return super().choose(hashes, loads, avoid, tokens=tokens)
        n = self._length(hashes, tokens)
        level, owner = self.owner(hashes)
        if owner is not None and min((level + 1) * self.chunk_size, n) < self.min_match * n:
            owner = None
        wait = {r: self._replica(r).queued_tokens * (prefill[r] or 0.0) for r in ok}
        if owner in wait and wait[owner] - min(wait.values()) <= self.imbalance_s:
            self.counts["affinity"] += 1
            return owner
        self.counts["new" if owner is None else "spilled"] += 1
        cost = {r: self.predicted_completion(r, float(n), now) or 0.0 for r in ok}
        return min(ok, key=lambda r: (cost[r], loads[r], r))


class CostRouter(LearnedRouter):
    """LMetric's product on learned speeds (``prefix-cost``): the replica of the least
    ``(uncached prompt tokens + overhead_tokens) x w x (requests in flight + 1) ** load_power``, where the
    uncached tokens are the prompt less the longest prefix that replica was sent (LMetric's KV indicator,
    a :class:`PrefixHistory` of what each replica was sent) and ``w`` the replica's learned prefill time
    per token over the fleet's median (:meth:`LearnedRouter.weights`: 1 within ``band``). The product is
    a new prefill's stall (its prefill seconds) times the requests it stalls (a replica's decoding
    requests wait out every prefill step: the TPOT misses of the unequal fleets, the note's third
    session), so a new document goes where it stalls the least, and a known one stays where it is cheap.

    Args:
        load_power: the exponent of the load term (LMetric: 1).
        **kwargs: :class:`LearnedRouter`'s (``overhead_tokens``: the work of a fully cached prompt).
    """

    name = "prefix-cost"

    def __init__(self, load_power: float = 1.0, **kwargs: Any) -> None:
        if not load_power > 0:
            raise ValueError("load_power must be > 0")
        super().__init__(**kwargs)
        self.load_power = float(load_power)
        self.held = PrefixHistory(self.chunk_size, 1 << 40)

    def choose(self, hashes: np.ndarray | None, loads: Mapping[str, int],
               avoid: Collection[str] = (), *, tokens: int | None = None) -> str:
        ok = self._allowed(loads, avoid)
        if hashes is None or len(hashes) == 0:
            return min(ok, key=lambda r: (loads[r], r))
        w = self.weights(ok, self.clock())
        n = self._length(hashes, tokens)
        held = self.held.match(hashes)
        chunk = self.chunk_size

        def score(r: str) -> float:
            uncached = max(0, n - min(held.get(r, 0) * chunk, n))
            return (uncached + self.overhead_tokens) * w[r] * (loads[r] + 1) ** self.load_power

        if not any(held.get(r, 0) for r in ok):
            self.counts["new"] += 1  # no replica was sent any of it
        return min(ok, key=lambda r: (score(r), loads[r], r))

    def routed(self, hashes: np.ndarray | None, replica: str, *, tokens: int | None = None,
               request_id: str | None = None) -> None:
        super().routed(hashes, replica, tokens=tokens, request_id=request_id)
        if hashes is not None and len(hashes):
            self.held.insert(hashes, replica, tokens)

    def forget(self, replica: str) -> None:
        super().forget(replica)
        self.held.forget(replica)


class CostSloRouter(SloRouter, CostRouter):
    """:class:`SloRouter`'s rule over :class:`CostRouter`'s choice (``prefix-cost-slo``): LMetric's
    product on learned speeds, then, where no replica is predicted to serve a request within the SLO,
    ``doomed``'s placement (``scope="new"``: for a prompt no replica was sent any of)."""

    name = "prefix-cost-slo"


#: The learned router's variants by name (``benchmarks.unequal_replicas``' ``--variants``).
VARIANTS: dict[str, type[LearnedRouter]] = {SloRouter.name: SloRouter,
                                            SecondsAffinityRouter.name: SecondsAffinityRouter,
                                            CostRouter.name: CostRouter, CostSloRouter.name: CostSloRouter}
