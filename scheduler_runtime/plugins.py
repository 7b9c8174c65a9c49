"""Which policy a scheduler answers with: a policy file, a plug-in, or a rule, chosen in one place.

Plug-in policies. :func:`load_policy_spec` also takes ``py:MODULE:ATTRIBUTE``: ATTRIBUTE of
the importable module MODULE is a class (or any callable) that is called without arguments and
returns an object with ``act(obs, mask) -> 0 | 1`` (optional: ``obs_spec``, an
:class:`ObservationSpec`, and ``reset()``), as :class:`~scheduler_runtime.batching.BatchingPolicy`
says. The scheduler names it ``feather:py:MODULE:ATTRIBUTE``. This runs the module's code inside
the engine, exactly as vLLM's own ``--scheduler-cls`` does: name only code you trust.

:func:`default_policy` is the one choice of a scheduler's policy (the vLLM scheduler's runtime
and the environment's reference answer both call it).
"""

from __future__ import annotations

import importlib
from typing import Any

from scheduler_runtime.decision import AlwaysAdd, ObservationSpec, PolicyFormatError
from scheduler_runtime.policy import load_policy
from scheduler_runtime.rules import GroupCapRule, HeuristicRule

__all__ = ["PLUGIN_PREFIX", "default_policy", "load_policy_spec"]


#: ``load_policy_spec("py:MODULE:ATTRIBUTE")`` builds a plug-in policy (module docstring).
PLUGIN_PREFIX = "py:"


def load_policy_spec(spec: str) -> Any:
    """The policy a scheduler name's ``feather:SPEC`` points at: a policy file, or a plug-in.

    ``py:MODULE:ATTRIBUTE`` builds a plug-in policy (module docstring); anything else is a
    policy file path (:func:`load_policy`). Raises :class:`PolicyFormatError`.
    """
    if not isinstance(spec, str) or not spec:
        raise PolicyFormatError(None, f"policy must be a file path or {PLUGIN_PREFIX}MODULE:ATTRIBUTE, "
                                      f"got {spec!r}")
    if spec.startswith(PLUGIN_PREFIX):
        return _load_plugin_policy(spec)
    return load_policy(spec)


def _load_plugin_policy(spec: str) -> Any:
    def error(problem: str) -> PolicyFormatError:
        return PolicyFormatError(None, f"plug-in {spec!r}: {problem}")

    module_name, _, attribute = spec[len(PLUGIN_PREFIX):].partition(":")
    if not module_name or not attribute:
        raise error(f"expected {PLUGIN_PREFIX}MODULE:ATTRIBUTE (e.g. py:mypackage.policies:MyPolicy)")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any error in the user's module, ImportError included
        raise error(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    factory = getattr(module, attribute, None)
    if factory is None:
        raise error(f"module {module_name!r} has no attribute {attribute!r}")
    if not callable(factory):
        raise error(f"{module_name}.{attribute} has no act(obs, mask): it is a {type(factory).__name__}, "
                    "not a policy class or factory")
    try:
        policy = factory()
    except Exception as exc:
        raise error(f"{module_name}.{attribute}() could not be built: {type(exc).__name__}: {exc}") from exc
    if not callable(getattr(policy, "act", None)):
        raise error(f"{module_name}.{attribute}() returned a {type(policy).__name__}, "
                    "which has no act(obs, mask)")
    spec_attr = getattr(policy, "obs_spec", None)
    if spec_attr is not None and not isinstance(spec_attr, ObservationSpec):
        raise error(f"its obs_spec must be an ObservationSpec, got {type(spec_attr).__name__}")
    reset = getattr(policy, "reset", None)
    if reset is not None and not callable(reset):
        raise error("its reset attribute is not callable")
    return policy


def default_policy(ordering: str | None, policy: str | None = None, group_cap: int | None = None) -> Any:
    """The policy a scheduler answers its decisions with, the one place that chooses it.

    A baseline's ordering (``fcfs``, ``lpm``, ...): always-add (its order does the work). Feather:
    the ``policy`` spec when given (a file or a plug-in, :func:`load_policy_spec`), else
    ``group-cap-K``'s rule when ``group_cap`` is given (0: no cap), else the authors' heuristic.
    """
    if ordering != "feather":
        return AlwaysAdd()
    if policy:
        return load_policy_spec(policy)
    if group_cap is not None:
        return GroupCapRule.from_cap(group_cap)
    return HeuristicRule()
