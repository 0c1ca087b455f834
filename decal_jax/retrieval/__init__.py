"""Compressed multi-vector retrieval: data, index, search, metrics."""
