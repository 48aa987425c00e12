"""Attention over the paged KV cache: one interface (backend.py), implementations looked up by name."""
