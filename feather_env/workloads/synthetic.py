"""Synthetic prefix-sharing workloads, length distributions, and seeded random token content.

:func:`synthetic_workload` builds ``num_groups`` groups; each group has one random shared
prefix and ``per_group`` requests, each with its own random suffix (like docs/design.md's
measurement: 4000-token prefixes, 20-token unique suffixes). Every length is an int or a
distribution spec parsed by :func:`parse_length_spec`:

- ``N`` or ``"N"``: always N;
- ``"uniform:LO:HI"``: an integer uniformly in [LO, HI];
- ``"lognormal:MEAN:SIGMA"``: lognormal with mean MEAN (in tokens) and log-space sigma SIGMA,
  rounded (long-tailed, like real output lengths);
- ``"choice:A,B,C"``: one of the listed integers, uniformly.

Token content is drawn from ``[3, vocab_size)`` (ids 0-2 are pad/bos/eos). The first two
tokens of a group's prefix encode the group's index (:func:`random_tokens` ``stamp``), so
distinct groups never share a prefix, by construction rather than by chance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from feather_env.workloads.request import Request
from feather_env.workloads.tokenizer import FIRST_CONTENT_ID
from feather_env.workloads.workload import Workload, WorkloadError
from scheduler_runtime.config import ConfigError

LENGTH_FORMS = 'N, "uniform:LO:HI", "lognormal:MEAN:SIGMA" or "choice:A,B,..."'
#: The longest length a spec may give (tokens): above it no model has a context, and numpy's
#: integers overflow.
MAX_LENGTH = 2**31 - 1
#: A synthetic pool holds at most this many prompt tokens (4 GiB of token ids).
MAX_POOL_TOKENS = 2**30
#: ... and at most this many requests.
MAX_REQUESTS = 10**7


def random_tokens(
    n: int, key: Sequence[int], vocab_size: int = 8192, stamp: int | None = None
) -> np.ndarray:
    """``n`` token ids in ``[3, vocab_size)``, a pure function of ``key`` (a tuple of ints).

    With ``stamp`` the first two tokens encode it (base ``vocab_size - 3``), so sequences
    with different stamps (below ``(vocab_size - 3) ** 2``) differ within two tokens.
    """
    if vocab_size <= FIRST_CONTENT_ID + 1:
        raise WorkloadError(f"vocab_size must be > {FIRST_CONTENT_ID + 1}, got {vocab_size}")
    rng = np.random.default_rng([int(k) % (1 << 63) for k in key])
    ids = rng.integers(FIRST_CONTENT_ID, vocab_size, size=n, dtype=np.int32)
    if stamp is not None:
        radix = vocab_size - FIRST_CONTENT_ID
        digits = (stamp % radix, (stamp // radix) % radix)
        for pos in range(min(2, n)):
            ids[pos] = FIRST_CONTENT_ID + digits[pos]
    return ids


@dataclass(frozen=True)
class LengthDistribution:
    """A distribution of non-negative integer lengths; ``spec`` is its string form."""

    kind: str
    params: tuple[float, ...]
    spec: str

    def sample(self, rng: np.random.Generator, n: int, minimum: int = 1) -> np.ndarray:
        """``n`` lengths (``np.int64``), each at least ``minimum`` and at most :data:`MAX_LENGTH`."""
        if self.kind == "const":
            out = np.full(n, self.params[0])
        elif self.kind == "uniform":
            out = rng.integers(int(self.params[0]), int(self.params[1]) + 1, size=n)
        elif self.kind == "lognormal":
            mean, sigma = self.params
            mu = np.log(mean) - sigma * sigma / 2  # so that E[length] = mean
            with np.errstate(over="ignore"):
                out = np.minimum(np.rint(rng.lognormal(mu, sigma, size=n)), MAX_LENGTH)
        else:  # choice
            out = rng.choice(np.array(self.params), size=n)
        return np.maximum(np.asarray(out, dtype=np.int64), minimum)


def parse_length_spec(spec: int | str, *, name: str = "length") -> LengthDistribution:
    """An int or a spec string (see the module docstring) -> :class:`LengthDistribution`.

    Raises :class:`ConfigError` naming ``name``, the spec and the valid forms.
    """

    def bad(reason: str) -> ConfigError:
        return ConfigError(
            f"{name}: bad length spec {spec!r}: {reason}; valid forms: {LENGTH_FORMS}"
        )

    def as_int(text: str) -> int:
        try:
            value = float(text)
        except ValueError:
            raise bad(f"{text!r} is not a number") from None
        if not value.is_integer() or value < 0:
            raise bad(f"{text!r} is not a non-negative integer")
        if value > MAX_LENGTH:
            raise bad(f"{text!r} is longer than any length ({MAX_LENGTH})")
        return int(value)

    def as_float(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise bad(f"{text!r} is not a number") from None

    if isinstance(spec, bool):
        raise bad("a boolean is not a length")
    if isinstance(spec, int | np.integer):
        if spec < 0:
            raise bad("lengths are >= 0")
        if spec > MAX_LENGTH:
            raise bad(f"longer than any length ({MAX_LENGTH})")
        return LengthDistribution("const", (float(spec),), str(int(spec)))
    if not isinstance(spec, str):
        raise bad(f"expected an int or a string, got {type(spec).__name__}")
    kind, sep, rest = spec.strip().partition(":")
    kind = kind.strip().lower()
    if not sep:
        return LengthDistribution("const", (float(as_int(kind)),), spec.strip())
    args = [a.strip() for a in rest.split(":")] if kind != "choice" else [rest]
    if kind == "uniform":
        if len(args) != 2:
            raise bad("uniform takes LO:HI")
        lo, hi = as_int(args[0]), as_int(args[1])
        if lo > hi:
            raise bad(f"LO={lo} > HI={hi}")
        return LengthDistribution("uniform", (lo, hi), spec.strip())
    if kind == "lognormal":
        if len(args) != 2:
            raise bad("lognormal takes MEAN:SIGMA")
        mean, sigma = as_float(args[0]), as_float(args[1])
        if not (0 < mean <= MAX_LENGTH and 0 <= sigma <= 10 and np.isfinite(sigma)):
            raise bad(f"lognormal needs MEAN > 0 (at most {MAX_LENGTH}) and 0 <= SIGMA <= 10")
        return LengthDistribution("lognormal", (mean, sigma), spec.strip())
    if kind == "choice":
        values = [v.strip() for v in rest.split(",") if v.strip()]
        if not values:
            raise bad("choice needs at least one value")
        return LengthDistribution("choice", tuple(float(as_int(v)) for v in values), spec.strip())
    raise bad(f"unknown distribution {kind!r}")


def synthetic_workload(
    num_groups: int,
    per_group: int | str,
    prefix_len: int | str,
    suffix_len: int | str,
    output_len: int | str,
    seed: int = 0,
    vocab_size: int = 8192,
    name: str = "synthetic",
    *,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
    overflow: str = "truncate",
    max_request_tokens: int | None = None,
    capacity_note: str = "",
) -> Workload:
    """``num_groups`` groups of requests that share a random prefix within their group.

    ``per_group`` and ``prefix_len`` are drawn once per group, ``suffix_len`` and
    ``output_len`` once per request (each an int or a spec, see :func:`parse_length_spec`).
    Per-group counts and suffix/output lengths are at least 1; a prefix may be empty (0).
    Deterministic for ``seed``. Request ids are ``synthetic/gG/rJ``.

    A prompt over ``max_prompt_tokens`` raises (``overflow="error"``) or has its group's
    prefix cut (``"truncate"``) to what fits the group's longest suffix, so the group still
    shares one prefix (a suffix longer than the cap on its own is cut too). Outputs are
    capped by ``max_output_tokens``.

    Every length is drawn, and checked, before any token is: a request of more than
    ``max_request_tokens`` prompt + output tokens (a KV cache's capacity, ``capacity_note`` says
    which), or a pool of more than :data:`MAX_POOL_TOKENS` prompt tokens, raises at once.
    """
    if not 1 <= num_groups <= MAX_REQUESTS:
        raise WorkloadError(f"synthetic workload needs 1 <= num_groups <= {MAX_REQUESTS}, got {num_groups}")
    if overflow not in ("truncate", "error"):
        raise WorkloadError(f"overflow must be 'truncate' or 'error', got {overflow!r}")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise WorkloadError(f"max_prompt_tokens must be >= 1 or None, got {max_prompt_tokens}")
    counts_d = parse_length_spec(per_group, name="per_group")
    prefix_d = parse_length_spec(prefix_len, name="prefix_len")
    suffix_d = parse_length_spec(suffix_len, name="suffix_len")
    output_d = parse_length_spec(output_len, name="output_len")
    rng = np.random.default_rng([int(seed) % (1 << 63)])
    counts = counts_d.sample(rng, num_groups, minimum=1)
    prefixes = prefix_d.sample(rng, num_groups, minimum=0)
    total = int(counts.sum())
    if total > MAX_REQUESTS:
        raise WorkloadError(f"synthetic workload of {total} requests (> {MAX_REQUESTS}): fewer groups or "
                            "requests per group")
    suffixes = suffix_d.sample(rng, total, minimum=1)
    outputs = output_d.sample(rng, total, minimum=1)
    if max_output_tokens is not None:
        outputs = np.minimum(outputs, max_output_tokens)
    starts = np.concatenate([[0], np.cumsum(counts)])
    for g in range(num_groups):  # the lengths, capped and checked before any token is drawn
        k, n = int(starts[g]), int(counts[g])
        if max_prompt_tokens is not None:
            longest = int(suffixes[k : k + n].max())
            if int(prefixes[g]) + longest > max_prompt_tokens:
                if overflow == "error":
                    raise WorkloadError(
                        f"synthetic group {g}: prompt of {int(prefixes[g]) + longest} tokens (prefix "
                        f"{int(prefixes[g])}, suffix {longest}) > max_prompt_tokens={max_prompt_tokens}"
                    )
                prefixes[g] = max(0, max_prompt_tokens - longest)
                suffixes[k : k + n] = np.minimum(suffixes[k : k + n], max_prompt_tokens)
        if max_request_tokens is not None:
            peaks = prefixes[g] + suffixes[k : k + n] + outputs[k : k + n]
            j = int(np.argmax(peaks))
            if peaks[j] > max_request_tokens:
                raise WorkloadError(
                    f"synthetic group {g}, request {j}: {int(prefixes[g] + suffixes[k + j])} prompt + "
                    f"{int(outputs[k + j])} output tokens can never fit the KV cache of {max_request_tokens} "
                    f"tokens{capacity_note}; lower workload.prefix_len / suffix_len / output_len, cap them "
                    "(max_prompt_tokens, max_output_tokens) or raise engine.kv_cache_gib")
    pool_tokens = int(np.dot(prefixes, counts)) + int(suffixes.sum())
    if pool_tokens > MAX_POOL_TOKENS:
        raise WorkloadError(f"synthetic workload of {pool_tokens} prompt tokens (> {MAX_POOL_TOKENS}): "
                            "fewer groups, requests per group or tokens per request")
    requests: list[Request] = []
    k = 0
    for g in range(num_groups):
        n, prefix_n = int(counts[g]), int(prefixes[g])
        prefix = random_tokens(prefix_n, (seed, g, 0), vocab_size, stamp=g)
        for j in range(n):
            suffix = random_tokens(int(suffixes[k]), (seed, g, j + 1), vocab_size)
            requests.append(
                Request(
                    request_id=f"synthetic/g{g}/r{j}",
                    prompt_token_ids=np.concatenate([prefix, suffix]),
                    prefix_group=g,
                    output_len=int(outputs[k]),
                    source="synthetic",
                    meta={"prefix_tokens": prefix_n, "suffix_tokens": int(suffixes[k])},
                )
            )
            k += 1
    return Workload(name, tuple(requests))
