"""What an 8-bit KV cache costs in quality, as a function of context position.

The chapter: "Validate quality on long-context tasks, never on short ones." This runs the
engine's own model, attention and cache classes over one long real text, teacher-forced:
once with the unquantized cache (the reference) and once per 8-bit kind, chunk by chunk in
lockstep, and compares the next-token distributions at every position:

* mean KL divergence KL(reference || quantized), in nats;
* top-1 agreement: the share of positions whose most likely next token is the same;
* perplexity of the text under each cache.

Results are reported per bucket of context positions, so error that compounds with the
context shows as a rising curve. Every key and value, the current chunk's included, is read
back from the cache (``read_back_fresh``): each position sees exactly what decoding would,
a stricter measure than the engine's prefill, which attends over a fresh chunk unquantized.
Greedy continuations of the text's opening are also generated with each cache, and the
first position where they part from the reference's is reported.

The default text is the Python language reference shipped with Python itself
(``pydoc_data.topics``, PSF License): long, real English prose, on every machine.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from kvledger.config import CUDA_BLOCK_SIZE, ENGINE_DTYPE
from kvledger.errors import KVLedgerError
from kvledger.layers.attention import AttentionMetadata, PrefillChunk
from kvledger.kvcache.storage import KVCache
from kvledger.kvcache.quantized_storage import make_kv_cache
from kvledger.progress import progress_bar
from kvledger.spec.dtypes import KV_QUALITY_DEFAULT_KINDS as DEFAULT_KINDS

DEFAULT_TEXT_SOURCE = "the Python language reference (pydoc_data.topics, shipped with Python; PSF License)"


@dataclass(frozen=True)
class QualityConfig:
    model: str | None = None
    text: str | None = None
    """A UTF-8 text file; ``None`` for the Python language reference."""
    kv_cache_dtypes: tuple[str, ...] = DEFAULT_KINDS
    dtype: str = ENGINE_DTYPE
    max_tokens: int = 6400
    """Tokens of the text to read (positions scored = max_tokens - 1)."""
    num_buckets: int = 8
    chunk_tokens: int = 1024
    greedy_prompt_tokens: int = 512
    greedy_new_tokens: int = 128
    block_size: int = CUDA_BLOCK_SIZE
    """The engine's block on CUDA, on every device: the cache layout the quality is measured in."""


@dataclass
class Bucket:
    start: int
    end: int
    kl: float
    top1_agreement: float
    ppl: float


@dataclass
class DtypeQuality:
    kv_cache_dtype: str
    positions: int
    buckets: list[Bucket]
    ppl_total: float
    top1_total: float
    kl_total: float
    greedy_divergence: int | None
    """First generated token (0-based) that differs from the reference's greedy continuation;
    ``None`` if all ``greedy_new_tokens`` agree."""
    cache_bytes: int
    meta: dict = field(default_factory=dict)


class _Accumulator:
    """Per-position statistics, summed into buckets."""

    def __init__(self, positions: int, num_buckets: int) -> None:
        self.kl = torch.zeros(positions, dtype=torch.float64)
        self.agree = torch.zeros(positions, dtype=torch.float64)
        self.nll = torch.zeros(positions, dtype=torch.float64)
        self.num_buckets = num_buckets

    def add(self, start: int, ref_logp: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor) -> None:
        end = start + logp.shape[0]
        self.kl[start:end] = (ref_logp.exp() * (ref_logp - logp)).sum(-1).double()
        self.agree[start:end] = (ref_logp.argmax(-1) == logp.argmax(-1)).double()
        self.nll[start:end] = -logp.gather(-1, targets[:, None])[:, 0].double()

    def buckets(self) -> list[Bucket]:
        n = self.kl.shape[0]
        edges = [round(i * n / self.num_buckets) for i in range(self.num_buckets + 1)]
        return [Bucket(a, b, self.kl[a:b].mean().item(), self.agree[a:b].mean().item(),
                       math.exp(self.nll[a:b].mean().item())) for a, b in zip(edges, edges[1:])]


def load_text(path: str | None) -> tuple[str, str]:
    """(text, where it came from)."""
    if path is None:
        import pydoc_data.topics

        topics = pydoc_data.topics.topics
        return "\n\n".join(topics[k] for k in sorted(topics)), DEFAULT_TEXT_SOURCE
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8"), str(p)
    except FileNotFoundError:
        raise KVLedgerError(f"no such text file: {p}; give a UTF-8 text file or leave --text out") from None
    except (UnicodeDecodeError, IsADirectoryError):
        raise KVLedgerError(f"{p} is not a UTF-8 text file") from None


def _chunk_metadata(start: int, n: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """One sequence laid out in order (slot = position), tokens ``[start, start + n)`` new."""
    table = torch.arange(-(-(start + n) // block_size), device=device).view(1, -1)
    meta = AttentionMetadata(slot_mapping=torch.arange(start, start + n, device=device))
    meta.prefills.append(PrefillChunk.causal(0, n, start, table))
    return meta


class _Scorer:
    """The engine's model over one cache per KV dtype, for a single sequence."""

    def __init__(self, cfg: QualityConfig, max_len: int) -> None:
        from kvledger.config import EngineConfig
        from kvledger.engine.llm_engine import LLMEngine

        blocks = -(-max_len // cfg.block_size)
        self.engine = LLMEngine(EngineConfig(model=cfg.model, dtype=cfg.dtype, block_size=cfg.block_size,
                                             num_gpu_blocks_override=blocks, max_model_len=blocks * cfg.block_size,
                                             enable_prefix_caching=False))
        self.model, self.device, self.block_size = self.engine.model, self.engine.device, cfg.block_size
        spec = self.engine.spec
        self.caches: dict[str, KVCache] = {"reference": self.engine.cache}
        for kind in cfg.kv_cache_dtypes:
            self.caches[kind] = make_kv_cache(kind, spec.num_layers, blocks, cfg.block_size, spec.num_kv_heads,
                                              spec.head_dim, self.engine.dtype, self.device)
        for cache in self.caches.values():
            cache.read_back_fresh = True  # every position sees what a decode step sees

    @torch.inference_mode()
    def logits(self, kind: str, token_ids: torch.Tensor, start: int, all_positions: bool = True) -> torch.Tensor:
        n = token_ids.shape[0]
        meta = _chunk_metadata(start, n, self.block_size, self.device)
        positions = torch.arange(start, start + n, device=self.device)
        wanted = torch.arange(n, device=self.device) if all_positions else torch.tensor([n - 1], device=self.device)
        return self.model(token_ids.to(self.device), positions, meta, self.caches[kind], wanted)

    def greedy(self, kind: str, prompt: torch.Tensor, new_tokens: int, chunk: int) -> list[int]:
        out: list[int] = []
        logits = None
        for start in range(0, prompt.shape[0], chunk):
            logits = self.logits(kind, prompt[start:start + chunk], start, all_positions=False)
        position = prompt.shape[0]
        for _ in range(new_tokens):
            token = int(logits[-1].argmax())
            out.append(token)
            logits = self.logits(kind, torch.tensor([token]), position, all_positions=False)
            position += 1
        return out


def run_kv_quality(cfg: QualityConfig, progress: bool = False) -> dict[str, DtypeQuality]:
    """Reference plus one entry per 8-bit kind, keyed by dtype name."""
    if cfg.num_buckets < 1 or cfg.max_tokens < cfg.num_buckets + 1:
        raise KVLedgerError(f"--max-tokens {cfg.max_tokens} is too short for {cfg.num_buckets} buckets")
    text, source = load_text(cfg.text)
    scorer = _Scorer(cfg, cfg.max_tokens + cfg.greedy_new_tokens)
    ids = scorer.engine.tokenizer(text, add_special_tokens=False)["input_ids"][: cfg.max_tokens]
    if len(ids) < cfg.num_buckets + 1:
        raise KVLedgerError(f"the text has only {len(ids)} tokens; give a longer --text")
    tokens = torch.tensor(ids)
    positions = len(ids) - 1
    kinds = ["reference", *cfg.kv_cache_dtypes]
    stats = {k: _Accumulator(positions, cfg.num_buckets) for k in kinds}
    chunks = range(0, positions, cfg.chunk_tokens)
    bar = progress_bar(len(chunks), "kv-quality", "chunk", enabled=progress)
    try:
        for start in chunks:
            chunk = tokens[start:min(start + cfg.chunk_tokens, positions)]
            targets = tokens[start + 1:start + 1 + chunk.shape[0]]
            ref = F.log_softmax(scorer.logits("reference", chunk, start), dim=-1)
            stats["reference"].add(start, ref, ref, targets)
            for kind in cfg.kv_cache_dtypes:
                stats[kind].add(start, ref, F.log_softmax(scorer.logits(kind, chunk, start), dim=-1), targets)
            bar.update(1)
    finally:
        bar.close()
    prompt = tokens[: cfg.greedy_prompt_tokens]
    greedy = {k: scorer.greedy(k, prompt, cfg.greedy_new_tokens, cfg.chunk_tokens) for k in kinds}
    reference_name = scorer.engine.kv_cache_dtype
    meta = {"model": scorer.engine.model_name, "text": source, "tokens": len(ids), "reference": reference_name,
            "greedy_prompt_tokens": int(prompt.shape[0]), "greedy_new_tokens": cfg.greedy_new_tokens}
    report = {}
    for kind in kinds:
        acc = stats[kind]
        diverge = next((i for i, (a, b) in enumerate(zip(greedy["reference"], greedy[kind])) if a != b), None)
        name = reference_name if kind == "reference" else kind
        report[name] = DtypeQuality(
            kv_cache_dtype=name, positions=positions, buckets=acc.buckets(),
            ppl_total=math.exp(acc.nll.mean().item()), top1_total=acc.agree.mean().item(),
            kl_total=acc.kl.mean().item(), greedy_divergence=diverge,
            cache_bytes=scorer.caches[kind].measured_bytes, meta=meta)
    return report


def to_json(report: dict[str, DtypeQuality]) -> dict:
    return {name: asdict(q) for name, q in report.items()}


def run_dtype_quality(cfg: QualityConfig, dtype: str = "bfloat16") -> DtypeQuality:
    """The whole model in ``dtype`` (weights, activations and cache) against the same model in
    ``cfg.dtype`` (float32), teacher-forced over the same text chunk by chunk: the statistics of
    :func:`run_kv_quality` (KL, top-1 agreement, perplexity per bucket) for the model dtype rather
    than the cache's. ``cfg.kv_cache_dtypes`` is ignored and no greedy continuation is generated
    (``greedy_divergence`` is None)."""
    if cfg.num_buckets < 1 or cfg.max_tokens < cfg.num_buckets + 1:
        raise KVLedgerError(f"--max-tokens {cfg.max_tokens} is too short for {cfg.num_buckets} buckets")
    text, source = load_text(cfg.text)
    plain = replace(cfg, kv_cache_dtypes=())
    reference = _Scorer(plain, cfg.max_tokens)
    other = _Scorer(replace(plain, dtype=dtype), cfg.max_tokens)
    ids = reference.engine.tokenizer(text, add_special_tokens=False)["input_ids"][: cfg.max_tokens]
    if len(ids) < cfg.num_buckets + 1:
        raise KVLedgerError(f"the text has only {len(ids)} tokens; give a longer --text")
    tokens = torch.tensor(ids)
    positions = len(ids) - 1
    acc = _Accumulator(positions, cfg.num_buckets)
    for start in range(0, positions, cfg.chunk_tokens):
        chunk = tokens[start:min(start + cfg.chunk_tokens, positions)]
        targets = tokens[start + 1:start + 1 + chunk.shape[0]]
        ref = F.log_softmax(reference.logits("reference", chunk, start), dim=-1)
        acc.add(start, ref, F.log_softmax(other.logits("reference", chunk, start), dim=-1), targets)
    meta = {"model": other.engine.model_name, "text": source, "tokens": len(ids), "reference": cfg.dtype,
            "dtype": dtype}
    return DtypeQuality(kv_cache_dtype=other.engine.kv_cache_dtype, positions=positions, buckets=acc.buckets(),
                        ppl_total=math.exp(acc.nll.mean().item()), top1_total=acc.agree.mean().item(),
                        kl_total=acc.kl.mean().item(), greedy_divergence=None,
                        cache_bytes=other.caches["reference"].measured_bytes, meta=meta)
