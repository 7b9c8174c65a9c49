"""What both data planes of ``feather-serve --replicas N`` share; no Ray, no vLLM, no HTTP server.

``feather-serve --replicas N`` serves N engine replicas behind one endpoint through one of two data
planes: the lean asyncio proxy of :mod:`scheduler_runtime.serving.proxy` (one machine, the default) or the
Ray Serve application of :mod:`scheduler_runtime.serving.cluster` (several machines). Both take a
:class:`ClusterConfig`, pin a CPU replica to its cores the same way (:func:`core_binding`), answer
errors with vLLM's error body (:func:`error_body`) and serve the same ``/metrics``: every replica's
exposition with a ``replica`` label, the sums over the replicas under ``cluster:<name>``
(:func:`replica_exposition`), and the front end's own counters (:class:`FrontEndStats`).

This module sits below both (and below :mod:`scheduler_runtime.serving.serve` and
:mod:`scheduler_runtime.serving.ray_router`), so none of them imports another to reach these pieces.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from scheduler_runtime.hardware import kv_bytes_per_token, online_cores, parse_cores
from scheduler_runtime.learned_router import QUEUE_TIME as LEARNED_QUEUE_TIME
from scheduler_runtime.learned_router import QUEUE_TIME_MODES
from scheduler_runtime.prefix_index import DEFAULT_CHUNK_SIZE
from scheduler_runtime.serving.replica_args import check_replica_args, without_flags

if TYPE_CHECKING:  # admission_http imports this module
    from scheduler_runtime.serving.admission_http import AdmissionSettings

__all__ = ["DATA_PLANES", "LIVE_ROUTERS", "PROXY_ONLY_ROUTERS", "RAY_ONLY_ROUTERS", "ROUTER_CHOICES",
           "ClusterConfig", "FrontEndStats", "core_binding", "error_body", "estimates_exposition",
           "flag_value", "gpu_groups", "replica_exposition", "replica_kv_tokens", "soonest_retry"]

ROUTER_CHOICES = ("prefix", "pow2", "ray-prefix-affinity", "prefix-learned")
#: Routers that only the proxy data plane has (none now: ours learning each replica's speed and KV size,
#: :class:`~scheduler_runtime.learned_router.LearnedRouter`, runs on both, fed by the streams the front end
#: relays and each replica's ``/metrics``: scraped by the proxy, Ray's routing stats on Ray Serve).
PROXY_ONLY_ROUTERS: tuple[str, ...] = ()
#: Routers that only the Ray data plane has: Ray Serve LLM's ``PrefixCacheAffinityRouter`` (ray 2.60,
#: its defaults; importing it needs ``pyarrow``, the ``peers`` extra), to measure ours against.
RAY_ONLY_ROUTERS = ("ray-prefix-affinity",)
#: The vLLM flag that makes a replica report each request's wait before its first step (``queue_time``).
PER_REQUEST_METRICS = "--enable-per-request-metrics"
#: ``proxy``: :mod:`scheduler_runtime.serving.proxy` (one machine);
#: ``ray``: :mod:`scheduler_runtime.serving.cluster`.
DATA_PLANES = ("proxy", "ray")

#: The Ray Serve prefix routers of this process (the ingress's), so that ``/metrics`` can report
#: their decisions (:class:`scheduler_runtime.serving.ray_router.PrefixRequestRouter` registers itself).
LIVE_ROUTERS: list[Any] = []


@dataclass(frozen=True)
class ClusterConfig:
    """What ``feather-serve --replicas N`` deploys (``docs/cluster.md``).

    Attributes:
        replicas: engine replicas (>= 1; ``feather-serve`` runs 1 as the plain server).
        router: ``"prefix"`` (ours), ``"pow2"``, ``"ray-prefix-affinity"`` (Ray's, ``ray`` only) or
            ``"prefix-learned"`` (ours learning each replica's speed and KV).
        data_plane: ``"proxy"`` (replica processes on this machine behind an asyncio proxy) or
            ``"ray"`` (a Ray Serve application, on a Ray cluster or a local instance).
        vllm_args: the vLLM API server arguments every replica is built from (``feather-serve``'s).
        host, port: where the endpoint listens (vLLM's ``--host`` / ``--port``).
        chunk_size: tokens per chunk of the routing key (the scheduler's CHT chunk size).
        replica_cores: per local rank, the CPU cores its engine is pinned to (``None``: no pinning);
            with no ``ray_address`` the replicas run here, and the cores must be this machine's.
        replica_cpus, replica_gpus: Ray resources each engine replica reserves (``ray``); with the
            proxy, ``replica_gpus`` >= 1 gives replica ``k`` the ``k``-th group of that many GPUs.
        ray_address: a running Ray cluster (``auto``, ``HOST:PORT``); ``None``: start one here.
        max_ongoing_requests: requests one engine replica is sent at most (the rest wait).
        load_factor, slack: the prefix router's load bound (:class:`PrefixAffinityRouter`); its cache
            model is told each replica's KV tokens, :attr:`kv_tokens`.
        object_store_mb: the local Ray instance's object store.
        replica_weights: ``prefix-learned`` told each replica's relative speed (one per replica)
            instead of learning it (``--replica-weights``; ``proxy`` only).
        scrape_period_s: seconds between the proxy's reads of each replica's ``/metrics``, and on Ray
            Serve the period of each replica's routing stats (``prefix-learned``).
        kv_guard: ``prefix-learned`` places a new document where it fits the replica's published KV
            (``--kv-guard``; :class:`~scheduler_runtime.learned_router.LearnedRouter`'s ``kv_guard``).
        queue_time: what ``prefix-learned`` makes of each stream's wait at its replica before its first
            step (``--queue-time``, :class:`~scheduler_runtime.learned_router.LearnedRouter`'s
            ``queue_time``); unless ``"off"`` it is read from vLLM's per-request metrics: every replica is
            started with ``--enable-per-request-metrics``, and the front end asks a stream's usage chunk.
        replica_args: each replica's own engine arguments, over ``vllm_args`` (``--replica-args 'K:
            ARGS'``, :mod:`scheduler_runtime.serving.replica_args`; ``proxy`` only), one tuple per
            replica (``()``: the common ones alone); ``None``: every replica alike.
        reroute_shed: a request that a replica's admission rule shed is tried on a replica not tried yet
            (``--reroute-shed``); ``False`` (the default): that rejection is the client's answer. Past
            capacity a rerouted request is a cold prefill at a replica near its own limit: rerouting cost
            attainment on real engines and in the simulator (``docs/results.md``, "Admission across a
            fleet").
        admission: the settings of the ``slo`` / ``deadline`` admission middleware
            (:class:`~scheduler_runtime.serving.admission_http.AdmissionSettings`) from the common
            arguments (``None``: no middleware); each replica is started with its own,
            :meth:`replica_admission` (``proxy`` only).
    """

    replicas: int
    router: str = "prefix"
    data_plane: str = "proxy"
    vllm_args: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    chunk_size: int = DEFAULT_CHUNK_SIZE
    replica_cores: tuple[str, ...] | None = None
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    ray_address: str | None = None
    max_ongoing_requests: int = 1024
    load_factor: float = 20.0
    slack: int = 2
    object_store_mb: int = 200
    replica_weights: tuple[float, ...] | None = None
    scrape_period_s: float = 1.0
    kv_guard: bool = False
    queue_time: str = LEARNED_QUEUE_TIME
    replica_args: tuple[tuple[str, ...], ...] | None = None
    reroute_shed: bool = False
    admission: AdmissionSettings | None = None

    def __post_init__(self) -> None:
        """Every value checked, as ``feather-serve`` reports it (a ``ValueError`` naming the flag):
        the one check of the cluster's options, for the command line and for code that builds one."""
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.router not in ROUTER_CHOICES:
            raise ValueError(f"--router must be one of {list(ROUTER_CHOICES)}, got {self.router!r}")
        if self.data_plane not in DATA_PLANES:
            raise ValueError(f"--data-plane must be one of {list(DATA_PLANES)}, got {self.data_plane!r}")
        if self.data_plane == "proxy" and self.router in RAY_ONLY_ROUTERS:
            raise ValueError(f"--router {self.router} is Ray Serve's own router: it needs --data-plane ray")
        if self.data_plane == "ray" and self.router in PROXY_ONLY_ROUTERS:
            raise ValueError(f"--router {self.router} runs in the proxy data plane only: it needs "
                             "--data-plane proxy")
        if self.replica_weights is not None:
            if self.router != "prefix-learned":
                raise ValueError("--replica-weights are read by --router prefix-learned only")
            if self.data_plane == "ray":
                raise ValueError("--replica-weights needs --data-plane proxy: Ray Serve names its replicas "
                                 "only once they run")
            if len(self.replica_weights) != self.replicas:
                raise ValueError(f"--replica-weights: {len(self.replica_weights)} weights for "
                                 f"{self.replicas} replicas (one per replica)")
            if not all(math.isfinite(w) and w > 0 for w in self.replica_weights):
                raise ValueError(f"--replica-weights must be > 0, got {list(self.replica_weights)}")
        if self.queue_time not in QUEUE_TIME_MODES:
            raise ValueError(f"--queue-time must be one of {list(QUEUE_TIME_MODES)}, got {self.queue_time!r}")
        if self.kv_guard and self.router != "prefix-learned":
            raise ValueError("--kv-guard is a knob of --router prefix-learned only")
        if self.replica_args is not None:
            if self.replicas < 2:
                raise ValueError("--replica-args needs --replicas N >= 2 (one replica: give it the arguments "
                                 "themselves)")
            if self.data_plane == "ray":
                raise ValueError("--replica-args needs --data-plane proxy: a Ray Serve deployment starts "
                                 "every replica with the same arguments")
            if len(self.replica_args) != self.replicas:
                raise ValueError(f"--replica-args: {len(self.replica_args)} entries for {self.replicas} "
                                 "replicas (one per replica)")
            for rank, own in enumerate(self.replica_args):
                if own:
                    check_replica_args(rank, own)
        if not self.scrape_period_s > 0:
            raise ValueError(f"--scrape-period must be > 0, got {self.scrape_period_s}")
        if self.data_plane == "proxy" and self.ray_address is not None:
            raise ValueError("--ray-address needs --data-plane ray (the proxy serves local replicas)")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"--max-ongoing-requests must be >= 1, got {self.max_ongoing_requests}")
        if self.replica_cpus < 0 or self.replica_gpus < 0:
            raise ValueError("--replica-cpus and --replica-gpus must be >= 0")
        local = self.ray_address is None  # the replicas run on this machine
        machine = online_cores() if local and self.replica_cores else set()
        for spec in self.replica_cores or ():
            try:
                cores = parse_cores(spec)
            except ValueError as exc:
                raise ValueError(f"--replica-cores: {exc}") from None
            missing = sorted(set(cores) - machine) if local else []
            if missing:
                raise ValueError(f"--replica-cores {spec.strip()!r}: core(s) {missing} are not among this "
                                 f"machine's cores ({sorted(machine)})")

    def replica_vllm_args(self, rank: int) -> tuple[str, ...]:
        """The engine arguments replica ``rank`` starts with: :attr:`vllm_args`, its own
        (:attr:`replica_args`) in place of the common ones they name."""
        own = self.replica_args[rank] if self.replica_args is not None else ()
        args = (*without_flags(self.vllm_args, own[::2]), *own) if own else self.vllm_args
        if self.reads_queue_time and PER_REQUEST_METRICS not in args:
            args = (*args, PER_REQUEST_METRICS)
        return args

    @property
    def reads_queue_time(self) -> bool:
        """Whether the router reads each stream's reported wait (``prefix-learned`` with
        :attr:`queue_time`): the replicas are started with ``--enable-per-request-metrics``."""
        return self.router == "prefix-learned" and self.queue_time != "off"

    def replica_admission(self, rank: int) -> AdmissionSettings | None:
        """The admission middleware's settings of replica ``rank`` (``None``: no middleware): those of
        :attr:`admission` (rule, SLOs, status, step model) with the engine figures of the arguments it
        starts with (:meth:`replica_vllm_args`, by
        :meth:`~scheduler_runtime.serving.admission_http.AdmissionSettings.for_engine`): its own KV cache,
        ``--max-num-seqs`` and token budget where ``--replica-args`` gives them. The token budget is the
        replica's own ``--max-num-batched-tokens``, else :attr:`admission`'s (the scheduler name's
        ``@TOKENS`` included).

        Raises:
            ConfigError: figures the rule cannot use.
        """
        own = self.replica_args[rank] if self.replica_args is not None else ()
        if self.admission is None or not own:
            return self.admission
        budget = None if "--max-num-batched-tokens" in own[::2] else self.admission.token_budget
        return self.admission.for_engine(self.replica_vllm_args(rank), budget)

    @property
    def kv_tokens(self) -> int | tuple[int, ...] | None:
        """Each replica's KV cache in tokens, from the engine arguments it is started with
        (:func:`replica_kv_tokens`): one number where they are alike, one per replica where
        ``--replica-args`` sets them apart; ``None``: not known from them (for some replica)."""
        if not self.replica_args:
            return replica_kv_tokens(self.vllm_args)
        per = [replica_kv_tokens(self.replica_vllm_args(k)) for k in range(self.replicas)]
        if any(kv is None for kv in per):
            return None
        return per[0] if len(set(per)) == 1 else tuple(kv for kv in per if kv is not None)

    def router_kwargs(self) -> dict[str, Any]:
        """The prefix router's arguments (:class:`~scheduler_runtime.router.PrefixAffinityRouter`), the
        same for both data planes: the load bound, the chunk size, and each replica's KV tokens, which
        its cache model needs (:attr:`kv_tokens`)."""
        return {"load_factor": self.load_factor, "slack": self.slack, "chunk_size": self.chunk_size,
                "kv_tokens": self.kv_tokens}

    def learned_router_kwargs(self) -> dict[str, Any]:
        """The learned router's arguments (:class:`~scheduler_runtime.learned_router.LearnedRouter`), the
        same for both data planes: the prefix router's, told no KV size (it reads each replica's from
        its metrics), and ``kv_guard``."""
        knobs = self.router_kwargs()
        del knobs["kv_tokens"]
        knobs["kv_guard"] = self.kv_guard
        knobs["queue_time"] = self.queue_time
        return knobs


def flag_value(args: Sequence[str], flag: str, default: str) -> str:
    """The value of ``flag`` in a vLLM command line (``--flag value`` or ``--flag=value``, underscores
    too; the last one wins), or ``default``."""
    names = {flag, "--" + flag[2:].replace("-", "_")}
    value = default
    for i, a in enumerate(args):
        if a in names and i + 1 < len(args):
            value = args[i + 1]
        elif a.split("=", 1)[0] in names and "=" in a:
            value = a.split("=", 1)[1]
    return value


def replica_kv_tokens(vllm_args: Sequence[str]) -> int | None:
    """The KV cache of a replica started with ``vllm_args`` (``feather-serve``'s, as
    :func:`scheduler_runtime.serving.serve.vllm_arguments` completes them), in tokens requests can hold:
    vLLM's blocks of ``--block-size`` tokens in ``--kv-cache-memory-bytes`` (bytes per token from the
    ``--model`` directory's ``config.json``, in ``--kv-cache-dtype`` or else ``--dtype``, sharded over
    ``--tensor-parallel-size`` and ``--pipeline-parallel-size``), less vLLM's null block: what the
    simulator's engine holds for the same configuration (``EngineConfig.usable_kv_tokens``). With
    ``--num-gpu-blocks-override`` vLLM allocates that many blocks whatever the bytes: those, less the
    null block.

    ``None`` where the arguments do not say: no ``--kv-cache-memory-bytes`` (vLLM sizes the cache from
    the free memory it finds at start), a model that is not a local directory with a ``config.json``
    (a hub name), or a dtype ``auto``. The prefix router's cache model is then off.
    """
    override = flag_value(vllm_args, "--num-gpu-blocks-override", "")
    if override:
        try:
            blocks, block = int(override), int(flag_value(vllm_args, "--block-size", "16"))
        except ValueError:
            return None
        return (blocks - 1) * block if blocks > 1 else None
    kv_bytes = flag_value(vllm_args, "--kv-cache-memory-bytes", "")
    model = flag_value(vllm_args, "--model", "")
    dtype = flag_value(vllm_args, "--kv-cache-dtype", "auto")
    if dtype == "auto":
        dtype = flag_value(vllm_args, "--dtype", "auto")
    if not kv_bytes or not model or dtype == "auto":
        return None
    try:
        per_token = kv_bytes_per_token(
            model, dtype, tensor_parallel=int(flag_value(vllm_args, "--tensor-parallel-size", "1")),
            pipeline_parallel=int(flag_value(vllm_args, "--pipeline-parallel-size", "1")))
        block = int(flag_value(vllm_args, "--block-size", "16"))  # vLLM's default: only rounding moves
        blocks = int(kv_bytes) // (block * per_token)
    except (OSError, KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return (blocks - 1) * block if blocks > 1 else None


def core_binding(spec: str) -> tuple[list[int], dict[str, str]]:
    """A replica pinned to the cores ``spec``: the cores for ``sched_setaffinity`` (of the replica's
    process, which its vLLM engine-core process inherits) and the environment that binds vLLM's
    OpenMP threads to the same cores."""
    cores = parse_cores(spec)
    return cores, {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}


def error_body(message: str, status: int, err_type: str) -> dict[str, Any]:
    """vLLM's (OpenAI's) error response body."""
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}


S = TypeVar("S", bound=tuple)


def soonest_retry(shed: Sequence[S]) -> S:
    """Every replica tried shed a request: of their rejections ``(status, headers, body)`` (headers
    with lower-case names), the one that lets it retry soonest (``retry-after``), else the last."""
    retryable = [s for s in shed if "retry-after" in s[1]]
    return min(retryable, key=lambda s: int(s[1]["retry-after"])) if retryable else shed[-1]


# ------------------------------------------------------------------------------------ /metrics

#: One exposition's families: ``{name: (type, help, [(sample name, labels, value), ...])}``.
Families = dict[str, tuple[str, str, list[tuple[str, dict[str, str], float]]]]


def _families(text: str, replica: str) -> Families:
    """One replica's exposition, parsed, a ``replica`` label on every sample."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: (f.type, f.documentation, [(s.name, {**s.labels, "replica": replica}, s.value)
                                                for s in f.samples])
            for f in text_string_to_metric_families(text)}


def _exposed(name: str, kind: str) -> str:
    # the parser names a counter's family without the ``_total`` its samples (and its TYPE line) carry
    return f"{name}_total" if kind == "counter" else name


def _exposition(per_replica: list[Families]) -> str:
    """Every replica's samples, each family once (its HELP and TYPE, then all replicas' samples)."""
    merged: Families = {}
    for families in per_replica:
        for name, (kind, doc, samples) in families.items():
            merged.setdefault(name, (kind, doc, []))[2].extend(samples)
    lines = []
    for name, (kind, doc, samples) in merged.items():
        name = _exposed(name, kind)
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        lines += [f"{sample}{_labels(labels)} {_number(value)}" for sample, labels, value in samples]
    return "\n".join(lines)


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + body + "}"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return repr(float(value)) if value == value else "NaN"


def _sums(per_replica: list[Families]) -> str:
    """``cluster:<name>`` families: every replica's samples summed (info and unknown types left out)."""
    merged: dict[str, tuple[str, str, dict[tuple[str, tuple], float]]] = {}
    for families in per_replica:
        for name, (kind, doc, samples) in families.items():
            if kind not in ("counter", "gauge", "histogram", "summary") or name.endswith("_info"):
                continue
            into = merged.setdefault(name, (kind, doc, {}))[2]
            for sample, labels, value in samples:
                key = (sample, tuple(sorted((k, v) for k, v in labels.items() if k != "replica")))
                into[key] = into.get(key, 0.0) + value
    lines = []
    for name, (kind, doc, sums) in merged.items():
        name = _exposed(name, kind)
        lines.append(f"# HELP cluster:{name} Sum over the engine replicas of {name}: {doc}")
        lines.append(f"# TYPE cluster:{name} {kind}")
        for (sample, labels), value in sums.items():
            lines.append(f"cluster:{sample}{_labels(dict(labels))} {_number(value)}")
    return "\n".join(lines)


def replica_exposition(texts: Iterable[tuple[str, str]]) -> str:
    """``(replica label, its exposition)`` pairs -> every sample with its ``replica`` label, then the
    ``cluster:<name>`` sums (so a client that sums a metric over its samples gets the cluster's
    total, and nothing is counted twice)."""
    families = [_families(text, replica) for replica, text in texts]
    return "\n".join(p for p in (_exposition(families), _sums(families)) if p)


def _family(name: str, kind: str, doc: str, samples: Iterable[tuple[Mapping[str, str], float]]) -> list[str]:
    return [f"# HELP {name} {doc}", f"# TYPE {name} {kind}",
            *(f"{name}{_labels(labels)} {_number(v)}" for labels, v in samples)]


@dataclass
class FrontEndStats:
    """The front end's own counters (the Ray ingress's or the proxy's), exposed as ``feather_cluster_*``
    and ``feather_router_*`` on ``/metrics``."""

    #: requests answered, by (replica rank, outcome)
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: requests retried on another replica (the first died before anything reached the client)
    retries: int = 0
    #: requests answered with an error, by reason
    errors: Counter[str] = field(default_factory=Counter)
    #: requests shed by a replica's admission rule and then served by another ("rerouted"), or by none
    #: ("rejected"); sheds are not errors
    shed: Counter[str] = field(default_factory=Counter)

    def exposition(self, router: str, replicas: int, answered: int,
                   router_stats: Iterable[Mapping[str, float]] = (),
                   replica_states: Mapping[str, int] | None = None) -> str:
        """The counters, the replicas listed and answering ``/metrics`` (plus ``replica_states``:
        more ``feather_cluster_replicas`` states), and each prefix router's :meth:`stats`."""
        states = {"listed": replicas, "answered": answered, **(replica_states or {})}
        lines = _family("feather_cluster_replicas", "gauge", "Engine replicas listed / answering /metrics",
                        [({"state": s}, n) for s, n in states.items()])
        lines += _family("feather_cluster_requests_total", "counter",
                         "Requests answered, by replica rank and outcome",
                         [({"replica": r, "outcome": o}, n) for (r, o), n in sorted(self.counts.items())])
        lines += _family("feather_cluster_retries_total", "counter",
                         "Requests retried on another replica (the first died before streaming anything)",
                         [({}, self.retries)])
        lines += _family("feather_cluster_errors_total", "counter",
                         "Requests answered with an error, by reason",
                         [({"reason": k}, n) for k, n in sorted(self.errors.items())])
        lines += _family("feather_cluster_shed_total", "counter",
                         "Requests a replica's admission rule shed, by what followed: served by another "
                         "replica (rerouted) or rejected by every one tried (rejected)",
                         [({"outcome": k}, self.shed[k]) for k in ("rerouted", "rejected")])
        lines += _family("feather_cluster_router_info", "gauge", "The router of the engine replicas",
                         [({"router": router}, 1)])
        for stats in router_stats:
            lines += _family("feather_router_decisions_total", "counter", "Prefix router decisions, by kind",
                             [({"kind": k}, stats[k]) for k in ("affinity", "spilled", "new") if k in stats])
            lines += _family("feather_router_decision_seconds_total", "counter",
                             "Time spent choosing replicas",
                             [({}, stats["decision_seconds"])])
            if "table_keys" in stats:
                lines += _family("feather_router_table_keys", "gauge",
                                 "Chunk keys in the prefix router's table",
                                 [({}, stats["table_keys"])])
            if "queue_reports" in stats:
                lines += _family("feather_router_queue_reports_total", "counter",
                                 "Waits before the first step the replicas reported and the router read",
                                 [({}, stats["queue_reports"])])
        return "\n".join(lines)


#: The learned estimates exported per replica: (gauge, ``estimates()`` key, help).
_ESTIMATE_GAUGES = (
    ("feather_router_replica_prefill_tok_s", "prefill_tok_s",
     "Prefill speed the router learned per replica (uncached prompt tokens/s)"),
    ("feather_router_replica_decode_tok_s", "decode_tok_s",
     "Decode speed the router learned per replica (output tokens/s of one request)"),
    ("feather_router_replica_kv_tokens", "kv_tokens",
     "KV cache per replica in tokens, as the router reads it (vllm:cache_config_info) or was told"),
)


def estimates_exposition(estimates: Mapping[str, Mapping[str, Any]], scrapes: Mapping[str, int] | None = None,
                         skipped_lines: int = 0) -> str:
    """``feather_router_replica_*`` gauges labelled by replica from a learning router's
    ``estimates()`` (a value not learned yet is left out), its samples by kind (prefill, decode), and
    the proxy's scrapes of the replicas' ``/metrics`` by outcome with the lines it could not read."""
    lines: list[str] = []
    for gauge, key, doc in _ESTIMATE_GAUGES:
        lines += _family(gauge, "gauge", doc, [({"replica": r}, e[key]) for r, e in sorted(estimates.items())
                                               if e.get(key) is not None])
    lines += _family("feather_router_replica_samples", "gauge",
                     "Samples behind each learned speed, by replica and kind",
                     [({"replica": r, "kind": kind}, e.get(f"{kind}_samples", 0))
                      for r, e in sorted(estimates.items()) for kind in ("prefill", "decode")])
    if scrapes is not None:
        lines += _family("feather_router_scrapes_total", "counter",
                         "Reads of the replicas' /metrics by outcome (restarted: a new server behind a URL)",
                         [({"outcome": k}, scrapes.get(k, 0)) for k in ("ok", "error", "restarted")])
        lines += _family("feather_router_scrape_skipped_lines_total", "counter",
                         "Lines of the replicas' /metrics the proxy could not read", [({}, skipped_lines)])
    return "\n".join(lines)


def gpu_groups(replicas: int, gpus_per_replica: float, visible: Sequence[str]) -> list[str | None]:
    """Per replica, the ``CUDA_VISIBLE_DEVICES`` of the proxy's replica ``k`` (its ``k``-th group of
    ``gpus_per_replica`` of the ``visible`` devices); ``None`` each without GPUs.

    Raises ValueError for a fractional count or too few devices (the proxy does not share a GPU).
    """
    if gpus_per_replica <= 0:
        return [None] * replicas
    if gpus_per_replica != math.floor(gpus_per_replica):
        raise ValueError(f"--replica-gpus {gpus_per_replica}: the proxy data plane gives each replica whole "
                         "GPUs (use --data-plane ray to share one)")
    g = int(gpus_per_replica)
    if replicas * g > len(visible):
        raise ValueError(f"{replicas} replicas x {g} GPUs need {replicas * g} GPUs, {len(visible)} visible")
    return [",".join(visible[k * g:(k + 1) * g]) for k in range(replicas)]
