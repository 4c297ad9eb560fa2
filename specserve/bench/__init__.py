"""Benchmarks of specserve against plain transformers (run them with ``python -m specserve.bench.<name>``)."""
