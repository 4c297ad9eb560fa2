"""Platform tuning: what the serving process changes about itself and its models for the device it runs on.

``cpu/`` holds the CPU side: the OpenMP thread pools (``omp.py``), glibc's allocator (``malloc.py``) and
oneDNN weight packing (``packing.py``).
"""
