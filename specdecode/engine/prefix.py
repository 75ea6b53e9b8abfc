"""What the serving engine shares between requests through the prefix cache.

Owns: when a request's prompt is matched against the cached blocks (`match`: before its
first prefill pass, so requests admitted together still share what the first computed)
and which of its blocks are published (`publish`: every full committed block; a prefill's
with the drafter's target features, which a later match hands back). Does not own: the
blocks, their keys and their eviction (prefix_cache.py, block_pool.py).
"""

from __future__ import annotations

import torch

from specdecode.engine import processing
from specdecode.engine.requests import Request
from specdecode.cache.prefix_cache import PrefixCachingKVCache


def match(cache: PrefixCachingKVCache, req: Request, features: bool) -> None:
    """Start a request that computed nothing from the longest cached run of its tokens' full
    blocks: all but the last token (its logits are needed). Not where its prompt's logprobs
    are asked for (they need every position's logits). With ``features`` (the drafter reads
    the target's), only blocks that kept theirs count; they become the request's."""
    req.matched = True
    if processing.wants_prompt_logprobs(req.seq, 0):
        return
    usable = (lambda extra: extra is not None) if features else None
    tokens = req.seq.token_ids[: req.prefill_target]
    req.cached = cache.match_prefix(req.request_id, tokens, req.prefill_target - 1, usable)
    if req.num_cached_tokens is None:
        req.num_cached_tokens = req.cached
    if req.cached and features:
        req.features = [torch.cat([cache.pool.extra(b) for b in cache.block_table(req.request_id)])]


def publish(cache: PrefixCachingKVCache, req: Request, prefill: bool = False) -> None:
    """Cache the request's full committed blocks; with ``prefill``, each keeps its features
    (the request's prefill features cover every token it has computed)."""
    extra = None
    if prefill:
        if len(req.features) > 1:
            req.features = [torch.cat(req.features)]
        features, bs = req.features[0], cache.block_size
        extra = lambda i: features[i * bs : (i + 1) * bs].clone()  # noqa: E731
    cache.publish(req.request_id, req.seq.token_ids, extra)
