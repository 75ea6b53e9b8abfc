"""KV caches: contiguous rows (kv_cache.py), paged blocks from a shared pool (paged_cache.py,
block_pool.py), and automatic prefix caching over the paged blocks (prefix_cache.py)."""
