"""The systems every question compares, as simulator configurations.

The seed's three variants (§4, Setup), with vtoken in both read paths:

    native          no eviction, full retention (policy None)
    naive_evict     the same token-level eviction, reclamation off: a block stays allocated while any
                    token in it lives
    vtoken_compact  eviction + lazy, theta_F-gated ``compact``, gather read path (attention reads live slots)
    vtoken_densify  eviction + ``densify`` after every eviction, dense read path (stock kernels)

Eviction decisions depend only on the policy, the budget, the seed and the
request's live tokens, never on the physical layout, so naive_evict and both
vtoken systems evict exactly the same tokens (Q2 checks this: their ideal
packed footprints are equal).
"""

from __future__ import annotations

from dataclasses import replace

from vtoken.core.errors import ConfigError
from vtoken.core.sim.simulator import SimConfig

SYSTEMS = ("native", "naive_evict", "vtoken_compact", "vtoken_densify")
EVICTING = SYSTEMS[1:]
LABELS = {"native": "Native", "naive_evict": "Naive-Evict", "vtoken_compact": "vtoken compact",
          "vtoken_densify": "vtoken densify"}
COLORS = {"native": "#7f7f7f", "naive_evict": "#1f77b4", "vtoken_compact": "#d62728", "vtoken_densify": "#ff7f0e"}


def configure(base: SimConfig, system: str, policy: str | None) -> SimConfig:
    """``base`` with the policy, reclamation mode and read path of ``system``."""
    if system not in SYSTEMS:
        raise ConfigError(f"system must be one of {list(SYSTEMS)}, got {system!r}")
    if system == "native":
        return replace(base, policy=None, reclaim="off", read_path="gather", ordering="poll")
    if policy is None:
        raise ConfigError(f"system {system!r} evicts: it needs a policy, got None")
    if system == "naive_evict":
        return replace(base, policy=policy, reclaim="off", read_path="gather", ordering="poll")
    if system == "vtoken_compact":
        return replace(base, policy=policy, reclaim="compact", read_path="gather", ordering="poll")
    return replace(base, policy=policy, reclaim="densify", read_path="dense", ordering="event")
