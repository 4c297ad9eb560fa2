"""The HTTP server: OpenAI-compatible and SGLang-native endpoints in front of a model worker process.

    app.py          FastAPI app factory (routers, errors, API key, lifespan)
    protocol.py     pydantic request/response models
    openai_api.py   /v1/chat/completions, /v1/completions, /v1/models
    openai_format.py  pure OpenAI <-> specserve conversions
    native_api.py   /generate, /health, /health_generate, /get_model_info, /get_server_info, /flush_cache,
                    /abort_request, /metrics
    http_jobs.py    job submission, SSE, client-disconnect aborts
    manager.py      RequestManager (tokenizer, admission, routing, detokenization) and Job
    worker.py       the model worker process (Scheduler + SchedulerLoop)
    worker_client.py  the server's handle on that process
    metrics.py      Prometheus metrics
    errors.py       OpenAI error bodies and strict JSON parsing
"""
