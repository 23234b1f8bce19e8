"""sectionflow's engine: train a chain of blocks section by section, exactly like a whole-graph step.

Names load lazily, so ``import sections.rules`` (the plain-Python rules the runner checks config with)
does not import TensorFlow.
"""

from importlib import import_module

_EXPORTS = {
    "Engine": ".step.engine", "ReplayMismatchError": ".step.engine", "BudgetExceededError": ".step.engine",
    "WeightPenalty": ".step.executor", "host_copy": ".step.executor", "write_back": ".step.executor",
    "VariablesDoNotFit": ".backend.device",
    "OutOfMemory": ".backend.device", "DeviceMemory": ".backend.device", "device_memory": ".backend.device",
    "device_budget": ".backend.device", "reserve_cpu_limit": ".backend.device",
    "SectionedModel": ".keras_fit", "MicroBatched": ".step.accumulate",
    "lean_attention": ".backend.attention", "lean_attention_active": ".backend.lean",
    "WholeGraph": ".step.peers", "RecomputeGrad": ".step.peers",
    "Network": ".network.network", "Block": ".network.network", "from_keras": ".network.keras_network",
    "Section": ".schedule.partition",
    "Policy": ".schedule.policies", "Recompute": ".schedule.policies", "Store": ".schedule.policies",
    "Recreate": ".schedule.policies",
    "Plan": ".schedule.planner", "plan_schedule": ".schedule.planner", "Schedule": ".schedule.program",
    "compare_with_whole": ".verify.verify", "to_keras": ".network.export",
    "run_through_graph": ".backend.keras_internals",
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
