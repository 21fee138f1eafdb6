"""JSON from outside (a manifest, a bundle's index) read with a nesting limit.

`json.loads` recurses once per level: a document of a few thousand nested brackets
ends in RecursionError, a traceback instead of a refusal. Nothing this project
reads nests deeper than a handful of levels. Light to import.
"""

from __future__ import annotations

import json

MAX_DEPTH = 32  # levels of arrays and objects: a record of this project uses under 10


def load_json(raw: bytes | str, max_depth: int = MAX_DEPTH):
    """The document in `raw`; raises ValueError (json.JSONDecodeError for bad syntax) when it
    is not JSON or nests more than `max_depth` arrays and objects."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ValueError(f"nested more than {max_depth} levels deep") from None
    # Measured after parsing, without recursion: json.loads stops far deeper than max_depth.
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(max_depth):
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node) if isinstance(child, (dict, list))]
        if not level:
            return value
    raise ValueError(f"nested more than {max_depth} levels deep")
