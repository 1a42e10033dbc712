"""vLLM's one pool for a hybrid model's attention K/V and its per-request state, block by block.

vLLM's hybrid KV-cache manager keeps both kinds of layer in one pool of equal pages:

1. **Block size.** One attention page (``block_size`` tokens of one layer's K and V) must hold one
   layer's whole state. The block size is the smallest multiple of the kernel alignment ``a``
   that does, ``a x cdiv(state, a x attention bytes per token)``; ``a`` is the attention
   backend's smallest kernel block, 16 on CUDA, or ``--block-size`` when that is larger (128 for
   an MLA attention). A ``--block-size`` below the result is raised to it
   (``Platform._align_hybrid_block_size``, vLLM 0.32; logged as "Setting attention block size to
   N tokens ...").
2. **Padding.** The state page is padded up to the attention page ("Padding mamba page size by
   X% ...").
3. **Groups.** Layers of one kind form a bucket; every group holds ``g`` layers, ``g`` the
   smallest bucket's size (the largest's when it is under 1.5 times the smallest), each bucket
   cut into ``cdiv(n, g)`` groups (``_get_kv_cache_groups_uniform_page_size``).
4. **Blocks.** A block of the pool is one page for each of the ``g`` layers of a group:
   ``num_blocks = pool // (g x page)`` (``get_kv_cache_config_from_groups``).
5. **A request** takes ``cdiv(T, block_size)`` blocks in every attention group and a fixed number
   of blocks in every state group: 1 without prefix caching, 2 in the "align" mode prefix
   caching selects (the running state and the last block-aligned checkpoint), plus 1 for
   Mamba2's prefill checkpoint in vLLM 0.32 (``MambaSpec.max_memory_usage_bytes``).

Every count is per rank. The rules that changed between vLLM releases are in
:class:`VllmRules`, each naming its source. Pure Python: no torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvledger.errors import KVLedgerError
from kvledger.spec.state import MAMBA2

CUDA_KERNEL_BLOCK_ALIGNMENT = 16
"""The smallest kernel block of vLLM's CUDA attention backends (FlashAttention, FlashInfer, Triton)."""
MLA_KERNEL_BLOCK_ALIGNMENT = 128
"""vLLM 0.32 raises the alignment to 128 for a hybrid with MLA attention (TRTLLM/FlashInfer MLA decode)."""
GROUP_SIZE_MAX_RATIO = 1.5
"""When the largest bucket is under this many times the smallest, vLLM groups by the largest
(``_get_kv_cache_groups_uniform_page_size``)."""

OLDEST_VLLM_VERSION = (0, 10)
"""The first release whose v1 engine runs hybrid models (vLLM PR #20016, "Enable V1 for Hybrid
SSM/Attention Models")."""
NEWEST_VLLM_VERSION = (0, 32)
"""The newest release the planner models (its source is the specification); the default of ``--vllm-version``."""
DEFAULT_VLLM_VERSION = f"{NEWEST_VLLM_VERSION[0]}.{NEWEST_VLLM_VERSION[1]}"


def parse_vllm_version(text: str | None) -> tuple[int, int]:
    """``(major, minor)`` of ``text`` ("0.19", "0.19.1", "v0.24.0"); ``None`` is the newest modeled.
    A KVLedgerError names the range for anything outside it."""
    if text is None:
        return NEWEST_VLLM_VERSION
    match = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.\d+)?(?:\.post\d+)?", str(text).strip())
    if not match:
        raise KVLedgerError(f"--vllm-version {text!r} is not a release number such as 0.19 or 0.24.1")
    version = (int(match.group(1)), int(match.group(2)))
    if not OLDEST_VLLM_VERSION <= version <= NEWEST_VLLM_VERSION:
        raise KVLedgerError(f"--vllm-version {text}: the planner models vLLM {_fmt(OLDEST_VLLM_VERSION)} to "
                            f"{_fmt(NEWEST_VLLM_VERSION)}")
    return version


def _fmt(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


@dataclass(frozen=True)
class VllmRules:
    """What a vLLM release does where releases differ in a way that moves a printed number."""

    version: tuple[int, int]

    @property
    def name(self) -> str:
        return _fmt(self.version)

    @property
    def token_line_from_concurrency(self) -> bool:
        """The "GPU KV cache size: N tokens" line. Up to 0.19 it printed
        ``num_blocks // len(groups) x min block size``, the pool as if every group were attention
        (vLLM issue #40691, on 0.19.0: "290,864 tokens" beside "33.04x" at 32,768). From 0.20 it is
        ``int(max concurrency x max_model_len)`` (the fix of vLLM PRs #38364 / #40694; a 0.24.0 log,
        club-3090 issue #612, prints 567,978 = 4.333 x 131,072)."""
        return self.version >= (0, 20)

    @property
    def prefix_caching_default(self) -> bool:
        """Prefix caching for a hybrid model unless told: opt-in until vLLM PR #50991 ("[Mamba] enable
        prefix cache by default", merged 2026-08-04, first released in 0.28), on after."""
        return self.version >= (0, 28)

    @property
    def refuses_max_num_seqs_above_blocks(self) -> bool:
        """vLLM refuses to start when ``max_num_seqs`` exceeds the pool's blocks ("max_num_seqs (S)
        exceeds available Mamba cache blocks (N)"), from PR #38270 (merged 2026-03-26, in 0.19);
        0.18 capped the CUDA-graph sizes silently instead (PR #37416) and older releases checked nothing."""
        return self.version >= (0, 19)

    def state_blocks_per_request(self, family: str, prefix_caching: bool) -> int:
        """Blocks one request holds in each state group: 1 without prefix caching; 2 in "align"
        mode (the running state and the last checkpoint: ``MambaSpec.max_memory_usage_bytes``);
        the Mamba2 mixer adds one prefill checkpoint block (``MambaMixer2.get_kv_cache_spec``:
        ``num_prefill_checkpoint_blocks=1``, vLLM PR #57329 "Enable internal prefill checkpoints",
        opened 2026-09-17: in 0.32; the releases between 0.28 and 0.32 are not told apart here and
        are given the older count)."""
        if not prefix_caching:
            return 1
        return 2 + (1 if family == MAMBA2 and self.version >= (0, 32) else 0)


def vllm_rules(version: str | None = None) -> VllmRules:
    return VllmRules(parse_vllm_version(version))


@dataclass(frozen=True)
class HybridLayout:
    """vLLM's pool for one hybrid model on one rank: block size, pages, groups. Sizes in bytes."""

    attention_bytes_per_token: int
    """One attention layer's K and V (and per-token scales) for one token on one rank."""
    state_page_bytes: int
    """One state layer's state for one request, unpadded (vLLM's ``MambaSpec.page_size_bytes``)."""
    kernel_alignment: int
    block_size: int
    """Tokens per attention block, aligned so that a page holds a state."""
    page_bytes: int
    """``block_size x attention_bytes_per_token``: every layer's page, the state's padded to it."""
    group_size: int
    """Layers per KV-cache group: one block holds a page for each of them."""
    num_attention_layers: int
    num_state_layers: int
    attention_groups: int
    state_groups: int
    state_blocks_per_request: int
    prefix_caching: bool
    state_family: str
    rules: VllmRules
    block_size_raised: bool
    """Whether vLLM set the block size itself ("Setting attention block size to N tokens ...")."""

    @property
    def padding_pct(self) -> float:
        """vLLM's "Padding mamba page size by X%" (0 when the pages are equal)."""
        return 100 * (self.page_bytes - self.state_page_bytes) / self.state_page_bytes

    @property
    def block_bytes(self) -> int:
        """One block of the pool: a page for each of a group's ``group_size`` layers."""
        return self.page_bytes * self.group_size

    @property
    def num_groups(self) -> int:
        return self.attention_groups + self.state_groups

    @property
    def padding_layers(self) -> int:
        """Empty layer slots of the last group of each kind (vLLM warns "Add N padding layers")."""
        return (self.attention_groups * self.group_size - self.num_attention_layers
                + self.state_groups * self.group_size - self.num_state_layers)

    def num_blocks(self, pool_bytes: int) -> int:
        """Blocks a pool of ``pool_bytes`` holds (vLLM's ``num_blocks``)."""
        return max(0, pool_bytes // self.block_bytes)

    def blocks_per_request(self, tokens: int) -> int:
        """Blocks one request of ``tokens`` tokens holds: its attention blocks in every attention
        group and its state blocks in every state group."""
        return (self.attention_groups * math.ceil(tokens / self.block_size)
                + self.state_groups * self.state_blocks_per_request)

    def max_concurrency(self, num_blocks: int, max_model_len: int) -> float:
        """vLLM's "Maximum concurrency for N tokens per request"."""
        return num_blocks / self.blocks_per_request(max_model_len)

    def kv_tokens(self, num_blocks: int, max_model_len: int) -> int:
        """vLLM's "GPU KV cache size: N tokens" as this release prints it (:class:`VllmRules`)."""
        if self.rules.token_line_from_concurrency:
            return int(self.max_concurrency(num_blocks, max_model_len) * max_model_len)
        return num_blocks // self.num_groups * self.block_size

    def attention_tokens(self, num_blocks: int) -> int:
        """Tokens the pool holds for one request with every block spent on attention and its state
        blocks taken: what one sequence can grow to, ``(blocks - state blocks) / groups x block``."""
        free = num_blocks - self.state_groups * self.state_blocks_per_request
        return max(0, free // self.attention_groups * self.block_size) if self.attention_groups else 0


def hybrid_layout(attention_bytes_per_token: int, state_page_bytes: int, num_attention_layers: int,
                  num_state_layers: int, state_family: str, *, block_size: int | None = None,
                  prefix_caching: bool | None = None, vllm_version: str | None = None,
                  mla: bool = False) -> HybridLayout:
    """vLLM's pool layout for a hybrid model, from one attention layer's bytes per token and one
    state layer's state on one rank. ``block_size``: ``--block-size`` when given; ``prefix_caching``:
    ``None`` for the release's default."""
    if attention_bytes_per_token <= 0 or state_page_bytes <= 0:
        raise KVLedgerError("a hybrid layout needs attention and state layers with bytes to keep")
    rules = vllm_rules(vllm_version)
    caching = rules.prefix_caching_default if prefix_caching is None else prefix_caching
    align = max(CUDA_KERNEL_BLOCK_ALIGNMENT, block_size or 0)
    if mla:
        align = max(align, MLA_KERNEL_BLOCK_ALIGNMENT)
    needed = align * math.ceil(state_page_bytes / (align * attention_bytes_per_token))
    chosen = max(block_size or 0, needed)
    smallest, largest = sorted((num_attention_layers, num_state_layers))
    group = largest if largest < smallest * GROUP_SIZE_MAX_RATIO else smallest
    return HybridLayout(
        attention_bytes_per_token=attention_bytes_per_token, state_page_bytes=state_page_bytes,
        kernel_alignment=align, block_size=chosen, page_bytes=chosen * attention_bytes_per_token,
        group_size=group, num_attention_layers=num_attention_layers, num_state_layers=num_state_layers,
        attention_groups=math.ceil(num_attention_layers / group), state_groups=math.ceil(num_state_layers / group),
        state_blocks_per_request=rules.state_blocks_per_request(state_family, caching), prefix_caching=caching,
        state_family=state_family, rules=rules, block_size_raised=block_size is None or block_size < needed,
    )


def layout_for(kvb, *, mla: bool = False, block_size: int | None = None, prefix_caching: bool | None = None,
               vllm_version: str | None = None) -> HybridLayout:
    """:func:`hybrid_layout` for a hybrid model's :class:`~kvledger.spec.kv_bytes.KVBytes` (one rank)."""
    per_layer = (kvb.bytes_per_token + kvb.scale_bytes_per_token) // kvb.num_layers
    return hybrid_layout(per_layer, kvb.state_bytes_per_layer, kvb.num_layers, kvb.num_state_layers,
                         kvb.state_family or "", block_size=block_size, prefix_caching=prefix_caching,
                         vllm_version=vllm_version, mla=mla)
