"""CPU tuning: ``CpuPolicy`` (policy.py) and its mechanisms: OpenMP worker pools (``omp.py``), the C allocator
(``malloc.py``), oneDNN weight packing (``packing.py``)."""
