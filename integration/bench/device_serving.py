"""The core simulator over real K/V tensors: the device half of Q4 (``q4_device``).

``TensorSimulator`` is ``Simulator`` (same scheduler, runtime and eviction decisions) over a ``PagedKVCache`` with a
``TorchCopyEngine``. Its forward is a decode step's device work: write new K/V, per layer gather every request's
read slots and attend with the newest query (the gather read path), and one device-to-host read (the sampler's
sync). StreamingLLM and Random need no scores, so every system sees the same victims.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from vtoken.core.block_pool import BlockPool
from vtoken.core.plan import PlanKind
from vtoken.core.policies import make_policy
from vtoken.core.reclamation import Ordering, ReclaimConfig
from vtoken.core.runtime import ReadPath, VTokenRuntime
from vtoken.core.sim.simulator import RequestSpec, SimConfig, Simulator

from ..device.copy_engine import TorchCopyEngine
from ..device.kv_cache import PagedKVCache
from ..device.kv_layout import gpu_planes
from ..device.verify import Verifier, VerifyConfig

SCORE_FREE_POLICIES = ("streaming_llm", "random")


@dataclass(frozen=True)
class ModelShape:
    """The K/V geometry: vLLM's GPU layout, K and V stacked per layer in one allocation."""

    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.heads * self.head_dim * torch.finfo(self.dtype).bits // 8


def build_cache(device: torch.device, shape: ModelShape, num_blocks: int, block_size: int,
                seed: int = 0) -> PagedKVCache:
    g = torch.Generator(device=device).manual_seed(seed)
    per = 2 * num_blocks * block_size * shape.heads * shape.head_dim
    big = torch.randn(shape.layers * per, generator=g, device=device).to(shape.dtype)
    return PagedKVCache([p for i in range(shape.layers) for p in
                         gpu_planes(f"layer{i}", big[i * per:(i + 1) * per].view(2, num_blocks, block_size,
                                                                                  shape.heads, shape.head_dim))])


class TimedCopyEngine(TorchCopyEngine):
    """Counts what the host spends blocked in ``wait`` (the force-sync ablation's cost) and the moves copied."""

    def __init__(self, cache: PagedKVCache, verifier: Verifier) -> None:
        super().__init__(cache, verifier)
        self.blocked_s = 0.0
        self.copies = 0
        self.moves = 0

    def submit(self, moves, req_id=None):
        self.copies += 1
        self.moves += len(moves)
        return super().submit(moves, req_id)

    def wait(self, handle):
        t = time.perf_counter()
        try:
            return super().wait(handle)
        finally:
            self.blocked_s += time.perf_counter() - t


class TensorSimulator(Simulator):
    def __init__(self, cfg: SimConfig, workload: list[RequestSpec], cache: PagedKVCache, shape: ModelShape,
                 verify: str = "off") -> None:
        if cfg.policy not in SCORE_FREE_POLICIES:
            raise ValueError(f"the tensor simulator runs {SCORE_FREE_POLICIES} (no scores needed), not {cfg.policy!r}")
        if (cache.num_blocks, cache.block_size) != (cfg.num_blocks, cfg.block_size):
            raise ValueError(f"cache has {cache.num_blocks} blocks of {cache.block_size}, "
                             f"config wants {cfg.num_blocks} of {cfg.block_size}")
        super().__init__(cfg, workload)
        self.cache, self.shape = cache, shape
        self.device = cache.device
        self.engine = TimedCopyEngine(cache, Verifier(cache, VerifyConfig(verify, seed=cfg.seed)))
        reclaim = None if cfg.reclaim == "off" else ReclaimConfig(
            planner=PlanKind(cfg.reclaim), theta_f=cfg.theta_f, check_every=cfg.check_every,
            max_sources=cfg.max_sources, ordering=Ordering(cfg.ordering))
        self.rt = VTokenRuntime(BlockPool(cfg.num_blocks, cfg.block_size, cfg.headroom), self.engine,
                                make_policy(cfg.policy), cfg.budget, reclaim, ReadPath(cfg.read_path), cfg.seed)
        g = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.query = torch.randn(cfg.max_running, shape.heads, shape.head_dim, generator=g,
                                 device=self.device).to(shape.dtype)
        self.scale = shape.head_dim ** -0.5
        self.sampled = 0.0

    def _to_device(self, rows: list[int]) -> torch.Tensor:
        t = torch.tensor(rows, dtype=torch.int64)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def _forward(self, inputs) -> None:
        reqs = list(inputs.requests.values())
        write = [s for r in reqs for s in r.write_slots if s >= 0]
        if write:  # new K/V: copied from random existing slots (bandwidth as a real write, no host data)
            n = len(write)
            src = torch.randint(0, self.cache.num_blocks * self.cache.block_size, (n,), device=self.device)
            self.cache.scatter(self._to_device(write), self.cache.gather(src))
        reqs = [r for r in reqs if r.read_slots]
        if not reqs:
            return
        width = max(len(r.read_slots) for r in reqs)
        idx = self._to_device([s for r in reqs for s in r.read_slots + [0] * (width - len(r.read_slots))])
        lens = self._to_device([len(r.read_slots) for r in reqs])
        pad = torch.arange(width, device=self.device).unsqueeze(0) >= lens.unsqueeze(1)  # [R, W]
        R, H, D = len(reqs), self.shape.heads, self.shape.head_dim
        q = self.query[:R]
        out = None
        for i in range(self.shape.layers):
            k = self.cache.read(f"layer{i}.K", idx).view(R, width, H, D)
            v = self.cache.read(f"layer{i}.V", idx).view(R, width, H, D)
            w = torch.einsum("rhd,rwhd->rhw", q, k).float().mul_(self.scale)
            w = w.masked_fill_(pad.unsqueeze(1), float("-inf")).softmax(-1).to(v.dtype)
            o = torch.einsum("rhw,rwhd->rhd", w, v)
            out = o if out is None else out + o
        self.sampled += float(out.float().sum())  # the per-step device-to-host read a sampler makes
        return


def run_timed(cfg: SimConfig, workload: list[RequestSpec], cache: PagedKVCache, shape: ModelShape,
              verify: str = "off") -> dict:
    """One run; wall time from the first step to the last copy settled."""
    sim = TensorSimulator(cfg, workload, cache, shape, verify)
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)
    t = time.perf_counter()
    res = sim.run()
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)
    wall = time.perf_counter() - t
    e = sim.engine
    return {"steps": res.steps, "finished": res.finished, "wall_s": wall, "step_ms": 1e3 * wall / max(1, res.steps),
            "blocked_ms_per_step": 1e3 * e.blocked_s / max(1, res.steps), "copies": e.copies, "moves": e.moves,
            "verified": e.verifier.counters.verified, "mismatches": e.verifier.counters.mismatches,
            "retained_blocks_per_step": res.mean_allocated_blocks, "plans_committed": res.reclaim["plans_committed"]}
