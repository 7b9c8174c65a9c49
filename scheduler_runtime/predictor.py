"""Output-length predictor for SJF, SVF and 1-bit SVF: a small numpy model shipped as one JSON file.

Two linear models over the same features of a request, known when it arrives:

* a median regression (least absolute deviations, ridge-penalized) on ``log(1 + output_len)``
  (:meth:`OutputLengthPredictor.predict`, in tokens: ``exp(prediction) - 1``, an estimate of
  the conditional median, which is what minimizes the MAE), used by SJF and SVF;
* a logistic classifier *short* (``output_len <= threshold``) vs *long*
  (:meth:`OutputLengthPredictor.predict_long`), used by 1-bit SVF with one proxy length per
  class (the training requests' mean output length in that class,
  :meth:`OutputLengthPredictor.proxy_length`).

Features (:meth:`OutputLengthPredictor.features`): a bias; ``log(1 + prompt_len)`` and its
square; a one-hot of the request's *source* (task, e.g. ``"leval/sci_fi"``) and of its family
(``"leval"``); and a hashed bag of the last ``tail_tokens`` prompt tokens (the question: the
words that decide whether an answer is a letter or a summary) in ``hash_buckets`` buckets.
A source the model has not seen (or none) leaves its one-hots at zero; training duplicates
every request without its source so that case has a sensible answer too.

The model is trained by ``scripts/train_predictor.py`` on L-Eval, LongBench and ShareGPT
lengths, and the file it writes (``configs/predictors/output_len.json``) records the held-out
accuracy. Predicting one request costs a few numpy operations on at most ``tail_tokens`` ids.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["DEFAULT_PREDICTOR_PATH", "OutputLengthPredictor", "load_predictor"]

DEFAULT_PREDICTOR_PATH = Path(__file__).resolve().parent.parent / "configs" / "predictors" / "output_len.json"
FORMAT_VERSION = 1
# Knuth's multiplicative hash: spreads token ids over the buckets; the top bits are the best mixed.
_HASH_MULT = np.uint32(2654435761)


def _family(source: str) -> str:
    return source.split("/", 1)[0] if source else ""


@dataclass
class OutputLengthPredictor:
    """A fitted predictor (see the module docstring). Build with :meth:`fit` or :meth:`load`.

    Attributes:
        sources: source vocabulary of the one-hot (tasks seen in training).
        families: family vocabulary (``"leval"``, ``"longbench"``, ``"trace"``).
        hash_buckets: buckets of the hashed token bag (a power of two).
        tail_tokens: how many of the last prompt tokens are hashed.
        reg_weights: median-regression weights (predict ``log1p(output_len)``).
        clf_weights: logistic weights (predicts P(long)).
        threshold: a request is *long* when its output exceeds this many tokens.
        proxy_short, proxy_long: 1-bit SVF proxy lengths (mean output per class in training).
        max_output: predictions are clipped to ``[1, max_output]``.
        metrics: held-out accuracy recorded by the training script.
    """

    sources: list[str]
    families: list[str]
    hash_buckets: int
    tail_tokens: int
    reg_weights: np.ndarray
    clf_weights: np.ndarray
    threshold: int
    proxy_short: float
    proxy_long: float
    max_output: float
    metrics: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hash_buckets < 1 or self.hash_buckets & (self.hash_buckets - 1):
            raise ValueError(f"hash_buckets must be a power of two, got {self.hash_buckets}")
        self.reg_weights = np.asarray(self.reg_weights, dtype=np.float64)
        self.clf_weights = np.asarray(self.clf_weights, dtype=np.float64)
        dim = self.num_features
        for name in ("reg_weights", "clf_weights"):
            if getattr(self, name).shape != (dim,):
                raise ValueError(f"{name} has shape {getattr(self, name).shape}, expected ({dim},)")
        self._source_index = {s: i for i, s in enumerate(self.sources)}
        self._family_index = {f: i for i, f in enumerate(self.families)}
        self._shift = np.uint32(32 - int(self.hash_buckets).bit_length() + 1)
        # Feature blocks: [bias, loglen, loglen^2 | sources + unknown | families + unknown | hash].
        # The "unknown" slots give an unseen source its own intercept, so serving requests
        # without a source neither needs nor disturbs the per-source weights.
        self._off_src = 3
        self._off_fam = self._off_src + len(self.sources) + 1
        self._off_hash = self._off_fam + len(self.families) + 1

    @property
    def num_features(self) -> int:
        return 3 + len(self.sources) + 1 + len(self.families) + 1 + self.hash_buckets

    # ------------------------------------------------------------------ features

    def features(self, token_ids: np.ndarray | Sequence[int], source: str = "") -> np.ndarray:
        """Feature vector of one request (float64, ``num_features`` entries)."""
        tokens = np.asarray(token_ids)
        return self.features_of(tokens.size, tokens[-self.tail_tokens :], source)

    def features_of(self, prompt_len: int, tail: np.ndarray, source: str = "") -> np.ndarray:
        """Features from the prompt's length and its last tokens (all that is read of it)."""
        x = np.zeros(self.num_features, dtype=np.float64)
        loglen = np.log1p(prompt_len) / 10.0  # ~1 for a 20K-token prompt
        x[0], x[1], x[2] = 1.0, loglen, loglen * loglen
        x[self._off_src + self._source_index.get(source, len(self.sources))] = 1.0
        x[self._off_fam + self._family_index.get(_family(source), len(self.families))] = 1.0
        tail = np.asarray(tail)[-self.tail_tokens :]
        if tail.size:
            buckets = (tail.astype(np.uint32) * _HASH_MULT) >> self._shift
            x[self._off_hash :] = np.bincount(buckets, minlength=self.hash_buckets) / self.tail_tokens
        return x

    def features_batch(
        self, prompt_lens: Sequence[int], tails: Sequence[np.ndarray], sources: Sequence[str]
    ) -> np.ndarray:
        """Feature matrix ``[n, num_features]`` of many requests (see :meth:`features_of`)."""
        rows = zip(prompt_lens, tails, sources, strict=True)
        return np.stack([self.features_of(n, t, s) for n, t, s in rows])

    # ------------------------------------------------------------------ predictions

    def predict(self, token_ids: np.ndarray | Sequence[int], source: str = "") -> float:
        """Predicted output length in tokens (in ``[1, max_output]``)."""
        return self._from_log(float(self.features(token_ids, source) @ self.reg_weights))

    def predict_long(self, token_ids: np.ndarray | Sequence[int], source: str = "") -> bool:
        """Whether the output is predicted *long* (``> threshold`` tokens)."""
        return float(self.features(token_ids, source) @ self.clf_weights) > 0.0

    def predict_both(self, token_ids: np.ndarray | Sequence[int], source: str = "") -> tuple[float, bool]:
        """``(predict(...), predict_long(...))`` from one feature vector."""
        x = self.features(token_ids, source)
        return self._from_log(float(x @ self.reg_weights)), float(x @ self.clf_weights) > 0.0

    def proxy_length(self, is_long: bool) -> float:
        """1-bit SVF's proxy output length of a class."""
        return self.proxy_long if is_long else self.proxy_short

    def predict_matrix(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorized predictions from a feature matrix: (lengths, is_long)."""
        lengths = np.clip(np.expm1(x @ self.reg_weights), 1.0, self.max_output)
        return lengths, (x @ self.clf_weights) > 0.0

    def _from_log(self, value: float) -> float:
        return float(min(max(np.expm1(value), 1.0), self.max_output))

    # ------------------------------------------------------------------ fitting

    @classmethod
    def fit(
        cls,
        prompt_lens: Sequence[int],
        tails: Sequence[np.ndarray],
        sources: Sequence[str],
        output_lens: Sequence[int] | np.ndarray,
        *,
        threshold: int = 64,
        hash_buckets: int = 64,
        tail_tokens: int = 64,
        ridge: float = 0.01,
        hash_ridge: float = 100.0,
        l2: float = 1.0,
        unknown_source_weight: float = 0.25,
    ) -> OutputLengthPredictor:
        """Fit both models (median regression by IRLS; logistic regression by Newton's method).

        ``ridge`` penalizes the length and source weights, ``hash_ridge`` the hashed-token
        weights (noisier: many buckets, few requests each); ``l2`` the classifier.
        ``unknown_source_weight``: weight of the classifier's duplicated rows without a source.
        """
        y = np.asarray(output_lens, dtype=np.float64)
        if not (len(prompt_lens) == len(tails) == len(sources) == y.size) or y.size == 0:
            raise ValueError("prompt_lens, tails, sources and output_lens must be non-empty, one length")
        present = sorted({s for s in sources if s})
        families = sorted({_family(s) for s in present})
        dim = 3 + len(present) + 1 + len(families) + 1 + hash_buckets
        model = cls(
            sources=present,
            families=families,
            hash_buckets=hash_buckets,
            tail_tokens=tail_tokens,
            reg_weights=np.zeros(dim),
            clf_weights=np.zeros(dim),
            threshold=int(threshold),
            proxy_short=1.0,
            proxy_long=1.0,
            max_output=float(y.max()),
        )
        x_known = model.features_batch(prompt_lens, tails, sources)
        x_unknown = model.features_batch(prompt_lens, tails, [""] * y.size)
        x = np.vstack([x_known, x_unknown])
        weights = np.concatenate([np.ones(y.size), np.full(y.size, unknown_source_weight)])
        yy = np.concatenate([y, y])
        penalty = np.full(dim, ridge)
        penalty[0] = 0.0  # the bias is not shrunk
        penalty[model._off_hash :] = hash_ridge
        # Regression on the requests as they are; then the unknown-source intercept alone, as
        # the median residual without a source (fitting both at once lets the sourceless
        # copies pull the shared length and token weights away from the per-source optimum).
        ly = np.log1p(y)
        reg = _median_regression(x_known, ly, np.ones(y.size), penalty)
        unknown_src, unknown_fam = model._off_src + len(present), model._off_fam + len(families)
        reg[unknown_src] = reg[unknown_fam] = 0.0
        reg[unknown_src] = float(np.median(ly - x_unknown @ reg))
        model.reg_weights = reg
        labels = (yy > threshold).astype(np.float64)
        model.clf_weights = _logistic(x, labels, weights, l2)
        is_long = y > threshold
        model.proxy_short = float(y[~is_long].mean()) if (~is_long).any() else float(threshold)
        model.proxy_long = float(y[is_long].mean()) if is_long.any() else float(threshold + 1)
        return model

    # ------------------------------------------------------------------ persistence

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "feather-output-length-predictor",
            "version": FORMAT_VERSION,
            "sources": self.sources,
            "families": self.families,
            "hash_buckets": self.hash_buckets,
            "tail_tokens": self.tail_tokens,
            "reg_weights": [round(float(v), 8) for v in self.reg_weights],
            "clf_weights": [round(float(v), 8) for v in self.clf_weights],
            "threshold": self.threshold,
            "proxy_short": self.proxy_short,
            "proxy_long": self.proxy_long,
            "max_output": self.max_output,
            "metrics": self.metrics,
        }

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> OutputLengthPredictor:
        """Read a predictor file; ValueError naming the file and the problem when it cannot be
        used (not UTF-8 JSON, another format or version, a missing field, a value of the wrong
        type or range, a non-finite weight), so a predictor that loads predicts finite lengths."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"predictor file {path}: not UTF-8 text (byte {exc.start}: {exc.reason})"
                             ) from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read predictor file {path}: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != "feather-output-length-predictor":
            raise ValueError(f"{path} is not a Feather output-length predictor file")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path}: predictor format version {data.get('version')}, "
                             f"this code reads {FORMAT_VERSION}")
        problem = _schema_problem(data)
        if problem:
            raise ValueError(f"predictor file {path}: {problem}")
        fields = {k: data[k] for k in _FIELDS}
        try:
            return cls(**fields, metrics=data.get("metrics", {}))
        except ValueError as exc:  # shapes, hash_buckets not a power of two
            raise ValueError(f"predictor file {path}: {exc}") from None


_FIELDS = ("sources", "families", "hash_buckets", "tail_tokens", "reg_weights", "clf_weights",
           "threshold", "proxy_short", "proxy_long", "max_output")


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _schema_problem(data: dict[str, Any]) -> str | None:
    """What is wrong with a predictor document's fields (None: nothing)."""
    missing = [k for k in _FIELDS if k not in data]
    if missing:
        return f"missing field(s) {missing}"
    for key in ("sources", "families"):
        if not isinstance(data[key], list) or not all(isinstance(v, str) for v in data[key]):
            return f"{key!r} must be a list of strings"
    for key, low in (("hash_buckets", 1), ("tail_tokens", 1), ("threshold", 0)):
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{key!r} must be an integer, got {value!r}"
        if value < low:
            return f"{key!r} must be >= {low}, got {value}"
    for key in ("reg_weights", "clf_weights"):
        if not isinstance(data[key], list) or not all(_finite(v) for v in data[key]):
            return f"{key!r} must be a list of finite numbers"
    for key, low in (("proxy_short", 0.0), ("proxy_long", 0.0), ("max_output", 1.0)):
        value = data[key]
        if not _finite(value):
            return f"{key!r} must be a finite number, got {value!r}"
        if value < low:
            return f"{key!r} must be >= {low:g}, got {value}"
    return None


def load_predictor(path: str | Path | None = None) -> OutputLengthPredictor:
    """The predictor at ``path`` (default: the shipped ``configs/predictors/output_len.json``)."""
    return OutputLengthPredictor.load(path if path is not None else DEFAULT_PREDICTOR_PATH)


def _ridge(x: np.ndarray, y: np.ndarray, w: np.ndarray, penalty: np.ndarray) -> np.ndarray:
    """Weighted ridge regression with one penalty per weight."""
    xw = x * w[:, None]
    return np.linalg.solve(xw.T @ x + np.diag(penalty), xw.T @ y)


def _median_regression(
    x: np.ndarray, y: np.ndarray, w: np.ndarray, penalty: np.ndarray, iters: int = 60
) -> np.ndarray:
    """Ridge-penalized least-absolute-deviation regression (IRLS from the least-squares fit).

    The conditional median minimizes the MAE, and the median of ``log(1 + o)`` maps to the
    median of ``o``: fitting it in log space is what an MAE in tokens rewards.
    """
    beta = _ridge(x, y, w, penalty)
    for _ in range(iters):
        resid = np.abs(y - x @ beta)
        new = _ridge(x, y, w / np.maximum(resid, 1e-3), penalty)
        if np.abs(new - beta).max() < 1e-6:
            return new
        beta = new
    return beta


def _logistic(x: np.ndarray, y: np.ndarray, w: np.ndarray, l2: float, iters: int = 50) -> np.ndarray:
    """Weighted L2-regularized logistic regression by Newton's method (IRLS)."""
    beta = np.zeros(x.shape[1])
    reg = l2 * np.eye(x.shape[1])
    reg[0, 0] = 1e-8
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-np.clip(x @ beta, -30, 30)))
        grad = x.T @ (w * (p - y)) + reg @ beta
        hess = (x * (w * p * (1 - p))[:, None]).T @ x + reg
        step = np.linalg.solve(hess, grad)
        beta -= step
        if np.abs(step).max() < 1e-8:
            break
    return beta
