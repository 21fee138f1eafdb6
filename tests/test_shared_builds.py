"""Specs that fix a dim only the host code uses are served by one shared build.

A GEMM's M and N on sm_90+ size the grid and the TMA descriptors, never the
device code (and so do causal attention's batch and seq_len), so every static
(M, N) of one K and tiling is served by the build that leaves them to run time:
one lowering, one device compile, then a copy per spec with its sizes recorded
for the loader to enforce. The first test holds the kinds to that claim.
"""

from __future__ import annotations

import itertools
import json
import re

import pytest

import kernels
from tests.lowering import cuda_source
from tests.marks import needs_gpu, needs_nvcc

GEMM = {"kind": "gemm", "N": 512, "K": 128, "dtype": "float16", "trans_b": True, "block_N": 128, "target": "sm_90a"}


# GEMMs in the zoo's tilings and epilogues, on both TMA archs we target.
TILINGS = (
    {"block_M": 128, "block_N": 256, "block_K": 64, "num_stages": 3, "threads": 256},
    {"block_M": 128, "block_N": 128, "block_K": 64, "num_stages": 4, "threads": 256},
    {"block_M": 64, "block_N": 128, "block_K": 64, "num_stages": 4, "threads": 128},
)
ATTENTION = {"heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "float16"}
# (kind, params, arch, the dims its shared build leaves to run time)
SHARING = [("gemm", {"M": 4096, "N": 3072, "K": 2048, "dtype": "float16", "trans_b": True, **t}, "sm_90a", {"M", "N"}) for t in TILINGS] + [
    ("gemm", {"M": 256, "N": 384, "K": 64, "dtype": "bfloat16", "act": "gelu", "schedule": "tma"}, "sm_90a", {"M", "N"}),
    ("gemm", {"M": 256, "N": 384, "K": 64, "dtype": "float16", "bias": True, "schedule": "tma"}, "sm_90a", {"M"}),  # a bias reads N
    ("gemm", {"M": 512, "N": 1024, "K": 512, "dtype": "float16", "trans_b": True, "schedule": "tma"}, "sm_100a", {"M", "N"}),
    (
        "gemm",
        {
            "M": 100,
            "N": 1024,
            "K": 512,
            "dtype": "float16",
            "schedule": "splitk",
            "block_M": 32,
            "block_N": 64,
            "block_K": 128,
            "num_stages": 6,
            "threads": 128,
        },
        "sm_90a",
        {"M", "N"},
    ),
    ("attention", {**ATTENTION, "batch": 1, "seq_len": 4096, "causal": True, "block_M": 64}, "sm_90a", {"seq_len"}),
    ("attention", {**ATTENTION, "batch": 2, "seq_len": 4096, "causal": True, "block_M": 128}, "sm_90a", {"batch", "seq_len"}),
    (
        "attention",
        {**ATTENTION, "batch": 2, "seq_len": 1024, "causal": True, "dtype": "bfloat16", "head_dim": 64, "block_N": 64, "num_stages": 3},
        "sm_90a",
        {"batch", "seq_len"},
    ),
    ("attention", {**ATTENTION, "batch": 3, "seq_len": 1024, "causal": False}, "sm_90a", {"batch"}),  # seq_len bounds the key loop
]


def _static_values(dim: str, p: dict) -> tuple[int, int]:
    """Sizes to check: just past where TileLang lowers a static size otherwise (and no tile multiple), and a large one."""
    if dim in ("M", "N"):
        return p[f"block_{dim}"] + 8, 4096
    if dim == "seq_len":
        return 2 * p["num_stages"] * p["block_N"] + 8, 4096
    return 2, 7  # batch


@pytest.mark.parametrize("kind, params, arch, shared_dims", SHARING, ids=lambda v: v if isinstance(v, str) else None)
def test_host_side_dims_never_reach_the_device_code(kind, params, arch, shared_dims):
    spec = kernels.canonicalize(kind, params, arch)
    build, fixed = kernels.get_kind(kind).shared_build(spec)
    assert set(fixed) == shared_dims
    # The runtime-size build only gains the dims as (unused) kernel arguments.
    runtime = cuda_source(kind, build.params, arch)
    for dim in fixed:
        runtime = re.sub(rf",\s*int {dim}\b", "", runtime)
        assert f"int {dim}" not in runtime
    for values in itertools.product(*[[(dim, v) for v in _static_values(dim, spec.params)] for dim in fixed]):
        assert cuda_source(kind, {**spec.params, **dict(values)}, arch) == runtime, (kind, params, arch, values)


@pytest.mark.parametrize("causal", [True, False])
def test_causal_attention_starts_its_longest_query_blocks_first(causal):
    """Query block i of a causal attention reads i + 1 key blocks: the grid runs them last to first,
    counting blocks on the device (gridDim.x), so seq_len still reaches only the host code."""
    src = cuda_source("attention", {**ATTENTION, "batch": 1, "seq_len": 4096, "causal": causal}, "sm_90a")
    reversed_order = re.search(r"int bx = \(\(grid_x\(\) - \(\(int\)blockIdx\.x\)\) - 1\);", src)
    assert bool(reversed_order) == causal


def test_masked_attention_reads_only_the_key_blocks_its_rows_see():
    """A padded (varlen) or windowed attention's key loop starts at the first block its query block's
    rows see, read on the device from key_range, and ends where they stop seeing keys: that skipping
    is what makes a padded batch cheap. Masked forms claim no host-side dims."""
    p = dict(batch=None, heads=12, kv_heads=12, seq_len=None, head_dim=64, dtype="bfloat16", varlen=True, window=64)
    src = cuda_source("attention", p, "sm_90a")
    assert "const int* key_range" in src
    tiles = kernels.canonicalize("attention", p, "sm_90a").params
    shift = tiles["block_N"].bit_length() - 1  # kb counts key blocks
    first_block = (  # the range read once, the rows' first key less the window, its block
        r"lo = key_range\[",
        rf"int r0 = max\(\(\(\(int\)blockIdx\.x\) \* {tiles['block_M']}\), lo\);",
        r"int k0 = max\(lo, \(r0 - 64\)\);",
        rf"for \(int kb = \(k0 >> {shift}\); kb < ",
    )
    assert re.search(".*".join(first_block), src, re.S), src[:4000]
    # The range is read once by each warp role (the TMA producer, the consumers), never per score.
    assert src.count("key_range[") == 4, src.count("key_range[")
    spec = kernels.canonicalize("attention", {**p, "batch": 2, "seq_len": 512}, "sm_90a")
    assert kernels.get_kind("attention").shared_build(spec) is None


def _gemm(arch="sm_90a", **changes):
    params = {k: v for k, v in {**GEMM, **changes}.items() if k not in ("kind", "target")}
    return kernels.canonicalize("gemm", params, arch)


def test_which_specs_share_a_build():
    gemm = kernels.get_kind("gemm")
    spec = _gemm(M=384)
    build, fixed = gemm.shared_build(spec)
    assert fixed == {"M": 384, "N": 512} and build.params == {**spec.params, "M": None, "N": None}
    assert gemm.shared_build(build) is None  # the runtime-size build is its own build
    assert gemm.shared_build(_gemm(M=None))[1] == {"N": 512}  # a runtime-M spec still shares the build
    assert gemm.shared_build(_gemm(M=384, bias=True))[1] == {"M": 384}  # a bias reads N in device code
    # Where TileLang lowers a static size of a single tile otherwise.
    assert gemm.shared_build(_gemm(M=128, block_M=128)) is None
    assert gemm.shared_build(_gemm(M=4096, N=256, block_M=64, block_N=256, threads=128)) is None
    # A static M with schedule "auto" is a copy of its M range's build (Gemm.dispatch), or of the
    # build that range's build is a copy of, where N is a host-side dim too.
    for m, fixed in ((384, {"M": 384, "N": 512}), (33, {"M": 33})):
        auto = _gemm(M=m, block_N=None)
        route = gemm.routes(_gemm(M=None, block_N=None))[1]
        range_build = next(b for upto, b in route if upto is None or m <= upto)
        build, shared_fixed = gemm.shared_build(auto)
        assert shared_fixed == fixed and build in (range_build, gemm.shared_build(range_build)[0])
    assert gemm.shared_build(_gemm("sm_80", M=384)) is None  # no TMA: M reaches the device code
    attention = kernels.get_kind("attention")

    def shared_dims(arch="sm_90a", **changes):
        shared = attention.shared_build(kernels.canonicalize("attention", {**ATTENTION, "batch": 2, "seq_len": 4096, "causal": True, **changes}, arch))
        return shared and set(shared[1])

    assert shared_dims() == {"batch", "seq_len"}
    assert shared_dims(batch=1) == {"seq_len"}  # batch 1: block z is 0 in the device code
    assert shared_dims(causal=False) == {"batch"}  # seq_len bounds the key loop
    assert shared_dims(seq_len=512) == {"batch"}  # 4 key blocks of 128 in 2 stages: TileLang unrolls the barrier phases
    assert shared_dims(seq_len=640) == {"batch", "seq_len"}
    assert shared_dims("sm_80") is None
    assert gemm.shared_build(_gemm("c", M=384, dtype="float32", block_N=None)) is None


@needs_nvcc
def test_static_size_gemms_are_copies_of_one_build(make_daemon):
    import torch

    d = make_daemon("--cuda-compiler", "nvcc")
    c = d.client()
    specs = [{**GEMM, "M": 256}, {**GEMM, "M": 200, "N": 384}, {**GEMM, "M": 256}]
    assert c.prefetch(specs, load=False) == ["compiled", "compiled", "joined"]
    stats = c.stats()
    assert (stats["compiles"], stats["derived"], stats["entries"]) == (1, 2, 3)
    assert (stats["misses"], stats["joined"]) == (3, 1)  # the service's own request for the shared build is not counted
    metas = {(m["spec"]["params"]["M"], m["spec"]["params"]["N"]): m for m in (json.loads(p.read_text()) for p in d.cache_dir.glob("entries/*/*/entry.json"))}
    shared = metas[None, None]
    for m, n in ((256, 512), (200, 384)):
        meta = metas[m, n]
        assert meta["shared_build"]["spec"] == shared["spec"] and meta["abi"]["fixed"] == {"M": m, "N": n}
        assert {k: v for k, v in meta["abi"].items() if k != "fixed"} == shared["abi"]
    assert c.prefetch([{**GEMM, "M": None, "N": None}], load=False) == ["hit"]

    kernel = c.get_kernel("gemm", **{k: v for k, v in specs[0].items() if k != "kind"})
    assert kernel.abi["fixed"] == {"M": 256, "N": 512}
    a, b = torch.zeros(256, 128, dtype=torch.float16), torch.zeros(512, 128, dtype=torch.float16)
    # A runtime-size library would take these: the loader holds the spec's sizes.
    with pytest.raises(ValueError, match="asked for with M=256"):
        kernel(torch.zeros(200, 128, dtype=torch.float16), b)
    with pytest.raises(ValueError, match="asked for with N=512"):
        kernel(a, torch.zeros(384, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match="built for cuda"):
        kernel(a, b)  # the right sizes get as far as the device check


def test_a_failed_shared_build_fails_every_spec_it_serves(make_daemon):
    import client

    import tests.failing_kind  # noqa: F401  (clients validate locally: they share the daemon's registry)

    c = make_daemon("--kernel-module", "tests.failing_kind").client()
    with pytest.raises(client.CompileError, match="Buffer X is 1-dimensional") as first:
        c.get_kernel("broken_shared", target="c", N=4)
    assert "remembered" not in str(first.value)
    with pytest.raises(client.CompileError, match=r"(?s)Buffer X is 1-dimensional.*remembered failure"):
        c.get_kernel("broken_shared", target="c", N=8)  # another N, the same shared build: not built again
    stats = c.stats()
    assert (stats["failures"], stats["compiles"], stats["derived"], stats["entries"]) == (1, 0, 0, 0)


@needs_gpu
def test_copies_of_shared_builds_compute_like_torch(make_daemon):
    import torch

    from kernels.reference import make_inputs, reference, tolerance

    c = make_daemon("--target", "sm_90a").client()
    specs = [  # sizes that are no multiple of the tiles, so the runtime-size build's edges are exercised
        ("gemm", {"M": 1000, "N": 3080, "K": 2048, "dtype": "float16", "trans_b": True}),
        ("gemm", {"M": 333, "N": 392, "K": 256, "dtype": "bfloat16", "bias": True, "act": "silu"}),
        ("attention", {**ATTENTION, "batch": 2, "seq_len": 1000, "causal": True, "block_M": 64}),
        ("attention", {**ATTENTION, "batch": 1, "seq_len": 4096, "causal": True}),
    ]
    for kind, params in specs:
        kernel = c.get_kernel(kind, target="sm_90a", **params)
        assert kernel.abi["fixed"], (kind, params)  # served by a shared build
        ins = make_inputs(kind, kernel.spec["params"], "cuda")
        torch.testing.assert_close(kernel(*ins).float(), reference(kind, kernel.spec["params"], ins).float(), **tolerance(params["dtype"]))
    assert c.stats()["derived"] == len(specs)
