"""CPU tuning: OpenMP worker pools (``omp.py``), the C allocator (``malloc.py``), oneDNN weight packing
(``packing.py``)."""
