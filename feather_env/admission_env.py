"""AdmissionEnv: admit or reject each arriving request, as a Gymnasium environment (``feather/Admission-v0``).

See :class:`AdmissionEnv` for its manual.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from feather_env.cluster_sim import ReplicaSim
from feather_env.records import RequestTimeline
from feather_env.resolved import resolve_env
from feather_env.scenarios import Scenario
from feather_env.serving_metrics import meets_slos, serving_metrics
from feather_env.workloads import Request
from scheduler_runtime.admission import (
    AdmissionController,
    AdmissionRule,
    parse_slos,
    prompt_block_hashes,
    split_admission,
)
from scheduler_runtime.config import ConfigError

__all__ = ["ADMIT", "DEFAULT_PROFILE", "DEFAULT_SETTING", "OBS_NAMES", "REJECT", "AdmissionEnv",
           "rule_action"]

#: The actions.
REJECT, ADMIT = 0, 1
#: The base setting whose serving loop the agent's admissions feed (no admission rule of its own).
DEFAULT_SETTING = "group-cap-8@256"
#: The profile of the overload scenarios' host (configs/scenarios/mooncake-overload-*.yaml).
DEFAULT_PROFILE = str(Path(__file__).resolve().parents[1] / "configs" / "profiles"
                      / "cpu-tiny-llama-epyc-avx512.json")
DEFAULT_SLOS = "ttft:5000 tpot:50"
#: The observation's entries, in order (see :class:`AdmissionEnv`'s table).
OBS_NAMES = ("pred_ttft_ratio", "alone_ratio", "never_fits", "uncached_fraction", "queued",
             "running", "queued_uncached", "since_reject", "recent_arrivals")
#: Every ratio, count and time of the observation is clipped to this.
OBS_CLIP = 16.0
#: ``queued_uncached``'s unit (tokens).
TOKEN_SCALE = 65536.0


def rule_action(obs: np.ndarray, factor: float) -> int:
    """``slo:F`` as a policy of this environment: ADMIT iff the request can fit at all (``never_fits``
    is 0) and its predicted TTFT is at most ``factor`` x the TTFT SLO, exactly the decision of
    :class:`~scheduler_runtime.admission.AdmissionController` with the rule ``slo:F`` (which also
    rejects a request that never fits, whatever F)."""
    return ADMIT if obs[2] < 0.5 and obs[0] <= factor else REJECT


class AdmissionEnv(gym.Env):
    """Serve an episode of a scenario on the simulator, admitting or rejecting each request at its arrival.

    ## Description
    An episode is one episode of the scenario (for ``mooncake-overload-*``: a 100-s window of the
    Mooncake trace, replayed at the scenario's rate), served on the simulator
    (:class:`~feather_env.engines.sim_backend.SimBackend`) with a base setting (default
    ``group-cap-8@256``, whose own scheduler answers its batching decisions, as it does when
    serving). The requests arrive one at a time, in arrival order; before each, the engine runs up
    to its arrival (to the end of the engine step that reaches it, as a real engine finishes its
    step before it sees a new request: the cluster simulator's driver,
    :class:`~feather_env.cluster_sim.ReplicaSim`), and the agent answers: ADMIT (1) submits the
    request to the engine (:meth:`~feather_env.serving.ServingBackend.submit`), REJECT (0) refuses
    it: it never reaches the engine, which costs the engine nothing, and it counts as submitted and
    not good. With every request admitted the episode is the base setting's own run, request for
    request (``tests/test_admission_env.py`` checks it against the plain serving loop).

    ## Action Space
    ``Discrete(2)``: 0 = REJECT, 1 = ADMIT; both are always valid (``action_masks()`` says so, for
    MaskablePPO).

    ## Observation Space
    ``Box(float32)``, at the request's arrival, each entry clipped to ``[0, high]``. The predictions
    are those of an :class:`~scheduler_runtime.admission.AdmissionController` fed by the backend
    exactly as the ``~slo:F`` rule's is (it sees every admitted request, its first token and its
    finish; its prefix estimate holds the admitted prompts), whose rule never rejects:

    | index | name | meaning | high |
    |---|---|---|---|
    | 0 | pred_ttft_ratio | predicted TTFT (FCFS behind the queue, ``predicted_ttft``) / TTFT SLO | 16 |
    | 1 | alone_ratio | its own prefill on an idle engine (``alone_seconds``) / TTFT SLO | 16 |
    | 2 | never_fits | 1 when it cannot meet its SLOs even on an idle engine (as ``slo:F`` rejects it) | 1 |
    | 3 | uncached_fraction | prompt share the prefix estimate does not hold | 1 |
    | 4 | queued | admitted requests waiting for their first token / max_num_seqs | 16 |
    | 5 | running | admitted requests past their first token / max_num_seqs | 16 |
    | 6 | queued_uncached | prompt tokens the queued requests still have to prefill / 65,536 | 16 |
    | 7 | since_reject | seconds since the last rejection / TTFT SLO (16 before the first) | 16 |
    | 8 | recent_arrivals | requests that arrived in the last TTFT-SLO seconds / max_num_seqs | 16 |

    ``slo:F`` is ``rule_action(obs, F)``: admit iff ``never_fits == 0`` and ``pred_ttft_ratio <= F``.
    After the last request the observation is all zeros.

    ## Rewards
    +1 for each request that finished meeting every SLO of ``slos`` (vLLM's definition,
    :func:`~feather_env.serving_metrics.meets_slos`), credited at the step in whose engine run it
    finished (not at its own decision: whether it meets its SLOs is known only then); 0 otherwise.
    The last step serves the episode to its end, so the return is exactly the episode's good
    requests, and return / requests is its SLO attainment.

    ## Starting State and Episode End
    ``reset(seed)`` draws an episode seed (uniformly among ``episode_seeds`` when given, else any)
    from the reset seed; ``options={"episode_seed": S}`` serves episode ``S``. The engine starts
    empty (prefix cache cleared). The episode terminates after the decision on its last request;
    every admitted request is then checked to be served exactly once with its tokens.

    ## Info
    Every step: ``clock``, ``decisions``, ``good`` (so far). At the end ``info["episode"]``:
    :func:`~feather_env.serving_metrics.serving_metrics` over every request of the episode, the
    rejected included as submitted (``slo_attainment`` = good / submitted, ``rejected``), plus
    ``good``, ``return``, ``episode_seed``, ``setting``. :meth:`timelines` gives every request's
    timeline (the rejected with ``outcome == "rejected"``, reason ``"agent"``).

    ## Arguments
    ``scenario`` (a name, YAML path or :class:`~feather_env.scenarios.Scenario`; default
    ``mooncake-overload-3l``), ``scenario_overrides``, ``setting`` (a setting name without a
    ``~RULE``), ``profile`` (the simulator's profile JSON; default the EPYC AVX-512 host's),
    ``slos`` (``"ttft:5000 tpot:50"`` or a mapping, ms; a TTFT SLO is required),
    ``episode_seeds``.
    """

    metadata = {"render_modes": []}

    def __init__(self, scenario: str | Scenario = "mooncake-overload-3l", *, setting: str = DEFAULT_SETTING,
                 profile: str | None = DEFAULT_PROFILE, slos: str | Mapping[str, float] = DEFAULT_SLOS,
                 scenario_overrides: Mapping[str, Mapping[str, Any]] | None = None,
                 episode_seeds: Sequence[int] | None = None) -> None:
        super().__init__()
        base, rule = split_admission(setting)
        if rule is not None:
            raise ConfigError(f"setting {setting!r} has its own admission rule: the agent is the rule here; "
                              f"give {base!r}")
        self.slos = parse_slos(slos) if isinstance(slos, str) else dict(slos)
        if "ttft" not in self.slos:
            raise ConfigError("the admission environment needs a TTFT SLO (slos='ttft:MS ...')")
        resolved = resolve_env(scenario, "sim", scenario_overrides=scenario_overrides, scheduler=setting,
                               profile=profile, goodput_slos=self.slos)
        self.resolved = resolved
        self.scenario = resolved.scenario
        self.setting = setting
        self.config = resolved.scheduler
        self.engine_config = resolved.engine
        self.episode_seeds = None if episode_seeds is None else [int(s) for s in episode_seeds]
        if self.episode_seeds is not None and not self.episode_seeds:
            raise ConfigError("episode_seeds is empty")
        # the cluster simulator's replica: driven request by request, the engine run up to each arrival
        self.backend = ReplicaSim("admission", resolved.engine, self.config, resolved.backend.profile)
        self.max_num_seqs = self.engine_config.max_num_seqs
        high = np.array([OBS_CLIP, OBS_CLIP, 1.0, 1.0, OBS_CLIP, OBS_CLIP, OBS_CLIP, OBS_CLIP, OBS_CLIP],
                        dtype=np.float32)
        self.observation_space = spaces.Box(low=np.zeros_like(high), high=high, dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self.obs_names = OBS_NAMES
        #: Divide observations by this for values in [0, 1] (the ratios that matter, near 1, then sit
        #: near 0: benchmarks/admission_agents.py's PPO takes ``log1p(obs) / log1p(high)`` instead).
        self.obs_scale = high.copy()
        self.controller: AdmissionController | None = None
        self._hashes: dict[str, tuple[Request, list[int]]] = {}
        self._requests: list[Request] = []
        self._i = 0
        self._terminated = True
        self.episode_seed: int | None = None

    # -- gymnasium API --------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        given = (options or {}).get("episode_seed")
        if given is not None:
            episode_seed = int(given)
        elif self.episode_seeds is not None:
            episode_seed = self.episode_seeds[int(self.np_random.integers(len(self.episode_seeds)))]
        else:
            episode_seed = int(self.np_random.integers(2**31 - 1))
        episode = self.scenario.episode_workload(episode_seed)
        self.episode_seed = episode_seed
        self._requests = sorted(episode, key=lambda r: r.arrival_time)  # stable: queue order on ties
        backend = self.backend
        backend.admission_slos = dict(self.slos)
        backend.start((), self.config)  # an empty episode: the requests come by submit()
        backend.opened = True
        backend.events = []
        # the controller a ~RULE of this setting would get, with a rule that rejects nothing
        self.controller = backend.admission_controller(self.config, AdmissionRule())
        backend.admission = self.controller  # fed by the backend: offers, first tokens, finishes
        self._index: dict[str, RequestTimeline] = {}
        self._rejected: dict[str, RequestTimeline] = {}
        self._waiting: dict[str, int] = {}  # admitted, no first token yet -> uncached tokens
        self._waiting_uncached = 0
        self._recent: deque[float] = deque()
        self._last_reject = -math.inf
        self._good = 0
        self._i = 0
        self._terminated = False
        self._pending_obs: dict[str, Any] = {}
        self._run_until(float(self._requests[0].arrival_time))
        return self._observe(), {"episode_seed": episode_seed, "episode_requests": len(self._requests),
                                 "clock": backend.clock}

    def step(self, action: int):
        if self._terminated:
            raise RuntimeError("the episode is over (or never started): call reset()")
        try:
            action = int(action)
        except (TypeError, ValueError):
            raise ValueError(f"action must be 0 (REJECT) or 1 (ADMIT), got {action!r}") from None
        if action not in (REJECT, ADMIT):
            raise ValueError(f"action must be 0 (REJECT) or 1 (ADMIT), got {action}")
        request = self._requests[self._i]
        now = float(request.arrival_time)
        if action == ADMIT:
            self._waiting[request.request_id] = self._pending_obs["uncached"]
            self._waiting_uncached += self._pending_obs["uncached"]
            self.backend.submit(request)
        else:
            self._rejected[request.request_id] = RequestTimeline(
                request.request_id, request.prompt_len, request.output_len, now, source=request.source,
                outcome="rejected", reason="agent")
            self._last_reject = now
        self._i += 1
        good_before = self._good
        if self._i < len(self._requests):
            self._run_until(float(self._requests[self._i].arrival_time))
        else:
            self._run_until(math.inf)
            self.backend.check_complete()
            self._terminated = True
        reward = float(self._good - good_before)
        info: dict[str, Any] = {"clock": self.backend.clock, "decisions": self._i, "good": self._good}
        if self._terminated:
            info["episode"] = self.episode_metrics()
        return self._observe(), reward, self._terminated, False, info

    def action_masks(self) -> np.ndarray:
        """Both actions are always valid (MaskablePPO's convention: ``[REJECT, ADMIT]``)."""
        return np.array([True, True])

    @property
    def terminated(self) -> bool:
        return self._terminated

    @property
    def request(self) -> Request | None:
        """The request of the pending decision (None after the last)."""
        return None if self._terminated else self._requests[self._i]

    # -- the loop ---------------------------------------------------------------------------------
    def _run_until(self, t: float) -> None:
        """Run the engine up to ``t`` (the step that reaches it included), crediting the good finishes."""
        backend = self.backend
        backend.run_until(t)
        events = backend.events
        assert events is not None
        for rid, finished in events:
            if not finished:
                uncached = self._waiting.pop(rid, None)
                if uncached is not None:
                    self._waiting_uncached -= uncached
                continue
            tl = self._timeline(rid)
            if tl.completed and meets_slos(tl, self.slos):
                self._good += 1
        events.clear()

    def _timeline(self, request_id: str) -> RequestTimeline:
        t = self._index.get(request_id)
        if t is None:  # submitted since the index was built: the backend's own (live) timelines
            self._index = {tl.request_id: tl for tl in self.backend.timelines()}
            t = self._index[request_id]
        return t

    def _block_hashes(self, request: Request) -> list[int]:
        cached = self._hashes.get(request.request_id)
        if cached is None or cached[0] is not request:
            cached = self._hashes[request.request_id] = (
                request, prompt_block_hashes(request.prompt_token_ids, self.engine_config.block_size))
        return cached[1]

    def _observe(self) -> np.ndarray:
        if self._terminated:
            return np.zeros(self.observation_space.shape, dtype=np.float32)
        ctrl = self.controller
        assert ctrl is not None
        request = self._requests[self._i]
        now = float(request.arrival_time)
        n = request.prompt_len
        cached = min(n - 1, ctrl.prefix.cached_blocks(self._block_hashes(request)) * ctrl.block_size)
        slo = ctrl.ttft_slo_s()
        tpot = ctrl.slos.get("tpot", math.inf) / 1000.0
        alone = ctrl.alone_seconds(n, cached)
        predicted = ctrl.predicted_ttft(n, cached)
        never = alone > slo or ctrl.model.step(1, 1, n) > tpot
        recent = self._recent
        recent.append(now)
        while recent and recent[0] < now - slo:
            recent.popleft()
        self._pending_obs = {"uncached": n - cached, "predicted_s": predicted, "alone_s": alone,
                             "never_fits": never}
        since = (now - self._last_reject) / slo if math.isfinite(self._last_reject) else OBS_CLIP
        seqs = self.max_num_seqs
        obs = np.array([predicted / slo, alone / slo, float(never), (n - cached) / n, ctrl.num_queued / seqs,
                        ctrl.num_running / seqs, self._waiting_uncached / TOKEN_SCALE, since,
                        len(recent) / seqs], dtype=np.float32)
        return np.clip(obs, self.observation_space.low, self.observation_space.high)

    # -- results ------------------------------------------------------------------------------------
    def timelines(self) -> list[RequestTimeline]:
        """Every request of the episode in arrival order: the served ones (the backend's) and the
        rejected ones (``outcome == "rejected"``), so that every request counts as submitted."""
        served = {t.request_id: t for t in self.backend.timelines()}
        out = []
        for r in self._requests:
            t = served.get(r.request_id) or self._rejected.get(r.request_id)
            if t is None:  # not decided yet
                continue
            out.append(t)
        return out

    def episode_metrics(self) -> dict[str, Any]:
        """The episode's serving metrics over every request decided so far (see Info)."""
        out = serving_metrics(self.timelines(), goodput=self.slos)
        out.update(good=self._good, agent_rejected=len(self._rejected), episode_seed=self.episode_seed,
                   setting=self.setting, scenario=self.scenario.name, clock_s=self.backend.clock)
        out["return"] = float(self._good)
        return out
