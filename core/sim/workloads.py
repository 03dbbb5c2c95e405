"""Seeded request-length workloads for the simulator: chat (ShareGPT-like) and long-context (LongBench-like).

Each generator returns ``list[RequestSpec]`` and is a pure function of its
arguments: one seed, one workload. Lengths are drawn from log-normal
distributions (a common fit for heavy-tailed prompt/output lengths); a
``LengthModel`` is given by its *mean* (what papers publish) and its log-space
spread ``sigma`` (which they mostly do not: our stated assumption).

Sources (approximations, not the datasets themselves):

* Chat, ShareGPT-like. The vLLM paper (Kwon et al., "Efficient Memory
  Management for Large Language Model Serving with PagedAttention", SOSP 2023,
  §6.1 and Fig. 11) reports ShareGPT means of about 161 prompt tokens and 338
  output tokens, with long right tails. We use log-normal means 161 / 338 and
  sigma 1.0 / 0.8 (assumed: prompts are more dispersed than outputs), clipped
  to a 2,048-token context as that paper's OPT models were.
* Long context, LongBench-like. LongBench (Bai et al., "LongBench: A Bilingual,
  Multitask Benchmark for Long Context Understanding", 2023) reports an average
  English input of 6,711 words, about 8,700 tokens at ~1.3 tokens per word, and
  caps generation per task at 32-512 tokens (most tasks at 32-128). We use
  log-normal means 8,700 / 96 tokens with sigma 0.6 / 0.9 (assumed), clipped
  to a 32,768-token context.

``scale`` multiplies every drawn length before clipping (a pure-Python
simulator cannot serve 8,700-token prompts quickly); it keeps the shape of
both distributions and the prompt/output ratio. ``output_scale`` (default:
``scale``) scales outputs separately, e.g. to shrink long prompts while
keeping LongBench's absolute output lengths, so that decoding still lasts
tens of steps. Arrivals are one request every ``arrival_gap`` steps (0: all
at step 0).

``burst_schedule`` is the eviction side of a workload: a budget schedule for
``SimConfig.budget_schedule`` with long quiet stretches (budget 1.0: nothing
is evicted) and bursts in which every running request's budget drops at once.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

from ..errors import ConfigError
from .simulator import RequestSpec


@dataclass(frozen=True)
class LengthModel:
    """A log-normal token-length distribution given by its mean and log-space standard deviation."""

    mean: float
    sigma: float

    def __post_init__(self) -> None:
        if not self.mean > 0 or not self.sigma >= 0:
            raise ConfigError(f"length model needs mean > 0 and sigma >= 0, got mean {self.mean}, sigma {self.sigma}")

    @property
    def mu(self) -> float:
        """Log-space mean: E[X] = exp(mu + sigma^2 / 2)."""
        return math.log(self.mean) - self.sigma ** 2 / 2

    @property
    def median(self) -> float:
        return math.exp(self.mu)

    def draw(self, rng: random.Random, scale: float) -> int:
        return max(1, round(scale * rng.lognormvariate(self.mu, self.sigma)))


# ShareGPT-like chat (vLLM paper, SOSP 2023, Fig. 11): means 161 / 338 tokens; sigmas assumed.
CHAT_PROMPT = LengthModel(mean=161, sigma=1.0)
CHAT_OUTPUT = LengthModel(mean=338, sigma=0.8)
CHAT_MAX_LEN = 2048
# LongBench-like long context (Bai et al. 2023): ~6,711 words ~ 8,700 tokens in, 32-512 tokens out; sigmas assumed.
LONG_PROMPT = LengthModel(mean=8700, sigma=0.6)
LONG_OUTPUT = LengthModel(mean=96, sigma=0.9)
LONG_MAX_LEN = 32768


def _require_int(what: str, value: object, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        raise ConfigError(f"{what} must be an int{'' if minimum is None else f' >= {minimum}'}, got {value!r}")


def _require_scale(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{what} must be a number in (0, 1], got {value!r}")


def lognormal_workload(num_requests: int, seed: int, prompt: LengthModel, output: LengthModel,
                       arrival_gap: int, max_len: int, scale: float = 1.0,
                       output_scale: float | None = None) -> list[RequestSpec]:
    """Prompt and output lengths from ``prompt`` and ``output`` (times ``scale`` / ``output_scale``), clipped
    so that prompt + output <= ``max_len`` (the prompt is truncated first, as a context limit does)."""
    _require_int("num_requests", num_requests, 1)
    _require_int("seed", seed, None)
    _require_int("arrival_gap (steps between arrivals)", arrival_gap, 0)
    _require_int("max_len (prompt + output tokens)", max_len, 2)
    _require_scale("scale", scale)
    output_scale = scale if output_scale is None else output_scale
    _require_scale("output_scale", output_scale)
    rng = random.Random(seed)
    specs = []
    for i in range(num_requests):
        p = min(prompt.draw(rng, scale), max_len - 1)
        o = min(output.draw(rng, output_scale), max_len - p)
        specs.append(RequestSpec(i, i * arrival_gap, p, o))
    return specs


def chat_workload(num_requests: int, seed: int, arrival_gap: int = 2, max_len: int = CHAT_MAX_LEN,
                  scale: float = 1.0, output_scale: float | None = None) -> list[RequestSpec]:
    """ShareGPT-like: short prompts (mean 161 tokens), long outputs (mean 338 tokens); see the module docstring."""
    return lognormal_workload(num_requests, seed, CHAT_PROMPT, CHAT_OUTPUT, arrival_gap, max_len, scale,
                              output_scale)


def long_context_workload(num_requests: int, seed: int, arrival_gap: int = 8, max_len: int = LONG_MAX_LEN,
                          scale: float = 1.0, output_scale: float | None = None) -> list[RequestSpec]:
    """LongBench-like: long prompts (mean ~8,700 tokens), short outputs (mean 96 tokens); see the module docstring."""
    return lognormal_workload(num_requests, seed, LONG_PROMPT, LONG_OUTPUT, arrival_gap, max_len, scale,
                              output_scale)


def fixed_workload(num_requests: int, prompt_len: int, output_len: int, arrival_gap: int = 0,
                   first_id: int = 0) -> list[RequestSpec]:
    """``num_requests`` identical requests (ids from ``first_id``): the capacity frontier's fixed-footprint setup."""
    _require_int("num_requests", num_requests, 1)
    _require_int("prompt_len", prompt_len, 1)
    _require_int("output_len", output_len, 1)
    _require_int("arrival_gap (steps between arrivals)", arrival_gap, 0)
    _require_int("first_id", first_id, 0)
    return [RequestSpec(first_id + i, i * arrival_gap, prompt_len, output_len) for i in range(num_requests)]


WORKLOADS = {"chat": chat_workload, "long_context": long_context_workload}


def make_workload(name: str, num_requests: int, seed: int, **kwargs) -> list[RequestSpec]:
    """A workload by name (``chat`` or ``long_context``)."""
    try:
        gen = WORKLOADS[name]
    except KeyError:
        raise ConfigError(f"workload must be one of {sorted(WORKLOADS)}, got {name!r}") from None
    return gen(num_requests, seed, **kwargs)


def burst_schedule(cycles: int, first_quiet: int, burst: int, quiet: int, low: float, high: float = 1.0,
                   jitter: int = 0, seed: int = 0) -> tuple[tuple[int, float], ...]:
    """A bursty-eviction budget schedule: ``first_quiet`` steps at ``high``, then ``cycles`` times a burst of
    ``burst`` steps at ``low`` followed by ``quiet`` steps at ``high``. Burst i nominally starts at
    ``first_quiet + i * (burst + quiet)`` and is delayed by a seeded 0 .. ``jitter`` - 1 steps (its length
    stays ``burst``), so that bursts do not always fall on the same phase of a reclamation cadence.
    Returns ``(step, budget)`` pairs, the first ``(0, high)``."""
    _require_int("cycles", cycles, 1)
    _require_int("first_quiet (steps before the first burst)", first_quiet, 1)
    _require_int("burst (steps per burst)", burst, 1)
    _require_int("quiet (steps between bursts)", quiet, 1)
    _require_int("jitter", jitter, 0)
    _require_int("seed", seed, None)
    _require_scale("low (the budget during a burst)", low)
    _require_scale("high (the budget between bursts)", high)
    if not low < high:
        raise ConfigError(f"a burst lowers the budget: low must be < high, got low {low}, high {high}")
    if jitter > quiet:
        raise ConfigError(f"jitter must be <= quiet so that bursts never overlap, got jitter {jitter}, quiet {quiet}")
    rng = random.Random(f"burst:{seed}")
    schedule: list[tuple[int, float]] = [(0, high)]
    for i in range(cycles):
        start = first_quiet + i * (burst + quiet) + (rng.randrange(jitter) if jitter else 0)
        schedule += [(start, low), (start + burst, high)]
    assert all(a[0] < b[0] for a, b in itertools.pairwise(schedule)), schedule
    return tuple(schedule)


def burst_windows(schedule: tuple[tuple[int, float], ...]) -> list[tuple[int, int | None]]:
    """The [start, end) steps of each burst of a budget schedule: where the budget drops, to its next change
    (None: the schedule ends in the burst)."""
    return [(step, schedule[i + 1][0] if i + 1 < len(schedule) else None)
            for i, (step, budget) in enumerate(schedule) if i and budget < schedule[i - 1][1]]
