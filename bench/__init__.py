"""Rebound's benchmarks: ``python -m bench`` runs scenarios against a fresh embedded broker each.

Speed and memory figures live here and never in the test suite, because the test machine is shared and timing
assertions there would be flaky. Every scenario writes its raw figures and a summary to ``bench/results/<name>.json``
plus a PNG chart, so the numbers in ``docs/benchmarks.md`` can be traced back to a run.
"""
