"""The built-in demo runs end to end and reclamation beats no reclamation on its own workload."""

from vtoken.core.sim.simulator import SimConfig, compare_modes, synthetic_workload


def test_demo_workload_orders_modes():
    results = compare_modes(SimConfig(num_blocks=2048, check_invariants=True), synthetic_workload(16, seed=0))
    off, compact, densify = results["off"], results["compact"], results["densify"]
    assert off.finished == compact.finished == densify.finished == 16
    assert off.mean_retained_blocks > compact.mean_retained_blocks > densify.mean_retained_blocks
    assert densify.mean_retained_blocks >= densify.mean_ideal_blocks
    assert off.invariant_checks > 0


def test_the_demo_command_prints_json_for_every_mode(capsys):
    import json

    from vtoken.core.cli import main

    assert main(["demo", "--requests", "4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert set(rows) == {"off", "compact", "densify"} and all(r["invariant_checks"] > 0 for r in rows.values())


def test_the_demo_refuses_a_bad_option_before_any_work(capsys, monkeypatch):
    from vtoken.core.sim import demo
    from vtoken.core.cli import main

    monkeypatch.setattr(demo, "compare_modes", lambda *a: (_ for _ in ()).throw(AssertionError("ran")))
    assert main(["demo", "--block-size", "0"]) == 2
    assert capsys.readouterr().err == "vtoken demo: --block-size must be in [1, 1024], got 0\n"
