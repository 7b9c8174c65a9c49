"""Workloads: the requests a scheduler serves, loaded from benchmark data or generated.

- :class:`Workload`: a named, immutable list of :class:`Request` (sampling, arrivals, stats);
- loaders: :func:`load_leval` (documents shared by their questions), :func:`load_longbench`
  (per-request lengths), :func:`load_trace` (vidur CSV traces), :func:`synthetic_workload`,
  :func:`load_custom` (your own requests: JSON lines or CSV of prompts, output lengths, timestamps);
- :func:`parse_arrival` (burst / Poisson / trace), :func:`parse_length_spec`;
- :class:`WorkloadConfig` + :func:`build_workload`: one config section -> one workload;
- :func:`resolve_data_dir`: where the data lives (flag > ``$FEATHER_DATA_DIR`` >
  ``../shared/data``), :class:`DataNotFoundError` when it is not there.
"""

from feather_env.workloads.arrivals import (
    ArrivalProcess,
    BurstArrivals,
    PoissonArrivals,
    TraceArrivals,
    parse_arrival,
)
from feather_env.workloads.build import (
    WORKLOAD_KINDS,
    WorkloadConfig,
    build_workload,
    load_workload,
    sample_workload,
)
from feather_env.workloads.custom import load_custom
from feather_env.workloads.datadir import ENV_VAR, DataNotFoundError, resolve_data_dir
from feather_env.workloads.leval import DEFAULT_INSTRUCTION_TEMPLATE, leval_task_files, load_leval
from feather_env.workloads.longbench import ZH_TASKS, load_longbench, read_max_new_tokens
from feather_env.workloads.request import Request
from feather_env.workloads.synthetic import (
    LengthDistribution,
    parse_length_spec,
    random_tokens,
    synthetic_workload,
)
from feather_env.workloads.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    count_tokens,
    encode_batch_ids,
    load_tokenizer,
    tokenizer_fingerprint,
)
from feather_env.workloads.traces import TRACE_FILES, load_trace, read_trace
from feather_env.workloads.workload import Workload, WorkloadError

__all__ = [
    "BOS_ID",
    "DEFAULT_INSTRUCTION_TEMPLATE",
    "ENV_VAR",
    "EOS_ID",
    "PAD_ID",
    "TRACE_FILES",
    "WORKLOAD_KINDS",
    "ZH_TASKS",
    "ArrivalProcess",
    "BurstArrivals",
    "DataNotFoundError",
    "LengthDistribution",
    "PoissonArrivals",
    "Request",
    "TraceArrivals",
    "Workload",
    "WorkloadConfig",
    "WorkloadError",
    "build_workload",
    "load_workload",
    "sample_workload",
    "count_tokens",
    "encode_batch_ids",
    "leval_task_files",
    "load_custom",
    "load_leval",
    "load_longbench",
    "load_trace",
    "load_tokenizer",
    "parse_arrival",
    "parse_length_spec",
    "random_tokens",
    "read_max_new_tokens",
    "read_trace",
    "resolve_data_dir",
    "synthetic_workload",
    "tokenizer_fingerprint",
]
