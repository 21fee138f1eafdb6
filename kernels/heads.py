"""What the attention kinds (attention, kv_attention) share in their parameters: the head
layout, grouped-query (GQA) included, and its rule."""

from .spec import InvalidSpec, dim

HEADS = dim("heads", "query heads")
KV_HEADS = dim("kv_heads", "key/value heads; heads must be a multiple (GQA)")
HEAD_DIM = dim("head_dim")


def check_gqa(p):
    """Each key/value head serves a whole group of query heads."""
    if p["heads"] % p["kv_heads"]:
        raise InvalidSpec("kv_heads", f"heads ({p['heads']}) must be a multiple of kv_heads ({p['kv_heads']})")
