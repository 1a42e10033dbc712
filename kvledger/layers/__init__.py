"""Building blocks of the model: the paged KV cache, attention over it, RoPE, RMSNorm, SwiGLU."""
