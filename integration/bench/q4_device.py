"""Q4, device half: what a relocation costs on the device, what the async copy path buys over force-sync,
and how the relocation stream fares next to unrelated GPU work (the review's open contention question).

``runs``, one object per measurement by ``kind``: "throughput" (relocating n scattered tokens, every layer's K and
V, and digesting them for strict verify, vs a contiguous copy of the same bytes; docs/device.md's targets),
"serving" (``device_serving``: the simulator over real K/V, Random at 0.5, the same victims in every system, run
interleaved per repeat: step time, its ratio to Naive-Evict, host time blocked in ``wait``), "contention" (CUDA
only: submit-to-done latency of one relocation, idle vs beside a matmul stream, default vs high priority).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch
from vtoken.core.sim.simulator import SimConfig, synthetic_workload
from vtoken.core.token_table import Move

from ..device.copy_engine import TorchCopyEngine
from ..device.verify import Verifier, VerifyConfig
from .device_serving import ModelShape, build_cache, run_timed
from .render import Panel, do, figure, fmt_spread, markdown, pct
from .stats import summarize

KEY = "q4_device"
TITLE = "Overhead on the device: relocation throughput, async vs force-sync, contention"
PAPER = {"force_sync": "the force-sync ablation exposes CPU blocking per relocation; async improves throughput and "
                       "decode p95 over Naive-Evict under stress (H100, seed §4.4)",
         "contention": "not measured in the paper (the review's open question 3)"}

# system key: (label, SimConfig overrides, verify mode)
SYSTEMS = {
    "naive": ("Naive-Evict", {"reclaim": "off"}, "off"),
    "compact_poll": ("compact, poll (async)", {"reclaim": "compact", "ordering": "poll"}, "off"),
    "compact_event": ("compact, event (async)", {"reclaim": "compact", "ordering": "event"}, "off"),
    "compact_force": ("compact, force-sync", {"reclaim": "compact", "ordering": "force_sync"}, "off"),
    "compact_strict": ("compact, event, strict verify", {"reclaim": "compact", "ordering": "event"}, "strict"),
    "densify_event": ("densify (dense), event", {"reclaim": "densify", "ordering": "event", "read_path": "dense"}, "off"),
    "densify_force": ("densify (dense), force-sync",
                      {"reclaim": "densify", "ordering": "force_sync", "read_path": "dense"}, "off"),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, reps: int) -> float:
    _sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / reps


def shape_of(s) -> ModelShape:
    return ModelShape(s.layers, s.heads, s.head_dim, getattr(torch, s.dtype))


def random_moves(cache, n: int, seed: int) -> list[Move]:
    S = cache.block_size
    slots = torch.randperm(cache.num_blocks * S, generator=torch.Generator().manual_seed(seed))[: 2 * n].tolist()
    return [Move(i, s // S, s % S, d // S, d % S) for i, (s, d) in enumerate(zip(slots[:n], slots[n:]))]


def throughput(cache, n: int, seed: int, reps: int) -> dict:
    """Seconds per relocation, per digest and per plain copy of the same bytes (medians of interleaved reps)."""
    device = cache.device
    moves = random_moves(cache, n, seed)
    nbytes = n * cache.bytes_per_token
    src_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst_buf = torch.empty_like(src_buf)
    eng = TorchCopyEngine(cache)
    ver = Verifier(cache, VerifyConfig("strict", seed=seed))
    values = cache.gather(torch.tensor([m.src_block * cache.block_size + m.src_offset for m in moves], device=device))

    def relocate():
        h = eng.submit(moves)
        eng.wait(h)
        eng.release(h)

    def digest():
        for gi, v in enumerate(values):
            ver.digest(gi, v)

    fns = {"plain": lambda: dst_buf.copy_(src_buf), "relocate": relocate, "digest": digest}
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            times[k].append(_timed(fn, device, 3))
    t = {k: statistics.median(v) for k, v in times.items()}
    return {"kind": "throughput", "tokens": n, "bytes": nbytes, "launches": 2 * len(cache.groups),
            **{f"{k}_s": v for k, v in t.items()},
            "relocate_vs_plain": t["plain"] / t["relocate"], "digest_vs_plain": t["plain"] / t["digest"]}


def serving(cache, shape: ModelShape, s, seed: int) -> list[dict]:
    """Every system once on one seeded workload (interleaved: the repeats alternate their order)."""
    base = SimConfig(num_blocks=s.num_blocks, block_size=s.block_size, policy=s.policy, budget=s.budget,
                     max_running=s.requests, seed=seed)
    workload = synthetic_workload(s.requests, seed, prompt=s.prompt, output=s.output, arrival_gap=0)
    keys = list(SYSTEMS) if seed % 2 == 0 else list(reversed(SYSTEMS))
    out = []
    for key in keys:
        _, overrides, verify = SYSTEMS[key]
        r = run_timed(replace(base, **overrides), workload, cache, shape, verify)
        out.append({"kind": "serving", "system": key, "seed": seed, **r})
    return out


def contention(cache, n: int, seed: int, reps: int) -> list[dict]:
    """Submit-to-complete latency of one relocation: idle vs beside a matmul stream; default vs high priority."""
    device = cache.device
    moves = random_moves(cache, n, seed)
    a = torch.randn(8192, 8192, device=device, dtype=torch.float16)
    busy = torch.cuda.Stream(device=device)
    out = []
    for priority in (0, -1):
        eng = TorchCopyEngine(cache)
        eng.stream = torch.cuda.Stream(device=device, priority=priority)
        for loaded in (False, True):
            lat = []
            for _ in range(reps):
                torch.cuda.synchronize(device)
                if loaded:
                    with torch.cuda.stream(busy):
                        for _ in range(40):  # ~tens of ms of tensor-core work queued ahead
                            a @ a
                t = time.perf_counter()
                h = eng.submit(moves)
                eng.wait(h)
                lat.append(time.perf_counter() - t)
                eng.release(h)
                torch.cuda.synchronize(device)
            out.append({"kind": "contention", "priority": "high" if priority else "default", "loaded": loaded,
                        "tokens": n, "latency_s": summarize(lat)})
    return out


def run(ctx) -> dict:
    s = ctx.settings
    device = torch.device(s.device)
    shape = shape_of(s)
    cache = build_cache(device, shape, s.num_blocks, s.block_size, s.seed)
    runs = []
    bar = ctx.progress("q4_device", 2 + len(s.seeds))
    for seed in s.seeds[:2]:
        runs.append({**throughput(cache, s.copy_tokens, seed, 5), "seed": seed})
        bar.advance("throughput")
    for seed in s.seeds:
        runs += serving(cache, shape, s, seed)
        bar.advance(f"serving seed {seed}")
    if device.type == "cuda":
        runs += contention(cache, s.copy_tokens, s.seed, 2 * s.repeats)
    bar.close()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"question": KEY, "title": TITLE, "paper": PAPER, "device": name, "torch": torch.__version__,
            "notes": _notes(device), "runs": runs, "summary": summarize_runs(runs)}


def _notes(device: torch.device) -> list[str]:
    notes = [("Victims are identical across systems (Random, seeded; no scores needed), so the step-time ratio "
             "isolates reclamation: planning, copies, and (force-sync) the host's wait."),
             ("The forward is the gather read path's work (every layer's K and V of the live slots, one query "
             "per request) plus one device-to-host read per step (the sampler's sync); no MLP, so copies are a "
             "larger share of a step than in a real model: the ratios bound the cost from above.")]
    if device.type != "cuda":
        notes.append("CPU run: copies finish inside submit, so poll, event and force-sync cannot differ here; "
                     "this run checks the harness. The overlap question needs --gpu.")
    return notes


def summarize_runs(runs: list[dict]) -> dict:
    serving_runs = [r for r in runs if r["kind"] == "serving"]
    base = {r["seed"]: r["step_ms"] for r in serving_runs if r["system"] == "naive"}
    systems = {}
    for key in SYSTEMS:
        rs = [r for r in serving_runs if r["system"] == key]
        if not rs:
            continue
        systems[key] = {"step_ms": summarize([r["step_ms"] for r in rs]),
                        "vs_naive": summarize([r["step_ms"] / base[r["seed"]] for r in rs]),
                        "blocked_ms_per_step": summarize([r["blocked_ms_per_step"] for r in rs]),
                        "retained_blocks": summarize([r["retained_blocks_per_step"] for r in rs]),
                        "moves": summarize([r["moves"] for r in rs]),
                        "mismatches": sum(r["mismatches"] for r in rs), "verified": sum(r["verified"] for r in rs)}
    tp = [r for r in runs if r["kind"] == "throughput"]
    return {"serving": systems,
            "throughput": {k: summarize([r[k] for r in tp]) for k in ("relocate_vs_plain", "digest_vs_plain")}
            if tp else {},
            "contention": [r for r in runs if r["kind"] == "contention"]}


def table(report: dict) -> list[str]:
    sm = report["summary"]
    rows = [[SYSTEMS[key][0], fmt_spread(v["step_ms"], "{:.2f}"), fmt_spread(v["vs_naive"], "{:.3f}"),
             fmt_spread(v["blocked_ms_per_step"], "{:.3f}"), fmt_spread(v["retained_blocks"], "{:.0f}"),
             fmt_spread(v["moves"], "{:.0f}"), f"{v['verified']} ({v['mismatches']} mismatches)"]
            for key, v in sm["serving"].items()]
    lines = [f"Device: {report['device']} (torch {report['torch']})", ""] + markdown(
        ("system", "step ms", "vs Naive-Evict", "host blocked ms/step", "retained blocks", "moves", "verified"), rows)
    if sm["throughput"]:
        t = sm["throughput"]
        lines += ["", f"Relocation throughput vs a plain copy of the same bytes: {pct(t['relocate_vs_plain'])}; "
                      f"strict-verify digests: {pct(t['digest_vs_plain'])}."]
    if sm["contention"]:
        lines += [""] + markdown(("relocation stream", "GPU", "submit-to-done ms"), [
            [f"{r['priority']} priority", "busy (matmul stream)" if r["loaded"] else "idle",
             fmt_spread(r["latency_s"], "{:.3f}", 1e3)] for r in sm["contention"]])
    return lines


def plot(report: dict, path) -> None:
    sm = report["summary"]
    keys = list(sm["serving"])
    panels = [Panel({"ratio": [sm["serving"][k]["vs_naive"] for k in keys]}, "step time / Naive-Evict",
                    [k.replace("_", "\n") for k in keys], colors={"ratio": "tab:blue"},
                    labels={"ratio": "step time / Naive-Evict"},
                    steps=[do("axhline", 1.0, color="k", lw=0.8),
                           do("set_title", f"Serving steps on {report['device']}", fontsize=9)])]
    if c := sm["contention"]:
        panels.append(Panel({"lat": [r["latency_s"] for r in c]}, "submit-to-done ms",
                            [f"{r['priority']}\n{'busy' if r['loaded'] else 'idle'}" for r in c], scale=1e3,
                            colors={"lat": "tab:orange"}, labels={"lat": "ms"},
                            steps=[do("set_title", "One relocation beside a matmul stream", fontsize=9)]))
    figure(path, [panels], figsize=(6 * len(panels), 4))
