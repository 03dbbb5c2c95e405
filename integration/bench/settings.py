"""What each ``vtoken bench`` target runs: a frozen dataclass of fields (recorded in every JSON as ``settings``)
with a table ``CHECKS`` (field -> check raising ``ConfigError`` naming it), its full and ``--quick`` scales, and
``settings_for`` applying the command line. Repeat i uses seed ``seed + i``; ``--quick`` keeps every question,
system and >= 5 repeats at a smaller scale.

sim: a pure-Python simulator on 2 cores. vllm: vLLM's CPU build with the shipped byte-level model; engine starts
dominate (one per system and budget; one per seed for Random); Q4, Q7 evict with ``overhead_policy`` at
``overhead_budget`` pinned to one core (``pin``); Q6's prefix half serves ``q6_prefix_groups`` x
``q6_prefix_requests`` requests sharing held-out prefixes. device: on CUDA (``--gpu``) Llama-3.1-8B's KV geometry,
32 requests under Random at 0.5; on CPU a tiny geometry that checks the harness.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from vtoken.core.errors import ConfigError
from vtoken.core.policies import POLICIES as CORE_POLICIES
from vtoken.core.sim.simulator import RequestSpec
from vtoken.core.sim.workloads import WORKLOADS, make_workload

from .server import ENGINE as SERVER_ENGINE

MIN_REPEATS = 5
POLICIES = ("streaming_llm", "random", "h2o", "scissorhands", "tova", "knorm", "snapkv")  # what vtoken inside vLLM evicts with


# ---- checks: each raises ConfigError naming the field ------------------------------------------------
def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def int_at_least(lo: int):
    def check(name: str, v: object, s) -> None:
        if not _int(v) or v < lo:
            raise ConfigError(f"{name} must be an int >= {lo}, got {v!r}")
    return check


def enough_repeats(name: str, v: object, s) -> None:
    least = getattr(s, "min_repeats", MIN_REPEATS)
    if not _int(v) or v < least:
        raise ConfigError(f"repeats must be an int >= {least} (median and spread need them), got {v!r}")


def a_ratio(name: str, v: object, s) -> None:
    if not isinstance(v, float) or not 0.0 < v < 1.0:
        raise ConfigError(f"{name} must be a ratio in (0, 1) (float), got {v!r}")


def ratios_in_0_1(name: str, v: object, s) -> None:
    if not v or any(not isinstance(b, float) or not 0.0 < b < 1.0 for b in v):
        raise ConfigError(f"{name} must be ratios in (0, 1) (floats), got {v!r}")


def known_policies(choices: list[str], required: bool = True):
    def check(name: str, v: object, s) -> None:
        if required and not v:
            raise ConfigError(f"{name} must name at least one eviction policy")
        bad = [p for p in v if p not in choices]
        if bad:
            raise ConfigError(f"unknown policies {bad}; choose from {choices}")
    return check


def one_of(choices: tuple, shown: str):
    def check(name: str, v: object, s) -> None:
        if v not in choices:
            raise ConfigError(f"{name} must be {shown}, got {v!r}")
    return check


def increasing_counts(least: int):
    def check(name: str, v: object, s) -> None:
        if not isinstance(v, tuple) or len(v) < least or any(not _int(c) or c < 1 for c in v) \
                or list(v) != sorted(set(v)):
            raise ConfigError(f"{name} must be >= {least} increasing request counts >= 1, got {v!r}")
    return check


def prefix_bounds(name: str, v: object, s) -> None:
    if not isinstance(v, tuple) or len(v) != 2 or not all(_int(n) for n in v) or not 1 <= v[0] <= v[1]:
        raise ConfigError(f"{name} must be (shortest, longest) prefix bytes, 1 <= shortest <= longest, got {v!r}")


def seconds_in_range(name: str, v: object, s) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 600:
        raise ConfigError(f"{name} must be a number of seconds in (0, 600], got {v!r}")


def fits_the_server(name: str, v: object, s) -> None:
    if s.q9_prompt_len + s.q9_max_tokens + 1 > SERVER_ENGINE["max_model_len"]:
        raise ConfigError(f"q9_prompt_len + q9_max_tokens must fit the server's max_model_len "
                          f"{SERVER_ENGINE['max_model_len']} with bos, got {s.q9_prompt_len} + {s.q9_max_tokens}")


class Settings:
    """A target's settings: ``CHECKS`` (field -> check, in the order they run) validated on construction; a key
    that is no field names a check of several fields (it reads them from the settings)."""

    CHECKS: dict = {}

    def __post_init__(self) -> None:
        for name, check in self.CHECKS.items():
            check(name, getattr(self, name, None), self)

    @property
    def seeds(self) -> list[int]:
        return list(range(self.seed, self.seed + self.repeats))

    def describe(self) -> dict:
        """JSON-ready, as recorded in every question's output."""
        return asdict(self)


# ---- sim ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkloadSpec:
    """A named workload generator and its arguments (``core/sim/workloads.py``)."""

    name: str
    num_requests: int
    arrival_gap: int
    max_len: int
    scale: float = 1.0
    output_scale: float | None = None

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ConfigError(f"workload must be one of {sorted(WORKLOADS)}, got {self.name!r}")

    def build(self, seed: int) -> list[RequestSpec]:
        return make_workload(self.name, self.num_requests, seed, arrival_gap=self.arrival_gap,
                             max_len=self.max_len, scale=self.scale, output_scale=self.output_scale)


@dataclass(frozen=True)
class Q3Setup:
    """The paper's capacity-frontier setup (seed §4.3: 1,020 blocks of 16 per fully retained request, 512 ideal
    after H2O at 50 %, 5,427 and 11,519 usable blocks), request length and budgets divided by ``length_divisor``
    (which keeps budget / blocks per request at 5.3 and 11.3)."""

    length_divisor: int
    paper_prompt: int = 4032
    paper_output: int = 12288
    paper_budgets: tuple[int, ...] = (5427, 11519)
    paper_native_c: tuple[int, ...] = (5, 11)
    paper_vtoken_c: tuple[int, ...] = (8, 22)
    compact_headroom: int = 4

    @property
    def prompt_len(self) -> int:
        return round(self.paper_prompt / self.length_divisor)

    @property
    def output_len(self) -> int:
        return round(self.paper_output / self.length_divisor)

    @property
    def budgets(self) -> tuple[int, ...]:
        return tuple(round(b / self.length_divisor) for b in self.paper_budgets)


@dataclass(frozen=True)
class SimSettings(Settings):
    quick: bool
    repeats: int = MIN_REPEATS
    seed: int = 0
    block_size: int = 16
    budget: float = 0.5  # live tokens kept per request: eviction ratio 0.5, as the paper's H2O setup
    theta_f: float = 0.25  # the paper's default
    headroom: int = 8
    policies: tuple[str, ...] = ("h2o", "scissorhands", "streaming_llm", "random")
    workloads: tuple[WorkloadSpec, ...] = ()  # Q1, Q2
    q3: Q3Setup = Q3Setup(32)
    q5_workload: WorkloadSpec | None = None
    q5_policy: str = "h2o"
    q5_eviction_ratios: tuple[float, ...] = (0.3, 0.4, 0.5, 0.6, 0.7)
    q5_theta_fs: tuple[float, ...] = (0.05, 0.10, 0.25, 0.50, 0.75, 0.90)
    q5_block_sizes: tuple[int, ...] = (16, 32, 64, 128)
    q7_sizes: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
    q7_prompt_len: int = 128
    q7_warmup_steps: int = 2
    q7_timed_steps: int = 8
    q10_contexts: tuple[int, ...] = (256, 1024, 4096, 8192, 32768)  # live tokens per request (the context axis)
    q10_requests: int = 16
    q10_request_counts: tuple[int, ...] = (16, 64, 256, 1024)  # the requests axis, at q10_request_live each
    q10_request_live: int = 256
    q10_warmup_steps: int = 2
    q10_timed_steps: int = 10
    check_invariants: bool = False

    CHECKS = {"repeats": enough_repeats, "seed": int_at_least(0),
              "policies": known_policies(sorted(CORE_POLICIES), required=False)}


_QUICK_CHAT = WorkloadSpec("chat", 10, arrival_gap=2, max_len=1024, scale=0.5)
SIM = {
    False: SimSettings(
        quick=False,
        workloads=(WorkloadSpec("chat", 48, arrival_gap=2, max_len=2048),
                   WorkloadSpec("long_context", 16, arrival_gap=8, max_len=32768, scale=0.25, output_scale=1.0)),
        q3=Q3Setup(32), q5_workload=WorkloadSpec("chat", 24, arrival_gap=2, max_len=2048)),
    True: SimSettings(
        quick=True,
        workloads=(_QUICK_CHAT,
                   WorkloadSpec("long_context", 8, arrival_gap=8, max_len=32768, scale=0.0625, output_scale=1.0)),
        q3=Q3Setup(64), q5_workload=_QUICK_CHAT, q7_sizes=(16, 64, 256, 1024), q7_prompt_len=32,
        q7_warmup_steps=1, q7_timed_steps=3, q10_contexts=(64, 256, 1024), q10_requests=4,
        q10_request_counts=(4, 16), q10_request_live=64, q10_warmup_steps=1, q10_timed_steps=3),
}


# ---- vllm --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VllmSettings(Settings):
    quick: bool
    repeats: int = MIN_REPEATS
    seed: int = 0
    prompts: int = 8  # held-out windows per seed
    prompt_len: int = 64  # bytes (= tokens)
    max_tokens: int = 160  # generated greedily, ignore_eos
    budgets: tuple[float, ...] = (0.3, 0.5, 0.7)  # live tokens kept per request (ratio)
    policies: tuple[str, ...] = POLICIES
    score_layers: int = 1  # score policies: attention rows (or key norms) from the last layer
    block_size: int = 32
    threads: int = 1  # torch threads in the (in-process) engine; 2 OpenMP threads stall on a shared 2-core box
    overhead_policy: str = "random"  # Q4, Q7: victims spread over blocks, so reclamation has work; no score pass
    overhead_budget: float = 0.5
    q4_concurrency: tuple[int, ...] = (16, 48)  # requests per round (the paper's C)
    q4_max_tokens: int = 128
    q7_concurrency: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)  # running requests C (max_num_seqs = C)
    q7_max_tokens: int = 32
    q7_contexts: tuple[int, ...] = (128, 512, 1536, 2000)  # the context axis: prompt tokens (+ q7_max_tokens <= 2,048)
    q7_context_concurrency: tuple[int, ...] = (8, 64)  # running requests on the context axis
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

    CHECKS = {"min_repeats": int_at_least(1), "repeats": enough_repeats, "seed": int_at_least(0),
              **{name: int_at_least(1) for name in (
                  "prompts", "prompt_len", "max_tokens", "threads", "score_layers", "block_size", "q4_max_tokens",
                  "q7_max_tokens", "q6_prefix_groups", "q6_suffix_len", "q6_prefix_max_tokens", "q9_clients",
                  "q9_prompt_len", "q9_max_tokens")},
              "q6_prefix_requests": int_at_least(2),  # a first request and one that hits it
              "q6_prefix_len": prefix_bounds,
              "q4_concurrency": increasing_counts(1),
              "q7_concurrency": increasing_counts(2),  # Q7 fits an exponent: >= 2 sizes
              "q7_contexts": increasing_counts(2),  # a growth needs >= 2 contexts
              "q7_context_concurrency": increasing_counts(1),
              "q9_seconds": seconds_in_range, "q9 fits the server": fits_the_server,
              "overhead_policy": one_of(POLICIES, f"one of {list(POLICIES)}"), "overhead_budget": a_ratio,
              "q6_prefix_budget": a_ratio, "budgets": ratios_in_0_1, "policies": known_policies(list(POLICIES)),
              "q6_prefix_policies": known_policies(list(POLICIES))}


VLLM = {False: VllmSettings(quick=False),
        True: VllmSettings(quick=True, prompts=4, max_tokens=96, budgets=(0.5,), q4_concurrency=(16,),
                           q4_max_tokens=96, q7_concurrency=(16, 64, 256), q7_contexts=(128, 512),
                           q7_context_concurrency=(8,), q6_prefix_max_tokens=32,
                           q6_prefix_policies=("random", "h2o"), q9_clients=4, q9_seconds=6.0, q9_prompt_len=128,
                           q9_max_tokens=64)}


# ---- device ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceSettings(Settings):
    quick: bool
    device: str = "cpu"
    repeats: int = MIN_REPEATS
    seed: int = 0
    layers: int = 4
    heads: int = 2
    head_dim: int = 32
    dtype: str = "float32"
    num_blocks: int = 512
    block_size: int = 16
    requests: int = 8
    prompt: tuple[int, int] = (64, 128)
    output: tuple[int, int] = (32, 64)
    policy: str = "random"
    budget: float = 0.5
    copy_tokens: int = 1024  # tokens per relocation in the throughput and contention measurements
    min_repeats: int = MIN_REPEATS

    CHECKS = {"device": one_of(("cpu", "cuda"), "'cpu' or 'cuda'"), "repeats": enough_repeats,
              "seed": int_at_least(0)}


_GPU_FULL = DeviceSettings(quick=False, device="cuda", layers=32, heads=8, head_dim=128, dtype="float16",
                           num_blocks=4096, requests=32, prompt=(256, 768), output=(128, 256), copy_tokens=4096)
DEVICE = {(False, True): DeviceSettings(quick=True),  # (gpu, quick)
          (False, False): DeviceSettings(quick=False, layers=8, heads=4, head_dim=64, num_blocks=1024, requests=16,
                                         prompt=(128, 256), output=(64, 128)),
          (True, False): _GPU_FULL,
          (True, True): replace(_GPU_FULL, quick=True, requests=16, output=(64, 128))}


def settings_for(base: Settings, repeats: int | None = None, seed: int = 0, **options) -> Settings:
    """``base`` with the command line's ``--repeats`` (None: the minimum), ``--seed`` and the target's own options
    (those left None keep ``base``'s value)."""
    over = {k: v for k, v in options.items() if v is not None}
    return replace(base, repeats=MIN_REPEATS if repeats is None else repeats, seed=seed, **over)


def bench_settings(quick: bool, repeats: int | None = None, seed: int = 0,
                   check_invariants: bool = False) -> SimSettings:
    return settings_for(SIM[quick], repeats, seed, check_invariants=check_invariants)


def vllm_bench_settings(quick: bool, repeats: int | None = None, seed: int = 0,
                        threads: int | None = None) -> VllmSettings:
    return settings_for(VLLM[quick], repeats, seed, threads=threads)


def device_bench_settings(gpu: bool, quick: bool, repeats: int | None = None, seed: int = 0) -> DeviceSettings:
    return settings_for(DEVICE[(gpu, quick)], repeats, seed)


# the names the questions and tests know them by
BenchSettings, VllmBenchSettings, DeviceBenchSettings = SimSettings, VllmSettings, DeviceSettings
