"""One episode of ``vtoken fuzz --target vllm``: a random request mix through real vLLM (in-process engine).

An episode is a pure function of its seed: the vtoken settings (policy, budget, relocation drill), the
engine (prefix caching, pool size) and a script of requests (prompt lengths, shared prefixes, output
lengths, arrival steps, aborts). Oracles, every step: strict verify on every copy (raise), the worker's
audit of every write slot against the scheduler's token tables, and ``SchedulerTokens.check`` (vLLM's
block lists equal the tables', the dense prefix I7, vLLM's pool P1). At the end: every block is back in
the pool and no token table is left.
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

MODEL = str(Path(__file__).parent / "models" / "tiny-llama")


@dataclass
class Episode:
    seed: int
    vtoken: dict
    prefix_caching: bool
    num_blocks: int | None  # None: as many as 1 GiB holds
    requests: list[dict] = field(default_factory=list)  # id, prompt, max_tokens, arrive (step), abort (step|None)

    @classmethod
    def draw(cls, seed: int, max_requests: int = 10) -> Episode:
        rng = random.Random(seed)
        policy = rng.choice(["none", "streaming_llm", "random"])
        budget = rng.choice([0.3, 0.5, 0.75, 0.9, rng.randint(8, 96)])
        vt = {"policy": policy, "budget": budget, "strict_verify": "strict", "seed": rng.randint(0, 99),
              "drill_every": rng.choice([0, 0, 1, 2, 3])}
        prefixes = [[rng.randint(3, 500) for _ in range(rng.randint(1, 100))] for _ in range(2)]
        reqs = []
        for i in range(rng.randint(1, max_requests)):
            head = rng.choice(prefixes) if rng.random() < 0.5 else []
            prompt = head + [rng.randint(3, 500) for _ in range(rng.randint(1, 80))]
            arrive = rng.randint(0, 30)
            abort = arrive + rng.randint(0, 40) if rng.random() < 0.2 else None
            reqs.append({"id": str(i), "prompt": prompt, "max_tokens": rng.randint(1, 60), "arrive": arrive,
                         "abort": abort})
        num_blocks = rng.choice([None, None, rng.randint(9, 24)])  # >= 9: one 256-token request must fit
        prefix_caching = rng.random() < 0.5
        vt["read_path"] = rng.choice(["dense", "gather"])  # drawn last: earlier seeds keep their episodes
        vt["reclaim"] = "densify" if vt["read_path"] == "dense" else rng.choice(["compact", "off", "densify"])
        vt["theta_f"] = rng.choice([0.0, 0.1, 0.3, 0.6])
        vt["headroom"] = rng.choice([0, 1, 2]) if vt["reclaim"] == "compact" else 0
        if vt["policy"] != "none" and rng.random() < 0.5:
            vt["policy"] = rng.choice(["h2o", "scissorhands"])  # scores: the gather backend or the score pass
            vt["score_layers"] = rng.choice([0, 1, 2])
        return cls(seed, vt, prefix_caching, num_blocks, reqs)

    def describe(self) -> dict:
        return asdict(self)


@dataclass
class EpisodeResult:
    steps: int = 0
    finished: int = 0
    aborted: int = 0
    stats: dict = field(default_factory=dict)
    worker: dict = field(default_factory=dict)


def run_episode(ep: Episode) -> EpisodeResult:
    """Raises on any oracle failure; the engine is gone when this returns or raises."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the oracles read the scheduler's state directly
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=MODEL, load_format="dummy", skip_tokenizer_init=True, dtype="float32", block_size=32,
              enforce_eager=True, max_model_len=256 if ep.num_blocks else 2048, seed=0,
              enable_prefix_caching=ep.prefix_caching, additional_config={"vtoken": ep.vtoken})
    if ep.num_blocks:
        kw["num_gpu_blocks_override"] = ep.num_blocks
    llm = LLM(**kw)
    try:
        return _drive(llm, ep, SamplingParams, TokensPrompt)
    except BaseException as e:
        del llm
        drop_frames(e)
        raise
    finally:
        import gc
        gc.collect()


def _drive(llm, ep: Episode, SamplingParams, TokensPrompt) -> EpisodeResult:
    eng = llm.llm_engine
    conn = eng.engine_core.engine_core.scheduler.connector
    res = EpisodeResult()
    pending = sorted(ep.requests, key=lambda r: (r["arrive"], int(r["id"])))
    live: dict[str, dict] = {}
    step = 0
    limit = 2000
    while pending or eng.has_unfinished_requests():
        while pending and pending[0]["arrive"] <= step:
            r = pending.pop(0)
            max_tokens = min(r["max_tokens"], (256 if ep.num_blocks else 2048) - len(r["prompt"]))
            eng.add_request(r["id"], TokensPrompt(prompt_token_ids=r["prompt"]),
                            SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))
            live[r["id"]] = r
        for rid, r in list(live.items()):
            if r["abort"] is not None and r["abort"] <= step:
                eng.abort_request([rid])
                del live[rid]
                res.aborted += 1
        for out in eng.step():
            if out.finished and out.request_id in live:
                del live[out.request_id]
                res.finished += 1
        conn.tokens.check()  # the connector checks the bridge every step under strict; the fuzzer the pool too
        step += 1
        assert step < limit, f"episode {ep.seed}: not finished after {limit} steps"
    res.steps = step
    tokens = conn.tokens
    tokens.check()
    assert tokens.allocator.num_free == tokens.allocator.num_blocks - 1, \
        f"leak: {tokens.allocator.num_blocks - 1 - tokens.allocator.num_free} blocks still held after every request left"
    assert not tokens.rt.table.request_ids(), f"token tables left behind: {tokens.rt.table.request_ids()}"
    res.stats = dict(vars(tokens.stats))
    res.worker = dict(vars(conn.workers))
    return res


def drop_frames(err: BaseException) -> None:
    """Keep the message and a short traceback, drop the frames: they hold the engine, which must be shut down
    now and not by a later garbage collection in the middle of the next episode's engine start."""
    import traceback
    err.add_note("".join(traceback.format_exception(err)[-10:]))
    e = err
    while e is not None:
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
