"""vtoken.integration.bench: the evaluation harness of issue #8 (``vtoken bench``).

The simulator half (``vtoken bench sim``) answers the seed's evaluation
questions (../shared/seed/vtoken-review.txt §4) on the deterministic core
simulator, one module per question:

    q1_trapped_capacity   Q1  share of blocks <= 50 % utilised, waste ratio F, per policy and workload
    q2_paired_frontier    Q2  utilisation and retained blocks per request, vtoken vs Naive-Evict
    q3_capacity_frontier  Q3  largest feasible concurrency at a fixed block budget
    q5_sensitivity        Q5  eviction ratio, theta_F and block size sweeps
    q7_bookkeeping_cost   Q7  CPU cost of the runtime's per-step work as tracked requests grow
    q8_bursty_eviction    Q8  reclamation lag after an eviction burst: fixed theta_F / K vs the adaptive trigger

The vLLM half (``vtoken bench vllm``, ``vllm_cli.py``) answers Q4, Q6, Q7 and Q9 on
real vLLM (CPU) with the trained byte-level model; the device half
(``vtoken bench device``, ``device_cli.py``) answers Q4 on a GPU; ``vtoken
bench all`` runs them in order.

Every question compares the same systems (``systems.py``) under identical
eviction decisions (same policy, same seed), repeats each point over several
seeds, and writes ``<question>.json`` (raw measurements; fields in
``report.py``) and ``<question>.png`` into the output directory. A new
question is one module with the same names (KEY, TITLE, PAPER, run, table,
plot) added to a registry (``questions.QUESTIONS``, ``vllm_cli.VLLM_QUESTIONS``).
"""
