"""What ``vtoken bench sim`` runs: the full evaluation, or ``--quick`` (same questions, smaller scale).

Scales are chosen for a pure-Python simulator on 2 cores: ``--quick`` keeps
every question, every system and >= 5 repeats, with fewer and shorter
requests; the full run is closer to the paper's scale (docs/results.md gives
its duration). Repeat i uses seed ``seed + i`` for both the workload's
lengths and the randomized eviction policy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from vtoken.core.errors import ConfigError
from vtoken.core.policies import POLICIES
from vtoken.core.sim.simulator import RequestSpec
from vtoken.core.sim.workloads import WORKLOADS, make_workload

MIN_REPEATS = 5


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
    """The paper's capacity-frontier setup (seed §4.3), request length divided by ``length_divisor``.

    Paper: Llama-3.1-8B, LongBench, H2O keeping 50 %, 12K-token outputs; a fully retained request
    needs 1,020 blocks of 16 tokens (16,320 tokens, so a 4,032-token prompt), the ideal packed
    footprint after eviction is 512 blocks; 5,427 and 11,519 usable blocks. Dividing the request
    length and the block budgets by the same factor keeps budget / blocks-per-request (5.3 and 11.3).
    """

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
class BenchSettings:
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
    check_invariants: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < MIN_REPEATS:
            raise ConfigError(f"repeats must be an int >= {MIN_REPEATS} (median and spread need them), "
                              f"got {self.repeats!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be an int >= 0, got {self.seed!r}")
        bad = [p for p in self.policies if p not in POLICIES]
        if bad:
            raise ConfigError(f"unknown policies {bad}; choose from {sorted(POLICIES)}")

    @property
    def seeds(self) -> list[int]:
        return list(range(self.seed, self.seed + self.repeats))

    def describe(self) -> dict:
        """JSON-ready, as recorded in every question's output."""
        return asdict(self)


FULL = BenchSettings(
    quick=False,
    workloads=(WorkloadSpec("chat", 48, arrival_gap=2, max_len=2048),
               WorkloadSpec("long_context", 16, arrival_gap=8, max_len=32768, scale=0.25, output_scale=1.0)),
    q3=Q3Setup(32),
    q5_workload=WorkloadSpec("chat", 24, arrival_gap=2, max_len=2048),
)

_QUICK_CHAT = WorkloadSpec("chat", 10, arrival_gap=2, max_len=1024, scale=0.5)
QUICK = BenchSettings(
    quick=True,
    workloads=(_QUICK_CHAT,
               WorkloadSpec("long_context", 8, arrival_gap=8, max_len=32768, scale=0.0625, output_scale=1.0)),
    q3=Q3Setup(64),
    q5_workload=_QUICK_CHAT,
    q7_sizes=(16, 64, 256, 1024),
    q7_prompt_len=32,
    q7_warmup_steps=1,
    q7_timed_steps=3,
)


def bench_settings(quick: bool, repeats: int | None = None, seed: int = 0,
                   check_invariants: bool = False) -> BenchSettings:
    base = QUICK if quick else FULL
    return replace(base, repeats=MIN_REPEATS if repeats is None else repeats, seed=seed,
                   check_invariants=check_invariants)
