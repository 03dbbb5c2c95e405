"""Real vLLM (CPU build) for ``vtoken bench vllm``: the byte-level model, held-out prompts, engines.

``run_engine``: an in-process engine with vtoken on (vLLM's KV connector is process-global, so one process never
mixes plain vLLM with vtoken), created and dropped one at a time. ``EngineProcess``: such an engine in a process
of its own, so plain vLLM and vtoken engines can live together (Q4). ``one_core`` pins the timing questions.
Prompts are seeded windows of the model's held-out stdlib stream (``train_byte_llama.load_stream("val")``): the
first ``prompt_len`` bytes the prompt, the next ``max_tokens`` the true continuation.
"""

from __future__ import annotations

import gc
import importlib.util
import multiprocessing
import os
import time
import traceback
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from vtoken.core.errors import ConfigError

MODELS = Path(__file__).resolve().parents[1] / "vllm" / "models"
MODEL_DIR = MODELS / "byte-llama"


def _train_module():
    """``integration/vllm/models/train_byte_llama.py`` (a script, not a package module): imported by path."""
    path = MODELS / "train_byte_llama.py"
    if not path.is_file() or not (MODEL_DIR / "model.safetensors").is_file():
        raise ConfigError(f"vtoken bench vllm needs the byte-llama checkpoint and its training script in {MODELS}")
    spec = importlib.util.spec_from_file_location("vtoken_bench_train_byte_llama", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@lru_cache(maxsize=1)
def _heldout_stream():
    return _train_module().load_stream("val")


def heldout_windows(n: int, prompt_len: int, max_tokens: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """``n`` (prompt, true continuation) pairs of held-out stdlib bytes, seeded by ``seed``."""
    import torch
    t = _train_module()
    w = t.sample_windows(_heldout_stream(), n, prompt_len + max_tokens, torch.Generator().manual_seed(seed))
    return [(row[:prompt_len], row[prompt_len:]) for row in w.tolist()]


@contextmanager
def engine_environment(threads: int):
    """While engines run: the engine core in this process, a small KV cache space (unless set), ``threads``
    torch threads (the CPU worker replaces ``torch.set_num_threads`` with a no-op once an engine has
    started, so the setter underneath is used). Restored afterwards, so a test session's later engines
    see the environment they expect."""
    import torch
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}
    saved_threads = torch.get_num_threads()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch._C.set_num_threads(threads)
    try:
        yield
    finally:
        torch._C.set_num_threads(saved_threads)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def one_core(enabled: bool = True):
    """Pin this thread and what it starts meanwhile to the highest core of its affinity (on a shared 2-core box a
    parallel op whose second thread is descheduled waits a time slice, swamping per-step timings). Yields
    {"core", "affinity_before"}, or None when not pinning; restored after."""
    if not enabled or not hasattr(os, "sched_setaffinity"):
        yield None
        return
    before = os.sched_getaffinity(0)
    core = max(before)
    os.sched_setaffinity(0, {core})
    try:
        yield {"core": core, "affinity_before": sorted(before)}
    finally:
        os.sched_setaffinity(0, before)


def engine_args(vtoken: dict | None, longest: int, most: int, block_size: int, prefix_caching: bool = False) -> dict:
    """``LLM`` keyword arguments for the byte-llama: ``most`` requests of up to ``longest`` tokens all at full
    length at once (no preemption), fp32, eager, prefix caching off unless ``prefix_caching``. ``vtoken`` None:
    plain vLLM."""
    blocks = most * -(-longest // block_size) + most + 8
    kw = {"model": str(MODEL_DIR), "skip_tokenizer_init": True, "dtype": "float32", "block_size": block_size,
          "enforce_eager": True, "compilation_config": {"mode": 0},
          "max_model_len": -(-longest // block_size) * block_size, "enable_prefix_caching": prefix_caching, "seed": 0,
          "num_gpu_blocks_override": blocks, "max_num_seqs": max(most, 1)}
    if vtoken is not None:
        kw["additional_config"] = {"vtoken": vtoken}
    return kw


ATTENTION_SECONDS = [0.0]  # in the worker's process: time inside attention impls, once ``time_attention`` ran


def worker_counters(worker) -> dict:
    """(``collective_rpc``) The worker's vtoken counters: strict verify's relocations (copies) seen, verified,
    mismatched; seconds spent in vtoken; seconds inside attention (when timed). Empty for plain vLLM."""
    from vllm.distributed.kv_transfer import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )
    if not has_kv_transfer_group():
        return {}
    conn = get_kv_transfer_group()
    c = conn.engine.verifier.counters
    return {"relocations": c.relocations, "verified": c.verified, "mismatches": c.mismatches,
            "bytes_hashed": c.bytes_hashed, "worker_seconds": conn.worker.seconds,
            "attention_seconds": ATTENTION_SECONDS[0]}


def worker_threads(worker) -> dict:
    """(``collective_rpc``) torch threads and cores in the worker's affinity mask (the pinning, as it landed)."""
    import torch
    return {"torch_threads": torch.get_num_threads(), "cores": sorted(os.sched_getaffinity(0))}


def time_attention(worker) -> int:
    """(``collective_rpc``) Wrap every attention impl's forward with a timer adding to ``ATTENTION_SECONDS``;
    returns how many impls are timed."""
    ATTENTION_SECONDS[0] = 0.0
    n = 0
    for _, mod in worker.model_runner.model.named_modules():
        impl = getattr(mod, "impl", None)
        if impl is None or not hasattr(impl, "forward"):
            continue
        n += 1
        if getattr(impl, "_vtoken_timed", False):
            continue
        real = impl.forward

        def forward(*a, _real=real, **k):
            t0 = time.perf_counter()
            try:
                return _real(*a, **k)
            finally:
                ATTENTION_SECONDS[0] += time.perf_counter() - t0
        impl.forward, impl._vtoken_timed = forward, True
    return n


def _counters(llm) -> dict:
    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
    s, w = conn.tokens.stats, conn.workers
    out = {"tokens_evicted": s.evicted, "plans_committed": s.plans_committed, "plans_aborted": s.plans_aborted,
           "tokens_moved": s.moves, "copies_done": s.copies_done, "copies_failed": s.copies_failed,
           "blocks_released": s.blocks_released, "attention_rows": s.attention_rows,
           "write_slots_audited": w.audited, "quarantined": w.quarantined,
           "vtoken_steps": s.steps, "scheduler_seconds": s.seconds}
    out.update(llm.collective_rpc(worker_counters)[0])
    return out


def run_engine(vtoken: dict, prompt_sets: list[list[list[int]]], max_tokens: int, block_size: int,
               threads: int = 1, on_done=None, warmup_tokens: int = 0, timed_attention: bool = False,
               prefix_caching: bool | None = None, counters=None) -> dict:
    """One in-process engine with ``additional_config={"vtoken": vtoken}``, one ``generate`` per prompt set:
    {"start_s", "threads", "sets": [{"outputs": [(ids, logprobs, finish reason)], "counters" (this set's deltas,
    with ``counters(llm)``'s), "wall_s"}]}. ``warmup_tokens``: first an untimed ``generate`` of the first set;
    ``timed_attention``: time the attention impls; ``prefix_caching`` not None: vLLM's prefix cache on or off, and
    each set's "cached_tokens" per request. ``on_done(i)`` after each set."""
    with engine_environment(threads):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        longest = max(len(p) for ps in prompt_sets for p in ps) + max_tokens
        most = max(len(ps) for ps in prompt_sets)
        started = time.monotonic()
        llm = start_llm(**engine_args(vtoken, longest, most, block_size, bool(prefix_caching)))
        res: dict = {"start_s": time.monotonic() - started, "sets": []}
        try:
            res["threads"] = llm.collective_rpc(worker_threads)[0]
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, detokenize=False)
            if warmup_tokens:
                params.max_tokens = warmup_tokens
                llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_sets[0]], params, use_tqdm=False)
                params.max_tokens = max_tokens
            if timed_attention:
                llm.collective_rpc(time_attention)
            before = _counters(llm) if counters is None else {**_counters(llm), **counters(llm)}
            for i, ps in enumerate(prompt_sets):
                t0 = time.monotonic()
                outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params, use_tqdm=False)
                wall = time.monotonic() - t0
                outputs = []
                for o in outs:
                    c = o.outputs[0]
                    ids = list(c.token_ids)
                    outputs.append((ids, [d[t].logprob for d, t in zip(c.logprobs or [], ids)], c.finish_reason))
                after = _counters(llm) if counters is None else {**_counters(llm), **counters(llm)}
                res["sets"].append({"outputs": outputs, "wall_s": wall,
                                    "counters": {k: after[k] - before.get(k, 0) for k in after}})
                if prefix_caching is not None:
                    res["sets"][-1]["cached_tokens"] = [o.num_cached_tokens or 0 for o in outs]
                before = after
                if on_done is not None:
                    on_done(i)
            llm.llm_engine.engine_core.engine_core.scheduler.connector.tokens.allocator.check()  # P1 after the run
        except Exception as e:
            del llm
            drop_frames(e)
            gc.collect()
            raise
        del llm  # vLLM's shutdown collects garbage itself
        return res


# ---- an engine in a process of its own ------------------------------------------------------------
def run_steps(llm, prompts: list[list[int]], params, tag: str) -> tuple[float, list[float]]:
    """Run the prompts through the engine step by step: wall seconds, and the gaps (seconds) between
    consecutive steps that returned output once every request has its first token (decode steps)."""
    from vllm.inputs import TokensPrompt
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=p), params)
    t0 = last = time.perf_counter()
    gaps: list[float] = []
    started: set[str] = set()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        if outs:
            if len(started) == len(prompts):
                gaps.append(now - last)
            started.update(o.request_id for o in outs)
            last = now
    return time.perf_counter() - t0, gaps


def _serve_engine(conn, env: dict, cores: list[int], threads: int, kwargs: dict) -> None:
    """An ``EngineProcess``'s body: pin to ``cores``, start one in-process engine, answer ``conn``'s requests
    ("steps", prompts, max_tokens, tag) -> (wall, gaps); ("counters",) -> dict; ("close",)."""
    os.environ.update(env)
    os.sched_setaffinity(0, cores)
    llm = None
    try:
        with engine_environment(threads):
            from vllm import LLM, SamplingParams
            t0 = time.monotonic()
            llm = LLM(**kwargs)
            conn.send(("ok", {"start_s": time.monotonic() - t0, **llm.collective_rpc(worker_threads)[0]}))
            vtoken = "additional_config" in kwargs
            while True:
                op, *args = conn.recv()
                if op == "close":
                    break
                if op == "steps":
                    prompts, max_tokens, tag = args
                    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
                    conn.send(("ok", run_steps(llm, prompts, params, tag)))
                elif op == "counters":
                    conn.send(("ok", _counters(llm) if vtoken else {}))
                else:
                    raise ValueError(f"engine process: unknown request {op!r}")
            if vtoken:
                llm.llm_engine.engine_core.engine_core.scheduler.connector.tokens.allocator.check()
            conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with this traceback
        conn.send(("error", traceback.format_exc()))
    finally:
        del llm
        gc.collect()
        conn.close()


class EngineProcess:
    """An in-process engine (``engine_args``) in a process of its own, driven over a pipe, so plain vLLM and vtoken
    engines can be alive together. Forked from a ``forkserver`` that imported vLLM once, pinned to ``cores``
    (default: this thread's affinity). ``info``: start_s, torch_threads, cores (as the worker saw them)."""

    TIMEOUT_S = 600.0

    def __init__(self, vtoken: dict | None, longest: int, most: int, block_size: int, threads: int = 1,
                 cores: list[int] | None = None) -> None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__, "torch", "vllm.entrypoints.llm"])
        self.conn, child = ctx.Pipe()
        cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
        self.proc = ctx.Process(target=_serve_engine, args=(child, dict(os.environ), cores, threads,
                                                            engine_args(vtoken, longest, most, block_size)))
        self.proc.start()
        child.close()
        self.info = self._answer()

    def _answer(self):
        if not self.conn.poll(self.TIMEOUT_S):
            raise TimeoutError(f"engine process {self.proc.pid}: no answer in {self.TIMEOUT_S:.0f} s")
        kind, value = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"engine process {self.proc.pid} failed:\n{value}")
        return value

    def run_steps(self, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[float, list[float]]:
        """``run_steps`` in the engine's process: wall seconds and decode-step gaps."""
        self.conn.send(("steps", prompts, max_tokens, tag))
        return self._answer()

    def counters(self) -> dict:
        """vtoken's counters in the engine's process (``_counters``; empty for plain vLLM)."""
        self.conn.send(("counters",))
        return self._answer()

    def close(self) -> None:
        """Stop the engine (its token pool is checked, P1) and its process."""
        close_all([self])


def close_all(engines: list[EngineProcess]) -> None:
    """Close ``engines`` together (their shutdowns overlap); the first failure is raised after all are gone."""
    errors = []
    asked = []
    for e in engines:
        try:
            if e.proc.is_alive():
                e.conn.send(("close",))
                asked.append(e)
        except OSError as err:  # the process died: nothing to ask
            errors.append(err)
    for e in engines:
        try:
            if e in asked:
                e._answer()
        except (RuntimeError, TimeoutError, EOFError) as err:
            errors.append(err)
        finally:
            e.proc.join(30)
            if e.proc.is_alive():
                e.proc.terminate()
                e.proc.join()
            e.conn.close()
    if errors:
        raise errors[0]


def start_llm(**kwargs):
    """``vllm.LLM(**kwargs)``, in this process, after collecting the engines nobody holds any more.

    NOTE: vLLM keeps a process's first KV connector agent (``ensure_kv_transfer_initialized`` returns early while
    one exists), and an engine's agent goes only when the engine shuts down, which for an unreferenced in-process
    engine is when the collector reaches it. A new engine that finds an old agent is refused by vtoken's worker
    (``connector.bind_model_runner``): collect first, and shut down engines still held
    (``llm.llm_engine.engine_core.shutdown()``). The heap is unfrozen first: objects a caller froze
    (``gc.freeze``, as vLLM does while an engine runs) are invisible to the collector, an old engine among them."""
    from vllm import LLM
    gc.unfreeze()
    gc.collect()
    return LLM(**kwargs)


def drop_frames(err: BaseException) -> None:
    """Keep the message and a short traceback, drop the frames: they hold the engine, which must be shut down
    now and not by a later garbage collection in the middle of the next episode's engine start."""
    import traceback
    err.add_note("".join(traceback.format_exception(err)[-10:]))
    e = err
    while e is not None:
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
