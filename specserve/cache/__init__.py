"""Prefix caching for the KV pool: a radix tree over token ids (see radix_cache.py)."""
