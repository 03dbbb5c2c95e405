"""The systems every question compares, as simulator configurations (``configure``) and as vtoken's
``additional_config`` on vLLM (``vtoken_config``, ``system_config``), with their labels and colours.

    native          no eviction (policy None)
    naive_evict     the same eviction, reclamation off: a block stays while any token in it lives
    vtoken_compact  eviction + lazy theta_F-gated ``compact``, gather read path
    vtoken_densify  eviction + ``densify`` after every eviction, dense read path (stock kernels)

Eviction depends only on policy, budget, seed and live tokens, never on the layout, so the evicting systems evict
the same tokens. On vLLM the full cache is ``full`` (policy none); Q4 adds ``plain`` (vtoken off), ``on``
(nothing evicted) and ``*_strict`` (strict verify).
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


VLLM_EVICTING = ("naive_evict", "vtoken_compact", "vtoken_densify")
READ_RECLAIM = {"naive_evict": ("gather", "off"), "vtoken_compact": ("gather", "compact"),
                "vtoken_densify": ("dense", "densify")}


def vtoken_config(system: str, policy: str | None, budget: float | None, seed: int, score_layers: int,
                  evidence_dir: str) -> dict:
    """``additional_config["vtoken"]`` of a Q6 system: strict verify on, a mismatch quarantined (counted)."""
    if system == "full":
        return {"policy": "none"}
    read_path, reclaim = READ_RECLAIM[system]
    return {"policy": policy, "budget": budget, "read_path": read_path, "reclaim": reclaim, "seed": seed,
            "score_layers": score_layers, "strict_verify": "strict", "on_mismatch": "quarantine",
            "evidence_dir": evidence_dir}


def system_config(system: str, policy: str, budget: float, seed: int, score_layers: int,
                  evidence_dir: str) -> dict | None:
    """``additional_config["vtoken"]`` of a timing configuration (Q4, Q7, Q9); None for plain vLLM."""
    if system == "plain":
        return None
    if system == "on":
        return {"policy": "none"}
    strict = system.endswith("_strict")
    cfg = vtoken_config(system.removesuffix("_strict"), policy, budget, seed, score_layers, evidence_dir)
    return cfg | {"strict_verify": "strict" if strict else "off"}
