"""The two CUDA device compilers, nvcc and NVRTC: both build the zoo, the choice is
part of the key and reported, and (on a GPU) their kernels compute the same thing.

On a CPU-only machine both paths cross-compile sm_90a; the GPU test runs where
torch sees a GPU (the H200 host) and is skipped elsewhere.
"""

from __future__ import annotations

import ast
import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

from compile_service.build import nvrtc
from compile_service.build.devices import NVCC, NVRTC, choose
from tests.lowering import cuda_source
from tests.marks import needs_gpu, needs_nvcc, needs_nvrtc
from tests.processes import descendants

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmark"))
import zoo  # noqa: E402

COMPILERS = [pytest.param(NVCC, marks=needs_nvcc), pytest.param(NVRTC, marks=needs_nvrtc)]


def _library_blob(path: Path) -> bytes:
    """The device-module blob TVM's loader reads from the exported library, read with dlopen."""
    from client import loader

    loader._tvm_runtime()  # the TVM symbols the library links against
    lib = ctypes.CDLL(str(path))
    size = ctypes.c_uint64.in_dll(lib, "__tvm_ffi__library_bin").value
    return bytes((ctypes.c_char * (size + 8)).in_dll(lib, "__tvm_ffi__library_bin"))[8:]


@pytest.mark.parametrize("compiler", COMPILERS)
def test_every_kind_cross_compiles(make_daemon, compiler):
    d = make_daemon("--cuda-compiler", compiler)
    c = d.client()
    specs = zoo.build_zoo("sm_90a", quick=True)  # one kernel of each kind, two GEMM tilings
    assert c.prefetch(specs, load=False) == ["compiled"] * len(specs)
    # The client loads what either path built (running it needs a GPU; loading does not).
    kernels = [c.get_kernel(s["kind"], target=s["target"], **zoo.params_of(s)) for s in specs]
    assert [k.outcome for k in kernels] == ["hit"] * len(specs) and all(k.abi["loader"] == "tvm_ffi" for k in kernels)
    stats = c.stats()
    assert stats["cuda_compiler"].startswith(f"{compiler}-") and stats["cuda_compiler"] in stats["toolchain"]
    assert c.service_info()["cuda_compiler"] == stats["cuda_compiler"]
    assert 0 < stats["device_compile_seconds"] <= stats["compile_seconds"]
    for entry_dir in d.cache_dir.glob("entries/*/*"):
        meta = json.loads((entry_dir / "entry.json").read_text())
        assert meta["toolchain"]["cuda_compiler"] == stats["cuda_compiler"]
        blob = _library_blob(entry_dir / "kernel.so")  # embedded through .incbin: the cubin must be in it
        assert b"\x7fELF" in blob and b"main_kernel" in blob
        # Every kind's kernels are launched as programmatic dependents (kernels.launch.dependent_launch).
        assert b"tirx.use_programtic_dependent_launch" in blob, meta["spec"]
    # Each distinct device source was compiled once, by this path, into its own directory.
    assert list(d.cache_dir.glob("device-binaries/*")) == [d.cache_dir / "device-binaries" / stats["cuda_compiler"]]


@pytest.mark.parametrize("arch,dependent", [("sm_90a", True), ("sm_80", False)])
def test_kernels_wait_for_their_inputs_then_release_the_next_launch(arch, dependent):
    """From sm_90 on, a kernel's first statements are griddepcontrol's wait and launch_dependents
    (kernels.launch.dependent_launch); before sm_90 there is no such instruction."""
    src = cuda_source("rmsnorm", dict(M=None, N=4096, dtype="float16"), arch)
    body = src[src.index("__launch_bounds__") :]
    first_read = body.index("*(uint4*)(X_local_cast")  # the kernel's first global load
    for call in ("cudaGridDependencySynchronize();", "cudaTriggerProgrammaticLaunchCompletion();"):
        assert (call in body[:first_read]) == dependent and src.count(call) == int(dependent)


@pytest.mark.parametrize("m", [8, 512])  # an mma.sync decode tile and a wgmma tile
def test_a_gemm_releases_the_next_launch_after_its_k_loop(m):
    """A GEMM waits first, like every kernel, but lets the next kernel launch only once its K loop
    is done (gemm.build_mma; faster on the H200, docs/measured.md#programmatic-dependent-launch)."""
    src = cuda_source("gemm", dict(M=m, N=6144, K=4096, dtype="float16", trans_b=True))
    wait, trigger = src.index("cudaGridDependencySynchronize();"), src.index("cudaTriggerProgrammaticLaunchCompletion();")
    products = [i for i in (src.rfind("tl::mma_sync<"), src.rfind("tl::wgmma_ss<")) if i >= 0]
    assert products and wait < src.index("tma_load") and max(products) < trigger
    assert src.count("cudaTriggerProgrammaticLaunchCompletion();") == 1


@needs_nvcc
@needs_nvrtc
def test_the_compiler_is_part_of_the_key(make_daemon, tmp_path):
    spec = {"kind": "rmsnorm", "M": 256, "N": 1024, "dtype": "float16", "target": "sm_90a"}
    cache = tmp_path / "shared-cache"
    for compiler, outcome in ((NVCC, "compiled"), (NVRTC, "compiled"), (NVCC, "hit")):  # one cache, two keys
        d = make_daemon("--cuda-compiler", compiler, cache_dir=cache)
        assert d.client().prefetch([spec], load=False) == [outcome]
        d.stop()
    assert len(list(cache.glob("entries/*/*"))) == 2


@needs_nvrtc
def test_a_fresh_agent_loads_a_cuda_kernel_without_ml_dtypes(make_daemon):
    """tvm_ffi's optional ml_dtypes import costs more than the rest of a warm first kernel; the
    loader leaves it out, and the process can still import ml_dtypes itself afterwards."""
    import subprocess

    spec = {"kind": "rmsnorm", "M": 256, "N": 1024, "dtype": "float16", "target": "sm_90a"}
    d = make_daemon("--cuda-compiler", NVRTC)
    assert d.client().prefetch([spec], load=False) == ["compiled"]
    script = f"""
import sys, torch, client
k = client.connect({str(d.socket)!r}).get_kernel("rmsnorm", target="sm_90a", M=256, N=1024, dtype="float16")
assert k.outcome == "hit" and k.abi["loader"] == "tvm_ffi", k
assert "ml_dtypes" not in sys.modules, "the loader imported ml_dtypes"
import ml_dtypes, numpy, tvm_ffi
assert str(tvm_ffi.dtype(numpy.dtype(ml_dtypes.bfloat16))) == "bfloat16"
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, cwd=ROOT)


@needs_nvrtc
def test_a_cuda_kernels_fast_call_is_made_at_its_first_call_not_at_load(make_daemon):
    """A warm start loads kernels it may never call, so loading makes no code; the first call
    makes the kernel's own straight-line call (no loop per call), and a call it does not take
    (CPU tensors here) still gets the checked path's error."""
    import torch

    from client import fastcall

    d = make_daemon("--cuda-compiler", NVRTC)
    k = d.client().get_kernel("rmsnorm", target="sm_90a", M=None, N=1024, dtype="float16")
    assert k._fast is fastcall._first
    with pytest.raises(ValueError, match="built for cuda, inputs are on cpu"):
        k(torch.randn(4, 1024, dtype=torch.float16), torch.randn(1024, dtype=torch.float16))
    made = k._fast.source
    assert "d0 = a0.shape[0]" in made and "a0.new_empty((d0, 1024))" in made and "fn(a0, a1, o2)" in made
    loops = (ast.For, ast.While, ast.ListComp, ast.GeneratorExp, ast.DictComp, ast.SetComp, ast.List, ast.Dict)
    assert not [type(n).__name__ for n in ast.walk(ast.parse(made)) if isinstance(n, loops)]


def test_the_fast_call_never_puts_an_abi_name_in_its_source():
    """Dim names are any strings in the ABI: the generated call names dims by position, so a name
    cannot become code."""
    from client import fastcall
    from client.loader import Kernel, KernelRecord, answered

    evil = "M), __import__('os').system('false'), (1"
    abi = {
        "loader": "tvm_ffi",
        "symbol": "main",
        "device": "cuda",
        "params": [{"name": "X", "dtype": "float16", "shape": [evil, 8]}, {"name": "Y", "dtype": "float16", "shape": [evil, 8]}],
        "outputs": [1],
        "dynamic": [{"name": evil, "dtype": "int32"}],
    }
    k = Kernel(
        lambda *args: None,
        KernelRecord(answered("0" * 64, Path("/nonexistent"), "kernel.so", "0" * 64, 0, {"kind": "copy", "params": {}, "target": "sm_90a"}, abi)),
    )
    made = fastcall._build(k).source
    assert evil not in made and "__import__" not in made and "d0 = a0.shape[0]" in made


@needs_nvrtc
def test_workers_meeting_the_same_device_code_compile_it_once(make_daemon):
    d = make_daemon("--cuda-compiler", "nvrtc")  # two workers, both busy at once
    # An RMSNorm's static M (one row per block) changes only the grid, not the device code.
    specs = [{"kind": "rmsnorm", "M": m, "N": 1024, "dtype": "float16", "target": "sm_90a"} for m in (256, 512)]
    assert d.client().prefetch(specs, load=False) == ["compiled", "compiled"]
    metas = [json.loads(p.read_text()) for p in d.cache_dir.glob("entries/*/*/entry.json")]
    assert sorted(m["device_compiled"] for m in metas) == [False, True]  # one compiled, the other waited and reused


def test_choosing_a_compiler(monkeypatch):
    assert choose("nvcc").name == NVCC
    assert choose("auto").name == (NVRTC if nvrtc.unavailable_reason() is None else NVCC)
    assert choose(None, {"KERNEL_SERVICE_CUDA_COMPILER": "nvcc"}).name == NVCC  # the flag's absence defers to the environment
    with pytest.raises(ValueError, match="auto, nvrtc or nvcc"):
        choose("clang").name
    monkeypatch.setattr(nvrtc, "unavailable_reason", lambda: "NVRTC is not installed")
    assert choose("auto").name == NVCC
    with pytest.raises(ValueError, match="--cuda-compiler nvrtc: NVRTC is not installed"):
        choose("nvrtc").name


@pytest.mark.parametrize("headers", [None, 12040])
def test_asking_for_nvrtc_where_it_cannot_run_stops_the_daemon(make_daemon, tmp_path, headers):
    cuda_home = tmp_path / "cuda"  # $CUDA_HOME is the only place looked at for headers when set
    if headers:  # headers of another CUDA release than the NVRTC installed
        (cuda_home / "include").mkdir(parents=True)
        (cuda_home / "include" / "vector_types.h").write_text("")
        (cuda_home / "include" / "cuda.h").write_text(f"#define CUDA_VERSION {headers}\n")
    d = make_daemon("--cuda-compiler", "nvrtc", start=False)
    d.env["CUDA_HOME"] = str(cuda_home)
    d.start(wait=False)
    assert d.proc.wait(60) == 2
    if nvrtc.version() is None:
        assert "NVRTC is not installed" in d.log()
    elif headers:
        assert f"NVRTC {nvrtc.version()} does not match the CUDA 12.4 headers" in d.log()
    else:
        assert "no CUDA headers" in d.log()


def _wait_ready(d, timeout: float = 300) -> set[int]:
    """Waits until every worker has warmed up; returns the scheduling policies its processes'
    threads were seen with meanwhile."""
    deadline, seen = time.monotonic() + timeout, set()
    while (stats := d.client().stats())["workers_ready"] < stats["workers"]:
        assert time.monotonic() < deadline, "workers never finished warming up"
        seen |= {policy for _, policy in _threads(d)}
        time.sleep(0.1)
    return seen


def _threads(d) -> list[tuple[str, int]]:
    """(name, scheduling policy) of every thread of the daemon's descendants."""
    threads = []
    for pid in descendants(d.proc.pid):
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                threads.append(((task / "comm").read_text().strip(), os.sched_getscheduler(int(task.name))))
            except OSError:  # gone meanwhile
                pass
    return threads


@needs_nvrtc
def test_nvrtc_workers_parse_the_zoo_headers_in_the_background(make_daemon, tmp_path):
    cache = tmp_path / "cache"
    first = make_daemon("--target", "sm_90a", "--cuda-compiler", "nvrtc", cache_dir=cache, workers=2)  # CUDA default: warm-up on
    # Serving at once: a request goes to a worker that is not warming up, and is not held behind the warm-up.
    k = first.client().get_kernel("rmsnorm", M=None, N=64, dtype="float32", target="c")
    assert k.outcome == "compiled" and first.client().stats()["workers_ready"] < 2
    # The warm-up runs at idle CPU priority (an agent starting beside the daemon goes first), and
    # leaves no thread of a worker at that priority for its builds.
    assert os.SCHED_IDLE in _wait_ready(first)
    assert not (idle := [name for name, policy in _threads(first) if policy == os.SCHED_IDLE]), idle
    preludes = list(cache.glob("device-binaries/nvrtc-*/nvrtc-preludes-v2-sm_90a-*.json"))
    assert len(preludes) == 1 and len(entries := json.loads(preludes[0].read_text())) >= 6  # GEMM (two), attention, kv_attention (two), elementwise, ...
    assert ["--use_fast_math"] in [flags for _, flags in entries]  # attention's: its PCH is made with them
    assert "lowering the kinds' warm-up examples" in first.log() and first.log().count("precompiled headers for") == 2
    # Each worker keeps its PCH files (hundreds of MB) in a private directory, removed when it exits.
    pch_root = Path(tempfile.gettempdir()) / f"kernel-service-nvrtc-pch-{os.getuid()}"
    workers = [w for w in map(str, descendants(first.proc.pid)) if (pch_root / w).is_dir() and any((pch_root / w).iterdir())]
    assert len(workers) == 2  # not the resource tracker
    first.stop()
    assert not any((pch_root / w).exists() for w in workers)

    # A later daemon on this cache, which holds a kernel, parses no header while it only serves
    # hits: its workers count as ready once started. Its first build starts the warm-up, which
    # builds the PCHs of the preludes the first daemon found, with no lowering of examples.
    again = make_daemon("--target", "sm_90a", "--cuda-compiler", "nvrtc", cache_dir=cache, workers=2)
    _wait_ready(again)
    assert again.client().get_kernel("rmsnorm", M=None, N=64, dtype="float32", target="c").outcome == "hit"
    time.sleep(1.5)  # past WARM_AFTER_IDLE: a warm-up would have started
    assert "precompiled headers for" not in again.log() and "warm-up" not in again.log()
    assert again.client().get_kernel("rmsnorm", M=None, N=64, dtype="float16", target="sm_90a").outcome == "compiled"
    _wait_ready(again)
    assert "lowering the kinds' warm-up examples" not in again.log() and again.log().count("precompiled headers for") == 2


def test_idle_workers_share_out_the_warm_up_examples_one_per_step(tmp_path):
    """Finding the preludes lowers every kind's warm-up examples (about 10 s on a 2-core
    machine, once on one worker). Each step lowers one example no other worker holds, so
    idle workers lower them side by side and a request waits behind one example at most;
    the step that finds none left joins the parts."""
    from filelock import FileLock

    import kernels
    from compile_service.build import compiler

    target = kernels.parse_target("sm_90a")
    known = tmp_path / "nvrtc-preludes.json"
    parts = tmp_path / "nvrtc-preludes.parts"
    examples = [(kind, params) for _, kind in sorted(kernels.kinds().items()) for params in kind.warm_up]
    with FileLock(str(parts / "0.json.lock")):  # another worker is lowering the first example
        compiler.find_preludes_step(known, target)
    assert sorted(p.name for p in parts.glob("*.json")) == ["1.json"] and not known.exists()
    kind, params = examples[1]
    source, flags = compiler.lowered(kind, dict(kind.canonicalize(dict(params), target).params), target)
    assert json.loads((parts / "1.json").read_text()) == [nvrtc.prelude(source), flags]
    for i in range(2, len(examples)):  # the others lowered theirs meanwhile
        (parts / f"{i}.json").write_text(json.dumps([f"#include <example_{i}.h>\n", []]))
    compiler.find_preludes_step(known, target)  # the first example, free again
    assert not known.exists()
    compiler.find_preludes_step(known, target)  # none left: the join
    want = [json.loads((parts / f"{i}.json").read_text()) for i in range(len(examples))]
    assert sorted(json.loads(known.read_text())) == sorted(want) and "#include" in json.loads((parts / "0.json").read_text())[0]


@needs_nvrtc
def test_warmed_up_preludes_spare_every_family_its_header_parse(tmp_path):
    """The header parse a PCH saves is most of a device compile (a GEMM: 1.4 s, against 0.25 s
    with the PCH). After warm-up on the kinds' warm-up examples, a kernel of each family parses
    no header. This fails when a kind's source puts code above its #includes (grid_x as a
    function did), or when warm-up and real compiles see different preludes (the PDL header was
    once added only to sources that launch dependents) or flags (a PCH serves only its own)."""
    import kernels

    from compile_service.build.compiler import lowered

    target = kernels.parse_target("sm_90a")

    def source_and_flags(kind, params):  # as a build hands them to NVRTC: attention's with --use_fast_math
        k = kernels.get_kind(kind)
        return lowered(k, dict(k.canonicalize(dict(params), target).params), target)

    c = nvrtc.Compiler(str(tmp_path))
    for kind in ("gemm", "attention", "rmsnorm", "kv_attention"):
        source, flags = source_and_flags(kind, kernels.get_kind(kind).warm_up[0])
        c.warm([source], "sm_90a", flags)
    before = (c.compiles, c.header_parses)
    gemm = {"M": 512, "N": 6144, "K": 4096, "dtype": "float16", "trans_b": True}
    attention = {"batch": 1, "heads": 32, "kv_heads": 8, "seq_len": 512, "head_dim": 128, "causal": True, "dtype": "float16"}
    decode = {"batch": 8, "heads": 32, "kv_heads": 8, "q_len": 1, "head_dim": 128, "dtype": "float16"}
    for kind, params in (("gemm", gemm), ("attention", attention), ("rmsnorm", {"M": 512, "N": 4096, "dtype": "float16"}), ("kv_attention", decode)):
        source, flags = source_and_flags(kind, params)
        c.compile(source, "sm_90a", flags)
    assert (c.compiles - before[0], c.header_parses - before[1]) == (4, 0)


@needs_gpu
@needs_nvrtc
def test_nvrtc_kernels_compute_what_nvcc_kernels_compute(make_daemon):
    import torch

    from kernels.reference import make_inputs, reference, tolerance

    specs = zoo.build_zoo("auto", quick=True)
    built = {}
    for compiler in (NVCC, NVRTC):
        c = make_daemon("--cuda-compiler", compiler).client()
        built[compiler] = [c.get_kernel(s["kind"], target=s["target"], **zoo.params_of(s)) for s in specs]
    for spec, a, b in zip(specs, built[NVCC], built[NVRTC]):
        p = a.spec["params"]
        ins = make_inputs(spec["kind"], p, "cuda")
        want = reference(spec["kind"], p, ins)
        got_nvcc, got_nvrtc = a(*[t.clone() for t in ins]), b(*[t.clone() for t in ins])
        torch.testing.assert_close(got_nvrtc.float(), want.float(), **tolerance(p["dtype"]))
        torch.testing.assert_close(got_nvrtc, got_nvcc, rtol=0, atol=0)  # the same device code, the same bits
