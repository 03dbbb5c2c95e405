"""``vtoken bench sim`` (issue #8, simulator half): workloads, the systems, the questions at tiny scale, the CLI.

Fast on purpose (well under a minute on 2 cores): every question runs at a
scale far below ``--quick``; the numbers pinned here are the simulator's,
deterministic per seed.
"""

from __future__ import annotations

import io
import json
import math
import statistics
from dataclasses import replace

import pytest

from vtoken.core.cli import main as vtoken_main
from vtoken.core.errors import ConfigError
from vtoken.core.sim.simulator import SimConfig
from vtoken.core.sim.workloads import (CHAT_OUTPUT, CHAT_PROMPT, LONG_PROMPT, LengthModel, burst_schedule, burst_windows,
                                   chat_workload, fixed_workload, long_context_workload, make_workload)
from vtoken.integration.bench import q3_capacity_frontier as q3
from vtoken.integration.bench import q8_bursty_eviction as q8
from vtoken.integration.bench.cli import QUESTIONS, select_questions
from vtoken.integration.bench.measure import RUN_FIELDS, measure_run, pool_for
from vtoken.integration.bench.runner import REPORT_FIELDS, BenchContext, run_questions
from vtoken.integration.bench.settings import BenchSettings, Q3Setup, WorkloadSpec, bench_settings
from vtoken.integration.bench.stats import loglog_slope, summarize
from vtoken.integration.bench.systems import SYSTEMS, configure

TINY = replace(
    bench_settings(quick=True),
    workloads=(WorkloadSpec("chat", 3, arrival_gap=2, max_len=256, scale=0.25),
               WorkloadSpec("long_context", 2, arrival_gap=4, max_len=32768, scale=1 / 64, output_scale=0.25)),
    policies=("h2o", "random"),
    q3=Q3Setup(256, paper_budgets=(5427,)),
    q5_workload=WorkloadSpec("chat", 2, arrival_gap=2, max_len=128, scale=0.25),
    q5_eviction_ratios=(0.3, 0.7), q5_theta_fs=(0.05, 0.9), q5_block_sizes=(16, 64),
    q7_sizes=(4, 16), q7_prompt_len=8, q7_warmup_steps=1, q7_timed_steps=2,
)
# Q8 reads its scale from its own module (QUICK / FULL); the tiny runs swap QUICK for this: 3 requests, one burst
TINY_Q8 = q8.Q8Setup(num_requests=3, first_quiet=16, burst=64, quiet=32, cycles=1)


# ---- workloads ---------------------------------------------------------------------------------
def test_workloads_are_deterministic_per_seed():
    assert chat_workload(40, seed=3) == chat_workload(40, seed=3)
    assert chat_workload(40, seed=3) != chat_workload(40, seed=4)
    assert long_context_workload(10, seed=1, scale=0.125) == long_context_workload(10, seed=1, scale=0.125)
    assert make_workload("chat", 5, 9) == chat_workload(5, 9)


@pytest.mark.parametrize("model", [CHAT_PROMPT, CHAT_OUTPUT])
def test_chat_lengths_match_the_stated_log_normal(model):
    rng_lengths = chat_workload(20_000, seed=11, max_len=10**9)
    xs = [r.prompt_len if model is CHAT_PROMPT else r.output_len for r in rng_lengths]
    assert statistics.fmean(xs) == pytest.approx(model.mean, rel=0.05)  # 161 / 338 tokens
    assert statistics.median(xs) == pytest.approx(model.median, rel=0.05)
    logs = [math.log(x) for x in xs]
    assert statistics.stdev(logs) == pytest.approx(model.sigma, rel=0.05)


def test_long_context_scale_keeps_shape_and_output_scale_is_separate():
    w = long_context_workload(20_000, seed=2, scale=0.125, output_scale=1.0)
    prompts = [r.prompt_len for r in w]
    assert statistics.fmean(prompts) == pytest.approx(LONG_PROMPT.mean * 0.125, rel=0.05)  # ~1,088 tokens
    assert statistics.median(prompts) == pytest.approx(LONG_PROMPT.median * 0.125, rel=0.05)
    assert statistics.median(r.output_len for r in w) == pytest.approx(64.0, rel=0.1)  # mean 96, sigma 0.9


def test_lengths_are_clipped_and_arrivals_follow_the_gap():
    w = chat_workload(500, seed=5, arrival_gap=3, max_len=300)
    assert all(r.prompt_len + r.output_len <= 300 and r.prompt_len >= 1 and r.output_len >= 1 for r in w)
    assert max(r.prompt_len + r.output_len for r in w) == 300  # the tail does reach the limit
    assert [r.arrival for r in w[:4]] == [0, 3, 6, 9] and [r.req_id for r in w[:3]] == [0, 1, 2]
    assert {r.arrival for r in chat_workload(4, seed=0, arrival_gap=0)} == {0}
    assert fixed_workload(3, 10, 20, first_id=100)[2].req_id == 102


def test_burst_schedule_quiet_then_bursts_with_seeded_jitter():
    assert burst_schedule(2, 10, 5, 7, 0.4) == ((0, 1.0), (10, 0.4), (15, 1.0), (22, 0.4), (27, 1.0))
    assert burst_windows(burst_schedule(2, 10, 5, 7, 0.4)) == [(10, 15), (22, 27)]
    jittered = [burst_windows(burst_schedule(3, 10, 5, 7, 0.4, jitter=7, seed=seed)) for seed in range(20)]
    assert all(10 <= w[0][0] < 17 and 22 <= w[1][0] < 29 and 34 <= w[2][0] < 41 and all(e - a == 5 for a, e in w)
               for w in jittered)
    assert len({w[0][0] for w in jittered}) > 3  # the phase does move with the seed
    assert burst_schedule(3, 10, 5, 7, 0.4, jitter=7, seed=4) == burst_schedule(3, 10, 5, 7, 0.4, jitter=7, seed=4)
    assert burst_windows(((0, 1.0), (5, 0.5))) == [(5, None)]


@pytest.mark.parametrize("call, named", [
    (lambda: chat_workload(0, 1), "num_requests"),
    (lambda: chat_workload(3, "1"), "seed"),
    (lambda: chat_workload(3, 1, arrival_gap=-1), "arrival_gap"),
    (lambda: chat_workload(3, 1, max_len=1), "max_len"),
    (lambda: long_context_workload(3, 1, scale=0), "scale"),
    (lambda: long_context_workload(3, 1, output_scale=1.5), "output_scale"),
    (lambda: make_workload("sharegpt", 3, 1), "workload must be one of ['chat', 'long_context']"),
    (lambda: LengthModel(mean=0, sigma=1.0), "mean > 0"),
    (lambda: fixed_workload(2, 0, 5), "prompt_len"),
    (lambda: burst_schedule(0, 10, 5, 5, 0.4), "cycles"),
    (lambda: burst_schedule(1, 0, 5, 5, 0.4), "first_quiet"),
    (lambda: burst_schedule(1, 10, 5, 5, 1.0), "low must be < high"),
    (lambda: burst_schedule(1, 10, 5, 5, 0.0), "low"),
    (lambda: burst_schedule(2, 10, 5, 4, 0.4, jitter=5), "jitter must be <= quiet"),
])
def test_bad_workload_arguments_name_what_is_wrong(call, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        call()


# ---- systems, stats, measurement ------------------------------------------------------------------
def test_systems_map_to_the_papers_variants():
    base = SimConfig()
    native = configure(base, "native", "h2o")
    assert native.policy is None and native.reclaim == "off"
    assert configure(base, "naive_evict", "h2o").reclaim == "off"
    compact = configure(base, "vtoken_compact", "random")
    assert (compact.policy, compact.reclaim, compact.read_path) == ("random", "compact", "gather")
    densify = configure(base, "vtoken_densify", "h2o")
    assert (densify.reclaim, densify.read_path, densify.ordering) == ("densify", "dense", "event")
    with pytest.raises(ConfigError, match="system must be one of"):
        configure(base, "vllm", "h2o")
    with pytest.raises(ConfigError, match="needs a policy"):
        configure(base, "vtoken_compact", None)


def test_stats():
    assert summarize([3, 1, 2]) == {"median": 2, "min": 1, "max": 3, "n": 3}
    assert loglog_slope([16, 64, 256], [3 * 16**2, 3 * 64**2, 3 * 256**2]) == pytest.approx(2.0)


def test_measure_run_counts_per_request_and_checks_invariants_on_request():
    w = chat_workload(3, seed=0, scale=0.25, max_len=256)
    cfg = configure(SimConfig(num_blocks=pool_for(w, 16, 8), headroom=8, max_running=3, check_invariants=True),
                    "vtoken_densify", "h2o")
    m = measure_run(cfg, w)
    assert set(RUN_FIELDS) <= set(m)
    assert m["completed"] and m["preemptions"] == 0 and m["finished"] == 3
    assert m["invariant_checks"] > 0
    assert m["ideal_blocks_per_request"] <= m["retained_blocks_per_request"] < 1.1 * m["ideal_blocks_per_request"]


# ---- Q3 at tiny scale: the capacity frontier ---------------------------------------------------------------
def test_q3_tiny_frontier_native_le_naive_lt_compact_lt_densify(tmp_path):
    """Paper ÷ 128: 32 + 96 tokens, 8 blocks fully retained, 4 ideal; 42 blocks (5,427 / 128). Under pressure
    compact packs to the ideal too; it stops one short of densify because it keeps 4 of the 42 blocks as its
    evacuation headroom (38 // 4 = 9)."""
    setup = Q3Setup(128)
    ctx = BenchContext(replace(TINY, q3=setup), tmp_path, stream=io.StringIO())
    assert (setup.prompt_len, setup.output_len, setup.budgets) == (32, 96, (42, 90))
    assert q3.request_blocks(setup, 16, 0.5) == (8, 4)
    c = {x: q3.frontier(ctx, x, 42, seed=0)[0] for x in SYSTEMS}
    assert c == {"native": 5, "naive_evict": 5, "vtoken_compact": 9, "vtoken_densify": 10}
    assert c["native"] <= c["naive_evict"] < c["vtoken_densify"]


# ---- every question end to end at tiny scale ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    tables = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(q8, "QUICK", TINY_Q8)
        reports = run_questions(select_questions(None), TINY, out, "vtoken bench sim (test)", io.StringIO(), tables)
    return out, reports, tables.getvalue()


def test_every_question_writes_json_with_the_documented_fields_and_a_png(tiny_reports):
    out, reports, _ = tiny_reports
    assert list(reports) == ["q1", "q2", "q3", "q5", "q7", "q8", "q10"] == list(QUESTIONS)
    for key in reports:
        data = json.loads((out / f"{key}.json").read_text())
        assert set(REPORT_FIELDS) <= set(data), key
        assert data["question"] == key and data["runs"] and data["settings"]["repeats"] == 5
        assert (out / f"{key}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    q1 = json.loads((out / "q1.json").read_text())
    assert set(RUN_FIELDS) <= set(q1["runs"][0])
    # 2 workloads x 5 seeds x (native + 2 policies x 3 evicting systems)
    assert len(q1["runs"]) == 2 * 5 * (1 + 2 * 3)


def test_q1_q2_show_trapped_capacity_and_its_reclamation(tiny_reports):
    _, reports, tables = tiny_reports
    by_w = reports["q1"]["summary"]["by_workload"]
    for w in by_w.values():
        for policy in ("h2o", "random"):
            naive, compact, densify = (w[policy][x]["waste_ratio_F"]["median"]
                                       for x in ("naive_evict", "vtoken_compact", "vtoken_densify"))
            assert naive > 0.4 and densify < compact < naive
    q2 = reports["q2"]["summary"]
    assert q2["identical_decisions_checked"]
    lo, hi = q2["median_ranges"]["vtoken_densify.retained_reduction"]
    assert 0.3 < lo <= hi < 0.6  # at budget 0.5 densify approaches the ~50 % ideal
    # Q3 at paper ÷ 256 (2 ideal blocks per request, 21 blocks): densify doubles C; compact, packing under
    # pressure, reaches what its 4-block headroom leaves (17 // 2 = 8)
    assert "| 21 (5,427) | 10 | 5 | 5 | 8 | 10 | 5 → 8 |" in tables


def test_q5_q7_shapes(tiny_reports):
    _, reports, _ = tiny_reports
    theta = reports["q5"]["summary"]["theta_f"]["vtoken_compact"]
    # F never reaches 0.9: compact plans only in the rounds the simulator's pressure runs (a pool this small fills)
    runs = [r for r in reports["q5"]["runs"] if r["sweep"] == "theta_f" and r["value"] == 0.9]
    assert runs and all(r["pressure_rounds"] > 0 for r in runs if r["plans_committed"] > 0)
    assert theta["0.9"]["plans_committed"]["max"] > 0
    assert theta["0.9"]["plans_committed"]["max"] < theta["0.05"]["plans_committed"]["min"]
    assert theta["0.05"]["plans_committed"]["median"] > 0
    ratio = reports["q5"]["summary"]["eviction_ratio"]["vtoken_densify"]
    assert ratio["0.7"]["retained_slots_per_request"]["median"] < ratio["0.3"]["retained_slots_per_request"]["median"]
    q7 = reports["q7"]["summary"]
    assert set(q7) == set(SYSTEMS)
    assert all(q7[x]["by_requests"]["16"]["us_per_step"]["median"] > 0 for x in SYSTEMS)
    assert all(math.isfinite(q7[x]["scaling_exponent"]["median"]) for x in SYSTEMS)


def test_q8_adaptive_trigger_meets_the_burst_the_fixed_one_waits_for_the_cadence(tiny_reports):
    """3 requests, one burst (budget 1.0 -> 0.4) starting 16-47 steps in, 5 seeds; lag = iterations until F <= theta_F."""
    _, reports, tables = tiny_reports
    q = reports["q8"]
    sm = q["summary"]
    assert len(q["runs"]) == 5 * 11  # seeds x (Naive-Evict + 2 theta x (3 fixed K + 2 adaptive K))
    assert sm["adaptive_vs_fixed_lag"]["0.5/32"] == {"fixed": 13.0, "adaptive": 1.0}
    assert sm["adaptive_vs_fixed_lag"]["0.25/32"] == {"fixed": 45.0, "adaptive": 4.0}
    assert sm["adaptive_vs_fixed_lag"]["0.5/8"] == {"fixed": 5.0, "adaptive": 1.0}
    by = sm["by_system"]
    for theta in (0.25, 0.5):
        lags = [by[f"fixed/{theta}/{k}"]["lag_mean"]["median"] for k in (1, 8, 32)]
        assert lags == sorted(lags) and lags[0] < lags[-1]  # the longer the cadence, the longer the lag
        assert by[f"adaptive/{theta}/32"]["lag_mean"]["median"] == by[f"fixed/{theta}/1"]["lag_mean"]["median"]
        assert by[f"adaptive/{theta}/32"]["bursts_detected"]["min"] >= 1
        assert by[f"fixed/{theta}/32"]["burst_rounds"]["max"] == by[f"fixed/{theta}/32"]["bursts_detected"]["max"] == 0
        # reclaiming sooner holds fewer blocks while catching up
        assert by[f"adaptive/{theta}/32"]["trapped_block_iterations"]["median"] \
            < by[f"fixed/{theta}/32"]["trapped_block_iterations"]["median"]
    assert by["naive_evict"]["censored"]["min"] == 1 and by["naive_evict"]["plans_made"]["max"] == 0
    assert sm["max_quiet_rise_F"] < TINY_Q8.burst_df  # no ordinary step looks like a burst
    run = q["runs"][0]
    assert run["trace"]["first_step"] == -min(q8.PRE, run["windows"][0][0])
    assert len(run["trace"]["F"]) == run["windows"][0][1] - max(0, run["windows"][0][0] - q8.PRE)
    assert "| adaptive | 0.5 | 32 | 1.0 |" in tables and "| fixed | 0.5 | 32 | 13.0 (1.0–17.0) |" in tables


def test_q8_scales_fit_their_time_budget_shape():
    for setup in (q8.QUICK, q8.FULL):
        assert setup.jitter <= setup.quiet and setup.burst > max(setup.check_everys)  # K=32 can catch up in a window
        assert setup.steps == setup.first_quiet + setup.cycles * (setup.burst + setup.quiet) + setup.jitter
    names = [c["name"] for c in q8.configs(q8.QUICK)]
    assert names[0] == "naive_evict" and len(names) == 11 and "adaptive/0.25/1" not in names


# ---- settings and the command line ----------------------------------------------------------------------
def test_settings_reject_bad_values():
    with pytest.raises(ConfigError, match="repeats must be an int >= 5"):
        bench_settings(quick=True, repeats=3)
    with pytest.raises(ConfigError, match="unknown policies"):
        BenchSettings(quick=True, policies=("h2o", "lru"))
    with pytest.raises(ConfigError, match="workload must be one of"):
        WorkloadSpec("sharegpt", 3, 2, 100)
    with pytest.raises(ConfigError, match=r"unknown question\(s\) \['q4'\]"):
        select_questions(["q1", "q4"])


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "2"], "repeats must be an int >= 5 (median and spread need them), got 2"),
    (["--questions", "q9"], "unknown question(s) ['q9']"),
])
def test_cli_bad_arguments_exit_2_with_a_specific_message(argv, message, tmp_path, capsys):
    assert vtoken_main(["bench", "sim", "--quick", "--out", str(tmp_path / "o"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_out_must_be_a_directory(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("")
    assert vtoken_main(["bench", "sim", "--quick", "--out", str(f)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


def test_q10_measures_both_axes_for_every_policy_on_both_planners(tiny_reports):
    _, reports, tables = tiny_reports
    q10 = reports["q10"]["summary"]
    systems = {f"{p}/{planner}" for p in TINY.policies for planner in ("compact", "densify")}
    assert set(q10) == {"context", "requests"} and set(q10["context"]) == systems == set(q10["requests"])
    assert list(q10["context"]["h2o/compact"]["by_size"]) == [str(x) for x in TINY.q10_contexts]
    assert all(v["growth"] > 0 for axis in q10.values() for v in axis.values())
    h2o = q10["context"]["h2o/densify"]["by_size"][str(TINY.q10_contexts[-1])]
    random = q10["context"]["random/densify"]["by_size"][str(TINY.q10_contexts[-1])]
    assert h2o["record_ns_per_live_token"]["median"] > 0 == random["record_ns_per_live_token"]["median"]
    assert h2o["select_ns_per_live_token"]["median"] > 0 and random["select_ns_per_live_token"]["median"] > 0
    assert 0 < h2o["us_per_request_excl_record_and_select"]["median"] < h2o["us_per_request_excl_record"]["median"]
    assert all(v["growth_excl_record_and_select"] > 0 for axis in q10.values() for v in axis.values())
    assert "recording excluded, by live tokens per request" in tables
