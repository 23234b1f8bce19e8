"""sectionflow's engine: train a chain of blocks section by section, exactly like a whole-graph step.

Names load lazily, so ``import sections.rules`` (the plain-Python rules the runner checks config with)
does not import TensorFlow.
"""

from importlib import import_module

_EXPORTS = {
    "Engine": "._engine", "ReplayMismatchError": "._engine", "BudgetExceededError": "._engine",
    "SectionedModel": "._fit",
    "WholeGraph": "._peers", "RecomputeGrad": "._peers",
    # Network from ._keras: importing it sets Network.from_keras (sections._keras builds on sections._network).
    "Network": "._keras", "Block": "._network", "from_keras": "._keras",
    "Section": "._partition",
    "Policy": "._policies", "Recompute": "._policies", "Store": "._policies", "Recreate": "._policies",
    "Plan": "._planner", "plan_schedule": "._planner", "Schedule": "._schedule",
    "compare_with_whole": "._verify", "to_keras": "._export",
    "POLICIES": ".rules", "STRATEGIES": ".rules", "parse_bytes": ".rules",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sections' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
