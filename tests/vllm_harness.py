"""Real vLLM (CPU build) on the shipped tiny Llama, for the end-to-end tests.

``load_format="dummy"`` initialises weights so that this model ignores its KV cache: zeroing the
whole cache mid-run leaves every logprob unchanged, which would make "bit-identical" vacuous. So
``generate`` re-initialises every weight from a seeded normal distribution first (norms 1,
embeddings N(0, 1), matrices N(0, 1/fan_in)); then a wrong K/V anywhere changes the logprobs
(``test_vllm_e2e.py`` shows it with planted bugs).
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

from vtoken.integration.vllm import compat

TINY = str(Path(compat.__file__).parent / "models" / "tiny-llama")


def reinit_weights(worker, seed: int = 1234) -> str:
    """Seeded random weights in every layer (fan-in scaled normal; norms 1). The dummy loader's weights are
    near zero, so attention would be uniform; and vLLM's CPU backend packs linear weights for its GEMM
    kernels and leaves ``weight`` empty, so those layers get a fresh weight and are packed again by vLLM's
    own ``process_weights_after_loading`` (the stock CPU GEMM path stays in use).

    Under tensor parallelism each rank draws its own shard from ``seed`` + its rank, so the ranks' heads differ
    (one seed would give every rank the same shard, a model whose heads repeat, where a rank that read only its
    own attention would agree with the others by construction). Every parameter but the norms (all 1) is
    sharded in a Llama under TP, so the shards make one consistent model."""
    import torch
    from vllm.distributed import get_tensor_model_parallel_rank, model_parallel_is_initialized
    rank = get_tensor_model_parallel_rank() if model_parallel_is_initialized() else 0
    g = torch.Generator().manual_seed(seed + rank)
    model = worker.model_runner.model
    packed = []
    for name, mod in sorted(model.named_modules()):
        w = getattr(mod, "weight", None)
        if hasattr(mod, "cpu_linear") and w is not None and w.numel() == 0:
            shape = (mod.output_size_per_partition, mod.input_size_per_partition)
            mod.weight = torch.nn.Parameter(torch.empty(shape, dtype=w.dtype), requires_grad=False)
            packed.append(mod)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.numel() == 0 or p.dim() == 0 or not p.dtype.is_floating_point:
                continue
            if "norm" in name:
                p.fill_(1.0)
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    for mod in packed:
        mod.quant_method.process_weights_after_loading(mod)
    return "ok"


TINY_GQA = str(Path(compat.__file__).parent / "models" / "tiny-llama-gqa")  # 8 query heads per KV head
UNIT_ROUNDOFF = 2.0 ** -24  # fp32


def logit_bound(worker) -> tuple[float, int]:
    """(``collective_rpc``) Z, a bound on every logit's magnitude, and the number of decoder layers.

    The logits are z = W h with h = g * x / rms(x) the final RMSNorm's output, so ||h|| <= max|g| sqrt(d) and
    |z_i| <= ||W_i|| ||h|| <= max_i ||W_i|| max|g| sqrt(d) = Z."""
    model = worker.model_runner.model
    w, g = model.lm_head.weight, model.model.norm.weight
    assert w.numel() and g.numel(), "lm_head or final norm without a weight: no bound from it"
    return float(w.norm(dim=1).max() * g.abs().max() * w.shape[1] ** 0.5), len(model.model.layers)


def logprob_tolerance(bound: tuple[float, int], keys: int) -> float:
    """How far two fp32 computations of the same attention, summed in different orders (the stock CPU kernel,
    vtoken's gather in torch), may move a logprob, from the model's logit bound Z (``logit_bound``).

    Each layer's attention output is a convex combination of at most ``keys`` values; two summation orders of
    it differ by at most gamma_n = n u / (1 - n u) relative to the values (n = keys, u = 2^-24: the worst-case
    bound of a length-n sum). First-order model, stated rather than proved: a relative perturbation of the
    residual stream passes each later layer with gain <= 1 (RMSNorm re-normalises each sublayer's input), so
    L layers leave the final hidden state within eps = L gamma_n of itself, relative, and every logit within
    eps Z. A logprob z_t - logsumexp(z) then moves by at most 2 eps Z. ``bound``: ``logit_bound``'s (Z, L)."""
    z, layers = bound
    gamma = keys * UNIT_ROUNDOFF / (1 - keys * UNIT_ROUNDOFF)
    return 2 * layers * gamma * z


def worker_stats(worker) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    if not has_kv_transfer_group():
        return {}
    import os

    import torch
    conn = get_kv_transfer_group()
    c = conn.engine.verifier.counters
    return {"relocations": c.relocations, "verified": c.verified, "mismatches": c.mismatches,
            "bytes_hashed": c.bytes_hashed, "audited": conn.worker.audited,
            "threads": torch.get_num_threads(), "cores": len(os.sched_getaffinity(0))}


def prompts(n: int = 3):
    from vllm.inputs import TokensPrompt
    return [TokensPrompt(prompt_token_ids=[(7 * i + 3 * j) % 500 + 3 for j in range(40 + 23 * i)]) for i in range(n)]


def make_llm(vtoken: dict | None, multiprocess: bool | None = None, **overrides):
    """``multiprocess``: run the engine core in its own process (None: as the environment says). vLLM keeps
    the KV connector in a process-global, so two engines in one process must not mix vtoken and plain."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if multiprocess is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1":
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of the functions above
    from vtoken.integration.bench.vllm_engine import start_llm
    preload_processes()
    kw = dict(model=TINY, load_format="dummy", skip_tokenizer_init=True, dtype="float32", block_size=32,
              enforce_eager=True, max_model_len=2048, enable_prefix_caching=False, seed=0)
    kw.update(overrides)
    if vtoken is not None:
        kw["additional_config"] = {"vtoken": vtoken}
    llm = start_llm(**kw)
    llm.collective_rpc(reinit_weights)
    return llm


def raise_without_engine(err: BaseException):
    """Re-raise ``err`` after the engine that raised it is gone (``vllm_engine.drop_frames``: an in-process
    engine kept alive by its exception's frames is shut down later by the garbage collector, in the middle
    of the next engine's start)."""
    import gc

    from vtoken.integration.bench.vllm_engine import drop_frames
    drop_frames(err)
    gc.collect()
    raise err


def generate(vtoken: dict | None, max_tokens: int = 40, n: int = 3, multiprocess: bool | None = None):
    """(token ids, logprobs) per prompt, and the worker's verify counters."""
    from vllm import SamplingParams
    llm = make_llm(vtoken, multiprocess)
    try:
        outs = llm.generate(prompts(n), SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0,
                                                       logprobs=0))
    except Exception as e:
        del llm
        raise_without_engine(e)
    res = [(list(o.outputs[0].token_ids), [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
           for o in outs]
    stats = llm.collective_rpc(worker_stats)[0]
    if vtoken is not None and not multiprocess:  # the drill's record (scheduler side)
        s = scheduler_connector(llm).tokens.stats
        stats.update(tail_moves=s.drill_tail, moved_twice=sum(n >= 2 for n in s.drill_moved.values()),
                     drill_moves=s.drill_moves)
    del llm
    return res, stats


# ---- the live-token attention reference (in-process engine only) ------------------------------------
PROBE: dict = {}


def scheduler_connector(llm):
    """The scheduler-side ``VTokenConnector`` of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def install_attention_probe(worker) -> int:
    """Forward hooks on every attention layer that recompute, for each decode token, attention over the
    tokens the scheduler's token table says are live, from K/V the probe recorded when each token was
    computed (so the reference never reads vLLM's paged cache), in float64. A check records the largest
    error relative to the largest |V| read, and the same for attention over every token instead."""
    from functools import partial
    runner = worker.model_runner
    PROBE.update(kv={}, checks=[], blocks=[])
    n = 0
    for name, mod in runner.model.named_modules():
        if name.endswith(".attn") and hasattr(mod, "impl"):
            mod.register_forward_hook(partial(_probe, name, runner))
            n += 1
    return n


def _probe(layer, runner, mod, args, out):
    import torch
    q, k, v = args[:3]
    tokens = PROBE["tokens"]
    table = tokens.rt.table
    batch = runner.input_batch
    n = batch.num_reqs
    qsl = runner.query_start_loc.np[: n + 1].tolist()
    pos = runner.positions[: qsl[-1]].tolist()
    H, KVH, D = mod.num_heads, mod.num_kv_heads, mod.head_size
    out = out.view(-1, H, D)
    for i, rid in enumerate(batch.req_ids[:n]):
        # K/V are stored under the token's whole prefix, so a prefix-cache hit finds what another request computed
        ids = batch.token_ids_cpu[i, : pos[qsl[i + 1] - 1] + 1].tolist()
        keys, h = [], 0
        for t in ids:
            h = hash((h, t))
            keys.append(h)
        for j in range(qsl[i], qsl[i + 1]):
            PROBE["kv"][(layer, keys[pos[j]])] = (k[j].view(KVH, D).double(), v[j].view(KVH, D).double())
        store = _PrefixStore(layer, keys)
        if qsl[i + 1] - qsl[i] != 1:
            continue  # prompt steps: nothing is evicted before decoding starts
        j, p = qsl[i], pos[qsl[i]]
        live = table.live_token_ids(rid)
        assert p == table.total_len(rid) - 1, f"{rid}: position {p} is not logical ({table.total_len(rid)} tokens)"
        assert live[-1] == p, f"{rid}: the decode token {p} is not the newest live token {live[-1]}"
        qh = q[j].view(H, D).double()

        def attend(ids):
            K = torch.stack([store[t][0] for t in ids]).repeat_interleave(H // KVH, dim=1)
            V = torch.stack([store[t][1] for t in ids]).repeat_interleave(H // KVH, dim=1)
            w = torch.softmax(torch.einsum("hd,lhd->hl", qh, K) * mod.impl.scale, dim=-1)
            return torch.einsum("hl,lhd->hd", w, V)

        got = out[j].double()
        scale = max(float(store[t][1].abs().max()) for t in live)  # errors relative to the largest |V| read
        err = float((got - attend(live)).abs().max()) / scale
        err_all = float((got - attend(list(range(p + 1)))).abs().max()) / scale if len(live) < p + 1 else None
        PROBE["checks"].append((rid, layer, p, len(live), err, err_all))
        if layer.endswith("layers.0.self_attn.attn"):
            PROBE["blocks"].append((rid, len(table.block_ids(rid)), -(-len(live) // tokens.block_size)))


class _PrefixStore:
    def __init__(self, layer, keys):
        self.layer, self.keys = layer, keys

    def __getitem__(self, t):
        return PROBE["kv"][(self.layer, self.keys[t])]


def probe_results(worker) -> dict:
    return {"checks": PROBE["checks"], "blocks": PROBE["blocks"]}


def outputs_of(outs) -> list:
    """(token ids, logprobs, finish reason, prefix-cached prompt tokens) per request, in prompt order."""
    return [(list(o.outputs[0].token_ids),
             [d[t].logprob for d, t in zip(o.outputs[0].logprobs or [], o.outputs[0].token_ids)],
             o.outputs[0].finish_reason, o.num_cached_tokens) for o in outs]


def shared_prefix_prompts(n: int = 4, prefix: int = 70):
    """Prompts that share their first ``prefix`` tokens (two full 32-token blocks and part of a third)."""
    from vllm.inputs import TokensPrompt
    head = [(11 * j) % 500 + 3 for j in range(prefix)]
    return [TokensPrompt(prompt_token_ids=head + [(5 * i + 7 * j) % 500 + 3 for j in range(20 + 13 * i)])
            for i in range(n)]


def _capture(scores, method: str, names: dict) -> list:
    """Wrap ``scores.<method>`` (``_apply``, ``_apply_keys``, ``_apply_observed``) on the instance to record each call as
    (request by arrival, token ids, values); returns the list it fills."""
    taken: list = []
    apply = getattr(scores, method)
    setattr(scores, method, lambda r, ids, v: (taken.append((names[r], list(ids), list(v))), apply(r, ids, v))[1])
    return taken


def run(vtoken: dict | None, prompt_list=None, max_tokens: int = 40, passes: int = 1, probe: bool = False,
        multiprocess: bool = False, count_preemptions: bool = False, rows: bool = False, setup=None,
        keys: bool = False, observed: bool = False, **overrides) -> dict:
    """Generate ``passes`` times on one engine. In-process runs also return the scheduler's vtoken state
    after the last pass (stats, pool accounting), with ``probe`` the attention probe's records, and with
    ``rows`` every attention row the scheduler's scores recorded: (request by arrival, token ids, weights), and
    with ``keys`` every batch of key norms they recorded (Knorm under strict verify): (request, token ids, norms),
    and with ``observed`` every observation (SnapKV under strict verify): (request, token ids, votes).
    ``setup``: (function, kwargs) run in every worker before the first pass (``collective_rpc``); its answers
    are ``res["setup"]``."""
    from vllm import SamplingParams
    if probe:
        overrides.setdefault("compilation_config", {"mode": 0})  # module hooks need the eager model
    llm = make_llm(vtoken, multiprocess, **overrides)
    res: dict = {"passes": []}
    try:
        conn = None if multiprocess or vtoken is None else scheduler_connector(llm)
        if probe:
            PROBE["tokens"] = conn.tokens
            llm.collective_rpc(install_attention_probe)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0, logprobs=0)
        if setup is not None:
            res["setup"] = llm.collective_rpc(setup[0], kwargs=setup[1])
        for wanted, name, method in ((rows, "rows", "_apply"), (keys, "keys", "_apply_keys"),
                                     (observed, "observed", "_apply_observed")):
            if wanted:  # every validated row (norms, votes) the runtime records goes through the method
                res[name] = _capture(conn.tokens.rt.scores, method, conn.tokens.policy_names)
        if count_preemptions:
            res["preempted"] = preempted = []
            sched = llm.llm_engine.engine_core.engine_core.scheduler
            real = sched._preempt_request
            sched._preempt_request = lambda request, *a, **k: (preempted.append(request.request_id.split("-")[0]),
                                                               real(request, *a, **k))[1]
        for _ in range(passes):
            res["passes"].append(outputs_of(llm.generate(prompt_list or prompts(3), params)))
        res["ranks"] = llm.collective_rpc(worker_stats)  # one per worker (tensor-parallel rank)
        res["worker"] = res["ranks"][0]
        res["logit_bound"] = llm.collective_rpc(logit_bound)[0]
        if probe:
            res["probe"] = llm.collective_rpc(probe_results)[0]
        if conn is not None:
            t = conn.tokens
            t.allocator.check()
            res["scheduler"] = dict(vars(t.stats), free=t.allocator.num_free, blocks=t.allocator.num_blocks,
                                    tracked=len(t.rt.running()), workers=vars(conn.workers), runtime=type(t.rt).__name__,
                                    quarantined=list(conn.quarantined))
    except Exception as e:
        if overrides.get("tensor_parallel_size", 1) > 1:
            llm.llm_engine.engine_core.shutdown()
        del llm
        raise_without_engine(e)
    if overrides.get("tensor_parallel_size", 1) > 1:
        # NOTE: the workers are processes of their own; unless shut down now they live (each holding its KV cache)
        # until the interpreter exits, and the next engine's workers would run beside them
        llm.llm_engine.engine_core.shutdown()
    del llm
    return res


TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}


def tp2_env(monkeypatch) -> None:
    """What vLLM's CPU backend needs for two tensor-parallel workers on this 2-core machine (one core each), and
    collective_rpc of the harness's functions."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


# ---- vLLM's processes started from a preloaded forkserver (tests only) ----------------------------------
# NOTE: vLLM's CPU platform starts its engine-core and worker processes with spawn, and a spawned process spends
# ~10 s importing torch and vLLM before it does anything: two thirds of a tensor-parallel engine's life here. A
# forkserver that imported them once hands each process a copy of itself instead (~1 s). Spawn's other guarantees
# are kept: the child gets its parent's sys.path, cwd and main module (multiprocessing sends them), and ``start``
# hands over the parent's environment at that moment, which a forkserver child would not get (vLLM sets each
# rank's OpenMP binding in ``os.environ`` just before ``start``: ompmultiprocessing.configure_omp_envs). vtoken is
# not preloaded: it is imported in the child, after the environment is in place, as under spawn.
_FORKSERVER = multiprocessing.get_context("forkserver")


def _run_in_environ(environ: dict, target, kwargs: dict):
    os.environ.clear()
    os.environ.update(environ)
    return target(**kwargs)


class _ProcessInParentsEnviron(_FORKSERVER.Process):
    def start(self):
        self._kwargs = {"environ": dict(os.environ), "target": self._target, "kwargs": self._kwargs}
        self._target = _run_in_environ
        super().start()


class _PreloadedForkserver(type(_FORKSERVER)):
    Process = _ProcessInParentsEnviron


_PRELOADED = _PreloadedForkserver()
_PRELOADED.set_forkserver_preload(["torch", "vllm.v1.engine.core", "vllm.v1.executor.multiproc_executor",
                                   "vllm.v1.worker.cpu_worker"])
_STARTERS = ("vllm.v1.engine.utils", "vllm.v1.executor.multiproc_executor")  # who imports get_mp_context


def preload_processes() -> None:
    """From now on, in this process, vLLM starts its engine-core and worker processes from the preloaded
    forkserver. ``make_llm`` calls it for every engine; spawn stays covered (``spawn_processes``: one test in
    test_vllm_tp.py, and ``vtoken serve``'s own processes)."""
    import importlib
    for name in _STARTERS:
        importlib.import_module(name).get_mp_context = lambda: _PRELOADED


def spawn_processes(monkeypatch) -> None:
    """vLLM's own start method (spawn, on the CPU platform) until ``monkeypatch`` is undone."""
    import importlib

    from vllm.utils.system_utils import get_mp_context
    for name in _STARTERS:
        monkeypatch.setattr(importlib.import_module(name), "get_mp_context", get_mp_context)


def corrupt_on_rank(worker, rank: int, victim: str, plane: str = "model.layers.0.self_attn.attn.K", bit: int = 20):
    """Planted fault for one tensor-parallel rank (``collective_rpc``; the others return False unchanged): the
    first copy of request ``victim`` (its prompt index) on that rank writes one wrong bit of ``plane`` at its first
    destination slot, as part of the copy, so only that rank's shard of the relocated K/V is torn."""
    import torch
    from vllm.distributed import get_tensor_model_parallel_rank

    from vtoken.integration.device.copy_engine import TorchCopyEngine
    if get_tensor_model_parallel_rank() != rank:
        return False
    real_launch, done = TorchCopyEngine._launch, []

    def launch(self, wave, src, rows):
        first, hit = 0, None
        for c in wave.copies:
            if hit is None and not done and str(c.req_id).split("-")[0] == victim:
                hit = first
            first += len(c.moves)
        if hit is None:
            return real_launch(self, wave, src, rows)
        done.append(hit)
        cache, real_scatter, real_mover = self.cache, self.cache.scatter, self.mover

        def tear(slots):
            slot = slots[hit:hit + 1].cpu()
            v = cache.read(plane, slot)
            v.view(torch.int32)[0, 0] ^= 1 << bit
            cache.write(plane, slot, v)

        # the copy writes through torch's scatter or the compiled mover (``fast_path``): tear after either
        cache.scatter = lambda slots, values: (real_scatter(slots, values), tear(slots))
        if real_mover is not None:
            self.mover = lambda moves: (real_mover(moves), tear(wave.dst_slots))  # strict verify: the slots are there
        try:
            return real_launch(self, wave, src, rows)
        finally:
            del cache.scatter
            self.mover = real_mover

    TorchCopyEngine._launch = launch
    return True


def skip_the_all_reduce(worker) -> bool:
    """Planted fault (``collective_rpc``): this rank ranks victims from its own heads' attention only, as if the
    ranks' rows were never all-reduced (``WorkerTokens.tp_group``)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    get_kv_transfer_group().worker.tp_group = None
    return True


def run_aborting(vtoken: dict, prompt_list, abort: str, max_tokens: int = 40) -> dict:
    """Drive the engine step by step; abort request ``abort`` (its prompt index) right after a step that left
    copies planned for it, i.e. between the plan and the workers' copy. In-process only."""
    from vllm import SamplingParams
    llm = make_llm(vtoken, False)
    res: dict = {"outputs": {}}
    try:
        eng, tokens = llm.llm_engine, scheduler_connector(llm).tokens
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0, logprobs=0)
        for i, p in enumerate(prompt_list):
            eng.add_request(str(i), p, params)
        aborted_at = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    res["outputs"][o.request_id] = outputs_of([o])[0]
            planned = {str(r).split("-")[0] for _, r, _ in tokens.engine._outbox}
            if aborted_at is None and abort in planned:
                aborted_at = tokens.stats.steps
                eng.abort_request([abort])
        res["aborted_at"] = aborted_at
        tokens.allocator.check()
        res["scheduler"] = dict(vars(tokens.stats), free=tokens.allocator.num_free, blocks=tokens.allocator.num_blocks,
                                tracked=len(tokens.rt.running()))
        res["worker"] = llm.collective_rpc(worker_stats)[0]
    except Exception as e:
        del llm
        raise_without_engine(e)
    del llm
    return res


def is_evicting(res: dict) -> bool:
    """Every decode check of the probe attended to fewer tokens than the request had."""
    return all(c[5] is not None for c in res["probe"]["checks"])


def capacity(vtoken: dict | None, num_blocks: int, prompt_len: int = 32, max_tokens: int = 224,
             limit: int = 16, expected: int | None = None, **overrides) -> tuple[int, dict]:
    """The largest number of concurrent requests (``max_num_seqs``) that a pool of ``num_blocks`` blocks runs
    to the end without a single preemption, and the runs' preemption counts; ``overrides`` go to the engine
    (e.g. ``enable_prefix_caching=True``).

    Both searches rest on one assumption, that running without a preemption is monotone in the concurrency.
    With ``expected`` (a test's measured value) two runs decide it: c = ``expected`` runs clean and c + 1
    preempts, so the capacity is ``expected``. Otherwise, or when either run disagrees, bisection over
    [1, limit] finds the real value (reusing the runs made), so a changed capacity is reported as the number it
    is, never as a failed guess."""
    from vllm.inputs import TokensPrompt
    seen: dict[int, int] = {}

    def ok(c: int) -> bool:
        if c not in seen:
            ps = [TokensPrompt(prompt_token_ids=[(13 * i + 7 * j) % 500 + 3 for j in range(prompt_len)])
                  for i in range(c)]
            res = run(vtoken, ps, max_tokens=max_tokens, max_model_len=prompt_len + max_tokens, max_num_seqs=c,
                      num_gpu_blocks_override=num_blocks, count_preemptions=True, **overrides)
            seen[c] = len(res["preempted"])
        return not seen[c]

    if expected is not None and 1 <= expected < limit and ok(expected) and not ok(expected + 1):
        return expected, seen
    lo, hi = 0, limit + 1  # ok(lo) holds (vacuously for 0); ok(hi) is assumed false
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo, seen


def staggered(vtoken: dict, n: int = 4, every: int = 10, prefix: int = 256, suffix: int = 8, max_tokens: int = 40,
              num_blocks: int = 96, before_start=None, shared: bool = True) -> dict:
    """Requests sharing a ``prefix``-token prompt head (each with its own ``suffix``; ``shared=False``: prompts of
    the same length that share nothing), one added every ``every`` engine steps, prefix caching on; in-process. Returns the blocks held after each step (referenced, the null
    block not counted), their sum (block-steps) and peak, each request's prefix-cached prompt tokens and token ids,
    and vtoken's scheduler stats. ``before_start(tokens)`` may patch the scheduler side first."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    llm = make_llm(vtoken, False, enable_prefix_caching=True, num_gpu_blocks_override=num_blocks,
                   max_model_len=max(512, prefix + suffix + max_tokens))
    res: dict = {"held": [], "outputs": {}}
    try:
        eng, tokens = llm.llm_engine, scheduler_connector(llm).tokens
        if before_start is not None:
            before_start(tokens)
        head = [(11 * j) % 500 + 3 for j in range(prefix)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0, logprobs=0)
        added = step = 0
        while added < n or eng.has_unfinished_requests():
            if added < n and step >= added * every:
                prompt = head + [(5 * added + 7 * j) % 500 + 3 for j in range(suffix)] if shared else \
                    [(13 * added + 17 * j + 1) % 500 + 3 for j in range(prefix + suffix)]
                eng.add_request(str(added), TokensPrompt(prompt_token_ids=prompt), params)
                added += 1
            for o in eng.step():
                if o.finished:
                    res["outputs"][o.request_id] = (list(o.outputs[0].token_ids), o.num_cached_tokens)
            res["held"].append(tokens.allocator.num_allocated)
            step += 1
        tokens.allocator.check()
        res["scheduler"] = dict(vars(tokens.stats), free=tokens.allocator.num_free, blocks=tokens.allocator.num_blocks)
        del eng, tokens
    except Exception as e:
        del llm
        raise_without_engine(e)
    llm.llm_engine.engine_core.shutdown()
    del llm
    res["block_steps"], res["peak"] = sum(res["held"]), max(res["held"])
    return res
