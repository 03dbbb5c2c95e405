"""vtoken.core: the pure-Python vToken runtime (standard library only).

Token tables, a block pool, two relocation planners, the reclamation manager,
eviction policies and metrics. Every other part of vtoken (spec, fuzz,
integration) drives this code.

The oracles that check it (the invariant checkers, the recounts of its
maintained views, the reference compact planner, CrossHair's predicates) are
in ``vtoken.core.reference``, which the runtime never imports when it is
imported. ``choose_sources`` and ``plan_compaction``, exported here before
issue #44, are ``vtoken.core.reference.compact``'s.

The deterministic simulator, its workloads, the demo and the in-memory copy
engine (tags instead of tensors) are in ``vtoken.core.sim``, which drives the
runtime and which the runtime never imports.
"""

from .block_pool import BlockAllocator, BlockPool, Purpose, blocks_needed
from .copy_engine import CopyEngine, CopyHandle, CopyStatus
from .densify import plan_densify
from . import errors
from .errors import *  # noqa: F401,F403  (the error hierarchy is part of the API)
from .metrics import MemoryMetrics, measure
from .plan import NoPlan, NoPlanReason, Plan, PlanKind
from .reclamation import Ordering, PlanRecord, PlanState, ReclaimConfig, ReclamationManager
from .errors import AdmissionClosedError
from .runtime import ReadPath, StepInputs, StepRequest, VTokenRuntime
from .scores import TokenScores
from .token_table import NO_SLOT, Move, RequestSnapshot, TokenTable

__all__ = [
    "BlockAllocator", "BlockPool", "Purpose", "blocks_needed",
    "CopyEngine", "CopyHandle", "CopyStatus", "plan_densify",
    "MemoryMetrics", "measure", "NoPlan", "NoPlanReason", "Plan", "PlanKind", "Ordering", "PlanRecord",
    "PlanState", "ReclaimConfig", "ReclamationManager", "AdmissionClosedError", "ReadPath", "StepInputs",
    "StepRequest", "VTokenRuntime", "TokenScores", "NO_SLOT", "Move", "RequestSnapshot", "TokenTable",
]
__all__ += [n for n in dir(errors) if n.endswith(("Error", "Violation"))]  # noqa: F405  (the hierarchy)
