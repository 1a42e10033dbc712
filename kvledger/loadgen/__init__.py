"""Load generators that measure a running server (``kvledger bench serve``); they do not live in
``server/``, and the repository's ``bench/`` scripts drive them."""
