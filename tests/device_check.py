"""The CUDA checks of the device layer, and one script that runs them and the benchmarks on a GPU box.

    python tests/device_check.py            # needs torch with CUDA; nothing else (no vLLM, no network)

Prints one line per check and the benchmark table; exits non-zero if a check fails. Each ``check_*``
function is also a pytest test (tests/test_device_cuda.py), skipped where there is no GPU.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
import traceback
from pathlib import Path


def import_from_checkout() -> None:
    """Make ``vtoken.core`` and ``vtoken.integration`` importable from this checkout without installing."""
    root = Path(__file__).resolve().parent.parent
    pkg = Path(tempfile.mkdtemp(prefix="vtoken-")) / "vtoken"
    pkg.mkdir()
    for sub in ("core", "integration"):
        (pkg / sub).symlink_to(root / sub)
    sys.path.insert(0, str(pkg.parent))


try:
    import vtoken.integration  # noqa: F401
except ImportError:
    import_from_checkout()

import torch  # noqa: E402

from vtoken.core.copy_engine import CopyStatus  # noqa: E402
from vtoken.core.token_table import Move  # noqa: E402
from vtoken.integration.device.copy_engine import TorchCopyEngine  # noqa: E402
from vtoken.integration.device.kv_cache import PagedKVCache  # noqa: E402
from vtoken.integration.device.kv_layout import cpu_plane, gpu_planes  # noqa: E402
from vtoken.integration.device.verify import RelocationMismatch, Verifier, VerifyConfig  # noqa: E402

NB, S, H, D = 64, 16, 4, 64


def cuda_cache(dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda")
    planes = []
    for i in range(3):
        planes += gpu_planes(f"layer{i}", torch.randn(2, NB, S, H, D, generator=g).to(dtype).to(dev))
    planes += gpu_planes("layer3", (torch.randn(NB, S, 1, D, generator=g).to(dev),
                                    torch.randn(NB, S, 1, D, generator=g).to(dev)))  # MQA, fp32
    planes.append(cpu_plane("layer4", torch.randn(NB, 2, S, 2 * D, generator=g).to(torch.bfloat16).to(dev)))
    return PagedKVCache(planes)


def snapshot(cache):
    return {n: cache.read(n, torch.arange(NB * S, device=cache.device)).clone() for n in cache.plane_names()}


def moves_with_chain(n, seed):
    slots = random.Random(seed).sample(range(NB * S), 2 * n)
    src, dst = slots[:n], slots[n:]
    dst[0] = src[1]
    return [Move(i, s // S, s % S, d // S, d % S) for i, (s, d) in enumerate(zip(src, dst))]


def settle(eng, h, timeout=10.0):
    t = time.perf_counter()
    while eng.poll(h) is CopyStatus.PENDING:
        assert time.perf_counter() - t < timeout, "copy did not complete"
    return eng.poll(h)


# ---- checks -------------------------------------------------------------------------------------------
def check_moves_exact_on_cuda():
    for dtype in (torch.float16, torch.bfloat16, torch.float32) + tuple(
            getattr(torch, n) for n in ("float8_e4m3fn",) if hasattr(torch, n)):
        cache = cuda_cache(dtype)
        before = snapshot(cache)
        moves = moves_with_chain(200, 1)
        eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict")))
        assert settle(eng, eng.submit(moves)) is CopyStatus.DONE
        after = snapshot(cache)
        for n in before:
            want = before[n].clone()
            for m in moves:
                want[m.dst_block * S + m.dst_offset] = before[n][m.src_block * S + m.src_offset]
            assert torch.equal(after[n].view(torch.uint8), want.view(torch.uint8)), (dtype, n)
        assert eng.launches == 2 * len(cache.groups) and eng.verifier.counters.verified == 1


def check_pre_attention_hook_orders_compute_after_the_copy():
    """A copy delayed on the relocation stream: without the hook the compute stream reads the old value
    (the race is real); with ``order_before_compute`` + ``before_compute`` it reads the new one, and the
    host never waited."""
    results = {}
    for use_hook in (False, True):
        cache = cuda_cache(torch.float32)
        eng = TorchCopyEngine(cache)
        src, dst = torch.tensor([5 * S], device="cuda"), torch.tensor([9 * S + 3], device="cuda")
        new = cache.read("layer0.K", src).clone()
        old = cache.read("layer0.K", dst).clone()
        eng.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(eng.stream):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the copy starts
        t = time.perf_counter()
        h = eng.submit([Move(0, 5, 0, 9, 3)])
        submit_s = time.perf_counter() - t
        assert eng.poll(h) is CopyStatus.PENDING, "the delayed copy should still be running"
        if use_hook:
            assert eng.order_before_compute(h) is CopyStatus.ORDERED
            eng.before_compute()
        seen = cache.read("layer0.K", dst)  # issued on the compute stream
        torch.cuda.synchronize()
        results[use_hook] = (torch.equal(seen, new), torch.equal(seen, old))
        assert submit_s < 0.05, f"submit blocked the host for {submit_s:.3f} s"
        settle(eng, h)
    assert results[False] == (False, True), "without the wait the compute stream should read the old value"
    assert results[True] == (True, False), "with the pre-attention wait it must read the copied value"


def check_force_sync_waits_on_the_host():
    cache = cuda_cache()
    eng = TorchCopyEngine(cache)
    h = eng.submit(moves_with_chain(100, 2))
    assert eng.wait(h) is CopyStatus.DONE


def check_strict_verify_on_cuda_detects_a_flip():
    """A faulty copy kernel: the scatter tears one element of layer2.V at the destination. The flip runs on the
    relocation stream inside the copy, between its scatter and its destination digest (a write after the copy
    is later work's, and strict verify rightly ignores it: the check below)."""
    cache = cuda_cache(torch.bfloat16)
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict")))
    slot = torch.tensor([7 * S + 7], device="cuda")
    real = cache.scatter

    def torn_scatter(slots, values):
        real(slots, values)
        v = cache.read("layer2.V", slot)
        v.view(torch.int16)[0, 5] ^= 1
        cache.write("layer2.V", slot, v)

    cache.scatter = torn_scatter
    try:
        h = eng.submit([Move(3, 1, 2, 7, 7)], req_id="gpu-req")
    finally:
        del cache.scatter
    try:
        settle(eng, h)
    except RelocationMismatch as e:
        assert "gpu-req" in str(e) and "layer2.V" in str(e) and "token 3" in str(e)
    else:
        raise AssertionError("the flipped element was not detected")


def check_strict_verify_reads_its_digests_after_they_are_computed():
    """Digests are computed on the relocation stream as part of the copy; reading them back must wait for
    those kernels. A long kernel queued on that stream after the copy makes a read-back that does not wait
    see unfinished digests: false mismatches (found on an H200)."""
    cache = cuda_cache(torch.float16)
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict")))
    h = eng.submit(moves_with_chain(300, 4), req_id="r")
    with torch.cuda.stream(eng.stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s, after the copy's event, before the destination digests
    assert eng.wait(h) is CopyStatus.DONE
    c = eng.verifier.counters
    assert (c.verified, c.mismatches) == (1, 0), (c.verified, c.mismatches)


def check_two_ordered_copies_into_one_slot_verify_clean():
    """Copy 1 (request "a") writes slot 9*S+3; copy 2 (request "b"), ORDERED after it, writes the same slot before
    the host first sees copy 1 complete (a long kernel ahead of both keeps them pending meanwhile). Copy 1
    wrote its destination correctly, so both verify clean: each copy's destination digest is taken on the
    relocation stream right after its own scatter. Taken when copy 1 was first seen complete, it read copy 2's
    value: RelocationMismatch under raise, a failed healthy request under quarantine."""
    for mode in ("raise", "quarantine"):
        cache = cuda_cache(torch.float16)
        before = snapshot(cache)
        evidence = tempfile.mkdtemp(prefix="vtoken-evidence-")
        eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict", on_mismatch=mode, evidence_dir=evidence)))
        eng.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(eng.stream):
            torch.cuda._sleep(200_000_000)  # ~0.1 s ahead of both copies on the relocation stream
        first = eng.submit([Move(0, 5, 0, 9, 3)], req_id="a")
        assert eng.order_before_compute(first) is CopyStatus.ORDERED
        second = eng.submit([Move(1, 6, 1, 9, 3)], req_id="b")
        assert eng.order_before_compute(second) is CopyStatus.ORDERED
        assert eng.poll(first) is CopyStatus.ORDERED, "copy 1 should still be running"
        eng.before_compute()
        torch.cuda.synchronize()
        assert (eng.poll(first), eng.poll(second)) == (CopyStatus.DONE, CopyStatus.DONE), mode
        c = eng.verifier.counters
        assert (c.relocations, c.verified, c.mismatches) == (2, 2, 0), (mode, c)
        assert eng.verifier.quarantined == {} and not any(Path(evidence).iterdir()), mode
        after = snapshot(cache)
        for n in before:
            assert torch.equal(after[n][9 * S + 3].view(torch.uint8), before[n][6 * S + 1].view(torch.uint8)), n


def check_submit_does_not_wait_for_the_device():
    """A submit while the compute stream runs a long kernel returns at once (slot lists are staged through
    pinned memory the engine warmed; a fresh cudaHostAlloc would wait for the whole device)."""
    cache = cuda_cache(torch.float32)
    eng = TorchCopyEngine(cache)
    torch.cuda._sleep(400_000_000)  # ~0.2 s on the compute stream
    t = time.perf_counter()
    for n in (2, 3, 17, 129, 500):  # lists of many sizes
        eng.submit(moves_with_chain(n, n))
    took = time.perf_counter() - t
    torch.cuda.synchronize()
    assert took < 0.05, f"5 submits blocked the host for {took:.3f} s"


def check_cuda_graph_reads_relocations_through_an_updated_slot_buffer():
    """A captured graph reads K through a fixed device slot buffer; after a relocation, an in-place update
    of that buffer makes the graph read the token at its new slot, with no re-capture."""
    cache = cuda_cache(torch.float32)
    g = cache.groups[0]
    slot_buf = torch.tensor([2 * S + 1, 4 * S], device="cuda")
    out = torch.empty(2, g.elems, device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.copy_(g.flat[g.index(slot_buf, S)])  # warm-up outside capture
        with torch.cuda.graph(graph, stream=s):
            out.copy_(g.flat[g.index(slot_buf, S)])
    torch.cuda.current_stream().wait_stream(s)
    graph.replay()
    torch.cuda.synchronize()
    want = out.clone()
    eng = TorchCopyEngine(cache)
    settle(eng, eng.submit([Move(0, 2, 1, 30, 0)]))
    cache.scatter(torch.tensor([2 * S + 1], device="cuda"),
                  [torch.zeros_like(v) for v in cache.gather(torch.tensor([2 * S + 1], device="cuda"))])  # reused
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out[0], want[0]), "the graph should still read the old (now reused) slot"
    slot_buf[0] = 30 * S  # the in-place update vtoken makes after a commit
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want), "after the buffer update the graph reads the relocated token"


CHECKS = [check_moves_exact_on_cuda, check_pre_attention_hook_orders_compute_after_the_copy,
          check_force_sync_waits_on_the_host, check_strict_verify_on_cuda_detects_a_flip,
          check_strict_verify_reads_its_digests_after_they_are_computed,
          check_two_ordered_copies_into_one_slot_verify_clean,
          check_submit_does_not_wait_for_the_device,
          check_cuda_graph_reads_relocations_through_an_updated_slot_buffer]


# ---- the Triton kernels (issue #47): compiled for this GPU, against the torch path and the reference --------------
def check_triton_relocation_is_bit_exact_and_its_digests_are_verifiers():
    """``TritonRelocator`` on every layout and dtype of ``cuda_cache``: random moves with a chain (one wave staged,
    then disjoint moves direct) leave the bits torch's gather and scatter leave, and the fused digests equal
    ``Verifier``'s of the same tokens."""
    from vtoken.integration.device.triton_relocate import TritonRelocator
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for disjoint in (False, True):
            cache, ref = cuda_cache(dtype, seed=5), cuda_cache(dtype, seed=5)
            slots = random.Random(7).sample(range(NB * S), 400)
            src, dst = slots[:200], slots[200:]
            if not disjoint:
                dst[0] = src[1]  # a chain: the wave reads a slot it writes
            moves = torch.tensor(list(zip(src, dst)), dtype=torch.int64, device="cuda")
            verifier = Verifier(cache, VerifyConfig("strict"))
            got_src, got_dst = TritonRelocator(cache, verifier).relocate(moves, digests=True, disjoint=disjoint)
            values = ref.gather(moves[:, 0])
            ref.scatter(moves[:, 1], values)
            want = verifier.source_digests(values)
            torch.cuda.synchronize()
            for n in cache.plane_names():
                every = torch.arange(NB * S, device="cuda")
                assert torch.equal(cache.read(n, every).view(torch.uint8), ref.read(n, every).view(torch.uint8)), n
            for a, b, c in zip(got_src.per_group, got_dst.per_group, want.per_group):
                assert torch.equal(a, c) and torch.equal(b, c), (dtype, disjoint)


def check_triton_padded_relocation_replays_in_a_cuda_graph():
    """``relocate_padded`` captured once with a capacity of 256 moves, replayed with 3 and then 100 valid ones (the
    count in a device tensor): each replay moves exactly its valid moves."""
    from vtoken.integration.device.triton_relocate import TritonRelocator
    cache, ref = cuda_cache(torch.float16, seed=9), cuda_cache(torch.float16, seed=9)
    mover = TritonRelocator(cache)
    buf = torch.zeros(256, 2, dtype=torch.int64, device="cuda")
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    mover.relocate_padded(buf, count)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mover.relocate_padded(buf, count)
    for n, seed in ((3, 1), (100, 2)):
        slots = random.Random(seed).sample(range(NB * S), 2 * n)
        moves = torch.tensor(list(zip(slots[:n], slots[n:])), dtype=torch.int64, device="cuda")
        buf[:n] = moves
        buf[n:] = -1  # padding: never read
        count.fill_(n)
        graph.replay()
        ref.scatter(moves[:, 1], ref.gather(moves[:, 0]))
        torch.cuda.synchronize()
        every = torch.arange(NB * S, device="cuda")
        for name in cache.plane_names():
            assert torch.equal(cache.read(name, every).view(torch.uint8), ref.read(name, every).view(torch.uint8))


def check_triton_decode_attention_is_within_the_bound():
    """``decode_attention`` on the GPU (fp16, bf16, fp32; GQA 4:1 over ``cuda_cache``'s layers 0 and 4, MQA over
    layer 3; 1, 2 and 5 splits) within ``check_decode_agreement``'s bound of the fp32 reference."""
    from vtoken.integration.device.gather_attention import PAD
    from vtoken.integration.device.triton_attention import check_decode_agreement, decode_attention
    rng = random.Random(3)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        cache = cuda_cache(dtype, seed=11)
        for layer, kv_heads in (("layer0", H), ("layer3", 1), ("layer4", 2)):
            R, N = 4, 200
            slots = torch.full((R, N), PAD, dtype=torch.int64)
            ids = torch.full((R, N), PAD, dtype=torch.int64)
            for r in range(R):
                n = rng.randint(1, N)
                slots[r, :n] = torch.tensor(sorted(rng.sample(range(NB * S), n)))
                ids[r, :n] = torch.tensor(sorted(rng.sample(range(4 * N), n)))
            query_pos = ids.masked_fill(ids == PAD, -1).amax(dim=1)
            plane = cache.read(f"{layer}.K", torch.zeros(1, dtype=torch.int64, device="cuda"))
            g = torch.Generator().manual_seed(kv_heads)
            q = torch.randn(R, 4 * kv_heads, D, generator=g).to(plane.dtype).cuda()
            for splits in (1, 2, 5):
                args = (cache, layer, q, slots.cuda(), ids.cuda(), query_pos.cuda(), D ** -0.5)
                out = decode_attention(*args, splits=splits)
                check_decode_agreement(*args, out)


def check_the_engine_on_triton_leaves_the_torch_engines_bits_and_catches_a_flip():
    """``TorchCopyEngine(triton=True)`` (what vLLM's connector builds on a GPU cache with ``fast_path``): a step of
    three requests' copies, one reading what another writes (two waves or more), leaves the torch engine's bits under strict
    verify, every copy DONE, in two launches per element width and wave; a destination digest altered as the kernel
    returns it (a torn write) fails request b's copy alone, under quarantine."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        cache, ref = cuda_cache(dtype, seed=5), cuda_cache(dtype, seed=5)
        chain = moves_with_chain(60, 4)
        copies = [(chain[:30], "a"), (chain[30:], "b"),
                  ([Move(0, chain[0].dst_block, chain[0].dst_offset, 63, 15)], "c")]  # reads what a writes
        got = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict", seed=3)), triton=True)
        want = TorchCopyEngine(ref, Verifier(ref, VerifyConfig("strict", seed=3)))
        handles = got.submit_batch(copies)
        waves = len({id(got._get(h).wave) for h in handles})  # by block: c reads a block a writes, b may too
        assert [settle(got, h) for h in handles] == [CopyStatus.DONE] * 3, dtype
        assert [settle(want, h) for h in want.submit_batch(copies)] == [CopyStatus.DONE] * 3, dtype
        a, b = snapshot(cache), snapshot(ref)
        assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a), dtype
        assert waves >= 2 and got.launches == 2 * waves * len(got.relocator.units), (waves, got.launches)
    cache = cuda_cache(torch.float16, seed=6)
    eng = TorchCopyEngine(cache, Verifier(cache, VerifyConfig("strict", on_mismatch="quarantine", seed=3,
                                                              evidence_dir=tempfile.mkdtemp())), triton=True)
    real = eng.relocator.relocate

    def torn(moves, wave_ends=None, *, digests=False, disjoint=False):
        out = real(moves, wave_ends, digests=digests, disjoint=disjoint)
        out[1].per_group[0][10, 0] += 1  # as if move 10 (b's third) landed torn
        return out

    eng.relocator.relocate = torn
    a = [Move(i, i, 0, 16 + i, 0) for i in range(8)]
    b = [Move(i, 32 + i, 1, 48 + i, 1) for i in range(8)]  # blocks apart from a's: one wave
    statuses = [settle(eng, h) for h in eng.submit_batch([(a, "a"), (b, "b")])]
    assert statuses == [CopyStatus.DONE, CopyStatus.FAILED] and list(eng.verifier.quarantined) == ["b"], statuses


def check_the_gather_attention_of_a_gpu_cache_decodes_in_triton():
    """``gather_attention.attention`` on a GPU cache (fp32, GQA 4:1): the decode queries run in ``decode_attention``
    (its bits), a prompt chunk in torch, and the whole step agrees with the reference within V5's bound."""
    from vtoken.integration.device.gather_attention import PAD, attention, check_agreement
    from vtoken.integration.device.triton_attention import decode_attention
    cache, rng = cuda_cache(torch.float32, seed=12), random.Random(12)
    R, N = 3, 300
    slots = torch.zeros((R, N), dtype=torch.int64)
    ids = torch.full((R, N), PAD, dtype=torch.int64)
    for r, n in enumerate((300, 120, 1)):
        slots[r, :n] = torch.tensor(rng.sample(range(NB * S), n))
        ids[r, :n] = torch.tensor(sorted(rng.sample(range(2 * N), n)))
    qreq = torch.tensor([0, 1, 1, 1, 2])
    qpos = torch.stack([ids[0, 299], ids[1, 117], ids[1, 118], ids[1, 119], ids[2, 0]])
    q = torch.randn(5, 4 * H, D, generator=torch.Generator().manual_seed(1)).cuda()
    args = (cache, "layer3", q, slots.cuda(), ids.cuda(), qreq.cuda(), qpos.cuda(), D ** -0.5)
    out, _ = attention(*args)
    decode = torch.tensor([0, 4], device="cuda")
    direct = decode_attention(cache, "layer3", q[decode], args[3][args[5][decode]], args[4][args[5][decode]],
                              args[6][decode], D ** -0.5)
    assert torch.equal(out[decode], direct)
    check_agreement(*args, (out, None), None, ["a", "b", "c"])


CHECKS += [check_triton_relocation_is_bit_exact_and_its_digests_are_verifiers,
           check_triton_padded_relocation_replays_in_a_cuda_graph, check_triton_decode_attention_is_within_the_bound,
           check_the_engine_on_triton_leaves_the_torch_engines_bits_and_catches_a_flip,
           check_the_gather_attention_of_a_gpu_cache_decodes_in_triton]


def triton_bench(out: str | None, quick: bool) -> dict:
    """#47's figures, each a ratio measured in the same run on this card: relocation (and with its fused digest) as a
    fraction of a plain device copy of the same bytes at 512 MB and 16 MB of random moves; gather decode against
    SDPA over the same live tokens stored densely, at 4K and 32K context, batch 1-64. JSON in ``out``."""
    import json
    from vtoken.integration.device import triton_attention, triton_relocate
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton
        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    for name, run in (("relocation", lambda: triton_relocate.benchmark(sizes_mb=(64, 16) if quick else (512, 16))),
                      ("gather_decode", lambda: triton_attention.benchmark(
                          contexts=(4096,) if quick else (4096, 32768), batches=(1, 8) if quick else (1, 8, 64)))):
        t = time.perf_counter()
        try:
            report[name] = run()
        except Exception:  # one kernel's failure is a finding: the other is still measured
            report[name] = {"error": traceback.format_exc()[-2000:]}
        print(f"triton {name}: {time.perf_counter() - t:.0f} s\n{json.dumps(report[name], indent=1, default=str)}",
              flush=True)
    out_dir = Path(out or tempfile.mkdtemp(prefix="vtoken-device-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "triton.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"triton: JSON in {out_dir}/triton.json", flush=True)
    return report


def bench(out: str | None, quick: bool, gpu: bool = True) -> dict:
    """Q4's device half (``vtoken bench device --gpu``): JSON (and PNG where matplotlib is installed) in ``out``."""
    from vtoken.integration.bench import q4_device
    from vtoken.integration.bench.runner import BenchContext, machine, write_report
    from vtoken.integration.bench.settings import device_bench_settings
    out_dir = Path(out or tempfile.mkdtemp(prefix="vtoken-device-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = device_bench_settings(gpu, quick)
    started = time.monotonic()
    report = q4_device.run(BenchContext(settings, out_dir, "python tests/device_check.py"))
    report.update(command=f"python tests/device_check.py{' --quick' if quick else ''} --out DIR",
                  settings=settings.describe(), machine=machine(), duration_s=round(time.monotonic() - started, 2))
    write_report(out_dir / f"{q4_device.KEY}.json", report)
    print("\n".join(q4_device.table(report)))
    try:
        q4_device.plot(report, out_dir / f"{q4_device.KEY}.png")
    except Exception as e:  # a GPU box without matplotlib: the JSON is what matters, plot it elsewhere
        print(f"(no plot: {e})")
    print(f"q4_device: {report['duration_s']:.0f} s, JSON in {out_dir}/")
    return report


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description="CUDA checks of the device layer, then Q4's device benchmark")
    ap.add_argument("--out", help="folder for q4_device.json (default: a temporary folder)")
    ap.add_argument("--quick", action="store_true", help="the benchmark at its quick scale")
    ap.add_argument("--bench-only", action="store_true", help="skip the checks")
    a = ap.parse_args(argv if argv is not None else [])
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    failed = 0
    for check in [] if a.bench_only else CHECKS:
        t = time.perf_counter()
        try:
            check()
            status = "ok"
        except Exception:
            failed += 1
            status = "FAILED\n" + traceback.format_exc()
        print(f"{check.__name__:<72} {time.perf_counter() - t:6.2f} s  {status}", flush=True)
    if not a.bench_only:
        print(f"\n{len(CHECKS) - failed}/{len(CHECKS)} CUDA checks passed", flush=True)
    triton_bench(a.out, a.quick)  # first: #47's figures have never been taken
    bench(a.out, a.quick)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
