"""The serving front end: the requests a scheduler holds back from its engine, and who answers the rounds.

Both engines the batching core serves in put it in front of their queue the same way: vLLM's
scheduler subclass (:mod:`scheduler_runtime.serving.vllm_scheduler`) and the simulator's backend
(``feather_env.engines.sim_backend``). A new request is *held* (:class:`HeldRequests`) while the core decides;
the ids a round releases leave the hold in release order, into the engine's own queue (the
``enqueue`` callable: vLLM's ``_enqueue_waiting_request``, the simulator's ``add_request``); a
request the engine frees while held leaves the hold.

A round is answered by a :class:`Planner`: the runtime itself
(:class:`~scheduler_runtime.schedulers.FeatherRuntime` ``.plan``: its policy answers every
decision, as under ``feather-serve``), or :class:`AnsweredRounds`, which hands over the ids of
rounds someone else answered between engine steps: the environment, whose agent answers each
decision in its own ``step()``. The scheduler asks its planner once per engine step; which
planner that is, is the only difference between serving and training.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Generic, Protocol, TypeVar

from scheduler_runtime.decision import EngineView

__all__ = ["AnsweredRounds", "HeldRequests", "Planner", "free_slots"]

R = TypeVar("R")


class Planner(Protocol):
    """Answers a round: the ids to release now, in order."""

    def plan(self, now: float, free_slots: int, engine: EngineView | None = None) -> list[str]: ...


class AnsweredRounds:
    """A planner whose rounds were answered outside the engine step: :meth:`plan` hands over the
    ids :meth:`push`\\ ed since the last step, in release order."""

    def __init__(self) -> None:
        self._ids: list[str] = []

    def push(self, request_ids: Sequence[str]) -> None:
        """A round, answered: its released ids go to the engine at its next step."""
        self._ids.extend(request_ids)

    def plan(self, now: float, free_slots: int, engine: EngineView | None = None) -> list[str]:
        ids, self._ids = self._ids, []
        return ids

    def clear(self) -> None:
        """Forget rounds not handed over (a new episode)."""
        self._ids = []


class HeldRequests(Generic[R]):
    """The engine's requests that the batching core holds, by id, in arrival order.

    Args:
        enqueue: puts a released request into the engine's own waiting queue.
    """

    def __init__(self, enqueue: Callable[[R], None]) -> None:
        self._held: dict[str, R] = {}
        self._enqueue = enqueue

    def hold(self, request_id: str, request: R) -> None:
        """A new request: held until a round releases it."""
        self._held[request_id] = request

    def release(self, request_ids: Sequence[str]) -> None:
        """Hand released requests, in release order, to the engine's queue."""
        held, enqueue = self._held, self._enqueue
        for request_id in request_ids:
            enqueue(held.pop(request_id))

    def drop(self, request_id: str) -> R | None:
        """The engine freed (aborted) a request: it leaves the hold, if it was held."""
        return self._held.pop(request_id, None)

    def take_all(self) -> list[R]:
        """Empty the hold: every held request, in arrival order (a fault hands them to the engine)."""
        held, self._held = list(self._held.values()), {}
        return held

    def get(self, request_id: str) -> R | None:
        return self._held.get(request_id)

    def __getitem__(self, request_id: str) -> R:
        return self._held[request_id]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def __iter__(self) -> Iterator[str]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)


def free_slots(max_active: int, in_engine: int) -> int:
    """How many more requests a round may release: the engine's running limit minus the requests
    already in it (running, or released and queued there)."""
    return max_active - in_engine
