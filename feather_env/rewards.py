"""The environment's rewards: what one advance of the engine is worth, one small named class each.

CompilerGym's pattern: a reward is a named, swappable class; :data:`REWARD_CLASSES` offers them by
name to :class:`~feather_env.env.FeatherEnv` (its manual's Rewards section says what each
measures, and which trained best). ``goodput`` needs latency SLOs (:func:`parse_goodput_slos`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from feather_env.records import Advance, RequestTimeline
from feather_env.serving_metrics import check_slos, meets_slos, parse_goodput
from scheduler_runtime.config import ConfigError

__all__ = ["GOODPUT_NEEDS_SLOS", "REWARDS", "REWARD_CLASSES", "DecodeThroughputReward", "GoodputReward",
           "LatencyReward", "MakespanReward", "Reward", "TimelineLookup", "make_reward",
           "parse_goodput_slos"]


#: How a reward reads the timeline of a request the engine finished (the environment's lookup).
TimelineLookup = Callable[[str], RequestTimeline]


class Reward:
    """A reward: what one advance of the engine (:class:`~feather_env.records.Advance`) is worth
    (CompilerGym's pattern: rewards are named, swappable classes). ``units`` is its unit.

    A reward holds no state of an episode: it is made once, when an environment is resolved
    (:func:`make_reward`), and every environment built from that resolution calls the same object,
    with the episode's request count and its lookup of finished requests' timelines."""

    name = ""
    units = ""

    def __call__(self, adv: Advance, episode_requests: int, timeline: TimelineLookup) -> float:
        raise NotImplementedError


class LatencyReward(Reward):
    """Minus requests in the system x seconds per request: the return is minus the mean E2E latency."""

    name, units = "latency", "s per request"

    def __call__(self, adv: Advance, episode_requests: int, timeline: TimelineLookup) -> float:
        return -adv.request_seconds / max(episode_requests, 1)


class MakespanReward(Reward):
    """Minus the seconds that passed: the return is minus the episode's makespan."""

    name, units = "makespan", "s"

    def __call__(self, adv: Advance, episode_requests: int, timeline: TimelineLookup) -> float:
        return -adv.seconds


class DecodeThroughputReward(Reward):
    """The paper's: decode throughput of the interval's decode-only steps (kilotokens/s; 0 when none)."""

    name, units = "decode_throughput", "ktok/s"

    def __call__(self, adv: Advance, episode_requests: int, timeline: TimelineLookup) -> float:
        return adv.decode_tokens / adv.decode_seconds * 1e-3 if adv.decode_seconds > 0 else 0.0


#: What asking for the goodput reward without SLOs says.
GOODPUT_NEEDS_SLOS = ("reward 'goodput' needs latency SLOs: goodput_slos='ttft:MS tpot:MS e2el:MS' "
                      "(vllm bench serve --goodput's milliseconds; any of the three)")


def parse_goodput_slos(spec: Mapping[str, float] | str | Sequence[str] | None) -> dict[str, float] | None:
    """Latency SLOs as ``vllm bench serve --goodput`` takes them (``"ttft:5000 tpot:50"``, its list of
    pairs, or a mapping ``{"ttft": 5000}``; milliseconds) -> a checked dict, ``None`` when none.

    Raises:
        ConfigError: a malformed pair, an unknown name (valid: ttft, tpot, e2el) or a bad value.
    """
    if spec is None:
        return None
    try:
        slos = check_slos(spec) if isinstance(spec, Mapping) else parse_goodput(spec)
    except ValueError as exc:
        raise ConfigError(f"goodput_slos: {exc}") from None
    return slos or None


class GoodputReward(Reward):
    """+1 for every request that finished in the interval meeting every SLO (vLLM's goodput).

    A request is good when its TTFT, TPOT and E2E latency are within the SLOs given (milliseconds;
    a missing one is no bound), :func:`~feather_env.serving_metrics.meets_slos`: the definition
    ``request_goodput`` counts (``vllm bench serve --goodput``). The return is the number of good
    requests of the episode; late and failed requests count nothing (nothing is subtracted).

    Not divided by the episode's duration: goodput is good requests / (first arrival -> last
    completion), but the duration is known only at the end, and a terminal-only reward would leave
    every decision without credit. For a fixed episode (its requests and arrival times are fixed) the
    return orders policies as goodput does whenever the duration is the same for them, which is the
    case when the makespan is arrival-bound (the last requests arrive late enough that the engine
    finishes soon after them, whatever the order); when the engine is the bottleneck, a policy that
    also shortens the makespan has a higher goodput than its return alone says.

    ``timeline`` (a call's) gives the :class:`~feather_env.records.RequestTimeline` of a finished
    request's id (the environment passes its backend's); TTFT and TPOT are read from it.
    """

    name, units = "goodput", "good requests"

    def __init__(self, slos: Mapping[str, float] | None = None) -> None:
        if not slos:
            raise ConfigError(GOODPUT_NEEDS_SLOS)
        self.slos = check_slos(slos)

    def __call__(self, adv: Advance, episode_requests: int, timeline: TimelineLookup) -> float:
        if not adv.finished:
            return 0.0
        slos = self.slos
        good = 0
        for rid in adv.finished:
            t = timeline(rid)
            good += t.completed and meets_slos(t, slos)
        return float(good)


#: The rewards the environment offers, by name (see the manual); the default is the first.
REWARD_CLASSES: dict[str, type[Reward]] = {r.name: r for r in (LatencyReward, MakespanReward,
                                                               DecodeThroughputReward, GoodputReward)}
REWARDS = tuple(REWARD_CLASSES)


def make_reward(kind: str, slos: Mapping[str, float] | None = None) -> Reward:
    """The reward named ``kind`` (:data:`REWARDS`); the goodput reward with ``slos`` (ms, checked)."""
    if kind == GoodputReward.name:
        return GoodputReward(slos)
    return REWARD_CLASSES[kind]()
