"""Device-layer benchmarks: ratios measured side by side, A/B interleaved, in one run.

    python tests/bench_device.py [--device cpu|cuda] [--quick]

1. relocation copy throughput (gather + scatter of n random tokens, all layers) vs a plain copy of the
   same number of bytes (contiguous ``dst.copy_(src)``);
2. strict-verify digest throughput (digests of the same n tokens) vs that plain copy;
3. a simulated decode step (per layer: a batched attention over the K/V cache, i.e. what a real step
   reads) with a relocation of a few blocks' tokens, verify off / sampled (1 in 16) / strict.
Prints one table; ``run()`` returns the numbers (the device-check script reuses it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

try:
    import vtoken.integration  # noqa: F401
except ImportError:  # a GPU box with torch only: import the package straight from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from device_check import import_from_checkout
    import_from_checkout()

import torch

from vtoken.core.token_table import Move
from vtoken.integration.copy_engine import TorchCopyEngine
from vtoken.integration.kv_cache import PagedKVCache
from vtoken.integration.kv_layout import gpu_planes
from vtoken.integration.verify import Verifier, VerifyConfig


def build_cache(device, layers, blocks, S, H, D, dtype, one_storage):
    """vLLM GPU layout, stacked [2, blocks, S, H, D] per layer; all layers in one allocation or one each."""
    per = 2 * blocks * S * H * D
    if one_storage:
        big = torch.randn(layers * per, device=device).to(dtype)
        tensors = [big[i * per:(i + 1) * per].view(2, blocks, S, H, D) for i in range(layers)]
    else:
        tensors = [torch.randn(2, blocks, S, H, D, device=device).to(dtype) for _ in range(layers)]
    return PagedKVCache([p for i, t in enumerate(tensors) for p in gpu_planes(f"layer{i}", t)])


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps):
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t) / reps


def interleaved(fns: dict, device, rounds, reps):
    """Median seconds per call of each fn, A/B/... interleaved ``rounds`` times."""
    out = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            out[k].append(timed(fn, device, reps))
    return {k: statistics.median(v) for k, v in out.items()}


def run(device="cpu", quick=False, seed=0) -> dict:
    device = torch.device(device)
    gpu = device.type == "cuda"
    cfg = dict(layers=32, blocks=2048, S=16, H=8, D=128, dtype=torch.float16) if gpu else \
        dict(layers=8 if quick else 16, blocks=256, S=16, H=4, D=64, dtype=torch.float32)
    n_tok = 4096 if gpu else 1024
    rounds, reps = (5, 20) if gpu else ((3, 3) if quick else (5, 5))
    g = torch.Generator().manual_seed(seed)
    results = {"device": str(torch.cuda.get_device_name(device)) if gpu else "cpu",
               "config": {k: str(v) for k, v in cfg.items()}, "tokens_per_copy": n_tok}
    rows = []
    for one_storage in (True, False):
        cache = build_cache(device, **cfg, one_storage=one_storage)
        slots = torch.randperm(cache.num_blocks * cache.block_size, generator=g)[: 2 * n_tok]
        S = cache.block_size
        moves = [Move(i, int(s) // S, int(s) % S, int(d) // S, int(d) % S)
                 for i, (s, d) in enumerate(zip(slots[:n_tok], slots[n_tok:]))]
        nbytes = n_tok * cache.bytes_per_token
        src_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst_buf = torch.empty_like(src_buf)
        eng = TorchCopyEngine(cache)
        ver = Verifier(cache, VerifyConfig("strict", seed=seed))
        src_slots = torch.tensor([m.src_block * S + m.src_offset for m in moves], device=device)
        values = cache.gather(src_slots)

        def relocate():
            h = eng.submit(moves)
            eng.wait(h)
            eng.release(h)

        def digest():
            for gi, v in enumerate(values):
                ver.digest(gi, v)

        t = interleaved({"plain": lambda: dst_buf.copy_(src_buf), "relocate": relocate, "digest": digest},
                        device, rounds, reps)
        launches = 2 * len(cache.groups)
        rows.append({"layers_in": "one storage" if one_storage else "a storage per layer", "launches": launches,
                     "bytes": nbytes, **{f"{k}_s": v for k, v in t.items()},
                     "relocate_vs_plain": t["plain"] / t["relocate"], "digest_vs_plain": t["plain"] / t["digest"]})
    results["throughput"] = rows
    results["decode_step"] = decode_step_overhead(device, cfg, rounds, reps, seed)
    return results


def decode_step_overhead(device, cfg, rounds, reps, seed) -> dict:
    """A decode step reading every layer's K through the slots (GPU: 32 requests x 512 tokens; CPU: 8 x 256),
    plus relocating 64 tokens."""
    cache = build_cache(device, **cfg, one_storage=True)
    S, (n_req, ctx) = cache.block_size, ((32, 512) if device.type == "cuda" else (8, 256))
    g = torch.Generator().manual_seed(seed)
    read_slots = torch.randperm(cache.num_blocks * S // 2, generator=g)[: n_req * ctx].to(device)
    q = torch.randn(n_req, 1, cfg["D"], device=device).to(cfg["dtype"])
    free = torch.arange(cache.num_blocks * S // 2, cache.num_blocks * S)
    engines = {mode: TorchCopyEngine(cache, Verifier(cache, VerifyConfig(mode, sample_every=16, seed=seed)))
               for mode in ("off", "sampled", "strict")}
    step_no = [0]

    def step(mode):
        eng = engines[mode]
        i = step_no[0] = (step_no[0] + 1) % (len(free) // 64)
        dst = free[i * 64:(i + 1) * 64]
        src = read_slots[:64].cpu()
        h = eng.submit([Move(j, int(s) // S, int(s) % S, int(d) // S, int(d) % S) for j, (s, d) in enumerate(zip(src, dst))])
        for gr in cache.groups:  # the forward: every layer's K (first head) read through the slots
            blocks = (read_slots // S).unsqueeze(1)
            for (a, _), name in zip(gr.segments, gr.names):
                if name.endswith(".K"):
                    idx = gr.offsets[:, a:a + cfg["D"]][read_slots % S] + blocks * gr.stride[a:a + cfg["D"]]
                    kv = gr.flat[idx].view(n_req, ctx, cfg["D"])
                    torch.bmm(q, kv.transpose(1, 2)).softmax(-1)
        eng.wait(h)
        eng.release(h)

    t = interleaved({m: (lambda m=m: step(m)) for m in engines}, device, rounds, reps)
    return {"step_s": t, "sampled_overhead": t["sampled"] / t["off"] - 1, "strict_overhead": t["strict"] / t["off"] - 1}


def print_table(r: dict) -> None:
    print(f"device: {r['device']}  config: {r['config']}  tokens per copy: {r['tokens_per_copy']}")
    print(f"{'layers in':<22}{'launches':>9}{'MB':>8}{'plain ms':>10}{'reloc ms':>10}{'digest ms':>11}"
          f"{'reloc/plain':>13}{'digest/plain':>14}")
    for row in r["throughput"]:
        print(f"{row['layers_in']:<22}{row['launches']:>9}{row['bytes'] / 2**20:>8.1f}{row['plain_s'] * 1e3:>10.3f}"
              f"{row['relocate_s'] * 1e3:>10.3f}{row['digest_s'] * 1e3:>11.3f}{row['relocate_vs_plain']:>12.1%}"
              f"{row['digest_vs_plain']:>14.1%}")
    d = r["decode_step"]
    print(f"simulated decode step: off {d['step_s']['off'] * 1e3:.2f} ms, sampled {d['step_s']['sampled'] * 1e3:.2f} ms "
          f"({d['sampled_overhead']:+.1%}), strict {d['step_s']['strict'] * 1e3:.2f} ms ({d['strict_overhead']:+.1%})")
    print("(throughput ratios: plain-copy time / relocation or digest time for the same bytes; higher is better)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    print_table(run(a.device, a.quick))


if __name__ == "__main__":
    main()
