"""``vtoken fuzz --target tensors``: the state machine drives the torch device layer on real K/V."""

import copy

from vtoken.fuzz.campaign import CampaignConfig, pytest_file, replay_command, run_batch
from vtoken.integration.device.kv_cache import PagedKVCache

CFG = CampaignConfig(examples=12, steps=60, seed=1, use_database=False, shrink=False, target="tensors",
                     planners=("compact", "densify"))


def test_the_tensor_target_commits_relocations_on_real_tensors_cleanly():
    res = run_batch(CFG, 0)
    assert res.failure is None, res.failure and res.failure.traceback
    assert res.events["plans_committed"] > 0 and res.events["invariant_checks"] > 100


def test_a_device_layer_bug_is_found_and_replays_on_the_tensor_target(monkeypatch):
    """Planted bug: the scatter forgets the last storage group (the fp16 CPU-layout layer)."""
    real = PagedKVCache.scatter
    monkeypatch.setattr(PagedKVCache, "scatter", lambda self, slots, values: real(
        _Drop(self), slots, values))
    res = run_batch(CFG, 0)
    assert res.failure is not None
    assert res.failure.error.startswith("RelocationMismatch: relocation of request")  # strict verify caught it
    assert "layer2.K" in res.failure.error and res.failure.program
    assert replay_command(CFG, res.failure.batch_seed).endswith("--target tensors")
    assert "import TensorMachine as VTokenMachine" in pytest_file(res.failure, CFG)


def _Drop(cache: PagedKVCache) -> PagedKVCache:
    """A view of a cache whose groups lack the last one (the same object otherwise)."""
    view = copy.copy(cache)
    view.groups = cache.groups[:-1]
    return view
