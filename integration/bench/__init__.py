"""vtoken.integration.bench: the evaluation harness of issue #8 (``vtoken bench``).

A question is a module (``runner.Question``: KEY, TITLE, PAPER, run, table, plot) in a target's registry; a target
(``cli.TARGETS``: sim, vllm, device) is data: its registry, settings (``settings.py``), options and reproducing
command. ``runner.run_questions`` runs any question on any target into ``<question>.json`` and ``.png``;
``render.py`` draws every table and plot, ``stats.py`` summarises (median, min-max), ``systems.py`` names the
systems compared, ``measure.py`` is a measured simulator run. Simulator: q1, q2, q3, q5, q7, q8; vLLM
(``vllm_engine``, ``server``): q4_overhead, q6_quality, q6_prefix_caching, q7_vllm_bookkeeping, q9_serving_load;
device (``device_serving``): q4_device.
"""
