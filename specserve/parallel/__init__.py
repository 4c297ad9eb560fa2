"""Scale-out: the processes of tensor parallelism (``ranks``); how a model shards is
``specserve.models.tensor_parallel``."""
