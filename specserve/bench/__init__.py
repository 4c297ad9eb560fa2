"""Benchmark commands (``specserve bench-speculative``, ``bench-serving``, ``bench-compare``, ``eval-acceptance``;
``python -m specserve.bench.bench_ngram`` and ``python -m specserve.bench.demo_report``) and the helpers they
share. The developer benchmarks are scripts in the repository's ``benchmarks/`` folder."""
