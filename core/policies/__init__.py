"""Eviction policies. Each is one file with only its selection logic (Algorithm 1, line 2)."""

from __future__ import annotations

from ..errors import ConfigError
from .base import EvictionPolicy, RenamedRequests, RequestView
from .h2o import H2O
from .knorm import Knorm
from .random_policy import RandomPolicy
from .scissorhands import Scissorhands
from .snapkv import SnapKV
from .streaming_llm import StreamingLLM
from .tova import TOVA

POLICIES = {"h2o": H2O, "streaming_llm": StreamingLLM, "scissorhands": Scissorhands, "random": RandomPolicy,
            "tova": TOVA, "knorm": Knorm, "snapkv": SnapKV}


def make_policy(name: str) -> EvictionPolicy:
    if not isinstance(name, str) or name not in POLICIES:
        raise ConfigError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]()


__all__ = ["EvictionPolicy", "RequestView", "H2O", "StreamingLLM", "Scissorhands", "RandomPolicy", "TOVA",
           "Knorm", "SnapKV", "POLICIES", "make_policy"]
