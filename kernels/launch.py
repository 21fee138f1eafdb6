"""What CUDA kernels of the zoo call inside their T.Kernel: programmatic dependent launch, which
every one does first, and reading the grid's size on the device. Build-time helpers (TileLang is
imported when they run, not when this module is)."""


def dependent_launch(target, trigger=True):
    """The first statement of every CUDA kernel, inside its T.Kernel: programmatic dependent launch
    on sm_90 and newer (PTX griddepcontrol; docs/measured.md#programmatic-dependent-launch).

    The kernel first waits until the kernels launched before it on the stream have finished and
    their writes are visible (griddepcontrol.wait), so every global read comes after it; then it
    lets the next kernel launch (griddepcontrol.launch_dependents). TileLang launches a kernel that
    waits with programmatic stream serialization, so the next one's launch and block scheduling
    overlap this one's tail instead of following its exit; in a chain of small decode kernels
    that gap is a large part of each step. With trigger=False the kernel calls
    launch_dependents itself, later."""
    if target.compute_capability >= 90:
        import tilelang.language as T
        from tilelang.cuda.language import pdl_sync

        T.evaluate(pdl_sync())
        if trigger:
            launch_dependents(target)


def launch_dependents(target):
    """Lets the next kernel on the stream launch (sm_90 and newer): a kernel that started with
    dependent_launch(target, trigger=False) calls it once its main loop is done."""
    if target.compute_capability >= 90:
        import tilelang.language as T
        from tilelang.cuda.language import pdl_trigger

        T.evaluate(pdl_trigger())


# A macro, not a function: TileLang puts imported source above its #includes, and a directive
# there keeps the include block NVRTC precompiles (build/nvrtc.py) whole; a function would end it.
GRID_X = "#define grid_x() ((int)gridDim.x)\n"


def grid_x():
    """The grid's x extent read on the device (gridDim.x): a size the host computed from runtime
    dims, without its expression in the device code (there it would also be evaluated per use)."""
    import tilelang.language as T

    T.import_source(GRID_X)
    return T.call_extern("int32", "grid_x")
