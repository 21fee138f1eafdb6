"""The gemm kind's schedules (tma, splitk, gemv) and its dispatch table by M (issue #18).

A CUDA spec with M=None and schedule "auto" is a router: one build per M range
(Gemm.dispatch), each correct for every M; a static M with schedule "auto" gets its
range's overrides and is served by that range's M=None build. The table tests and
the sm_90a lowerings run on any machine (TileLang cross-compiles); the numerics test
needs a GPU.
"""

from __future__ import annotations

import re

import pytest

import kernels
from kernels.gemm import TILES, overrides_for, ranges
from kernels.spec import InvalidSpec
from tests.lowering import cuda_source
from tests.marks import needs_gpu

GEMM = kernels.get_kind("gemm")
# Weights of the decode table (issue #18), a runtime N, and shapes no tile divides.
SHAPES = [
    dict(N=14336, K=4096, trans_b=True),
    dict(N=4096, K=4096, trans_b=True),
    dict(N=6144, K=4096, trans_b=True),
    dict(N=4096, K=14336, trans_b=True),
    dict(N=None, K=4096, trans_b=True),
    dict(N=1000, K=1000, trans_b=False),
    dict(N=4104, K=200, trans_b=True, bias=True, act="gelu", residual=True),
]


def compiled(spec):
    """The build that is compiled for `spec`: the end of its chain of shared builds."""
    while (shared := GEMM.shared_build(spec)) is not None:
        spec = shared[0]
    return spec


def _spec(arch="sm_90a", dtype="float16", **params):
    return kernels.canonicalize("gemm", {"M": None, "dtype": dtype, **params}, arch)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(str(s.get(d)) for d in ("N", "K")) + ("-nt" if s["trans_b"] else "-nn"))
def test_the_dispatch_table_covers_every_m_with_one_build_per_range(shape, dtype):
    router = _spec(dtype=dtype, **shape)
    assert router.params["schedule"] == "auto" and all(router.params[t] is None for t in TILES)  # the dispatching spec
    dim, table = GEMM.dispatch(dict(router.params), router.target)
    uppers = [upper for upper, _ in table]
    assert dim == "M" and uppers[-1] is None and uppers[:-1] == sorted(set(uppers[:-1])) and all(u >= 1 for u in uppers[:-1])
    assert table == ranges(router.params, router.target)  # one table: dispatch and check read the same
    builds = {}
    for upper, overrides in table:
        assert set(overrides) == {"schedule", *TILES} and overrides["schedule"] != "auto"  # complete: it pins the build
        build = GEMM.canonicalize({**router.params, **overrides}, router.target)
        assert build.params["M"] is None and {k: build.params[k] for k in overrides} == overrides
        assert GEMM.canonicalize(build.params, router.target) == build  # stable: one key
        assert GEMM.dispatch(dict(build.params), build.target) is None  # a range's build never routes again
        builds[upper] = build
    routes = GEMM.routes(router)[1]
    assert [(u, b) for u, b in routes] == list(builds.items())
    # Every static M, at and around each bound, takes exactly its range's overrides and build.
    for m in sorted({1, 2, 5000, *(u + d for u in uppers[:-1] for d in (-1, 0, 1) if u + d >= 1)}):
        upper = next(u for u in uppers if u is None or m <= u)
        static = _spec(dtype=dtype, **{**shape, "M": m})
        assert {k: static.params[k] for k in table[uppers.index(upper)][1]} == overrides_for(table, m) == table[uppers.index(upper)][1]
        build, fixed = GEMM.shared_build(static)  # its range's build, or the build that one is a copy of
        assert fixed["M"] == m and compiled(build) == compiled(builds[upper])
        assert GEMM.canonicalize(static.params, static.target) == static


def test_decode_sizes_get_decode_schedules():
    def schedule_at(m, **shape):
        return _spec(M=m, **shape).params["schedule"]

    assert [schedule_at(m, N=4096, K=4096, trans_b=True) for m in (1, 8, 32, 128, 4096)] == ["gemv", "splitk", "splitk", "tma", "tma"]
    assert schedule_at(1, N=4096, K=4096) == "splitk"  # gemv reads [N, K] rows: not without trans_b
    assert _spec(M=4096, N=4096, K=4096, trans_b=True).params["block_N"] == 256  # prefill keeps its tile
    # 65-512 rows: column tiles sized so the grid fills whole waves of the 132 SMs, not only powers of two.
    assert [_spec(M=m, N=14336, K=4096, trans_b=True).params["block_N"] for m in (128, 512)] == [112, 224]  # 128 and 256 blocks
    assert [_spec(M=m, N=6144, K=4096, trans_b=True).params["block_N"] for m in (128, 512)] == [48, 192]  # 128 blocks each
    assert _spec(M=512, N=4096, K=4096, trans_b=True).params["block_N"] == 128
    # float32 (tf32) and pre-Hopper parts keep the one prefill build: nothing to route.
    for spec in (_spec(dtype="float32", N=512, K=512), _spec("sm_80", N=512, K=512)):
        assert spec.params["schedule"] == "tma" and spec.params["block_M"] == 128 and GEMM.dispatch(dict(spec.params), spec.target) is None


def test_explicit_tiles_and_schedules():
    assert _spec(N=512, K=512, block_M=64).params["schedule"] == "tma"  # tiles given with "auto": the prefill kernel, as before
    assert GEMM.dispatch(dict(_spec(N=512, K=512, block_M=64).params), kernels.parse_target("sm_90a")) is None
    gemv = _spec(N=512, K=512, trans_b=True, schedule="gemv")
    assert (gemv.params["block_N"], gemv.params["threads"], gemv.params["num_stages"], gemv.params["split_k"]) == (8, 256, None, None)
    assert _spec(N=512, K=512, schedule="splitk").params["split_k"] == 1
    assert GEMM.scratch(_spec(N=512, K=512, schedule="splitk", split_k=2).params) == ("W",)
    assert GEMM.scratch(_spec(N=512, K=512, schedule="splitk").params) == () == GEMM.scratch(_spec(N=512, K=512).params)
    for params, field in [
        (dict(schedule="gemv"), "schedule"),  # needs trans_b
        (dict(schedule="gemv", trans_b=True, threads=128), "threads"),  # one warp per row of the block
        (dict(schedule="tma", split_k=2), "split_k"),
        (dict(schedule="gemv", trans_b=True, num_stages=2), "num_stages"),
        (dict(schedule="splitk", split_k=9, block_K=64), "split_k"),  # 8 tiles of K cannot make 9 slices
        (dict(schedule="splitk", split_k=17), "split_k"),
        (dict(schedule="tma", block_N=100), "block_N"),  # wgmma widths are multiples of 16
        (dict(schedule="tma", block_N=272), "block_N"),
    ]:
        with pytest.raises(InvalidSpec) as err:
            _spec(N=512, K=512, **params)
        assert err.value.field == field, params


def test_the_cpu_has_one_kernel_whatever_the_schedule():
    specs = [_spec("c", dtype="float32", N=64, K=64, schedule=s) for s in ("auto", "tma", "splitk", "gemv")]
    assert all(s == specs[0] for s in specs) and specs[0].params["schedule"] == "auto"
    assert GEMM.dispatch(dict(specs[0].params), specs[0].target) is None
    assert (specs[0].params["block_M"], specs[0].params["split_k"]) == (32, None)
    with pytest.raises(InvalidSpec, match="split_k"):
        _spec("c", dtype="float32", N=64, K=64, split_k=2)


# One of each schedule, with epilogues, at sizes no tile divides.
SCHEDULES = [
    dict(N=4104, K=4104, trans_b=True, schedule="gemv", block_M=1, block_N=8, block_K=1024),
    dict(N=1000, K=1000, trans_b=True, dtype="bfloat16", bias=True, act="silu", residual=True, schedule="gemv", block_M=4, block_N=4, block_K=512),
    dict(N=1000, K=1000, bias=True, act="relu", schedule="splitk", block_M=16, block_N=64, block_K=256, num_stages=4, threads=128, split_k=1),
    dict(
        N=4104,
        K=4104,
        trans_b=True,
        dtype="bfloat16",
        residual=True,
        schedule="splitk",
        block_M=128,
        block_N=128,
        block_K=64,
        num_stages=5,
        threads=256,
        split_k=4,
    ),
    dict(N=1000, K=1000, trans_b=True, bias=True, act="gelu", schedule="splitk", block_M=64, block_N=64, block_K=128, num_stages=4, threads=128, split_k=3),
    dict(N=1000, K=1000, trans_b=True, schedule="tma", block_M=64, block_N=128, block_K=64, num_stages=6, threads=128),
    dict(N=1000, K=1000, schedule="tma", block_M=128, block_N=112, block_K=64, num_stages=4, threads=256),  # a width no power of two
]


def _ids(p):
    return f"{p['schedule']}-{p.get('split_k', 0)}-{p.get('dtype', 'float16')}"


@pytest.mark.parametrize("params", SCHEDULES, ids=_ids)
def test_every_schedule_lowers_for_sm_90a(params):
    import tilelang
    import tvm

    spec = _spec(**params)
    target = kernels.parse_target("sm_90a")
    func = GEMM.build(dict(spec.params), target)
    names = [func.buffer_map[v].name for v in func.params if v in func.buffer_map]
    assert set(GEMM.scratch(spec.params)) <= set(names) and names[-1] == "C"
    with tvm.transform.PassContext(opt_level=3), tvm.target.Target(target.tilelang_target()):
        source = tilelang.lower(func, target=tvm.target.Target(target.tilelang_target())).kernel_source
    assert "main_kernel" in source
    assert ("main_kernel_1" in source) == ((spec.params["split_k"] or 1) > 1)  # split-K partials are summed by a second kernel


@pytest.mark.parametrize(
    "arch,tile,product",
    [
        ("sm_90a", (128, 256), "64, 256, 16"),  # the prefill tile: one m64n256 wgmma per warpgroup, not two m64n128
        ("sm_90a", (128, 192), "64, 192, 16"),  # a width no power of two
        ("sm_90a", (64, 128), "64, 128, 16"),
        ("sm_80", (128, 256), "16, 8, 16"),  # mma.sync: the default warp layout
    ],
)
def test_each_warpgroup_spans_the_tile_width_on_hopper(arch, tile, product):
    threads = 256 if tile[0] == 128 else 128
    src = cuda_source(
        "gemm",
        dict(
            M=4096,
            N=4096,
            K=4096,
            dtype="float16",
            trans_b=True,
            schedule="tma",
            block_M=tile[0],
            block_N=tile[1],
            block_K=64 if arch == "sm_90a" else 32,
            num_stages=3 if arch == "sm_90a" else 2,
            threads=threads,
        ),
        arch,
    )
    products = set(re.findall(r"(?:wgmma_ss|mma_sync)<(?:[^,]*, ){3}(\d+, \d+, \d+)", src))
    assert products == {product}


@needs_gpu
def test_every_schedule_and_the_router_compute_like_torch(make_daemon):
    import torch

    from kernels.reference import make_inputs, reference, tolerance

    c = make_daemon("--target", "sm_90a", workers=4).client()
    specs = [{"dtype": "float16", **p} for p in SCHEDULES] + [
        dict(N=4104, K=4104, trans_b=True, dtype="float16"),  # routers: every range's build, by M
        dict(N=1000, K=1000, dtype="bfloat16", bias=True, act="gelu", residual=True),
        dict(N=6152, K=1000, trans_b=True, dtype="float16", bias=True),  # 128x48 tiles to 128 rows, 128x192 to 512
    ]
    for params in specs:
        kernel = c.get_kernel("gemm", target="sm_90a", M=None, **params)
        for m in (1, 7, 33, 100, 129, 300, 1000):  # a row count in every range
            ins = make_inputs("gemm", kernel.spec["params"], "cuda", runtime={"M": m})
            torch.testing.assert_close(kernel(*ins).float(), reference("gemm", kernel.spec["params"], ins).float(), **tolerance(params["dtype"]))
    static = c.get_kernel("gemm", target="sm_90a", M=33, N=1000, K=1000, dtype="float16", trans_b=True)
    assert static.abi["fixed"]["M"] == 33 and static.shared_build["spec"]["params"]["M"] is None  # a copy of its range's build
    ins = make_inputs("gemm", static.spec["params"], "cuda")
    torch.testing.assert_close(static(*ins).float(), reference("gemm", static.spec["params"], ins).float(), **tolerance("float16"))
