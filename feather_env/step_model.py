"""The engine step-time model: what one continuous-batching step costs, from what it schedules.

The simulator (:mod:`feather_env.engines.sim_backend`) predicts each engine step with it, and the calibration
(:mod:`feather_env.calibrate`) fits it to steps measured on the real engine; both describe a
step the same way, by :func:`step_features` over the step's scheduled requests in the order of
vLLM's persistent batch (the order the CPU attention kernel walks them in)::

    t_step = c0 + c1 * R + c2 * N + c3 * D + c4 * M + c5 * A

- ``R``: scheduled requests, ``N``: scheduled tokens (the linear layers' work);
- ``D``: KV tokens the decoding requests read (their contexts);
- ``M``: of those, the tokens that miss a last-level cache of ``cache_tokens`` tokens when the
  batch is walked in its order (a request's own tokens always miss; a prefix that requests of
  one document share is a hit when it was read recently enough: an LRU reuse-distance model,
  the locality effect of Feather's paper);
- ``A``: prefill attention work, ``sum q * (c + (q + 1) / 2)`` over the prefilling requests
  (``q`` tokens computed on top of ``c`` already in the cache): chunked prefill and prefix-cache
  hits both show here.

Requests share a prefix physically when they hold the same KV blocks: a request's *group* is its
first block, and the group's shared length is the longest prefix-cache hit among its scheduled
members (whole blocks). The coefficients are non-negative (weighted non-negative least squares,
:func:`fit_step_model`), ``cache_tokens`` by grid search.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from feather_env.records import StepRequest
from scheduler_runtime.config import ConfigError
from scheduler_runtime.hardware import same_machine

__all__ = ["DEFAULT_PROFILE", "FEATURE_NAMES", "PROFILE_VERSION", "StepCostModel", "features_from_columns",
           "fit_step_model", "load_profile", "profile_note", "same_machine", "step_features"]

FEATURE_NAMES = ("const", "requests", "tokens", "decode_kv", "decode_kv_miss", "prefill_attn")
#: Cache sizes (tokens) the calibration tries for the locality term (10**9: no misses of shared KV).
CACHE_CANDIDATES = tuple(int(x) for x in np.geomspace(4096, 262144, 13)) + (10**9,)


def step_features(batch: Sequence[StepRequest], cache_tokens: float) -> np.ndarray:
    """The step's feature vector ``[1, R, N, D, M, A]`` (see the module docstring), ``float64``."""
    return features_from_columns([r.num_tokens for r in batch], [r.num_computed for r in batch],
                                 [r.group for r in batch], [r.shared_tokens for r in batch],
                                 [r.is_prefill for r in batch], cache_tokens)


def features_from_columns(num_tokens: Sequence[int], num_computed: Sequence[int], group: Sequence[int],
                          shared_tokens: Sequence[int], is_prefill: Sequence[bool],
                          cache_tokens: float) -> np.ndarray:
    """:func:`step_features` over parallel columns in batch order (the simulator's hot path:
    no object per request)."""
    n_req = len(num_tokens)
    tokens = 0
    decode_kv = 0.0
    prefill_attn = 0.0
    # the shared length of each group: the longest hit among its scheduled members
    shared: dict[int, int] = {}
    for q, c, g, h, pre in zip(num_tokens, num_computed, group, shared_tokens, is_prefill, strict=True):
        tokens += q
        if pre:
            prefill_attn += q * (c + (q + 1) / 2.0)
        else:
            decode_kv += c + 1
            if h > shared.get(g, 0):
                shared[g] = h
    miss = 0.0
    if decode_kv:
        miss = _decode_misses(num_computed, group, is_prefill, shared, cache_tokens)
    return np.array([1.0, n_req, tokens, decode_kv, miss, prefill_attn])


def _decode_misses(num_computed: Sequence[int], group: Sequence[int], is_prefill: Sequence[bool],
                   shared: dict[int, int], cache_tokens: float) -> float:
    """KV tokens of the decoding requests that miss the cache, walking the batch in order.

    LRU stack distance: a group's shared prefix is a hit when the distinct KV tokens read since
    its last read (other groups' prefixes once each, every request's own tokens) and the prefix
    itself fit ``cache_tokens``.
    """
    misses = 0.0
    own_read = 0.0  # cumulative own tokens read so far
    lru: dict[int, int] = {}  # group -> its prefix tokens, in order of latest read (oldest first)
    own_at: dict[int, float] = {}  # group -> own_read at its latest read
    for c, g, pre in zip(num_computed, group, is_prefill, strict=True):
        if pre:
            continue
        ctx = c + 1
        p = min(shared.get(g, 0), ctx)
        own = ctx - p
        if p > 0:
            if g not in lru:
                misses += p
            else:
                # the other groups read since g's latest read: those after it in the LRU order
                others = 0
                after = False
                for other, tokens in lru.items():
                    if after:
                        others += tokens
                    elif other == g:
                        after = True
                if (own_read - own_at[g]) + others + p > cache_tokens:
                    misses += p
                del lru[g]
            lru[g] = p
            own_at[g] = own_read
        own_read += own
        misses += own
    return misses


@dataclass
class StepCostModel:
    """Fitted coefficients (seconds per unit of each feature) and the cache size of ``M``."""

    coef: tuple[float, ...]
    cache_tokens: float

    def __post_init__(self) -> None:
        if len(self.coef) != len(FEATURE_NAMES):
            raise ValueError(f"a step model has {len(FEATURE_NAMES)} coefficients ({FEATURE_NAMES}), "
                             f"got {len(self.coef)}")
        if not all(np.isfinite(self.coef)) or min(self.coef) < 0:
            raise ValueError(f"step model coefficients must be finite and >= 0, got {self.coef}")
        if not (self.cache_tokens > 0):
            raise ValueError(f"cache_tokens must be > 0, got {self.cache_tokens}")
        self._w = np.asarray(self.coef, dtype=np.float64)

    def predict(self, batch: Sequence[StepRequest]) -> float:
        """Predicted seconds of one step."""
        return float(step_features(batch, self.cache_tokens) @ self._w)

    def predict_features(self, features: np.ndarray) -> np.ndarray | float:
        return features @ self._w

    def prefill_seconds(self, features: np.ndarray, prefill_tokens: int) -> float:
        """The prefill part of a step of ``features`` (:func:`step_features`) whose prefilling requests
        schedule ``prefill_tokens`` tokens: their tokens' share of the linear layers (``c2``) and their
        attention (``c5 * A``). The rest of the step (the constant, the per-request term, the decoding
        tokens and their KV reads) is its decode part."""
        w = self.coef
        return float(w[2] * prefill_tokens + w[5] * features[5])

    def decode_growth(self, batch: Sequence[StepRequest]) -> float:
        """Seconds each further identical decode step adds: every decoding request's context
        (and its own, always-missed tokens) grows by one token per step."""
        n_decode = sum(1 for r in batch if not r.is_prefill)
        return n_decode * (self.coef[3] + self.coef[4])

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["coef"] = list(self.coef)
        d["features"] = list(FEATURE_NAMES)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepCostModel:
        return cls(tuple(float(c) for c in data["coef"]), float(data["cache_tokens"]))


def _nnls_weighted(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares with non-negative coefficients (drop-and-refit)."""
    keep = list(range(X.shape[1]))
    while True:
        coef = np.zeros(X.shape[1])
        sol, *_ = np.linalg.lstsq(X[:, keep] * w[:, None], y * w, rcond=None)
        coef[keep] = sol
        neg = [k for k in keep if coef[k] < 0]
        if not neg:
            return coef
        keep.remove(min(neg, key=lambda k: coef[k]))


def fit_step_model(steps: Sequence[tuple[Sequence[StepRequest], float]]) -> tuple[StepCostModel, float]:
    """Fit the model to measured ``(batch, seconds)`` steps; returns it and its per-step MAPE.

    Weighted least squares with weights ``1 / sqrt(t)``: a step's error variance is taken to grow
    with its time. That sits between plain least squares (which fits the few long prefill steps
    that dominate an episode's duration and neglects the many decode steps) and relative error
    (the reverse); on this machine's calibration steps it gave the lowest error of whole episodes'
    summed time (3.8% mean, against 3.9% and 4.9%). ``cache_tokens`` is the candidate with the
    lowest weighted residual.
    """
    if len(steps) < len(FEATURE_NAMES):
        raise ValueError(f"need at least {len(FEATURE_NAMES)} measured steps, got {len(steps)}")
    y = np.array([t for _, t in steps], dtype=np.float64)
    if (y <= 0).any():
        raise ValueError("measured step times must be > 0")
    w = 1.0 / np.sqrt(y)
    best: tuple[float, float, np.ndarray, np.ndarray] | None = None
    for cache in CACHE_CANDIDATES:
        X = np.array([step_features(b, cache) for b, _ in steps])
        coef = _nnls_weighted(X, y, w)
        residual = float(np.sum(((X @ coef - y) * w) ** 2))
        if best is None or residual < best[0]:
            best = (residual, float(cache), coef, X)
    assert best is not None
    _, cache, coef, X = best
    mape = float(np.mean(np.abs(X @ coef - y) / y))
    return StepCostModel(tuple(float(c) for c in coef), cache), mape


# -- profiles: a fitted model in a JSON file, as the calibration writes it and the simulator reads it --
#: The profile format this toolkit reads and writes.
PROFILE_VERSION = 2
#: The shipped profile (fitted on a CPU with a tiny Llama).
DEFAULT_PROFILE = Path(__file__).resolve().parents[1] / "configs" / "profiles" / "cpu-tiny-llama.json"


def profile_note(path: str | Path | None, here: dict[str, Any]) -> str | None:
    """A line for a user about to simulate with the profile at ``path`` on machine ``here`` (a
    ``machine_info`` record) unless it was measured on this kind of machine (:func:`same_machine`):
    its step times may then be off several-fold. It names the shipped profiles of this kind of
    machine, if any, else how to check or fit one."""
    path = Path(path or DEFAULT_PROFILE)
    there = load_profile(path).get("measured_on") or {}
    if same_machine(there, here):
        return None
    mine = [p.name for p in sorted(DEFAULT_PROFILE.parent.glob("*.json"))
            if same_machine(load_profile(p).get("measured_on") or {}, here)]
    advice = (f"shipped for this kind of machine: {', '.join(mine)} (--profile)" if mine else
              "check it with `python -m feather_env.calibrate --validate PROFILE --scenario S`, or let "
              "`evaluate.py advise` probe the engine and pick or fit one")
    return (f"note: the simulator's profile {path.name} was measured on {there.get('cpu', 'a machine')} "
            f"({there.get('isa') or 'vector ISA not recorded'}); this machine is {here.get('cpu')} "
            f"({here.get('isa') or 'vector ISA unknown'}), where its step times may be off several-fold; "
            f"{advice}")


def load_profile(path: str | Path | None = None) -> dict[str, Any]:
    """Read and check a profile JSON (default: the shipped CPU profile); clear errors on bad files."""
    path = Path(path or DEFAULT_PROFILE)
    if not path.is_file():
        raise ConfigError(f"simulator profile not found: {path} "
                          "(make one with `python -m feather_env.calibrate --out PATH`)")
    try:
        profile = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: malformed profile JSON: {exc}") from None
    if not isinstance(profile, dict) or profile.get("version") != PROFILE_VERSION:
        got = profile.get("version") if isinstance(profile, dict) else None
        raise ConfigError(f"{path}: profile version {got!r}, this toolkit reads version "
                          f"{PROFILE_VERSION} (re-run `python -m feather_env.calibrate --out {path}`)")
    try:
        StepCostModel.from_dict(profile["step_model"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: bad step_model: {exc!r}") from exc
    return profile
