"""Issue #15, bug 1: densify must not leave a prefix-cache hash on a block it will overwrite (real vLLM).

The mechanism (dense path, ``reclaim: densify``, vLLM's prefix caching on): vLLM hashes a block when it fills,
as if it held logical tokens [i*S, (i+1)*S) for good. Densify then sets the request's append cursor to its live
count, usually inside such a block; the next decode tokens overwrite its tail. Before the fix only blocks that
received a moved token lost their hash, so the cursor's block went back to vLLM's free queue still hashed, and a
later request whose prompt matched the chain attended to another request's overwritten K/V.

The schedule, on the trained byte-level model (its outputs depend on its KV), 32-token blocks:
  step 1   A = T[:120] (3 full blocks, hashed) and Z = T[:120] + one byte, which skips reading the cache and
           so computes and hashes a second copy of the chain; Z stops after one token, before any eviction.
  decode   A evicts to 75 % (StreamingLLM: the oldest tokens after the sinks), densify moves its tail into the
           holes of blocks 0 and 1 (their hashes go) and rewinds the cursor to position 90, inside block 2.
  later    B = T[:110]: its first 96 tokens hit blocks 0 and 1 from Z's copy and block 2 from A's (the first
           copy hashed), unless A's block 2 lost its hash.
B must produce the same tokens and logprobs with prefix caching on as with it off.
"""

import os

import pytest

pytest.importorskip("vllm")

from vtoken.core.errors import InvariantViolation  # noqa: E402
from vtoken.integration.vllm import manager_hooks  # noqa: E402
from vtoken.integration.vllm.scheduler_tokens import SchedulerTokens  # noqa: E402

from vllm_harness import raise_without_engine, scheduler_connector  # noqa: E402

MODEL = os.path.join(os.path.dirname(manager_hooks.__file__), "models", "byte-llama")
TEXT = (b"    def parse_known_args(self, args=None, namespace=None):\n        if args is None:\n"
        b"            # args default to the system args\n            args = _sys.argv[1:]\n        else:\n"
        b"            # make sure that args are mutable\n            args = list(args)\n")
T = list(TEXT)
BLOCK = 32


def _run(caching: bool, vtoken: dict) -> dict:
    """A and Z together, then B; (token ids, logprobs, prefix-cached prompt tokens) of each, and vtoken's stats."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: planted bugs patch the scheduler's classes
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=MODEL, skip_tokenizer_init=True, dtype="float32", block_size=BLOCK, enforce_eager=True,
              compilation_config={"mode": 0}, max_model_len=512, enable_prefix_caching=caching, seed=0,
              num_gpu_blocks_override=64, additional_config={"vtoken": vtoken})
    try:
        decode = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0, logprobs=0)
        once = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0, logprobs=0,
                              skip_reading_prefix_cache=True)
        first = llm.generate([TokensPrompt(prompt_token_ids=T[:120]), TokensPrompt(prompt_token_ids=T[:121])],
                             [decode, once])
        [later] = llm.generate([TokensPrompt(prompt_token_ids=T[:110])], decode)
        out = {name: (list(o.outputs[0].token_ids),
                      [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                      o.num_cached_tokens)
               for name, o in zip("AZB", [*first, later])}
        tokens = scheduler_connector(llm).tokens
        tokens.check()
        out["stats"] = dict(vars(tokens.stats), free=tokens.allocator.num_free, blocks=tokens.allocator.num_blocks)
    except Exception as e:
        del llm
        raise_without_engine(e)
    del llm
    return out


def _only_destinations_lose_their_hash(self, r, plan):
    """The code before the fix: a commit drops the hashes of the blocks that received a moved token, no more."""
    return manager_hooks.uncache(self.allocator.pool, {m.dst_block for m in plan.moves})


CONFIG = {"policy": "streaming_llm", "budget": 0.75, "reclaim": "densify"}


@pytest.fixture(scope="module")
def caching_off():
    return _run(False, CONFIG)


def test_a_later_request_never_hits_a_block_densify_rewinds_into(caching_off):
    on = _run(True, {**CONFIG, "strict_verify": "strict"})
    assert on["B"][2] == 96 and caching_off["B"][2] == 0  # B's first three blocks came from the cache
    assert on["B"][:2] == caching_off["B"][:2]  # ids and logprobs: bit-identical
    assert on["A"][:2] == caching_off["A"][:2]
    s = on["stats"]
    assert s["evicted"] > 0 and s["uncached"] >= 3  # A's blocks 0 and 1 (destinations) and 2 (the cursor's)
    assert s["free"] == s["blocks"] - 1


def test_the_cursor_block_keeping_its_hash_serves_another_requests_kv(caching_off, monkeypatch):
    """Planted bug (the code before the fix), strict verify off: B hits A's rewritten block. Its very first
    generated token's logprob moves (measured 0.13), and its text diverges within a few tokens."""
    monkeypatch.setattr(SchedulerTokens, "_drop_stale_hashes", _only_destinations_lose_their_hash)
    on = _run(True, CONFIG)
    assert on["B"][2] == 96
    assert abs(on["B"][1][0] - caching_off["B"][1][0]) > 0.05
    assert on["B"][0] != caching_off["B"][0]


def test_strict_verify_names_the_stale_hash(monkeypatch):
    """The same planted bug under strict verify: B2 fails the step that leaves the hashed block at A's cursor."""
    monkeypatch.setattr(SchedulerTokens, "_drop_stale_hashes", _only_destinations_lose_their_hash)
    with pytest.raises(InvariantViolation, match=r"B2: request '0.*': block \d+ at or after its append cursor "
                                                 r"\(position 90\) is prefix-cached"):
        _run(True, {**CONFIG, "strict_verify": "strict"})


# ---- the gather path (found by tests/test_vllm_serve.py, #17) --------------------------------------------
COMPACT = {"policy": "streaming_llm", "budget": 0.5, "reclaim": "compact", "read_path": "gather"}


def test_compact_moves_hashed_blocks_down_the_list_and_b3_follows_the_chain(monkeypatch):
    """Compaction releases A's emptied middle blocks, so its hashed prompt blocks after them move down its block
    list with their content in place. B3 once compared a block's hash with the chain hash of its list index and
    failed the engine (vLLM's server, the default prefix caching); the block is right, and B, whose prompt
    hits those blocks, generates what it does with caching off. Teeth: told a chain one block short, B3 names a
    hash outside it or a block whose live tokens sit at another chain position's offsets."""
    from types import SimpleNamespace
    shifted, refused = [], []
    check = SchedulerTokens.check_prefix_hashes

    def recording_check(self, r, request):
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
        chain = [make_block_hash_with_group_id(h, 0) for h in request.block_hashes]
        for i, b in enumerate(self.rt.table.block_ids(r)):
            h = self.allocator.pool.blocks[b].block_hash
            if h is not None and chain.index(h) != i:
                shifted.append((r, i, chain.index(h)))
        if shifted and not refused:
            with pytest.raises(InvariantViolation) as e:
                check(self, r, SimpleNamespace(block_hashes=request.block_hashes[1:]))
            refused.append(str(e.value))
        return check(self, r, request)

    from vtoken.integration.vllm import connector
    monkeypatch.setattr(SchedulerTokens, "check_prefix_hashes", recording_check)
    monkeypatch.setattr(connector, "POOL_CHECK_EVERY", 1)  # B3 every step (the server checks every 64th)
    on = _run(True, {**COMPACT, "strict_verify": "strict"})
    off = _run(False, COMPACT)
    assert shifted and all(j > i for _, i, j in shifted)  # a hashed block sat below its chain index, and passed
    assert refused[0].startswith("B3: ") and ("not in the request's hash chain" in refused[0]
                                              or "of other positions than" in refused[0]), refused
    assert on["stats"]["blocks_released"] > 0 and on["stats"]["evicted"] > 0
    assert on["B"][2] > 0 and off["B"][2] == 0  # B's prompt came partly from the cache
    assert on["B"][:2] == off["B"][:2] and on["A"][:2] == off["A"][:2]  # ids and logprobs: bit-identical
    assert on["stats"]["free"] == on["stats"]["blocks"] - 1

