"""Prefix hits an int4 / int2 (KIVI) cache can take without changing a bit.

A token at position p reads its sequence's blocks below spec.blocks_read_quantized(p) quantized
and the newer ones (its residual window) in full precision (attention/kivi_reads.py). A request
that resumes at a hit's end h must therefore find the blocks of the window before h in full
precision, as computing its prompt would have left them; the older ones it may find in either
form (a row reads a full-precision block quantized through a scratch record, bit for bit the
pool's quantization).

So a KIVI cache publishes each block twice: its full-precision form as soon as it is full, under
full_precision_key(hash) with the block's hash as its parent, and its quantized form once it is
quantized, under its hash (a sink block, never quantized, only under its hash). The KV tiers keep
both forms as records of their keys, and a load takes the forms a hit would (kv/manager.py). The full-precision form stays cached after the
block is quantized elsewhere, and goes like any cached block, least recently used first, when
the pool needs its bytes (kv/arena.py quantizes into its own bytes only when nothing else is
free, and forgets the cached form then). A hit ends at the furthest block boundary whose window
is cached in full precision; every earlier block is taken quantized where it can be.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain

from kvserve.kv.block_pool import KVBlock
from kvserve.kv.hashing import block_hash
from kvserve.kv.prefix import PrefixCache, PrefixHit
from kvserve.kv.spec import KVCacheSpec

_FULL_PRECISION = b"kivi-full-precision"


def full_precision_key(key: int) -> int:
    """The key a block's full-precision form is published under (its quantized form: `key`)."""
    return block_hash(key, (), _FULL_PRECISION)


def read_in_full_precision(spec: KVCacheSpec, index: int, end: int) -> bool:
    """Whether block `index` must be in full precision for a request resuming at token `end`: a
    sink block, or one of the residual window before it (older ones may be either form)."""
    return index < spec.quant_sink_blocks or index >= spec.blocks_read_quantized(end)


def exact_hit(cache: PrefixCache, spec: KVCacheSpec, token_ids: Sequence[int], hashes: Sequence[int], limit: int) -> PrefixHit:
    """The longest cached prefix of at most `limit` tokens, in whole blocks, that gives a request
    the bits of computing it: every group holds the blocks its rows read from the hit's end on, the
    residual window's in full precision."""
    bs, sink = spec.block_size, spec.quant_sink_blocks
    groups = cache.groups
    full_attention = [g for g, group in enumerate(groups) if group.window is None]
    whole = min(len(hashes), limit // bs)

    def held(group: int, key: int, tokens: tuple[int, ...]) -> KVBlock | None:
        block = cache.cached(group, key)
        return block if block is not None and block.token_ids == tokens else None

    quantized: list[list[KVBlock | None]] = [[] for _ in groups]  # the hash's entry: a sink block is full precision
    precise: list[list[KVBlock | None]] = [[] for _ in groups]
    reach = 0  # every full-attention group holds some form of each block below
    for i in range(whole):
        tokens, key = tuple(token_ids[i * bs : (i + 1) * bs]), full_precision_key(hashes[i]) if i >= sink else None
        for g in range(len(groups)):
            quantized[g].append(held(g, hashes[i], tokens))
            precise[g].append(quantized[g][i] if key is None else held(g, key, tokens))
        if any(quantized[g][i] is None and precise[g][i] is None for g in full_attention):
            break  # a full-attention group reads every block before the hit's end
        reach = i + 1

    def form(g: int, i: int, end: int) -> KVBlock | None:
        return precise[g][i] if read_in_full_precision(spec, i, end) else (quantized[g][i] or precise[g][i])

    def checked(g: int, m: int, end: int) -> Iterable[int]:
        """The blocks of group g a hit ending at block m reads that may lack the form it needs: a
        sliding group's window; a full-attention group's sink and residual window (the older ones
        all have a form, or `reach` would be lower)."""
        first = groups[g].first_block(end, bs)
        if groups[g].window is not None:
            return range(first, m)
        return chain(range(first, min(sink, m)), range(max(first, sink, spec.blocks_read_quantized(end)), m))

    for m in range(reach, 0, -1):
        end = m * bs
        if all(form(g, i, end) is not None for g in range(len(groups)) for i in checked(g, m, end)):
            blocks = []
            for g, group in enumerate(groups):
                first = group.first_block(end, bs)
                blocks.append([None] * first + [form(g, i, end) for i in range(first, m)])
            return PrefixHit(num_tokens=end, blocks=blocks)
    return PrefixHit(blocks=[[] for _ in groups])
