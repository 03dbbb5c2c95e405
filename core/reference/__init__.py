"""vtoken.core.reference: the oracles that check the runtime, kept apart from the runtime a user runs.

The runtime (``core/*.py``, ``core/policies/``) is what serving executes. Everything here exists to check
it, from first principles and at a cost no hot path pays:

  invariants   I1-I7 and P3, one checker per invariant (``check_all``), run after every simulator step
               and every fuzzer rule (docs/spec.md)
  views        V1: the maintained views (the token table's live index, block index, per-block counts,
               token map and masks; the pool-wide occupancy) against recounts from scratch
  compact      the reference compact planner on a full snapshot (``eligible_sources``, ``choose_sources``,
               ``plan_compaction``): what the z3 planner proofs and CrossHair are about, and what V3
               compares the runtime's maintained path with
  contracts    CrossHair's named predicates, called by the ``post:`` lines of the runtime's docstrings

The import rule, one way (tests/test_layout.py checks it on the source, tests/test_import_rule.py on the
package graph):

* ``core.reference`` may import the runtime modules of ``core`` and the standard library, nothing else.
* No runtime module imports ``core.reference`` when it is imported. An opt-in self-check of the runtime that
  calls an oracle imports it inside the check, when it runs, so serving never loads it: the one today is
  ``ReclamationManager.verify_fast_paths`` (V3, on in the fuzzer and the checked simulator), which imports
  the reference compact planner.
* The runtime's docstring contracts name ``contracts.<predicate>`` without importing it:
  ``spec/crosshair_check.py`` binds ``contracts`` into the modules it checks before CrossHair reads them.

``core.sim``, ``spec``, ``fuzz`` and ``integration.bench`` import the oracles from here.
"""
