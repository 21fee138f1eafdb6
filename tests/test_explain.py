"""Explain: hit or miss, the key's inputs, and for a miss exactly which fields the nearest
entries differ in. Entries of other toolchains are planted through the store's put()."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import client
import kernels
from compile_service import explain
from compile_service.keys import cache_key, tilelang_version, toolchain
from compile_service.store import LocalStore
from tests.plant import host_toolchain, plant, spec_of

ROOT = Path(__file__).resolve().parent.parent
CC = "nvrtc-13.0"  # the serve-only daemon keys CUDA kernels as if built by this compiler

ATTENTION = dict(batch=1, heads=8, kv_heads=2, seq_len=None, head_dim=64, dtype="float16")

# (what is asked for, what is planted: spec and toolchain changes, the difference Explain must name)
CASES = {
    "parameter": (("rmsnorm", "c", dict(M=None, N=4096, dtype="float32")), (dict(N=4104), None, {}), "N=4096 vs 4104"),
    "dtype": (("softmax", "sm_90a", dict(M=None, N=4096, dtype="float16")), (dict(dtype="bfloat16"), None, {}), "dtype=float16 vs bfloat16"),
    "target": (("swiglu", "sm_90a", dict(M=None, N=4096, dtype="float16")), ({}, "sm_80", {}), "target sm_90a vs sm_80"),
    "tilelang": (("gemm", "c", dict(M=None, N=64, K=32, dtype="float32")), ({}, None, {"tilelang": "0.1.14"}), f"tilelang {tilelang_version()} vs 0.1.14"),
    "cuda compiler": (("attention", "sm_90a", ATTENTION), ({}, None, {"cuda_compiler": "nvcc-13.0.88"}), f"cuda {CC} vs nvcc-13.0.88"),
    "kernel source": (("rmsnorm", "sm_90a", dict(M=None, N=2048, dtype="float16")), ({}, None, {"kind_source": "0123456789abcdef"}), "kind_source"),
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """A serve-only daemon on a cache holding one planted near-miss per case."""
    from devtools.launch import DaemonProcess

    base = tmp_path_factory.mktemp("explain")
    store = LocalStore(base / "cache")
    for (kind, target, params), (changed, other_target, toolchain_changes), _ in CASES.values():
        planted = spec_of(kind, other_target or target, **{**params, **changed})
        plant(store, planted, {**host_toolchain(planted, CC), **toolchain_changes})
    # A second rmsnorm entry, farther away (two fields differ): never the nearest.
    far = spec_of("rmsnorm", "c", M=None, N=4104, dtype="float32", eps=1e-5)
    plant(store, far, host_toolchain(far, CC))
    d = DaemonProcess(base / "cache", "--target", "c", "--no-compile", "--cuda-compiler-id", CC, log_path=base / "daemon.log").start(timeout=120)
    yield d
    d.stop()


@pytest.mark.parametrize("case", CASES)
def test_a_miss_names_the_field_the_nearest_entry_differs_in(daemon, case):
    (kind, target, params), _, expected = CASES[case]
    e = daemon.client().explain(kind, target=target, **params)
    assert not e["hit"]
    assert e["spec"] == spec_of(kind, target, **params)  # the key's inputs: the canonical spec...
    assert set(e["toolchain"]) == {"schema", "tilelang", "cuda_compiler", "machine", "kind_source"}  # ...and each toolchain part
    assert e["toolchain"]["cuda_compiler"] == (None if target == "c" else CC)
    nearest = e["nearest"][0]
    texts = [d["text"] for d in nearest["differences"]]
    assert any(t.startswith(expected) for t in texts), texts
    if case != "target":  # another target also has its own default tiles: more fields differ
        assert len(texts) == 1, texts
    assert expected in e["reason"] or case == "kernel source"


def test_nearest_entries_come_fewest_differences_first_and_a_hit_says_so(daemon):
    c = daemon.client()
    e = c.explain("rmsnorm", target="c", M=None, N=4096, dtype="float32")
    counts = [len(n["differences"]) for n in e["nearest"]]
    assert counts[:2] == [1, 2] and counts == sorted(counts)  # then the sm_90a rmsnorm, far away
    assert {d["field"] for d in e["nearest"][1]["differences"]} == {"N", "eps"}
    assert e["nearest"][0]["differences"][0] == {"part": "param", "field": "N", "wanted": 4096, "found": 4104, "text": "N=4096 vs 4104"}

    hit = c.explain("rmsnorm", target="c", M=None, N=4104, dtype="float32")
    assert hit["hit"] and hit["reason"] == "hit" and hit["nearest"] == []


def test_a_kind_with_no_entries_says_so(tmp_path):
    store = LocalStore(tmp_path / "cache")
    planted = spec_of("rmsnorm", "c", M=None, N=64, dtype="float32")
    plant(store, planted, host_toolchain(planted, CC))
    spec = kernels.canonicalize("softmax", dict(M=None, N=16, dtype="float32"), "c")
    e = explain.explain(store, spec, cache_key(spec, CC), toolchain("softmax", "c", CC))
    assert (e.hit, e.nearest, e.reason) == (False, (), "no entry of kind softmax in the cache (1 entries of other kinds)")


def test_a_strict_miss_carries_the_explanation(daemon):
    (kind, target, params), _, expected = CASES["tilelang"]
    e = daemon.client().explain(kind, target=target, **params)
    with pytest.raises(client.KernelNotReady) as err:
        daemon.client(strict=True).get_kernel(kind, target=target, **params)
    assert err.value.key == e["key"] and e["key"] in str(err.value)
    assert expected in str(err.value) and '"kind":"gemm"' in str(err.value)


def test_explain_command(daemon):
    def explain(*args):
        return subprocess.run(
            [sys.executable, "-m", "compile_service.cli", "explain", *args, "--socket", str(daemon.socket)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    miss = explain("rmsnorm", "M=none", "N=4096", "dtype=float32", "--target", "c")
    assert miss.returncode == 1, miss.stderr
    assert miss.stdout.startswith("MISS  rmsnorm") and "N=4096 vs 4104" in miss.stdout and "tilelang=" in miss.stdout
    hit = explain("rmsnorm", "M=none", "N=4104", "dtype=float32", "--target", "c")
    assert hit.returncode == 0 and hit.stdout.startswith("HIT")
    bad = explain("rmsnorm", "M=none", "N=4096", "dtype=float16", "--target", "c")
    assert bad.returncode == 2 and "dtype: float16 is not supported on target 'c'" in bad.stderr
    assert explain("rmsnorm", "N").returncode == 2
