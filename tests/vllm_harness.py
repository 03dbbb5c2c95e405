"""Real vLLM (CPU build) on the shipped tiny Llama, for the end-to-end tests.

``load_format="dummy"`` initialises weights so that this model ignores its KV cache: zeroing the
whole cache mid-run leaves every logprob unchanged, which would make "bit-identical" vacuous. So
``generate`` re-initialises every weight from a seeded normal distribution first (norms 1,
embeddings N(0, 1), matrices N(0, 1/fan_in)); then a wrong K/V anywhere changes the logprobs
(``test_vllm_e2e.py`` shows it with planted bugs).
"""

from __future__ import annotations

import os
from pathlib import Path

from vtoken.integration.vllm import compat

TINY = str(Path(compat.__file__).parent / "models" / "tiny-llama")


def reinit_weights(worker, seed: int = 1234) -> str:
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(worker.model_runner.model.named_parameters()):
            if p.numel() == 0 or p.dim() == 0 or not p.dtype.is_floating_point:
                continue
            if "norm" in name:
                p.fill_(1.0)
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return "ok"


def worker_stats(worker) -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    if not has_kv_transfer_group():
        return {}
    import os

    import torch
    conn = get_kv_transfer_group()
    c = conn.engine.verifier.counters
    return {"relocations": c.relocations, "verified": c.verified, "mismatches": c.mismatches,
            "bytes_hashed": c.bytes_hashed, "tail_moves": conn.tail_moves,
            "moved_twice": sum(n >= 2 for n in conn.moved.values()),
            "threads": torch.get_num_threads(), "cores": len(os.sched_getaffinity(0))}


def prompts(n: int = 3):
    from vllm.inputs import TokensPrompt
    return [TokensPrompt(prompt_token_ids=[(7 * i + 3 * j) % 500 + 3 for j in range(40 + 23 * i)]) for i in range(n)]


def make_llm(vtoken: dict | None, multiprocess: bool | None = None):
    """``multiprocess``: run the engine core in its own process (None: as the environment says). vLLM keeps
    the KV connector in a process-global, so two engines in one process must not mix vtoken and plain."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if multiprocess is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1":
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of the functions above
    from vllm import LLM
    kw = dict(model=TINY, load_format="dummy", skip_tokenizer_init=True, dtype="float32", block_size=32,
              enforce_eager=True, max_model_len=2048, enable_prefix_caching=False, seed=0)
    if vtoken is not None:
        kw["additional_config"] = {"vtoken": vtoken}
    llm = LLM(**kw)
    llm.collective_rpc(reinit_weights)
    return llm


def generate(vtoken: dict | None, max_tokens: int = 40, n: int = 3, multiprocess: bool | None = None):
    """(token ids, logprobs) per prompt, and the worker's verify counters."""
    from vllm import SamplingParams
    llm = make_llm(vtoken, multiprocess)
    outs = llm.generate(prompts(n), SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0, logprobs=0))
    res = [(list(o.outputs[0].token_ids), [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
           for o in outs]
    stats = llm.collective_rpc(worker_stats)[0]
    del llm
    return res, stats
