"""Evaluations of the KV cache, run with torch on real tensors:

* ``verify``     -- the chapter's artifact: attention through an append-only cache equals full
                    causal attention, and the cache's bytes equal Eq 2.2 (``kvledger verify``).
* ``kv_quality`` -- what an 8-bit cache costs along a long text: KL, top-1 agreement and
                    perplexity per context bucket (``kvledger kv-quality``).
"""
