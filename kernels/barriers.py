"""Barriers the zoo's Hopper tensor-core kernels (gemm, attention) place themselves, with
TileLang's ThreadSync pass turned off for their builds. Build-time helpers, called inside a
T.Kernel as launch.py's are.

ThreadSync is the costliest pass of lowering such a kernel: it proves each pair of shared-memory
accesses apart with Z3 (docs/measured.md#barriers-placed-by-hand). In these kernels the TMA
pipeline synchronises through mbarriers, so the pass places few barriers: among the epilogue's
threads before and after each write of the shared tile they stage the output (and a residual)
through, and attention's one after its Q load. Each kernel places those itself, with
sync_shared. tests/test_barriers.py checks the generated code is byte for byte what ThreadSync
makes, so a TileLang that places barriers otherwise fails there, not as a race on the GPU."""


def owns_barriers(target) -> bool:
    """Hopper: the warp-specialised TMA pipelines these kernels lower to (checked there)."""
    return 90 <= target.compute_capability < 100


def sync_shared(target, threads=None):
    """A barrier where ThreadSync would place one: among the kernel's `threads` compute threads
    (the TMA producer warps take no part; named barrier 3 is the first TileLang leaves free), or
    with threads=None among the whole block (__syncthreads)."""
    if owns_barriers(target):
        import tilelang.language as T

        T.evaluate(T.sync_threads() if threads is None else T.sync_threads(3, threads))


def without_thread_sync(func, target):
    """The PrimFunc with ThreadSync turned off for its build (compiler._build_options reads it)."""
    if not owns_barriers(target):
        return func
    return func.with_attr("tilelang_pass_configs", {**dict((func.attrs or {}).get("tilelang_pass_configs") or {}), "tl.disable_thread_storage_sync": True})
