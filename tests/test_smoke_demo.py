"""The built-in demo runs end to end and reclamation beats no reclamation on its own workload."""

from vtoken.core.simulator import SimConfig, compare_modes, synthetic_workload


def test_demo_workload_orders_modes():
    results = compare_modes(SimConfig(num_blocks=2048, check_invariants=True), synthetic_workload(16, seed=0))
    off, compact, densify = results["off"], results["compact"], results["densify"]
    assert off.finished == compact.finished == densify.finished == 16
    assert off.mean_retained_blocks > compact.mean_retained_blocks > densify.mean_retained_blocks
    assert densify.mean_retained_blocks >= densify.mean_ideal_blocks
    assert off.invariant_checks > 0
