"""Bad input never reaches the engine's busy loop: scheduler config values, client hints, policy
and predictor files are checked when they are read, with errors that say what is wrong.

Engine-free: every check here runs on the runtime the vLLM scheduler delegates to, before
anything starts.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_runtime.batching import CoreConfig
from scheduler_runtime.config import ConfigError, load_mapping
from scheduler_runtime.decision import PolicyFormatError
from scheduler_runtime.plugins import load_policy_spec
from scheduler_runtime.predictor import DEFAULT_PREDICTOR_PATH, OutputLengthPredictor, load_predictor
from scheduler_runtime.schedulers import (
    BASELINE_NAMES,
    EXTRA_OUTPUT_LEN,
    EXTRA_SOURCE,
    MAX_SOURCE_CHARS,
    FeatherRuntime,
    SchedulerConfig,
    load_scheduler_config,
)

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the plug-in policies of these tests (tests/fault_policies.py)
    sys.path.insert(0, str(HERE))

TOKENS = np.arange(3, 300)
MAX_MODEL_LEN = 4096
#: Malformed hints, as a client can send them in ``vllm_xargs``.
MALFORMED = ["abc", [1], "nan", "inf", -5, 1e12]


# ---------------------------------------------------------------------------- config values


@pytest.mark.parametrize("overrides, message", [
    ({"max_wiat": 1}, r"unknown key\(s\) \['max_wiat'\]; valid keys are"),
    ({"max_wait": "10"}, "max_wait: expected float, got '10'"),
    ({"max_wait": float("nan")}, "max_wait must be a finite number of seconds >= 0"),
    ({"max_wait": float("inf")}, "max_wait must be a finite number of seconds >= 0"),
    ({"max_wait": -1.0}, "max_wait must be a finite number of seconds >= 0"),
    ({"chunk_size": "64"}, "chunk_size: expected int"),
    ({"chunk_size": True}, "chunk_size: expected int"),
    ({"chunk_size": 0}, "chunk_size must be >= 1"),
    ({"lpm_fcfs_fallback": -1}, "lpm_fcfs_fallback must be >= 0"),
    ({"kv_capacity_tokens": 0}, "kv_capacity_tokens must be >= 1"),
    ({"svf_seed": "yes"}, "svf_seed: expected bool"),
    ({"trust_client_hints": "true"}, "trust_client_hints: expected bool"),
    ({"max_faults": 0}, "max_faults must be >= 1"),
    ({"policy": 3}, "policy: expected str"),
])
def test_bad_config_values_are_config_errors_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig.for_name("feather-heuristic", **overrides)
    # the engine's own reader (additional_config) says the same
    with pytest.raises(ConfigError, match=message):
        load_scheduler_config({"feather_scheduler": {"name": "feather-heuristic", **overrides}}, environ={})


@pytest.mark.parametrize("kw", [{"max_wait": float("nan")}, {"max_wait": float("inf")},
                                {"lpm_fcfs_fallback": -1}, {"chunk_size": True}])
def test_core_config_rejects_what_would_break_the_core(kw):
    with pytest.raises(ValueError):
        CoreConfig(**kw)


@pytest.mark.parametrize("name", [n for n in BASELINE_NAMES if n != "fcfs"]
                         + ["feather-heuristic", "feather-heuristic+svf"])
def test_every_ordering_has_a_finite_default_max_wait(name):
    max_wait = SchedulerConfig.for_name(name).max_wait
    assert max_wait is not None and math.isfinite(max_wait) and max_wait > 0


def test_client_hints_are_untrusted_by_default():
    assert SchedulerConfig.for_name("oracle-svf").trust_client_hints is False


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_config_file_that_is_not_utf8_is_a_config_error_naming_it(tmp_path, suffix):
    path = tmp_path / f"sched{suffix}"
    path.write_bytes(b"max_wait: 10 # \xff\xfe latin-1 \xe9\n")
    with pytest.raises(ConfigError, match=f"{path.name}.*not UTF-8"):
        load_mapping(path)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_config_path_that_is_missing_or_a_folder_is_named_as_such(tmp_path: Path, suffix: str) -> None:
    with pytest.raises(ConfigError, match="config file not found: .*missing"):
        load_mapping(tmp_path / f"missing{suffix}")
    folder = tmp_path / f"configs{suffix}"
    folder.mkdir()
    with pytest.raises(ConfigError, match=f"configs{suffix}: not a regular file"):
        load_mapping(folder)


# ---------------------------------------------------------------------------- client hints


def _runtime(name: str, trusted: bool) -> FeatherRuntime:
    return FeatherRuntime(SchedulerConfig.for_name(name, trust_client_hints=trusted), 100_000,
                          max_model_len=MAX_MODEL_LEN)


def _expected_oracle_length(value: object, max_tokens: int) -> float:
    """The rule of the module docstring of ``scheduler_runtime.schedulers``."""
    upper = min(max_tokens, MAX_MODEL_LEN)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(min(max(value, 1), upper))
    return float(upper)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(value=json_values | st.sampled_from(MALFORMED), max_tokens=st.integers(1, 2 * MAX_MODEL_LEN))
def test_any_output_length_hint_gives_a_finite_length_in_range(value, max_tokens):
    runtime = _runtime("oracle-svf", trusted=True)
    length = runtime.output_length(TOKENS, max_tokens, {EXTRA_OUTPUT_LEN: value})
    assert length == _expected_oracle_length(value, max_tokens)
    assert 1 <= length <= MAX_MODEL_LEN


@pytest.mark.parametrize("value", MALFORMED)
def test_malformed_hints_are_counted_and_the_core_stays_usable(value):
    runtime = _runtime("oracle-svf", trusted=True)
    runtime.arrive("bad", TOKENS, now=0.0, max_tokens=8, extra_args={EXTRA_OUTPUT_LEN: value})
    runtime.arrive("good", TOKENS + 1, now=0.0, max_tokens=8, extra_args={EXTRA_OUTPUT_LEN: 8})
    assert runtime.stats.invalid_hints == 1
    assert sorted(runtime.plan(0.0, 4)) == ["bad", "good"]
    assert math.isfinite(runtime.core.budget.used) and runtime.core.budget.used <= 100_000
    runtime.core.check_consistency()


def test_hints_are_ignored_unless_clients_are_trusted():
    untrusted = _runtime("oracle-svf", trusted=False)
    assert untrusted.output_length(TOKENS, 50, {EXTRA_OUTPUT_LEN: 3}) == 50.0  # max_tokens
    trusted = _runtime("oracle-svf", trusted=True)
    assert trusted.output_length(TOKENS, 50, {EXTRA_OUTPUT_LEN: 3}) == 3.0
    pred = load_predictor()
    hint = {EXTRA_SOURCE: "leval/news_summ"}
    svf = FeatherRuntime(SchedulerConfig.for_name("svf"), 100_000, predictor=pred)
    assert svf.output_length(TOKENS, 50, hint) == pytest.approx(pred.predict(TOKENS, ""))
    svf_trusted = FeatherRuntime(SchedulerConfig.for_name("svf", trust_client_hints=True), 100_000,
                                 predictor=pred)
    expected = pred.predict(TOKENS, "leval/news_summ")
    assert svf_trusted.output_length(TOKENS, 50, hint) == pytest.approx(expected)
    assert untrusted.stats.invalid_hints == svf.stats.invalid_hints == 0  # ignored, not invalid


@pytest.mark.parametrize("source", [["leval/tpo"], 5, None, "x" * (MAX_SOURCE_CHARS + 1)])
def test_a_source_that_is_not_a_short_string_is_ignored(source):
    pred = load_predictor()
    runtime = FeatherRuntime(SchedulerConfig.for_name("svf", trust_client_hints=True), 100_000,
                             predictor=pred)
    length = runtime.output_length(TOKENS, 50, {EXTRA_SOURCE: source})
    assert length == pytest.approx(pred.predict(TOKENS, ""))
    assert runtime.stats.invalid_hints == (0 if source is None else 1)


# ---------------------------------------------------------------------------- plug-in policies


def test_a_plugin_policy_loads_from_its_import_path():
    policy = load_policy_spec("py:fault_policies:RaisesOnFiftiethDecision")
    assert type(policy).__name__ == "RaisesOnFiftiethDecision"
    runtime = FeatherRuntime(SchedulerConfig.for_name("feather:py:fault_policies:RaisesOnFiftiethDecision"),
                             100_000)
    assert type(runtime.core.policy).__name__ == "RaisesOnFiftiethDecision"


@pytest.mark.parametrize("spec, message", [
    ("py:fault_policies", "expected py:MODULE:ATTRIBUTE"),
    ("py:no_such_module_xyz:Policy", "cannot import module 'no_such_module_xyz'"),
    ("py:fault_policies:Missing", "has no attribute 'Missing'"),
    ("py:fault_policies:NOT_A_POLICY", "has no act"),
    ("py:fault_policies:FailsToBuild", "could not be built"),
])
def test_bad_plugin_policies_are_clear_errors(spec, message):
    with pytest.raises(PolicyFormatError, match=message):
        load_policy_spec(spec)
    with pytest.raises(PolicyFormatError, match=message):
        FeatherRuntime(SchedulerConfig.for_name(f"feather:{spec}"), 100_000)


# ---------------------------------------------------------------------------- predictor files


def _predictor_doc() -> dict:
    return json.loads(DEFAULT_PREDICTOR_PATH.read_text(encoding="utf-8"))


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("proxy_long"), "missing field.*proxy_long"),
    (lambda d: d["reg_weights"].__setitem__(3, float("nan")), "reg_weights.*finite"),
    (lambda d: d["clf_weights"].__setitem__(0, "x"), "clf_weights.*finite numbers"),
    (lambda d: d.update(hash_buckets="64"), "hash_buckets.*integer"),
    (lambda d: d.update(tail_tokens=0), "tail_tokens.*>= 1"),
    (lambda d: d.update(proxy_short=float("inf")), "proxy_short.*finite"),
    (lambda d: d.update(sources=["a", 3]), "sources.*strings"),
    (lambda d: d.update(max_output=0.5), "max_output.*>= 1"),
])
def test_predictor_file_problems_are_errors_naming_the_file(tmp_path, edit, message):
    doc = _predictor_doc()
    edit(doc)
    path = tmp_path / "predictor.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message) as err:
        OutputLengthPredictor.load(path)
    assert str(path) in str(err.value)


def test_a_predictor_file_that_is_not_utf8_is_an_error_naming_it(tmp_path):
    path = tmp_path / "predictor.json"
    path.write_bytes(b'{"format": "\xff"}')
    with pytest.raises(ValueError, match="not UTF-8") as err:
        OutputLengthPredictor.load(path)
    assert str(path) in str(err.value)
