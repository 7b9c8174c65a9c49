"""Evaluating schedulers: one workload served in-process or by any running server, reported alike.

- :mod:`~feather_env.evaluation.inprocess`: each scheduler on the real in-process vLLM engine
  (:meth:`feather_env.engines.vllm_backend.VLLMBackend.serve`, the scheduler deciding as in production);
- :mod:`~feather_env.evaluation.endpoint`: any OpenAI-compatible completions server over HTTP
  (``feather-serve``, vLLM's own server), streamed and timed at the client;
- :mod:`~feather_env.evaluation.simulated`: each scheduler on a scenario's episodes in the simulator;
- :mod:`~feather_env.evaluation.report`: a run's metrics in ``vllm bench serve``'s vocabulary plus
  the scheduler's own figures, the tables, the results folder, reading runs back and comparing them;
- :mod:`~feather_env.evaluation.plots`: the figures;
- :mod:`~feather_env.evaluation.server`: a local server subprocess sized like an in-process engine
  (the tests and benchmarks that compare the two).

``evaluate.py`` is the command line over these modules.
"""

from feather_env.evaluation.endpoint import EndpointConfig, EndpointError, evaluate_endpoint, probe_server
from feather_env.evaluation.inprocess import (
    InProcessConfig,
    evaluate_in_process,
    fit_engine,
    scheduler_config,
    schedulers_table,
    validate_schedulers,
)
from feather_env.evaluation.report import (
    ENDPOINT,
    IN_PROCESS,
    SIMULATOR,
    Run,
    compare,
    metrics_tables,
    read_runs,
    results_payload,
    summarize,
    write_results,
)
from feather_env.evaluation.simulated import (
    SimConfig,
    episodes_workload,
    evaluate_simulated,
    resolve_schedulers,
)

__all__ = [
    "ENDPOINT",
    "IN_PROCESS",
    "SIMULATOR",
    "EndpointConfig",
    "EndpointError",
    "InProcessConfig",
    "Run",
    "SimConfig",
    "compare",
    "episodes_workload",
    "evaluate_endpoint",
    "evaluate_in_process",
    "evaluate_simulated",
    "fit_engine",
    "metrics_tables",
    "probe_server",
    "read_runs",
    "resolve_schedulers",
    "results_payload",
    "scheduler_config",
    "schedulers_table",
    "summarize",
    "validate_schedulers",
    "write_results",
]
