"""Split-KV partial-result merge (log-sum-exp weighted)."""

from attn.merge.api import merge_partials

__all__ = ["merge_partials"]
