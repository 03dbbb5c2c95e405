"""vtoken.integration.bench: the evaluation harness of issue #8 (``vtoken bench``).

A question is a module (the ``runner.Question`` protocol: KEY, TITLE, PAPER, run, table, plot) listed in a
target's registry; a target (``cli.TARGETS``: sim, vllm, device) is data too: its registry, its settings
(``settings.py``: one dataclass and one table of checks per target), its own options and what its reproducing
command records. One runner (``runner.run_questions``) runs any question on any target and writes
``<question>.json`` (fields in ``runner.py``) and ``<question>.png``.

On the core simulator (``vtoken bench sim``), the seed's questions (../shared/seed/vtoken-review.txt §4):

    q1_trapped_capacity   Q1  share of blocks <= 50 % utilised, waste ratio F, per policy and workload
    q2_paired_frontier    Q2  utilisation and retained blocks per request, vtoken vs Naive-Evict
    q3_capacity_frontier  Q3  largest feasible concurrency at a fixed block budget
    q5_sensitivity        Q5  eviction ratio, theta_F and block size sweeps
    q7_bookkeeping_cost   Q7  CPU cost of the runtime's per-step work as tracked requests grow
    q8_bursty_eviction    Q8  reclamation lag after an eviction burst: fixed theta_F / K vs the adaptive trigger

On real vLLM (CPU) with the trained byte-level model (``vtoken bench vllm``; engines from ``vllm_engine``,
``vtoken serve`` processes from ``server``): q4_overhead, q6_quality, q6_prefix_caching, q7_vllm_bookkeeping,
q9_serving_load. On the device (``vtoken bench device``, over ``device_serving``): q4_device. ``vtoken bench
all`` runs the targets in order.

Every question compares the same systems (``systems.py``) under identical eviction decisions (same policy,
same seed) and repeats each point over several seeds; ``stats.py`` holds the selections and summaries (median
and min-max spread) every summary is built from, ``render.py`` the tables and plots, ``measure.py`` a measured
simulator run and the policy grid Q1 and Q2 share.
"""
