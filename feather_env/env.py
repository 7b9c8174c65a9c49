"""FeatherEnv: the ADD/STOP batching decision of Feather as a Gymnasium environment.

Registered as ``feather/Batching-v0``; see :class:`FeatherEnv` for its manual.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.envs.registration import EnvSpec

from feather_env.backends import Backend, BatchResult
from feather_env.workloads import Workload, WorkloadConfig, build_workload, synthetic_workload
from feather_env.workloads.request import Request
from scheduler_runtime.cht import ChunkedHashTree
from scheduler_runtime.config import ConfigError
from scheduler_runtime.prefix_index import DEFAULT_CHUNK_SIZE

STOP, ADD = 0, 1
REWARDS = ("makespan", "throughput")
#: Default reward scales: makespan reward is in seconds, throughput reward in kilotokens/s.
DEFAULT_REWARD_SCALE = {"makespan": 1.0, "throughput": 1e-3}


class InvalidActionError(ValueError):
    """The action is masked out in this state (see :meth:`FeatherEnv.action_masks`)."""


def default_workload(seed: int = 0) -> Workload:
    """The embedded default: 16 documents of 2K-8K tokens, 4-16 questions each (L-Eval-like)."""
    return synthetic_workload(num_groups=16, per_group="uniform:4:16", prefix_len="uniform:2000:8000",
                              suffix_len="uniform:10:40", output_len="uniform:16:64", seed=seed,
                              name="synthetic-default")


class FeatherEnv(gym.Env):
    """Form decode batches one request at a time: ADD the best candidate, or STOP and dispatch.

    ## Description
    An episode is one burst of ``waiting`` requests sampled from a workload and inserted
    in a Chunked Hash Tree (CHT). The agent builds a batch: at each step the CHT proposes
    its best candidate (the waiting request that misses the fewest prefix chunks of the
    batch); the agent ADDs it or STOPs, which dispatches the batch to the backend (the
    real vLLM engine, or a simulator fitted to it), runs it to completion and starts a new
    batch. The trade-off (Feather, arXiv 2605.06046): a larger batch uses the hardware
    better, but every request with another prefix breaks the locality of the shared KV.

    The first request of every batch is admitted by the environment itself (the CHT's best
    candidate): STOP on an empty batch is meaningless, so the agent is never asked. The
    first observation of a batch therefore has ``batch_size == 1``.

    ## Action Space
    ``Discrete(2)``: 0 = STOP (dispatch the batch), 1 = ADD (admit the best candidate).
    ``action_masks()`` returns the valid actions (for MaskablePPO): ADD is invalid when the
    batch is at ``max_batch_size``, nothing is waiting, or the candidate's KV peak does not
    fit (SVF's check: the batch's distinct KV tokens at its peak, counting a shared prefix
    once, plus the candidate's unshared prompt chunks and its output, must fit
    ``kv_capacity_tokens``); STOP is invalid on an empty batch. A masked action raises
    :class:`InvalidActionError`.

    ## Observation Space
    ``Box(float32)``, in the paper's units (no normalization; agents scale with
    :attr:`obs_scale`):

    | index | meaning | min | max |
    |---|---|---|---|
    | 0 | batch size B (requests admitted so far) | 0 | max_batch_size |
    | 1 | delta: shared-prefix chunks lost by adding the candidate, clipped | -delta_clip | delta_clip |
    | 2 | w: other waiting requests sharing the candidate's new depth, clipped | 0 | waiting |

    With ``extended_obs=True`` four more entries follow: 3 = waiting requests (0..waiting),
    4 = KV usage of the batch's peak as a fraction of capacity (0..1), 5 = candidate's
    missing chunks (0..delta_clip), 6 = candidate's prompt chunks (0..delta_clip). When no
    candidate exists, delta, w and the candidate entries are 0.

    delta = depth_before - depth_after; it is negative only for an empty batch.

    ## Rewards
    Given at STOP only (ADD: 0).

    - ``"makespan"`` (default): minus the wall seconds the batch took (decode + prefill),
      times ``reward_scale`` (1.0). The episode return is minus the episode's serving time,
      so maximizing it maximizes throughput over the whole burst.
    - ``"throughput"``: the batch's decode throughput in tokens/s times ``reward_scale``
      (1e-3, i.e. kilotokens/s), the paper's reward. Its sum over an episode also grows with
      the number of batches, which rewards splitting; it suits the bandit (which credits each
      batch's reward to the decisions that formed it) more than return-maximizing RL.
      ``benchmarks/agents.py`` compares the two for PPO.

    ## Starting State
    ``waiting`` requests sampled from the workload (``sample_groups`` whole prefix groups
    when ``groups_per_episode`` is set, else ``sample``), deterministic for the reset seed;
    the first batch holds its seed request.

    ## Episode End
    Terminates when every sampled request has been served exactly once. Truncation: never
    (an episode takes at most ``2 * waiting`` steps).

    ## Info
    At STOP, ``info["batch"]`` has the batch's metrics (size, prefix groups, decode tok/s,
    decode/prefill seconds, prefix-cache hits); at the end ``info["episode"]`` has the
    episode's decode tok/s (total decode tokens / total decode seconds), batches, served
    requests and seconds.

    ## Arguments
    - ``backend``: ``"sim"`` (default), ``"vllm"``, or a :class:`~feather_env.backends.Backend`.
    - ``workload``: a :class:`Workload`, a workload config mapping (see ``WorkloadConfig``),
      or ``None`` for :func:`default_workload`.
    - ``waiting``: requests per episode (W); ``max_batch_size``; ``chunk_size`` (CHT).
    - ``groups_per_episode``, ``max_per_group``: episode sampling by prefix groups.
    - ``reward`` (``"makespan"``/``"throughput"``), ``reward_scale``.
    - ``extended_obs``; ``delta_clip`` (chunks).
    - ``kv_capacity_tokens``: defaults to the backend's.
    - ``profile`` (sim: calibrated profile JSON), ``engine`` (vllm: ``EngineConfig`` or mapping),
      ``warm_prefixes`` (vllm).
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        backend: str | Backend = "sim",
        workload: Workload | Mapping[str, Any] | None = None,
        *,
        waiting: int = 64,
        max_batch_size: int = 64,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        groups_per_episode: int | None = None,
        max_per_group: int | None = None,
        reward: str = "makespan",
        reward_scale: float | None = None,
        extended_obs: bool = False,
        delta_clip: int = 64,
        kv_capacity_tokens: int | None = None,
        profile: str | None = None,
        engine: Any = None,
        warm_prefixes: bool = True,
    ) -> None:
        super().__init__()
        if reward not in REWARDS:
            raise ConfigError(f"reward must be one of {REWARDS}, got {reward!r}")
        for name, value in (("waiting", waiting), ("max_batch_size", max_batch_size),
                            ("chunk_size", chunk_size), ("delta_clip", delta_clip)):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if isinstance(workload, Workload):
            self.workload = workload
        elif workload is None:
            self.workload = default_workload()
        else:
            self.workload = build_workload(WorkloadConfig.from_mapping(workload))
        if groups_per_episode is not None and groups_per_episode > self.workload.num_groups:
            raise ConfigError(f"groups_per_episode={groups_per_episode} exceeds the workload's "
                              f"{self.workload.num_groups} prefix groups")
        if groups_per_episode is None and waiting > len(self.workload):
            raise ConfigError(f"waiting={waiting} exceeds the workload's {len(self.workload)} requests")
        self.waiting = waiting
        self.max_batch_size = max_batch_size
        self.chunk_size = chunk_size
        self.groups_per_episode = groups_per_episode
        self.max_per_group = max_per_group
        self.reward_kind = reward
        self.reward_scale = DEFAULT_REWARD_SCALE[reward] if reward_scale is None else reward_scale
        self.extended_obs = extended_obs
        self.delta_clip = delta_clip

        self._nondeterministic = False
        self.backend = self._make_backend(backend, profile, engine, warm_prefixes)
        if kv_capacity_tokens is None:
            kv_capacity_tokens = int(getattr(self.backend, "kv_capacity_tokens", 1 << 62))
        self.kv_capacity_tokens = kv_capacity_tokens
        too_big = [r.request_id for r in self.workload if r.peak_tokens > kv_capacity_tokens]
        if too_big:
            raise ConfigError(f"{len(too_big)} requests can never fit the KV cache of "
                              f"{kv_capacity_tokens} tokens, e.g. {too_big[:3]}")
        if self._nondeterministic:
            self.spec = EnvSpec("feather/Batching-v0", entry_point="feather_env.env:FeatherEnv",
                                nondeterministic=True)

        n = 7 if extended_obs else 3
        high = np.array([max_batch_size, delta_clip, waiting, waiting, 1.0, delta_clip, delta_clip],
                        dtype=np.float32)[:n]
        low = np.zeros(n, dtype=np.float32)
        low[1] = -delta_clip
        self.observation_space = spaces.Box(low=low, high=high, dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        #: Divide observations by this to get values in [-1, 1] (what PPO sees).
        self.obs_scale = high.copy()
        self._hash_cache: dict[str, tuple[Request, np.ndarray]] = {}
        self._reset_state()

    # -- gymnasium API --------------------------------------------------------------------
    @property
    def spec(self) -> EnvSpec | None:  # type: ignore[override]
        return self._spec

    @spec.setter
    def spec(self, value: EnvSpec | None) -> None:
        # Real-engine rewards are wall-clock measurements: say so to gymnasium's checks.
        if value is not None and getattr(self, "_nondeterministic", False):
            value = dataclasses.replace(value, nondeterministic=True)
        self._spec = value

    _spec: EnvSpec | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        episode_seed = int(self.np_random.integers(2**31 - 1))
        if self.groups_per_episode is not None:
            episode = self.workload.sample_groups(self.groups_per_episode, episode_seed,
                                                  self.max_per_group)
            if len(episode) > self.waiting:
                episode = episode.sample(self.waiting, episode_seed)
        else:
            episode = self.workload.sample(self.waiting, episode_seed)
        self._reset_state()
        self._requests = {r.request_id: r for r in episode}
        cache = self._hash_cache
        for r in episode:
            hit = cache.get(r.request_id)
            if hit is None or hit[0] is not r:  # hash each workload prompt once, not per episode
                hit = cache[r.request_id] = (r, self.cht.hash_prompt(r.prompt_token_ids))
            self.cht.insert_hashed(r.request_id, hit[1])
        self._seed_batch()
        return self._observe(), {"episode_requests": len(self._requests)}

    def step(self, action: int):
        if not self._requests:
            raise RuntimeError("call reset() before step()")
        if self._terminated:
            raise RuntimeError("episode has terminated; call reset()")
        action = int(action)
        mask = self.action_masks()
        if action not in (STOP, ADD):
            raise InvalidActionError(f"action must be 0 (STOP) or 1 (ADD), got {action}")
        if not mask[action]:
            raise InvalidActionError(self._mask_reason(action))
        self._steps += 1
        info: dict[str, Any] = {}
        reward = 0.0
        if action == ADD:
            self._admit(self._candidate)
        else:
            result = self._dispatch()
            reward = self._reward(result)
            info["batch"] = self._last_batch_info
            if self.cht.num_waiting == 0:
                self._terminated = True
                info["episode"] = self._episode_info()
            else:
                self._seed_batch()
        return self._observe(), reward, self._terminated, False, info

    def action_masks(self) -> np.ndarray:
        """Valid actions as booleans ``[STOP, ADD]`` (MaskablePPO's convention)."""
        cand = self._candidate
        can_add = (
            cand is not None
            and len(self._batch) < self.max_batch_size
            and self._batch_peak + self._new_peak_tokens(cand) <= self.kv_capacity_tokens
        )
        return np.array([len(self._batch) > 0, can_add], dtype=bool)

    def close(self) -> None:
        backend = getattr(self, "backend", None)
        if backend is not None and getattr(self, "_owns_backend", False):
            backend.close()

    # -- helpers ----------------------------------------------------------------------------
    def _make_backend(self, backend: Any, profile: str | None, engine: Any, warm: bool) -> Backend:
        self._owns_backend = isinstance(backend, str)
        if not isinstance(backend, str):
            self._nondeterministic = not getattr(backend, "deterministic", False)
            return backend
        if backend == "sim":
            from feather_env.sim import SimBackend

            return SimBackend.from_profile(profile)
        if backend == "vllm":
            from feather_env.backends import VLLMBackend
            from feather_env.engine import EngineConfig

            if engine is None or isinstance(engine, Mapping):
                engine = EngineConfig.from_dict({"max_num_seqs": self.max_batch_size,
                                                 **dict(engine or {})})
            self._nondeterministic = True
            return VLLMBackend(engine, warm_prefixes=warm)
        raise ConfigError(f"backend must be 'sim', 'vllm' or a Backend object, got {backend!r}")

    def _reset_state(self) -> None:
        self.cht = ChunkedHashTree(self.chunk_size)
        self._requests: dict[str, Request] = {}
        self._batch: list[Request] = []
        self._batch_peak = 0
        self._candidate = None
        self._served: set[str] = set()
        self._terminated = False
        self._steps = 0
        self._results: list[BatchResult] = []
        self._last_batch_info: dict[str, Any] = {}

    def _new_peak_tokens(self, cand) -> int:
        """KV tokens the candidate adds at its peak: its unshared prompt chunks + its output."""
        req = self._requests[cand.request_id]
        missing = self.cht.missing_count(cand.request_id) * self.chunk_size
        return min(missing, req.prompt_len) + req.output_len

    def _admit(self, cand) -> None:
        self._batch_peak += self._new_peak_tokens(cand)
        self.cht.activate(cand.request_id)
        self._batch.append(self._requests[cand.request_id])
        self._candidate = self.cht.best_candidate()

    def _seed_batch(self) -> None:
        self._candidate = self.cht.best_candidate()
        if self._candidate is not None:
            self._admit(self._candidate)

    def _dispatch(self) -> BatchResult:
        batch, self._batch = self._batch, []
        result = self.backend.run_batch(batch)
        for r in batch:
            if r.request_id in self._served:
                raise RuntimeError(f"request {r.request_id} served twice")
            self._served.add(r.request_id)
            self.cht.finish(r.request_id)
        self._batch_peak = 0
        self._results.append(result)
        self._last_batch_info = {
            "batch_size": len(batch),
            "prefix_groups": len({r.prefix_group for r in batch}),
            "decode_tok_s": result.decode_tok_s,
            "decode_seconds": result.decode_seconds,
            "prefill_seconds": result.prefill_seconds,
            "decode_tokens": result.decode_tokens,
            "prefix_hit_tokens": result.prefix_hit_tokens,
        }
        return result

    def _reward(self, result: BatchResult) -> float:
        if self.reward_kind == "makespan":
            return -result.total_seconds * self.reward_scale
        return result.decode_tok_s * self.reward_scale

    def _episode_info(self) -> dict[str, Any]:
        tokens = sum(r.decode_tokens for r in self._results)
        seconds = sum(r.decode_seconds for r in self._results)
        return {
            "decode_tok_s": tokens / seconds if seconds else 0.0,
            "decode_tokens": tokens,
            "decode_seconds": seconds,
            "total_seconds": sum(r.total_seconds for r in self._results),
            "batches": len(self._results),
            "served": len(self._served),
            "requests": len(self._requests),
            "mean_batch_size": len(self._served) / max(len(self._results), 1),
        }

    def _observe(self) -> np.ndarray:
        n = self.observation_space.shape[0]
        obs = np.zeros(n, dtype=np.float32)
        if self._terminated:
            return obs
        obs[0] = len(self._batch)
        cand = self._candidate
        if cand is not None:
            delta = cand.depth_before - cand.depth_after
            obs[1] = max(-self.delta_clip, min(delta, self.delta_clip))
            obs[2] = min(cand.w, self.waiting)
        if self.extended_obs:
            obs[3] = self.cht.num_waiting
            obs[4] = min(self._batch_peak / self.kv_capacity_tokens, 1.0)
            if cand is not None:
                obs[5] = min(self.cht.missing_count(cand.request_id), self.delta_clip)
                obs[6] = min(len(self.cht.hash_vector(cand.request_id)), self.delta_clip)
        return obs

    def _mask_reason(self, action: int) -> str:
        if action == STOP:
            return "STOP is invalid on an empty batch"
        if self._candidate is None:
            return "ADD is invalid: no request is waiting"
        if len(self._batch) >= self.max_batch_size:
            return f"ADD is invalid: batch is at max_batch_size={self.max_batch_size}"
        return (f"ADD is invalid: candidate {self._candidate.request_id} would exceed the KV "
                f"capacity of {self.kv_capacity_tokens} tokens")

    # read-only views for agents, tests and the oracle policy
    @property
    def batch(self) -> list[Request]:
        return list(self._batch)

    @property
    def candidate_request(self) -> Request | None:
        return None if self._candidate is None else self._requests[self._candidate.request_id]

    @property
    def candidate(self):
        return self._candidate

    @property
    def served_ids(self) -> set[str]:
        return set(self._served)
