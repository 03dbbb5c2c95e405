"""What ``vtoken bench device`` runs: the device half of Q4 on CUDA (``--gpu``) or, as a smoke run, on CPU.

GPU scale follows the paper's models: Llama-3.1-8B's KV geometry (32 layers, 8 KV heads of 128, fp16,
128 KiB per token), 16-token blocks, 32 requests under Random eviction at 0.5 (the paper's stress
setting). The CPU scale keeps every system and >= 5 repeats with a tiny geometry: it checks the
harness, it does not measure a GPU's overlap (CPU copies finish inside ``submit``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from vtoken.core.errors import ConfigError

from .settings import MIN_REPEATS


@dataclass(frozen=True)
class DeviceBenchSettings:
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

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < self.min_repeats:
            raise ConfigError(f"repeats must be an int >= {self.min_repeats} (median and spread need them), "
                              f"got {self.repeats!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be an int >= 0, got {self.seed!r}")

    @property
    def seeds(self) -> list[int]:
        return list(range(self.seed, self.seed + self.repeats))

    def describe(self) -> dict:
        return asdict(self)


CPU_QUICK = DeviceBenchSettings(quick=True)
CPU_FULL = DeviceBenchSettings(quick=False, layers=8, heads=4, head_dim=64, num_blocks=1024, requests=16,
                               prompt=(128, 256), output=(64, 128))
GPU_FULL = DeviceBenchSettings(quick=False, device="cuda", layers=32, heads=8, head_dim=128, dtype="float16",
                               num_blocks=4096, requests=32, prompt=(256, 768), output=(128, 256), copy_tokens=4096)
GPU_QUICK = replace(GPU_FULL, quick=True, requests=16, output=(64, 128))


def device_bench_settings(gpu: bool, quick: bool, repeats: int | None = None, seed: int = 0) -> DeviceBenchSettings:
    base = (GPU_QUICK if quick else GPU_FULL) if gpu else (CPU_QUICK if quick else CPU_FULL)
    return replace(base, repeats=MIN_REPEATS if repeats is None else repeats, seed=seed)
