"""The one configuration block that enables vtoken in vLLM: ``additional_config={"vtoken": {...}}``.

    LLM(..., additional_config={"vtoken": {"policy": "streaming_llm", "budget": 0.5,
                                           "reclaim": "densify", "strict_verify": "strict"}})
    vllm serve MODEL --additional-config '{"vtoken": {"policy": "streaming_llm", "budget": 0.5}}'

Every key is checked at start-up; a bad value raises ``SettingsError`` naming the key and what it
accepts, and unknown keys are refused (a typo must not silently turn a feature off).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from vtoken.core.errors import ConfigError
from vtoken.core.policies import POLICIES as _CORE_POLICIES
from vtoken.core.scores import ROW_STATISTICS, WINDOW_STATISTICS

POLICIES = ("none", "streaming_llm", "random", "h2o", "scissorhands", "tova", "knorm", "snapkv")
# rank victims from per-token statistics, which live on the workers (``integration/device/scores.py``)
SCORE_POLICIES = tuple(p for p in POLICIES if hasattr(_CORE_POLICIES.get(p), "ranking"))
# of those, the ones that read attention: vtoken's attention backend records it (H2O, Scissorhands, TOVA: each step's
# newest row; SnapKV: the prompt's observation window, once); the others read key statistics only (Knorm), which the
# workers take from the KV cache, and the stock kernels serve them
ATTENTION_POLICIES = tuple(p for p in SCORE_POLICIES
                           if set(_CORE_POLICIES[p].statistics) & {*ROW_STATISTICS, *WINDOW_STATISTICS})


def statistics_of(policy: str) -> tuple[str, ...]:
    """What a policy's ranking reads ("accumulated", "persistence", "latest", "key_norm", "observed"); () for none."""
    return tuple(getattr(_CORE_POLICIES.get(policy), "statistics", ()))


def observation_of(policy: str) -> tuple[int, int] | None:
    """A policy that reads "observed" (SnapKV): its observation window and pooling kernel, as built by default."""
    if "observed" not in statistics_of(policy):
        return None
    built = _CORE_POLICIES[policy]()
    return built.window, built.kernel
RECLAIM = ("densify", "compact", "off")
READ_PATHS = ("dense", "gather")
VERIFY = ("off", "sampled", "strict")
ON_MISMATCH = ("raise", "quarantine")


class SettingsError(ConfigError):
    """A vtoken setting in ``additional_config["vtoken"]`` is invalid."""


@dataclass(frozen=True)
class VTokenSettings:
    policy: str = "none"  # eviction policy; "none": vtoken on, nothing evicted (indirection only)
    budget: float | int = 1.0  # tokens a request keeps: a ratio in (0, 1] or a count >= 1
    evict_every: int = 1  # eviction cadence beta: a request evicts once it is beta tokens over its budget
    reclaim: str = "densify"
    read_path: str = "dense"
    theta_f: float = 0.0  # reclaim when the waste ratio F exceeds this (compact only)
    max_sources: int = 8  # B: source blocks per compact plan
    headroom: int = 0  # blocks of vLLM's pool kept free for compaction destinations (compact only)
    score_layers: int = 1  # score policies: attention (or keys, Knorm) on the last N layers; 0: all layers
    strict_verify: str = "off"
    sample_every: int = 16
    on_mismatch: str = "raise"
    evidence_dir: str = "vtoken-evidence"
    seed: int = 0
    drill_every: int = 0  # relocation drill: every N steps move one block of every running request; 0: off
    fast_path: bool = True  # compiled runtime where its domain allows (``scheduler_tokens``), CPU mover; False: core

    def __post_init__(self) -> None:
        _choice("policy", self.policy, POLICIES)
        _choice("reclaim", self.reclaim, RECLAIM)
        _choice("read_path", self.read_path, READ_PATHS)
        _choice("strict_verify", self.strict_verify, VERIFY)
        _choice("on_mismatch", self.on_mismatch, ON_MISMATCH)
        b = self.budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or (isinstance(b, float) and not 0.0 < b <= 1.0) \
                or (isinstance(b, int) and b < 1):
            raise SettingsError(f"vtoken.budget must be a ratio in (0, 1] (e.g. 0.5) or a token count >= 1 "
                                f"(e.g. 512), got {b!r}")
        if not isinstance(self.theta_f, (int, float)) or isinstance(self.theta_f, bool) or not 0 <= self.theta_f < 1:
            raise SettingsError(f"vtoken.theta_f must be a number in [0, 1), got {self.theta_f!r}")
        if not isinstance(self.score_layers, int) or isinstance(self.score_layers, bool) or self.score_layers < 0:
            raise SettingsError(f"vtoken.score_layers must be an integer >= 0 (the last N layers; 0: all), got "
                                f"{self.score_layers!r}")
        for key in ("max_sources", "sample_every", "evict_every"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SettingsError(f"vtoken.{key} must be an integer >= 1, got {v!r}")
        if not isinstance(self.headroom, int) or isinstance(self.headroom, bool) or self.headroom < 0:
            raise SettingsError(f"vtoken.headroom must be an integer >= 0 (blocks), got {self.headroom!r}")
        if self.headroom and self.reclaim != "compact":
            raise SettingsError(f"vtoken.headroom reserves blocks for compaction destinations; it needs "
                                f"reclaim='compact', got reclaim={self.reclaim!r}")
        if not isinstance(self.drill_every, int) or isinstance(self.drill_every, bool) or self.drill_every < 0:
            raise SettingsError(f"vtoken.drill_every must be an integer >= 0 (0: off), got {self.drill_every!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise SettingsError(f"vtoken.seed must be an integer >= 0, got {self.seed!r}")
        if self.fast_path.__class__ is not bool:
            raise SettingsError(f"vtoken.fast_path must be true or false, got {self.fast_path!r}")
        if not isinstance(self.evidence_dir, str) or not self.evidence_dir:
            raise SettingsError(f"vtoken.evidence_dir must be a non-empty path, got {self.evidence_dir!r}")
        # combinations
        if self.read_path == "dense" and self.reclaim != "densify" and self.policy != "none":
            raise SettingsError(f"vtoken.reclaim={self.reclaim!r} with read_path='dense': stock attention kernels "
                                f"read a dense prefix, so evicted tokens must be compacted away: use "
                                f"reclaim='densify', or read_path='gather'")

    @classmethod
    def from_additional_config(cls, additional_config: Mapping | None) -> VTokenSettings | None:
        """The settings in ``additional_config["vtoken"]``, or None if vtoken is not enabled.

        ``additional_config`` is vLLM's: None, a mapping, or a platform's own config object (vLLM's
        ``SupportsHash``: it has ``compute_hash``), which cannot carry vtoken's block (None). Anything
        else (a list, a string, a number) is refused, as are a block that is not a mapping and keys
        that are not strings; nothing is read from a refused config."""
        if additional_config is None:
            return None
        if not isinstance(additional_config, Mapping):
            if callable(getattr(additional_config, "compute_hash", None)):
                return None  # a platform's config object: vLLM's, not ours
            raise SettingsError(f"additional_config must be a mapping (a dict), got "
                                f"{type(additional_config).__name__} {additional_config!r:.80}")
        if "vtoken" not in additional_config:
            return None
        block = additional_config["vtoken"]
        if not isinstance(block, Mapping):
            raise SettingsError(f"additional_config['vtoken'] must be a mapping of settings, got "
                                f"{type(block).__name__} {block!r:.80}")
        not_str = [k for k in block if not isinstance(k, str)]
        if not_str:
            raise SettingsError(f"vtoken setting names must be strings, got {not_str!r:.200} in "
                                f"additional_config['vtoken']")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(block) - set(known))
        if unknown:
            raise SettingsError(f"unknown vtoken setting(s) {unknown}; known: {known}")
        return cls(**block)

    def as_dict(self) -> dict:
        return asdict(self)


def _choice(key: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SettingsError(f"vtoken.{key} must be one of {list(allowed)}, got {value!r}")
