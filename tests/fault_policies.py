"""Plug-in policies for the fault-isolation tests, loaded as ``feather:py:fault_policies:NAME``.

They are what a user's own policy module looks like (see ``scheduler_runtime.plugins.load_policy_spec``):
an importable module with a class whose instances have ``act(obs, mask)``. The test server finds
this module through ``PYTHONPATH`` (the tests folder), as a user's package would be found.
"""

from __future__ import annotations

import numpy as np

from scheduler_runtime.rules import HeuristicRule


class PolicyFault(RuntimeError):
    """The deliberate failure of :class:`RaisesOnFiftiethDecision`."""


class RaisesOnFiftiethDecision(HeuristicRule):
    """The authors' heuristic, except that its 50th decision raises :class:`PolicyFault`."""

    fail_at = 50

    def __init__(self) -> None:
        super().__init__()
        self.decisions = 0

    def act(self, obs: np.ndarray, mask: np.ndarray) -> int:
        self.decisions += 1
        if self.decisions == self.fail_at:
            raise PolicyFault(f"deliberate fault at decision {self.decisions}")
        return super().act(obs, mask)


class RaisesOnFifthDecision(RaisesOnFiftiethDecision):
    """The same fault at the 5th decision (small workloads)."""

    fail_at = 5


class FailsToBuild:
    """A policy class whose constructor fails (a plug-in that cannot start)."""

    def __init__(self) -> None:
        raise RuntimeError("missing weights")


#: Importable, but not a policy.
NOT_A_POLICY = 42
