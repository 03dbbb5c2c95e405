"""What ``vtoken bench vllm`` runs: the full evaluation, or ``--quick`` (same question, smaller scale).

Scales are chosen for vLLM's CPU build on 2 cores with the shipped byte-level model
(``integration/vllm/models/byte-llama``): an engine starts in ~2 s and a decode step of a few
requests takes a few ms, so the cost is dominated by engine starts (one per system and budget; one
per seed for Random, whose victims depend on the seed). ``--quick`` keeps every system, every
policy and >= 5 repeats at budget 0.5 only, with fewer and shorter generations. Repeat i uses seed
``seed + i`` for the held-out prompt windows and for vtoken's ``seed`` (Random's victims).

The timing questions (Q4 overhead, Q7 bookkeeping) evict with ``overhead_policy`` at ``overhead_budget``
and run pinned to one core (``pin``). Q4 keeps one engine process per configuration alive for the whole
run and serves ``q4_concurrency`` requests per round; Q7 starts one in-process engine per (configuration,
concurrency) and serves every seed from it. ``--quick`` keeps all configurations and >= 5 repeats with
one Q4 concurrency and three Q7 concurrencies.

Q6's prefix-caching half (``q6_prefix_caching``) serves, per seed, ``q6_prefix_groups`` groups of
``q6_prefix_requests`` requests that share a held-out prefix (``q6_prefix_len``: the shortest and the longest
group's, in bytes) and differ in a private ``q6_suffix_len``-byte suffix, evicting with each of
``q6_prefix_policies`` at ``q6_prefix_budget``. ``--quick`` keeps every system, two policies and >= 5 repeats
with shorter generations.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from vtoken.core.errors import ConfigError

from .server import ENGINE as SERVER_ENGINE
from .settings import MIN_REPEATS

POLICIES = ("streaming_llm", "random", "h2o", "scissorhands")


@dataclass(frozen=True)
class VllmBenchSettings:
    quick: bool
    repeats: int = MIN_REPEATS
    seed: int = 0
    prompts: int = 8  # held-out windows per seed
    prompt_len: int = 64  # bytes (= tokens)
    max_tokens: int = 160  # generated greedily, ignore_eos
    budgets: tuple[float, ...] = (0.3, 0.5, 0.7)  # live tokens kept per request (ratio)
    policies: tuple[str, ...] = POLICIES
    score_layers: int = 1  # H2O, Scissorhands: attention rows from the last layer (the dense score pass)
    block_size: int = 32
    threads: int = 1  # torch threads in the (in-process) engine; 2 OpenMP threads stall on a shared 2-core box
    overhead_policy: str = "random"  # Q4, Q7: victims spread over blocks, so reclamation has work; no score pass
    overhead_budget: float = 0.5
    q4_concurrency: tuple[int, ...] = (16, 48)  # requests per round (the paper's C)
    q4_max_tokens: int = 128
    q7_concurrency: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)  # running requests C (max_num_seqs = C)
    q7_max_tokens: int = 32
    pin: bool = True  # Q4, Q7: the bench and its engines on one core (``vllm_engine.one_core``)
    q6_prefix_groups: int = 4  # Q6 prefix caching: shared prefixes per seed
    q6_prefix_requests: int = 4  # requests per shared prefix: the first alone, then the rest (prefix-cache hits)
    q6_prefix_len: tuple[int, int] = (96, 128)  # bytes of the shortest and the longest group's shared prefix
    q6_suffix_len: int = 16  # private bytes after the shared prefix
    q6_prefix_max_tokens: int = 80  # generated greedily, ignore_eos
    q6_prefix_policies: tuple[str, ...] = POLICIES
    q6_prefix_budget: float = 0.5
    q9_clients: int = 8  # Q9 serving load: closed-loop streaming clients of one server
    q9_seconds: float = 20.0  # per timed window (one per seed)
    q9_prompt_len: int = 256  # bytes (= tokens, after bos)
    q9_max_tokens: int = 128  # generated greedily, ignore_eos
    min_repeats: int = MIN_REPEATS  # the CLI never lowers it; tests may, explicitly

    def __post_init__(self) -> None:
        def positive_int(name: str, v: object, lo: int = 1) -> None:
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name} must be an int >= {lo}, got {v!r}")

        positive_int("min_repeats", self.min_repeats)
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < self.min_repeats:
            raise ConfigError(f"repeats must be an int >= {self.min_repeats} (median and spread need them), "
                              f"got {self.repeats!r}")
        positive_int("seed", self.seed, 0)
        for name in ("prompts", "prompt_len", "max_tokens", "threads", "score_layers", "block_size", "q4_max_tokens",
                     "q7_max_tokens", "q6_prefix_groups", "q6_suffix_len", "q6_prefix_max_tokens", "q9_clients",
                     "q9_prompt_len", "q9_max_tokens"):
            positive_int(name, getattr(self, name))
        positive_int("q6_prefix_requests", self.q6_prefix_requests, 2)  # a first request and one that hits it
        lo_hi = self.q6_prefix_len
        if not isinstance(lo_hi, tuple) or len(lo_hi) != 2 or any(isinstance(n, bool) or not isinstance(n, int)
                                                                   for n in lo_hi) or not 1 <= lo_hi[0] <= lo_hi[1]:
            raise ConfigError(f"q6_prefix_len must be (shortest, longest) prefix bytes, 1 <= shortest <= longest, "
                              f"got {lo_hi!r}")
        for name, least in (("q4_concurrency", 1), ("q7_concurrency", 2)):  # Q7 fits an exponent: >= 2 sizes
            v = getattr(self, name)
            if not isinstance(v, tuple) or len(v) < least or any(isinstance(c, bool) or not isinstance(c, int)
                                                                  or c < 1 for c in v) or list(v) != sorted(set(v)):
                raise ConfigError(f"{name} must be >= {least} increasing request counts >= 1, got {v!r}")
        q9 = self.q9_seconds
        if isinstance(q9, bool) or not isinstance(q9, (int, float)) or not 0 < q9 <= 600:
            raise ConfigError(f"q9_seconds must be a number of seconds in (0, 600], got {q9!r}")
        if self.q9_prompt_len + self.q9_max_tokens + 1 > SERVER_ENGINE["max_model_len"]:
            raise ConfigError(f"q9_prompt_len + q9_max_tokens must fit the server's max_model_len "
                              f"{SERVER_ENGINE['max_model_len']} with bos, got {self.q9_prompt_len} + {self.q9_max_tokens}")
        if self.overhead_policy not in POLICIES:
            raise ConfigError(f"overhead_policy must be one of {list(POLICIES)}, got {self.overhead_policy!r}")
        if isinstance(self.overhead_budget, bool) or not isinstance(self.overhead_budget, float) \
                or not 0.0 < self.overhead_budget < 1.0:
            raise ConfigError(f"overhead_budget must be a ratio in (0, 1) (float), got {self.overhead_budget!r}")
        pb = self.q6_prefix_budget
        if isinstance(pb, bool) or not isinstance(pb, float) or not 0.0 < pb < 1.0:
            raise ConfigError(f"q6_prefix_budget must be a ratio in (0, 1) (float), got {pb!r}")
        if not self.budgets or any(isinstance(b, bool) or not isinstance(b, float) or not 0.0 < b < 1.0
                                   for b in self.budgets):
            raise ConfigError(f"budgets must be ratios in (0, 1) (floats), got {self.budgets!r}")
        for name in ("policies", "q6_prefix_policies"):
            if not getattr(self, name):
                raise ConfigError(f"{name} must name at least one eviction policy")
            bad = [p for p in getattr(self, name) if p not in POLICIES]
            if bad:
                raise ConfigError(f"unknown policies {bad}; choose from {list(POLICIES)}")

    @property
    def seeds(self) -> list[int]:
        return list(range(self.seed, self.seed + self.repeats))

    def describe(self) -> dict:
        """JSON-ready, as recorded in every question's output."""
        return asdict(self)


FULL = VllmBenchSettings(quick=False)
QUICK = VllmBenchSettings(quick=True, prompts=4, max_tokens=96, budgets=(0.5,), q4_concurrency=(16,), q4_max_tokens=96,
                          q7_concurrency=(16, 64, 256), q6_prefix_max_tokens=32, q6_prefix_policies=("random", "h2o"),
                          q9_clients=4, q9_seconds=6.0, q9_prompt_len=128, q9_max_tokens=64)


def vllm_bench_settings(quick: bool, repeats: int | None = None, seed: int = 0,
                        threads: int | None = None) -> VllmBenchSettings:
    base = QUICK if quick else FULL
    return replace(base, repeats=MIN_REPEATS if repeats is None else repeats, seed=seed,
                   threads=base.threads if threads is None else threads)
