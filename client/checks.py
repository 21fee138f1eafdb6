"""Checked mode: runtime metadata validated before a launch (KERNEL_SERVICE_CHECK=1).

The kernels trust their index inputs, as vLLM's and FlashInfer's do: a `seq_lens[b]` past the
cache, a page id past the pages, a rope position outside its cache read out of bounds or give
garbage. Checked mode reads those inputs on the host before each launch and raises ValueError
naming the input, the entry and the bound. Its cost: a copy of the index tensors to the host
and a device sync per call, and no CUDA graph capture (a sync inside a capture is an error);
off by default. Every rule is here, one function per kind.
"""

from __future__ import annotations

import os

ENV = "KERNEL_SERVICE_CHECK"


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def _first_bad(values, low: int, high: int):
    """(index, value) of the first entry outside [low, high), else None."""
    bad = ((values < low) | (values >= high)).nonzero()
    if len(bad) == 0:
        return None
    index = tuple(int(i) for i in bad[0])
    return index, int(values[index])


def _kv_attention(kernel, args: dict) -> None:
    seq_lens, K = args["seq_lens"].cpu(), args["K"]
    table = args.get("block_table")
    page_size = K.shape[1] if table is not None else 1
    max_kv = table.shape[1] * page_size if table is not None else K.shape[1]
    bad = _first_bad(seq_lens, 0, max_kv + 1)
    if bad:
        raise ValueError(f"kv_attention: seq_lens[{bad[0][0]}] is {bad[1]}, outside [0, {max_kv}] (the keys the cache holds)")
    if table is None:
        return
    table = table.cpu()
    for b, n in enumerate(seq_lens.tolist()):
        pages = -(-n // page_size)  # the pages sequence b reads
        bad = _first_bad(table[b, :pages], 0, K.shape[0])
        if bad:
            raise ValueError(f"kv_attention: block_table[{b}, {bad[0][0]}] is {bad[1]}, outside [0, {K.shape[0]}) (the cache's pages)")


def _rope(kernel, args: dict) -> None:
    max_position = args["cos_sin_cache"].shape[0]
    bad = _first_bad(args["positions"].cpu(), 0, max_position)
    if bad:
        raise ValueError(f"rope: positions[{bad[0][0]}] is {bad[1]}, outside [0, {max_position}) (the rows of cos_sin_cache)")


RULES = {"kv_attention": _kv_attention, "rope": _rope}


def rule_for(kind: str):
    """The check a kernel of `kind` runs before each launch in checked mode, or None."""
    return RULES.get(kind) if enabled() else None
