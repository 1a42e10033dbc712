"""Clients that measure a running server (``kvledger bench serve``); they do not live in ``server/``."""
