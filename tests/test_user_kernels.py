"""Users' own TileLang kernels (issue 30): the styles TileLang's examples are written in, served
on target "c" by a real daemon and compared with torch; their keys and build options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import client

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def user_daemon(tmp_path_factory):
    from devtools.launch import DaemonProcess

    base = tmp_path_factory.mktemp("user-kernels")
    d = DaemonProcess(base / "cache", "--target", "c", "--kernel-module", "tests.user_kernels", workers=2, log_path=base / "daemon.log").start(timeout=120)
    yield d
    d.stop()


def test_eager_style_kernels_return_what_the_kernel_wrote(user_daemon):
    c = user_daemon.client()
    for M in (7, None):  # a T.const size, static or runtime
        mm = c.get_kernel("eager_matmul", M=M, N=6, K=9, target="c")
        a, b = torch.randn(7, 9), torch.randn(9, 6)
        torch.testing.assert_close(mm(a, b), a @ b)
    norm = c.get_kernel("eager_rmsnorm", M=None, N=16, eps=1e-5, target="c")
    x, w = torch.randn(5, 16), torch.randn(16)
    torch.testing.assert_close(norm(x, w), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w)


def test_a_callee_allocated_output_is_built_caller_allocated():
    """TileLang's tvm_ffi lowering would allocate a T.empty output in the callee (and the loader's
    buffer would come back unwritten); the build strips the record so it stays a parameter."""
    from tilelang.jit.abi import CALLEE_ALLOCATED_OUTPUTS_ATTR, prepare_tvm_ffi_callee_allocated_outputs

    import kernels
    from compile_service.build.compiler import _build_options
    from kernels import plugins

    plugins.load_module("tests.user_kernels")
    kind = kernels.get_kind("eager_matmul")
    params = dict(kernels.canonicalize("eager_matmul", {"M": 4, "N": 4, "K": 4}, "c").params)
    func, outputs, _ = _build_options(kind.build(params, kernels.parse_target("c")), kind, params)
    assert [i % len(func.params) for i in outputs] == [2]  # C, the T.empty tensor
    stamped, out_idx = prepare_tvm_ffi_callee_allocated_outputs(func, None, supports_callee_allocated_outputs=True)
    assert out_idx is None and CALLEE_ALLOCATED_OUTPUTS_ATTR not in (stamped.attrs or {})


def test_the_schema_takes_what_tilelang_code_takes(user_daemon):
    c = user_daemon.client()
    kinds = {k["name"]: {p["name"]: p for p in k["params"]} for k in c.kinds()}
    assert {"eager_matmul", "eager_rmsnorm", "gemm_kernel", "tuned_scale", "scale_rows_", "cuda_only"} <= set(kinds)  # several in one module
    mm = kinds["eager_matmul"]
    assert list(mm) == ["M", "N", "K", "block_K", "dtype", "accum_dtype"]  # tensors A, B are inputs, not parameters
    assert mm["accum_dtype"]["default"] == "float32" and "float16" in mm["accum_dtype"]["choices"]
    assert kinds["gemm_kernel"]["trans_b"]["required"] and kinds["gemm_kernel"]["trans_b"]["doc"] != "size"

    gemm = c.get_kernel("gemm_kernel", N=6, K=5, trans_b=True, target="c")  # a bool with no default, M=None, num_stages=0
    for m in (1, 4):
        a, b = torch.randn(m, 5), torch.randn(6, 5)
        torch.testing.assert_close(gemm(a, b), a @ b.T)
    with pytest.raises(client.InvalidSpec, match="accum_dtype: bfloat16 is not supported on target 'c'"):
        c.get_kernel("eager_rmsnorm", M=4, N=8, accum_dtype="bfloat16", target="c")
    with pytest.raises(client.InvalidSpec, match="declared for target 'cuda'"):
        c.get_kernel("cuda_only", N=8, dtype="float32", target="c")


def test_autotuned_and_in_place_kernels(user_daemon):
    c = user_daemon.client()
    tuned = c.get_kernel("tuned_scale", N=7, unroll=2, scale=0.5, target="c")  # the config given as parameters
    x = torch.randn(3, 7)
    torch.testing.assert_close(tuned(x), x * 0.5)
    scale = c.get_kernel("scale_rows_", N=4, scale=3.0, target="c")  # updates X, returns nothing
    x = torch.randn(5, 4)
    want = x * 3.0
    assert scale(x) == ()
    torch.testing.assert_close(x, want)


def test_an_eager_kernel_without_t_empty_updates_its_tensors_as_tilelang_does(user_daemon):
    """No out_idx, no T.empty: TileLang's kernel takes every tensor and returns nothing (its splitK
    GEMM example accumulates into C). Served, it must too, not allocate C and drop the caller's."""
    c = user_daemon.client()
    acc = c.get_kernel("eager_accumulate", M=3, N=4, K=5, target="c")
    assert acc.input_names == ["A", "B", "C"] and acc.output_names == [] and acc.writes == ["A", "B", "C"]
    a, b, out = torch.randn(3, 5), torch.randn(5, 4), torch.randn(3, 4)
    want = out + a @ b
    assert acc(a, b, out) == ()
    torch.testing.assert_close(out, want)


def test_decorator_pass_configs_reach_the_build_and_the_key(tmp_path):
    (tmp_path / "pc_kinds.py").write_text(
        textwrap.dedent("""
        import tilelang
        import tilelang.language as T

        def body(N):
            @T.prim_func
            def main(X: T.Tensor((N,), "float32"), Y: T.Tensor((N,), "float32")):
                with T.Kernel(1):
                    for i in T.serial(N):
                        Y[i] = X[i]
            return main

        plain = tilelang.jit(out_idx=[-1])(body)
        bogus = tilelang.jit(out_idx=[-1], pass_configs={"tl.no_such_option": True}, compile_flags=["-O3"])(body)
    """)
    )
    code = textwrap.dedent("""
        import json, tempfile, kernels
        from kernels import plugins
        from compile_service.build import compiler
        plugins.load_module("pc_kinds:plain"); plugins.load_module("pc_kinds:bogus")
        out = {"digests": [kernels.source_digest(k) for k in ("plain", "bogus")]}
        for k in ("plain", "bogus"):
            try:
                compiler.build(kernels.canonicalize(k, {"N": 4}, "c").to_json(), tempfile.mkdtemp())
                out[k] = "built"
            except compiler.CompileFailed as exc:
                out[k] = str(exc)
        print(json.dumps(out))
    """)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["digests"][0] != out["digests"][1]  # same source, other options: other keys
    assert out["plain"] == "built" and "no_such_option" in out["bogus"]  # the decorator's pass configs reach TileLang


def _digest(path: Path, target: str) -> str:
    code = f"import kernels; from kernels import plugins; plugins.load_module({target!r}); print(kernels.source_digest({target.partition(':')[2]!r}))"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}"}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip().splitlines()[-1]


def test_keys_cover_a_top_level_plugins_sibling_modules(tmp_path):
    (tmp_path / "tiles.py").write_text("BLOCK = 4\n")
    (tmp_path / "my_kinds.py").write_text(
        textwrap.dedent("""
        import tilelang.language as T
        from tiles import BLOCK

        def copy_kernel(N):
            @T.prim_func
            def main(X: T.Tensor((N,), "float32"), Y: T.Tensor((N,), "float32")):
                with T.Kernel(1):
                    for i in T.serial(N):
                        Y[i] = X[i] * BLOCK
            return main
    """)
    )
    before = _digest(tmp_path, "my_kinds:copy_kernel")
    with open(tmp_path / "tiles.py", "a") as f:
        f.write("# an edit\n")
    assert _digest(tmp_path, "my_kinds:copy_kernel") != before


def test_keys_cover_a_jit_kind_subclasss_own_file(tmp_path):
    (tmp_path / "sub_kinds.py").write_text(
        textwrap.dedent("""
        import tilelang.language as T

        def copy_kernel(N):
            @T.prim_func
            def main(X: T.Tensor((N,), "float32"), Y: T.Tensor((N,), "float32")):
                with T.Kernel(1):
                    for i in T.serial(N):
                        Y[i] = X[i]
            return main
    """)
    )
    (tmp_path / "sub_kind.py").write_text(
        textwrap.dedent("""
        from kernels.jit import JitKind
        from kernels.registry import register
        from sub_kinds import copy_kernel

        class Copy(JitKind):
            pass

        register(Copy("copy", copy_kernel))
    """)
    )
    code = "import kernels, sub_kind; print(kernels.source_digest('copy'))"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}

    def digest():
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip().splitlines()[-1]

    before = digest()
    with open(tmp_path / "sub_kind.py", "a") as f:
        f.write("# an edit\n")
    assert digest() != before


# A plugin whose factor the test edits, and a kind whose build kills its compile worker (the
# daemon then starts a fresh one, which imports the plugin's file again).
EDITED_KINDS = """
import os

from kernels.registry import register
from kernels.spec import KernelKind, dim


@register
class Scaled(KernelKind):
    name = "edited_scale"
    params = (dim("N"),)

    def build_cpu(self, p):
        import tilelang.language as T

        N = p["N"]

        @T.prim_func
        def main(X: T.Tensor((N,), "float32"), Y: T.Tensor((N,), "float32")):
            with T.Kernel(1):
                for i in T.serial(N):
                    Y[i] = X[i] * FACTOR

        return main


@register
class CrashWorker(KernelKind):
    name = "crash_worker"
    params = (dim("N"),)

    def build_cpu(self, p):
        os._exit(70)
"""


def test_a_plugin_edited_while_the_daemon_runs_is_never_filed_under_its_old_key(make_daemon, tmp_path):
    """#47 item 2: a plugin's file is edited while the daemon serves it, and its worker is replaced
    (a crash), so the fresh worker imports the edited file. Its build is refused, not published
    under the key of the source the daemon started with; and once the file is restored, a
    restarted daemon serves what the restored source builds, not the edited kernel as a hit."""
    plugin = tmp_path / "plugins" / "edited_kinds.py"
    plugin.parent.mkdir()
    plugin.write_text(EDITED_KINDS.replace("FACTOR", "2.0"))
    env = {"PYTHONPATH": str(plugin.parent), "PYTHONDONTWRITEBYTECODE": "1"}  # no .pyc of an earlier version
    cache = tmp_path / "cache"
    x = torch.arange(1.0, 9.0)
    d = make_daemon("--kernel-module", "edited_kinds", cache_dir=cache, workers=1, env=env)
    c = d.client()
    torch.testing.assert_close(c.get_kernel("edited_scale", N=4, target="c")(x[:4]), 2 * x[:4])  # the daemon's keys are made

    plugin.write_text(EDITED_KINDS.replace("FACTOR", "30.0"))
    with pytest.raises(client.ServiceError, match="crashed"):
        c.get_kernel("crash_worker", N=1, target="c")
    with pytest.raises(client.CompileError, match="changed on disk after the daemon started"):
        c.get_kernel("edited_scale", N=8, target="c")
    c.close()
    d.stop()

    plugin.write_text(EDITED_KINDS.replace("FACTOR", "2.0"))
    again = make_daemon("--kernel-module", "edited_kinds", cache_dir=cache, workers=1, env=env).client()
    torch.testing.assert_close(again.get_kernel("edited_scale", N=8, target="c")(x), 2 * x)
    again.close()


def test_an_unannotated_size_takes_a_positive_int_only(user_daemon):
    """`gemm_kernel(N, K, trans_b, ...)`: N and K are in shapes, so sizes; trans_b is not."""
    c = user_daemon.client()
    for bad in ("64", True):
        with pytest.raises(client.InvalidSpec) as err:
            c.get_kernel("gemm_kernel", N=bad, K=5, trans_b=True, target="c")
        assert err.value.field == "N" and "expected an integer" in str(err.value) and "\n" not in str(err.value), str(err.value)
    kinds = {k["name"]: {p["name"]: p for p in k["params"]} for k in c.kinds()}
    assert kinds["gemm_kernel"]["N"]["type"] == "int" and kinds["gemm_kernel"]["K"]["type"] == "int"


def test_a_gpu_style_kernel_on_the_cpu_target_says_what_the_target_takes(tmp_path):
    (tmp_path / "gpu_kinds.py").write_text(
        textwrap.dedent("""
        import tilelang
        import tilelang.language as T

        @tilelang.jit(out_idx=[-1])
        def gpu_gemm(M, N, K, block_M=32, block_N=32, block_K=32, dtype="float32"):
            @T.prim_func
            def main(A: T.Tensor((M, K), dtype), B: T.Tensor((K, N), dtype), C: T.Tensor((M, N), dtype)):
                with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=128) as (bx, by):
                    A_shared = T.alloc_shared((block_M, block_K), dtype)
                    B_shared = T.alloc_shared((block_K, block_N), dtype)
                    C_local = T.alloc_fragment((block_M, block_N), "float32")
                    T.clear(C_local)
                    for k in T.Pipelined(T.ceildiv(K, block_K), num_stages=2):
                        T.copy(A[by * block_M, k * block_K], A_shared)
                        T.copy(B[k * block_K, bx * block_N], B_shared)
                        T.gemm(A_shared, B_shared, C_local)
                    T.copy(C_local, C[by * block_M, bx * block_N])
            return main
    """)
    )
    code = textwrap.dedent("""
        import tempfile, kernels
        from kernels import plugins
        from compile_service.build import compiler
        plugins.load_module("gpu_kinds:gpu_gemm")
        try:
            compiler.build(kernels.canonicalize("gpu_gemm", {"M": 64, "N": 64, "K": 64}, "c").to_json(), tempfile.mkdtemp())
            print("built")
        except compiler.CompileFailed as exc:
            print(exc)
    """)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    message = run.stdout.strip().splitlines()[-1]
    assert "target 'c'" in message and "CPU-style TIR" in message and "A_shared" in message, run.stdout
