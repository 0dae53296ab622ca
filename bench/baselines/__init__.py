"""Minimal Faust apps that Rebound is compared with, run as ``faust -A bench.baselines.<name> worker``.

They share Rebound's consumer-group timings and producer settings (``BENCH_*`` and ``REBOUND_*`` variables) so that
the difference measured is the retry design, not the configuration.
"""
