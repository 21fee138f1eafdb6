"""TileLang's DSL rewrite, done once per function in a worker.

TileLang turns each `@T.prim_func` and `@T.macro` body into an IR generator by reading the
function's source, rewriting its syntax tree and compiling the result
(`tilelang.language.eager.ast.mutate`), every time the decorator runs. A kernel factory
defines its body as a closure over the build's params, so every build of a kind rewrites
the same source again, and TileLang's own `T.reduce_*` define a macro on every call.

What the rewrite produces depends on the function's code, its globals, the names of its
closure variables, and the values of the few expressions the rewriter evaluates (argument
annotations such as `T.float32`, the context managers of `with` statements, to tell a
`T.Kernel`). The cache keys on the first three; a hit evaluates those expressions again,
with the function's own closure, and reuses the rewrite only when every value is the same
object as before. The rewritten function is then bound to this call's closure values, as
TileLang's own `make_closure(**nonlocals)` binds them.
"""

from __future__ import annotations

import ast
import threading
import types

_cache: dict[tuple, tuple] = {}
_recording = threading.local()  # the evaluations of the rewrite in progress on this thread


def install() -> None:
    """Puts the cache in front of TileLang's rewrite, for the decorators of this process."""
    from tilelang.language.eager import ast as dsl
    from tilelang.language.eager import builder

    if getattr(builder.mutate, "_cached", False):
        return
    rewrite, evaluate = builder.mutate, dsl.DSLMutator._try_eval

    def recorded_evaluate(self, node):
        value = evaluate(self, node)
        log = getattr(_recording, "log", None)
        if log is not None:
            log.append((ast.unparse(node), value))
        return value

    def cached_rewrite(func):
        from tilelang.language.eager import utils

        closure = utils.get_func_nonlocals(func)
        key = (func.__code__, id(func.__globals__), tuple(closure))
        hit = _cache.get(key)
        if hit is not None and all(_evaluate(text, closure, func.__globals__) is value for text, value in hit[1]):
            generator, _ = hit
            return dsl.IRGenerator(gen=_rebind(generator.gen, closure), source=generator.source, extra_type_hints=dict(generator.extra_type_hints))
        outer, _recording.log = getattr(_recording, "log", None), []
        try:
            generator = rewrite(func)
            _cache[key] = (generator, _recording.log)
        finally:
            _recording.log = outer
        return generator

    cached_rewrite._cached = True
    dsl.DSLMutator._try_eval = recorded_evaluate
    builder.mutate = cached_rewrite


def _evaluate(text: str, closure: dict, globals_: dict):
    """What the rewriter's `_try_eval` gives for the expression `text` (its own rule, on the text)."""
    from tilelang.language.eager.ast import _try_eval

    return _try_eval(ast.parse(text, mode="eval").body, closure, globals_)


def _rebind(function, closure: dict):
    """`function` (TileLang's generated IR generator) with its free variables taken from `closure`."""
    cells = tuple(types.CellType(closure[name]) for name in function.__code__.co_freevars)
    return types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__, cells)
