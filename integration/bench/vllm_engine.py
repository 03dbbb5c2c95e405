"""Real vLLM (CPU build) for ``vtoken bench vllm``: the trained byte-level model, held-out prompts, and one
engine's generations with vtoken's counters.

Every engine runs in this process with vtoken on (the full cache is ``policy: none``): vLLM keeps the KV
connector in a process-global, so one process must not mix plain vLLM with vtoken, and in-process
engines let the bench read the scheduler's token statistics directly. Engines are created and dropped
one at a time (``del``; vLLM's shutdown collects garbage) and never kept alive by an exception's frames.

Model: ``integration/vllm/models/byte-llama`` (vocab = the 256 byte values, bos 2, eos 3), trained on
the Python standard library's sources; its training script holds out every 20th file, and the prompts
are windows of that held-out stream (``train_byte_llama.load_stream("val")``), drawn with a seeded
generator: the first ``prompt_len`` bytes are the prompt, the next ``max_tokens`` the true continuation.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import time
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


def worker_verify_counters(worker) -> dict:
    """The worker's strict-verify counters (``collective_rpc``): relocations (copies) seen, verified, mismatched."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    if not has_kv_transfer_group():
        return {}
    c = get_kv_transfer_group().engine.verifier.counters
    return {"relocations": c.relocations, "verified": c.verified, "mismatches": c.mismatches,
            "bytes_hashed": c.bytes_hashed}


def _counters(llm) -> dict:
    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
    s, w = conn.tokens.stats, conn.workers
    out = {"tokens_evicted": s.evicted, "plans_committed": s.plans_committed, "plans_aborted": s.plans_aborted,
           "tokens_moved": s.moves, "copies_done": s.copies_done, "copies_failed": s.copies_failed,
           "blocks_released": s.blocks_released, "attention_rows": s.attention_rows,
           "write_slots_audited": w.audited, "quarantined": w.quarantined}
    out.update(llm.collective_rpc(worker_verify_counters)[0])
    return out


def run_engine(vtoken: dict, prompt_sets: list[list[list[int]]], max_tokens: int, block_size: int,
               threads: int = 1, on_done=None) -> dict:
    """One in-process engine with ``additional_config={"vtoken": vtoken}``; one ``generate`` per prompt set.
    Returns {"start_s", "sets": [{"outputs": [(token ids, logprobs, finish reason)], "counters", "wall_s"}]};
    counters are this set's deltas. ``on_done(i)`` after each set (progress)."""
    with engine_environment(threads):
        return _run_engine(vtoken, prompt_sets, max_tokens, block_size, on_done)


def _run_engine(vtoken: dict, prompt_sets: list[list[list[int]]], max_tokens: int, block_size: int, on_done) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vtoken.integration.vllm.fuzz_episode import drop_frames

    longest = max(len(p) for ps in prompt_sets for p in ps) + max_tokens
    most = max(len(ps) for ps in prompt_sets)
    blocks = most * -(-longest // block_size) + most + 8  # every request at full length at once: no preemption
    started = time.monotonic()
    llm = LLM(model=str(MODEL_DIR), skip_tokenizer_init=True, dtype="float32", block_size=block_size,
              enforce_eager=True, compilation_config={"mode": 0}, max_model_len=-(-longest // block_size) * block_size,
              enable_prefix_caching=False, seed=0, num_gpu_blocks_override=blocks, max_num_seqs=max(most, 1),
              additional_config={"vtoken": vtoken})
    res: dict = {"start_s": time.monotonic() - started, "sets": []}
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, detokenize=False)
        before = _counters(llm)
        for i, ps in enumerate(prompt_sets):
            t0 = time.monotonic()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params, use_tqdm=False)
            wall = time.monotonic() - t0
            outputs = []
            for o in outs:
                c = o.outputs[0]
                ids = list(c.token_ids)
                outputs.append((ids, [d[t].logprob for d, t in zip(c.logprobs or [], ids)], c.finish_reason))
            after = _counters(llm)
            res["sets"].append({"outputs": outputs, "wall_s": wall,
                                "counters": {k: after[k] - before.get(k, 0) for k in after}})
            before = after
            if on_done is not None:
                on_done(i)
        llm.llm_engine.engine_core.engine_core.scheduler.connector.tokens.allocator.check()  # P1 after the run
    except Exception as e:
        del llm
        drop_frames(e)
        gc.collect()
        raise e
    del llm  # vLLM's shutdown collects garbage itself
    return res
