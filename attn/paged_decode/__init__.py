"""Paged decode attention over head-major (optionally fp8) pages with per-head block tables."""

from attn.paged_decode.api import gather_pages, paged_decode, paged_decode_partials

__all__ = ["gather_pages", "paged_decode", "paged_decode_partials"]
