"""sectionflow's engine: train a chain of blocks section by section, exactly like a whole-graph step."""

from ._engine import STRATEGIES, Engine, ReplayMismatchError
from ._network import Block, Network
from ._partition import POLICIES, Section, boundary_names
from ._planner import Plan, parse_bytes
from ._verify import compare_with_whole

__all__ = ["Engine", "Network", "Block", "Section", "ReplayMismatchError", "POLICIES", "STRATEGIES",
           "boundary_names", "parse_bytes", "Plan", "compare_with_whole"]
