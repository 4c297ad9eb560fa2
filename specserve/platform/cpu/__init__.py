"""CPU tuning: ``CpuPolicy`` (policy.py) and its mechanisms: the usable CPUs (``cpus.py``) and the thread count
under contention (``governor.py``), OpenMP worker pools (``omp.py``), the C allocator (``malloc.py``), oneDNN weight
packing (``packing.py``)."""
