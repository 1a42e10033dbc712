"""The server: OpenAI-compatible HTTP API, Prometheus metrics and a live KV-ledger dashboard.

``kvledger serve`` runs it (its client, ``kvledger bench serve``, lives in ``kvledger.loadgen``).
Modules: ``protocol`` (request and
response bodies), ``errors`` (OpenAI error objects), ``async_engine`` (the one engine loop),
``prometheus`` (the /metrics endpoint), ``app`` (routes), ``launcher`` (uvicorn), ``static/`` (dashboard).
"""
