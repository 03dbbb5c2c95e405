"""The gather read path's Triton decode attention (integration/device/triton_attention.py), run on the CPU in
Triton's interpreter: against the reference (``gather_attention.reference_attention`` in fp32 over the same
inputs) within V5's bound, fp32's ``agreement_bound`` plus half an ulp of the output's dtype for fp16 and bf16;
on four KV layouts (vLLM's FLASH_ATTN stacked and HND pair, its CPU layout, and a scrambled one with no heads
view), GQA 1/2/4 and MQA, several splits (more than a request's tokens too), one-token requests, padding and
queries before their request's last token. Planted bugs (a skipped split, an off-by-one slot decode, no causal
mask) must fail V5. A GPU's checks and timings are ``triton_attention.benchmark``'s, on a device run."""
from __future__ import annotations

import importlib
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

# NOTE: Triton reads TRITON_INTERPRET when a kernel is decorated (its own library's too) and again while one runs
# (a lazy import asserts it), so the interpreter is chosen for a whole process from its start: `make test` runs these
# files in a process of their own with it set, and the rest of the suite never sees it
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter tests run in their own process (TRITON_INTERPRET=1 from its start; make test)",
                allow_module_level=True)

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402,F401  (the interpreter wants it beside a jit function)
import torch  # noqa: E402

from vtoken.core.errors import BlockOutOfRangeError, ConfigError, InvalidArgumentError, InvariantViolation  # noqa: E402
from vtoken.integration.device import gather_attention as GA  # noqa: E402
from vtoken.integration.device import triton_attention as TA  # noqa: E402
from vtoken.integration.device.kv_cache import PagedKVCache  # noqa: E402
from vtoken.integration.device.kv_layout import cpu_plane, gpu_planes  # noqa: E402

if not TA.interpreted():  # imported before, compiled for a GPU: decorated again, interpreted
    TA = importlib.reload(TA)


@triton.jit
def _offset_off_by_one(slot, block_size):
    return slot // block_size, (slot + 1) % block_size


@triton.jit
def _no_causal_mask(query_pos):
    return query_pos + (1 << 40)  # every live token: logical ids are far below


@triton.jit
def _last_split_skipped(split, splits):
    return split < splits - 1



NB, S = 12, 4  # 48 slots
LAYOUTS = ("flash stacked", "hnd pair", "vllm cpu", "scrambled")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEADS = ((2, 2), (4, 2), (8, 2), (4, 1))  # (query heads, KV heads): GQA 1, 2, 4; MQA


def make_cache(layout: str, kv_heads: int, d: int, dtype: torch.dtype, seed: int) -> PagedKVCache:
    """Layer "l" in ``layout``, random K and V."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(shape, generator=g).to(dtype)  # noqa: E731
    if layout == "flash stacked":  # [2, num_blocks, block_size, heads, head_size]
        return PagedKVCache(gpu_planes("l", r(2, NB, S, kv_heads, d)))
    if layout == "hnd pair":  # [num_blocks, heads, block_size, head_size], K and V apart
        return PagedKVCache(gpu_planes("l", (r(NB, kv_heads, S, d).transpose(1, 2),
                                             r(NB, kv_heads, S, d).transpose(1, 2))))
    order = None
    if layout == "scrambled":  # every element of a block anywhere in it: no heads view, the kernel's table path
        order = torch.randperm(S * kv_heads * 2 * d, generator=g).view(S, kv_heads * 2 * d)
    return PagedKVCache([cpu_plane("l", r(NB, kv_heads, S, 2 * d), order)])


def make_requests(rng: random.Random, g: torch.Generator, lengths: list[int], pad: int, early: float):
    """(slots, ids, query_pos) of requests with ``lengths`` live tokens at distinct random slots, ids ascending with
    holes, ``pad`` more padding columns than the longest needs (their slots outside the cache: never read); a query
    is at its request's last id, or (with probability ``early``) at an earlier one."""
    R, N = len(lengths), max(lengths) + pad
    perm = torch.randperm(NB * S, generator=g)
    slots = torch.full((R, N), NB * S + 7, dtype=torch.int64)
    ids = torch.full((R, N), GA.PAD, dtype=torch.int64)
    query_pos = torch.zeros(R, dtype=torch.int64)
    at = 0
    for r, n in enumerate(lengths):
        slots[r, :n] = perm[at:at + n]
        at += n
        ids[r, :n] = torch.sort(torch.randperm(3 * n, generator=g)[:n]).values
        query_pos[r] = ids[r, rng.randrange(n) if rng.random() < early else n - 1]
    return slots, ids, query_pos


def random_case(seed: int) -> dict:
    """Case ``seed``: dtype, layout and heads cycle through every combination; the rest drawn."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    dtype, layout = DTYPES[seed % 3], LAYOUTS[(seed // 3) % 4]
    heads, kv_heads = HEADS[(seed // 12) % 4]
    d = rng.choice((8, 12, 16))
    lengths = [rng.randint(1, 10) for _ in range(rng.choice((1, 1, 1, 2)))]
    if seed % 4 == 0:
        lengths[rng.randrange(len(lengths))] = 1
    slots, ids, query_pos = make_requests(rng, g, lengths, rng.randint(0, 3), early=0.4)
    q = torch.randn(len(lengths), heads, d, generator=g).to(dtype)
    return dict(cache=make_cache(layout, kv_heads, d, dtype, seed), layer="l", q=q, slots=slots, ids=ids,
                query_pos=query_pos, scale=d ** -0.5 * rng.uniform(0.5, 2.0),
                splits=rng.choice((1, 2, 3, 5, None, None)), tile_tokens=rng.choice((2, 4, 8, None, None)),
                layout=layout, lengths=lengths, kv_heads=kv_heads)


def run(case: dict, **change) -> torch.Tensor:
    c = {**case, **change}
    return TA.decode_attention(c["cache"], c["layer"], c["q"], c["slots"], c["ids"], c["query_pos"], c["scale"],
                               c["splits"], tile_tokens=c["tile_tokens"])


def check(case: dict, out: torch.Tensor) -> None:
    TA.check_decode_agreement(case["cache"], case["layer"], case["q"], case["slots"], case["ids"],
                              case["query_pos"], case["scale"], out)


# ---- agreement ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", range(8))
def test_random_decodes_agree_with_the_reference_within_the_bound(block):
    """200 cases (25 per block): every (dtype, layout, heads) combination, splits 1 to 5 (more than a request's
    tokens too), tiles of 2 to 64 tokens, one-token requests, padding, queries before their request's end."""
    for seed in range(25 * block, 25 * block + 25):
        case = random_case(seed)
        out = run(case)
        assert out.dtype == case["q"].dtype and out.shape == case["q"].shape, seed
        try:
            check(case, out)
        except InvariantViolation as e:
            raise AssertionError(f"case {seed} ({case['layout']}, {case['q'].dtype}, lengths {case['lengths']}, "
                                 f"splits {case['splits']}, tiles {case['tile_tokens']}): {e}") from e


def test_the_cases_cover_what_the_issue_asks():
    cases = [random_case(seed) for seed in range(200)]
    assert {(c["q"].dtype, c["layout"], c["q"].shape[1], c["kv_heads"]) for c in cases} == \
        {(dtype, layout, h, kvh) for dtype in DTYPES for layout in LAYOUTS for h, kvh in HEADS}
    assert sum((c["splits"] or 1) > min(c["lengths"]) for c in cases) >= 30  # more splits than tokens
    assert sum((c["tile_tokens"] or 64) < max(c["lengths"]) // (c["splits"] or 1) for c in cases) >= 30  # tiles
    assert sum(1 in c["lengths"] for c in cases) >= 50
    assert sum(c["ids"].shape[1] > max(c["lengths"]) for c in cases) >= 100  # padding columns
    assert sum(bool((c["query_pos"] < c["ids"].masked_fill(c["ids"] == GA.PAD, -1).amax(1)).any())
               for c in cases) >= 50  # a query before its request's last token


def test_every_layout_but_the_scrambled_one_is_read_through_its_heads_view():
    for layout in LAYOUTS:
        cache = make_cache(layout, 2, 8, torch.float32, 0)
        k, v = TA.plane_address(cache, "l.K", 8), TA.plane_address(cache, "l.V", 8)
        assert k.affine == v.affine == (layout != "scrambled") and k.heads == v.heads == 2, layout


def long_case(dtype=torch.float32, layout="flash stacked", splits=3) -> dict:
    """Two requests long enough for several tiles per split; request 1's query before its last tokens."""
    rng, g = random.Random(1), torch.Generator().manual_seed(1)
    slots, ids, query_pos = make_requests(rng, g, [11, 9], 2, early=0.0)
    query_pos[1] = ids[1, 5]
    q = torch.randn(2, 4, 16, generator=g).to(dtype)
    return dict(cache=make_cache(layout, 2, 16, dtype, 1), layer="l", q=q, slots=slots, ids=ids,
                query_pos=query_pos, scale=0.25, splits=splits, tile_tokens=2, layout=layout, lengths=[11, 9])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_low_precision_bound_is_tight_and_its_rounding_term_is_needed(dtype):
    """fp16 and bf16 outputs are within b + u (|ref| + b) + eta / 2 of the fp32 reference, not within fp32's b alone
    (the output's rounding is most of the gap), and the bound is far below the outputs' size (not a blanket)."""
    case = long_case(dtype)
    out = run(case)
    check(case, out)
    ref, bound = TA.decode_reference(case["cache"], "l", case["q"], case["slots"], case["ids"], case["query_pos"],
                                     case["scale"])
    host = TA.fp32_on_host(case["cache"])
    b, _ = GA.agreement_bound(host, "l", case["q"].float(), torch.where(case["ids"] != GA.PAD, case["slots"], 0),
                              case["ids"], torch.arange(2), case["scale"])
    gap = (out.double() - ref.double()).abs()
    assert bool((gap > b.unsqueeze(-1)).any())
    assert bool((gap <= bound).all()) and float(bound.max()) < 1e-2 * float(ref.abs().max())


def test_fp32_agrees_as_check_agreement_compares():
    """For fp32 the bound is ``agreement_bound``'s: ``gather_attention.check_agreement`` accepts the output too."""
    case = long_case()
    out = run(case)
    clean = torch.where(case["ids"] != GA.PAD, case["slots"], 0)
    GA.check_agreement(case["cache"], "l", case["q"], clean, case["ids"], torch.arange(2), case["query_pos"],
                       case["scale"], (out, None), None, ["a", "b"])


def test_padding_and_tokens_after_the_query_are_never_read():
    """NaN in the K and V of every slot a query must not read (its request's tokens after it, and the slot its
    padding points at) changes nothing, bit for bit."""
    case = long_case()
    before = run(case)
    poison = torch.full((1, 2 * 16), float("nan"))
    cache, ids, slots = case["cache"], case["ids"], case["slots"].clone()
    unused = sorted(set(range(NB * S)) - set(slots[ids != GA.PAD].tolist()))[0]
    slots[ids == GA.PAD] = unused
    after_query = slots[(ids > case["query_pos"].view(-1, 1)) & (ids != GA.PAD)]
    assert len(after_query) >= 3
    for plane in ("l.K", "l.V"):
        cache.write(plane, torch.cat([after_query, torch.tensor([unused])]),
                    poison.expand(len(after_query) + 1, -1))
    assert torch.equal(run(case, slots=slots), before)


@pytest.mark.parametrize("splits", [1, 4, 16])
def test_any_number_of_splits_agrees(splits):
    case = long_case(splits=splits)
    check(case, run(case))


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # numpy's 0 / 0
def test_a_query_that_attends_nothing_is_nan_as_in_the_reference():
    case = long_case()
    query_pos = case["query_pos"].clone()
    query_pos[0] = -1
    out = run(case, query_pos=query_pos)
    assert bool(out[0].isnan().all()) and not bool(out[1].isnan().any())
    TA.check_decode_agreement(case["cache"], "l", case["q"], case["slots"], case["ids"], query_pos, case["scale"], out)


# ---- planted bugs ------------------------------------------------------------------------------------------------
def test_the_case_for_planted_bugs_agrees_as_it_is():
    check(long_case(), run(long_case()))
    check(long_case(layout="scrambled"), run(long_case(layout="scrambled")))


@pytest.mark.parametrize("piece, planted, layout", [
    ("_merged", _last_split_skipped, "flash stacked"),
    ("_block_and_offset", _offset_off_by_one, "flash stacked"),
    ("_block_and_offset", _offset_off_by_one, "scrambled"),  # the table path decodes slots as well
    ("_last_attended_id", _no_causal_mask, "flash stacked"),
], ids=["a skipped split", "an off-by-one slot offset", "an off-by-one slot offset, table path", "no causal mask"])
def test_a_planted_bug_fails_v5(monkeypatch, piece, planted, layout):
    case = long_case(layout=layout)
    monkeypatch.setattr(TA, piece, planted)
    with pytest.raises(InvariantViolation, match=r"^V5: request 'row \d', layer 'l': decode attention differs"):
        check(case, run(case))


# ---- bad input ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, error, match", [
    (lambda c: {"q": c["q"][0]}, InvalidArgumentError, r"q must be a \[requests, heads, head_dim\]"),
    (lambda c: {"q": c["q"].double()}, InvalidArgumentError, r"q must be .* fp16, bf16 or fp32"),
    (lambda c: {"q": c["q"][:, :3]}, InvalidArgumentError, r"3 heads are not a multiple of the layer's KV heads"),
    (lambda c: {"q": c["q"][..., :12]}, InvalidArgumentError, r"not whole heads of head_dim 12"),
    (lambda c: {"slots": c["slots"].int()}, InvalidArgumentError, r"slots must be an int64 tensor of shape"),
    (lambda c: {"ids": c["ids"][:1]}, InvalidArgumentError, r"ids must be an int64 tensor of shape \[2, 13\]"),
    (lambda c: {"query_pos": c["query_pos"][:1]}, InvalidArgumentError, r"query_pos must be an int64 tensor"),
    (lambda c: {"splits": 0}, InvalidArgumentError, r"splits must be a positive int, got 0"),
    (lambda c: {"tile_tokens": 3}, InvalidArgumentError, r"tile_tokens must be a power of 2, got 3"),
    (lambda c: {"scale": float("nan")}, InvalidArgumentError, r"scale must be a finite number"),
    (lambda c: {"slots": torch.where(c["slots"] == c["slots"][0, 0], NB * S, c["slots"])}, BlockOutOfRangeError,
     r"slot 48 \(block 12, offset 0\) outside the KV cache's 12 blocks"),
    (lambda c: {"ids": torch.cat([c["ids"][:, -1:], c["ids"][:, :-1]], 1)}, InvalidArgumentError,
     r"row 0 of ids has padding \(PAD\) before a live id"),
])
def test_bad_input_is_refused_naming_what_is_wrong(change, error, match):
    case = long_case()
    with pytest.raises(error, match=match):
        run(case, **change(case))


# ---- the benchmark -----------------------------------------------------------------------------------------------
def test_the_benchmark_needs_a_gpu_and_says_so():
    with pytest.raises(ConfigError, match="interpreter"):
        TA.benchmark()


def test_a_benchmark_case_runs_end_to_end_on_a_stand_in_timer():
    """What a device run will time, here on the CPU with a timer that only calls: the gather agrees (V5), and with
    torch's fused attention over the dense tokens."""
    row, gap = TA.bench_case(torch.device("cpu"), context=24, batch=2, heads=4, kv_heads=2, head_dim=16,
                             timer=lambda fn: (fn(), (1.0, "stand-in"))[1], check=True)
    assert gap is not None and gap <= 1.0
    assert row["ratio"] == 1.0 and row["splits"] == 1 and row["timed_with"] == ["stand-in"]
    assert row["max_abs_vs_sdpa"] < 1e-2


# ---- what a GPU would compile -----------------------------------------------------------------------------------
COMPILE_FOR_SM90 = r"""
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from vtoken.integration.device import triton_attention as TA

FLOATS = {"q_ptr", "k_base", "v_base", "out_ptr"}

def build(fn, constexprs, dtype):
    sig = {name: "constexpr" if name in constexprs else f"*{dtype}" if name in FLOATS else
           "*fp32" if name in ("max_ptr", "sum_ptr", "acc_ptr") else "fp32" if name == "scale" else
           "*i64" if name.endswith(("_ptr", "offsets", "block_strides")) else "i32" for name in fn.arg_names}
    assert compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32)).asm["cubin"]

shape = dict(HEADS=32, GROUP=4, HEAD_DIM=128, BLOCK_G=4, BLOCK_N=16, BLOCK_D=128)
build(TA._partials_kernel, {**shape, "AFFINE": True, "FINAL": False}, "fp16")
build(TA._partials_kernel, {**shape, "AFFINE": False, "FINAL": True}, "bf16")
build(TA._merge_kernel, dict(HEADS=32, HEAD_DIM=128, BLOCK_S=64, BLOCK_D=128), "fp32")
print("built")
"""


GPU_BUILD = os.environ.get("VTOKEN_TRITON_GPU_BUILD") == "1"  # about 7 s of CPU more: asked for, not by default


@pytest.fixture(scope="module", autouse=True)
def hopper_build(tmp_path_factory):
    """``COMPILE_FOR_SM90`` in a process of its own, without the interpreter (a kernel built for a GPU cannot call
    the interpreted standard library this process holds), started with this module's first test so that it runs on
    another core beside them. None where not asked for (``VTOKEN_TRITON_GPU_BUILD=1``) or without an NVIDIA
    backend."""
    if not GPU_BUILD or not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        yield None
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    build = subprocess.Popen([sys.executable, "-c", COMPILE_FOR_SM90], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    yield build
    if build.poll() is None:  # not waited for (the test was deselected)
        build.kill()
        build.wait()


def test_the_kernels_compile_for_a_hopper_gpu(hopper_build):
    """No GPU here, but Triton's own compiler and ptxas: the kernels as a device run builds them (sm_90, the
    benchmark's shapes; fp16 through a heads view with several splits, bf16 through a layout table with one, the
    merge), to a cubin."""
    if hopper_build is None:
        pytest.skip("VTOKEN_TRITON_GPU_BUILD=1 not set, or this triton has no NVIDIA backend (ptxas)")
    out, err = hopper_build.communicate(timeout=300)
    assert hopper_build.returncode == 0 and out.strip() == "built", err[-3000:]


# ---- wired into the gather path's attention (``gather_attention.attention``) --------------------------------------
@pytest.mark.parametrize("layout, dtype", [("vllm cpu", torch.float32), ("flash stacked", torch.float16)])
def test_the_gather_paths_attention_sends_decode_queries_to_the_kernel(layout, dtype):
    """``attention(..., triton=True)`` (a GPU cache's default): the queries alone in their request and not sent to
    torch run in ``decode_attention`` (the same bits as calling it on their rows), a prompt chunk and a query torch
    is asked to compute run where they ran before; the weights asked for are the reference's. fp32: V5
    (``check_agreement``) holds for the whole step. Without ``triton`` on a CPU cache, nothing runs in Triton."""
    rng, g = random.Random(7), torch.Generator().manual_seed(7)
    cache = make_cache(layout, 2, 16, dtype, 7)
    slots, ids, _ = make_requests(rng, g, [9, 7, 5, 6], 0, early=0.0)
    slots[ids == GA.PAD] = 0  # the torch paths read padding's slots (the gather backend's plans pad with slot 0)
    # queries: request 0 decodes, request 1 a chunk of 3 at its last ids, request 2 decodes in torch, request 3 decodes
    qreq = torch.tensor([0, 1, 1, 1, 2, 3])
    qpos = torch.stack([ids[0, 8], ids[1, 4], ids[1, 5], ids[1, 6], ids[2, 4], ids[3, 5]])
    q = torch.randn(6, 4, 16, generator=g).to(dtype)
    in_torch = torch.tensor([False, False, False, False, True, False])
    weights_of = torch.tensor([0, 4])
    args = (cache, "l", q, slots, ids, qreq, qpos, 0.25)
    out, w = GA.attention(*args, True, weights_of, in_torch, triton=True)
    decode = torch.tensor([0, 5])
    direct = TA.decode_attention(cache, "l", q[decode], slots[qreq[decode]], ids[qreq[decode]], qpos[decode], 0.25)
    assert torch.equal(out[decode], direct)
    rest = torch.tensor([1, 2, 3, 4])
    before, _ = GA.attention(cache, "l", q[rest], slots, ids, qreq[rest], qpos[rest], 0.25, True, None, in_torch[rest],
                             triton=False)
    assert torch.equal(out[rest], before)
    _, want_w = GA.reference_attention(*args, False, weights_of)
    assert torch.equal(w, want_w)
    if dtype == torch.float32:
        GA.check_agreement(*args, (out, w), weights_of, ["a", "b", "c", "d"])
        plain, _ = GA.attention(*args, True, weights_of, in_torch)
        assert not torch.equal(plain[decode], direct)  # the C kernel's (or torch's) sums, not the Triton kernel's
        GA.check_agreement(*args, (plain, w), weights_of, ["a", "b", "c", "d"])
    else:
        TA.check_decode_agreement(cache, "l", q[decode], slots[qreq[decode]], ids[qreq[decode]], qpos[decode], 0.25,
                                  out[decode])
