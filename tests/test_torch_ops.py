"""Served kernels as torch ops: torch.compile (fullgraph, dynamic shapes), out= and in-place
forms, the inference-only rule, self-description, torch.export and AOTInductor in a fresh
process; on a GPU, CUDA-graph capture (plain and through mode="reduce-overhead").

CPU tests use the session daemon (target "c", float32); GPU tests start their own.
"""

from __future__ import annotations

import inspect
import json
import os
import pydoc
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import client
import kernels
from tests.marks import needs_gpu

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmark"))
from llama_block import BlockConfig, ServedBlock, reference, rel_error  # noqa: E402

ZOO = (
    "add_rmsnorm",
    "attention",
    "geglu",
    "gemm",
    "kv_attention",
    "layernorm",
    "rmsnorm",
    "rope",
    "softmax",
    "swiglu",
)  # other test files register more kinds in this process
ENCODER = BlockConfig(hidden=64, heads=4, kv_heads=2, ffn=96, seq_len=12, dtype="float32", target="c", causal=False)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch.manual_seed(0)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def encoder(shared_daemon):
    c = shared_daemon.client()
    yield ServedBlock(c, ENCODER)
    c.close()


def _fresh_process(code: str, socket) -> str:
    """Runs `code` in a new interpreter (cwd: the worktree) whose default client is the test daemon."""
    env = {**os.environ, "KERNEL_SERVICE_SOCKET": str(socket)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_importing_the_client_registers_the_ops_once_torch_is_there():
    code = "import sys, client; print('torch' in sys.modules); import torch, client.torch_ops; print(hasattr(torch.ops.kernel_service, 'gemm'))"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split() == ["False", "True"]
    code = "import torch, client, kernels; print(all(hasattr(torch.ops.kernel_service, k) == (v.artifact == 'service') for k, v in kernels.kinds().items()), sum(v.artifact == 'service' for v in kernels.kinds().values()))"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split() == ["True", str(len(ZOO))]


# ----- what ML users pass


def test_specs_take_torch_dtypes_and_numpy_numbers(cpu_kernel):
    plain = kernels.canonicalize("rmsnorm", {"M": 128, "N": 64, "dtype": "float32", "eps": 1e-5}, "c")
    for params in (
        {"M": np.int64(128), "N": np.int32(64), "dtype": torch.float32, "eps": 1e-5},
        {"M": 128, "N": 64, "dtype": np.dtype("float32"), "eps": np.float64(1e-5)},
    ):
        spec = kernels.canonicalize("rmsnorm", params, "c")
        assert spec == plain and spec.to_json() == plain.to_json()
        assert type(spec.params["M"]) is int and type(spec.params["dtype"]) is str
    gemm = kernels.canonicalize("gemm", {"M": None, "N": 8, "K": 8, "dtype": torch.float16, "trans_b": np.bool_(True)}, "sm_90a")
    assert gemm.params["dtype"] == "float16" and gemm.params["trans_b"] is True
    # The same kernel object, however the spec was spelled.
    assert cpu_kernel("softmax", M=np.int64(3), N=np.uint16(16), dtype=torch.float32) is cpu_kernel("softmax", M=3, N=16, dtype="float32")
    # A bool is still no size, and a dtype must be one the kind takes.
    for bad, field in (({"M": True}, "M"), ({"M": np.bool_(True)}, "M"), ({"M": 4.0}, "M"), ({"dtype": torch.int8}, "dtype")):
        with pytest.raises(client.InvalidSpec) as err:
            kernels.canonicalize("rmsnorm", {"M": 4, "N": 64, "dtype": "float32", **bad}, "c")
        assert err.value.field == field


def test_a_numpy_argument_is_one_line_naming_it_and_what_it_takes(cpu_kernel):
    k = cpu_kernel("rmsnorm", M=None, N=64, dtype="float32")
    x = np.ones((4, 64), dtype=np.float32)
    for call in (lambda: k(x, torch.ones(64)), lambda: k(torch.ones(4, 64), torch.ones(64), out=x)):
        with pytest.raises(TypeError) as err:
            call()
        message = str(err.value)
        assert "\n" not in message and len(message) < 200, message
        assert "must be a torch.Tensor, got numpy.ndarray (torch.from_numpy(x)" in message, message
    assert f"input {k.input_names[0]} " in str(pytest.raises(TypeError, k, x, torch.ones(64)).value)


def test_kinds_the_client_does_not_import_get_plain_values_on_the_wire():
    _request = client.connect("/nonexistent/ks.sock")._request  # an unknown kind asks no daemon

    _, proto, spec = _request("some_plugin_kind", {"dtype": torch.bfloat16, "M": np.int64(3), "eps": np.float32(0.5), "flag": np.bool_(True)}, "c")
    assert spec is None  # the daemon validates it
    values = {name: v.WhichOneof("value") and getattr(v, v.WhichOneof("value")) for name, v in proto.params.items()}
    assert values == {"dtype": "bfloat16", "M": 3, "eps": 0.5, "flag": True}


def test_the_abi_names_in_place_pairs_that_can_hold():
    from proto import abi

    params = [
        {"name": "X", "dtype": "float32", "shape": ["M", 8]},
        {"name": "W", "dtype": "float32", "shape": [8]},
        {"name": "Y", "dtype": "float32", "shape": ["M", 8]},
    ]
    dynamic = [{"name": "M", "dtype": "int32"}]
    assert abi.make("c", "call", params, [2], dynamic, {"Y": "X"})["inplace"] == {"Y": "X"}
    assert "inplace" not in abi.make("c", "call", params, [2], dynamic, {})
    for bad in ({"Y": "W"}, {"X": "Y"}, {"Y": "Z"}):
        with pytest.raises(abi.AbiError, match="abi.inplace"):
            abi.make("c", "call", params, [2], dynamic, bad)


def test_inputs_that_require_grad_are_refused_with_the_way_out(cpu_kernel):
    k = cpu_kernel("gemm", M=None, N=8, K=16, dtype="float32", trans_b=True)
    a, w = torch.randn(4, 16), torch.nn.Parameter(torch.randn(8, 16))
    with pytest.raises(RuntimeError, match=r"inference-only.*input B of gemm requires grad.*torch.inference_mode\(\).*B.detach\(\)"):
        k(a, w)
    with pytest.raises(RuntimeError, match="inference-only"):
        torch.ops.kernel_service.gemm(k.spec_json, [a, w])  # the op itself
    with pytest.raises(RuntimeError, match="inference-only"):
        torch.compile(lambda x: k(x, w), fullgraph=True, dynamic=True)(a)
    # No grad would be recorded: parameters are fine under no_grad and inference_mode.
    with torch.no_grad():
        torch.testing.assert_close(k(a, w), a @ w.T)
    with torch.inference_mode():
        torch.testing.assert_close(k(a, w), a @ w.T)
    torch.testing.assert_close(k(a, w.detach()), a @ w.detach().T)


# ----- out= and in-place forms


def test_out_writes_into_the_given_tensor_and_checks_it(cpu_kernel):
    k = cpu_kernel("gemm", M=None, N=8, K=16, dtype="float32", trans_b=True)
    a, w = torch.randn(5, 16), torch.randn(8, 16)
    out = torch.full((5, 8), float("nan"))
    assert k(a, w, out=out) is out
    torch.testing.assert_close(out, a @ w.T)
    for bad, err, match in (
        (torch.empty(5, 9), ValueError, r"out C must have shape \(5, 8\)"),
        (torch.empty(5, 8, dtype=torch.float64), TypeError, "out C must be float32"),
        (torch.empty(8, 5).T, ValueError, "out C must be contiguous"),
        ((torch.empty(5, 8), torch.empty(5, 8)), TypeError, r"out= takes 1 tensor"),
    ):
        with pytest.raises(err, match=match):
            k(a, w, out=bad)
    # A GEMM cannot write over its inputs; nothing was declared in place for it.
    square = cpu_kernel("gemm", M=None, N=16, K=16, dtype="float32")
    x = torch.randn(16, 16)
    with pytest.raises(ValueError, match="out C overlaps input A"):
        square(x, torch.randn(16, 16), out=x)


@pytest.mark.parametrize(
    "kind,params,into",
    [
        ("gemm", {"M": None, "N": 24, "K": 40, "trans_b": True, "residual": True}, 2),  # residual update: R += A @ B.T
        ("rmsnorm", {"M": None, "N": 40}, 0),
        ("softmax", {"M": None, "N": 40}, 0),
        ("swiglu", {"M": None, "N": 40}, 0),
    ],
)
def test_in_place_forms_where_the_kind_declares_them(cpu_kernel, kind, params, into):
    from kernels.reference import make_inputs, reference

    k = cpu_kernel(kind, dtype="float32", **params)
    assert list(k.inplace.values()) == [into]
    assert k.abi["inplace"] == {k.output_names[0]: k.input_names[into]}  # in the ABI: clients need not import the kind
    assert f"In place: out={k.input_names[into]}" in k.__doc__
    ins = make_inputs(kind, k.spec["params"], runtime={"M": 37})
    expected = reference(kind, k.spec["params"], ins)
    target = ins[into]
    assert k(*ins, out=target) is target
    torch.testing.assert_close(target, expected, rtol=1e-4, atol=1e-4)
    # Only that input, and only all of it: a tensor overlapping it one element off is refused.
    buf = torch.empty(target.numel() + 1)
    ins[into] = buf[1:].view_as(target).copy_(target)
    with pytest.raises(ValueError, match=f"out {k.output_names[0]} overlaps input {k.input_names[into]}"):
        k(*ins, out=buf[:-1].view_as(target))


def test_out_and_residual_update_compile_without_graph_breaks(cpu_kernel):
    res = cpu_kernel("gemm", M=None, N=24, K=40, dtype="float32", trans_b=True, residual=True)
    norm = cpu_kernel("rmsnorm", M=None, N=24, dtype="float32")
    w, wn = torch.randn(24, 40), torch.rand(24) + 0.5

    def step(x, h, buf):
        res(x, w, h, out=h)  # h += x @ w.T in place
        norm(h, wn, out=buf)
        return buf * 2

    def expected(x, h):
        h2 = h + x @ w.T
        return h2, h2 * torch.rsqrt(h2.pow(2).mean(-1, keepdim=True) + 1e-6) * wn * 2

    assert torch._dynamo.explain(step)(torch.randn(5, 40), torch.randn(5, 24), torch.empty(5, 24)).graph_break_count == 0
    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for m in (5, 9):
        x, h, buf = torch.randn(m, 40), torch.randn(m, 24), torch.empty(m, 24)
        want_h, want = expected(x, h)
        got = compiled(x, h, buf)
        torch.testing.assert_close(h, want_h, rtol=1e-4, atol=1e-4)  # the caller's tensors were updated
        torch.testing.assert_close(buf, want_h * torch.rsqrt(want_h.pow(2).mean(-1, keepdim=True) + 1e-6) * wn, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ----- self-description


def test_a_kernel_describes_itself(cpu_kernel):
    k = cpu_kernel("gemm", M=None, N=48, K=32, dtype="float32", trans_b=True, bias=True)
    sig = inspect.signature(k)
    assert list(sig.parameters) == ["A", "B", "Bias", "out"]
    assert sig.parameters["A"].annotation == "Tensor[M, 32] float32"
    assert sig.parameters["B"].annotation == "Tensor[48, 32] float32"
    assert sig.parameters["A"].kind is inspect.Parameter.POSITIONAL_ONLY
    assert sig.parameters["out"].kind is inspect.Parameter.KEYWORD_ONLY and sig.parameters["out"].default is None
    assert sig.return_annotation == "Tensor[M, 48] float32"
    doc = k.__doc__
    for text in (
        "gemm kernel for target c",
        "A[M,K] @ B",
        "gemm(A, B, Bias, *, out=None) -> C",
        "A: Tensor[M, 32] float32",
        "returns C: Tensor[M, 48] float32",
        "Runtime sizes: M",
        "Inference only",
        "torch.ops.kernel_service.gemm",
    ):
        assert text in doc, text
    static = cpu_kernel("softmax", M=6, N=16, dtype="float32")
    assert "Every size is static" in static.__doc__ and str(inspect.signature(static)).startswith("(X: 'Tensor[6, 16] float32'")


def test_help_of_get_kernel_explains_parameters_and_returns():
    text = pydoc.render_doc(client.get_kernel, renderer=pydoc.plaintext)
    for needle in ("Parameters", "Returns", "kind", "target", "torch.dtype", "InvalidSpec", "inference-only"):
        assert needle in text, needle
    for kind in ZOO:  # every kind's parameters, from its schema
        assert f"{kind}(" in text
    assert "trans_b" in text and "residual" in text
    assert client.Client.get_kernel.__doc__ == client.get_kernel.__doc__


# ----- torch.compile


def test_encoder_block_compiles_fullgraph_dynamic_without_recompiling(encoder):
    from torch._dynamo.testing import CompileCounterWithBackend

    xs = [torch.randn(b, ENCODER.seq_len, ENCODER.hidden) for b in (2, 3)]
    with torch.inference_mode():
        explained = torch._dynamo.explain(encoder)(xs[0])
        assert (explained.graph_break_count, explained.graph_count) == (0, 1), explained.break_reasons
        ops = {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}
        assert {
            "kernel_service.rmsnorm.default",
            "kernel_service.gemm.default",
            "kernel_service.attention.default",
            "kernel_service.swiglu.default",
            "kernel_service.gemm.out",
        } <= ops
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(encoder, backend=counter, fullgraph=True, dynamic=True)
        for x in xs:
            want = reference(encoder, x)
            assert rel_error(encoder(x), want) < 1e-5
            assert rel_error(compiled(x), want) < 1e-5
        assert counter.frame_count == 1  # batch 2 and 3: one graph, the batch symbolic


def test_static_sizes_specialize_and_fail_at_trace_with_the_loader_message(cpu_kernel):
    from torch._dynamo.testing import CompileCounter

    k = cpu_kernel("rmsnorm", M=None, N=16, dtype="float32")
    w = torch.rand(16)
    counter = CompileCounter()
    f = torch.compile(lambda x: k(x, w), backend=counter, fullgraph=True, dynamic=True)
    for m in (3, 4, 7):
        f(torch.randn(m, 16))
    assert counter.frame_count == 1  # M is a runtime size
    with pytest.raises(Exception, match=r"input X must have shape \['M', 16\], got \(3, 17\)"):
        f(torch.randn(3, 17))  # N=16 is the kernel's: the guard fails, the retrace refuses it


def test_fake_and_meta_tensors_get_shapes_from_the_abi(cpu_kernel):
    from torch._subclasses.fake_tensor import FakeTensorMode

    k = cpu_kernel("attention", batch=None, heads=4, kv_heads=2, seq_len=None, head_dim=8, dtype="float32")
    q, kv = torch.empty(3, 5, 4, 8, device="meta"), torch.empty(3, 5, 2, 8, device="meta")
    out = k(q, kv, kv)
    assert (out.device.type, out.shape, out.dtype) == ("meta", (3, 5, 4, 8), torch.float32)
    with FakeTensorMode():
        assert k(torch.empty(2, 7, 4, 8), torch.empty(2, 7, 2, 8), torch.empty(2, 7, 2, 8)).shape == (2, 7, 4, 8)
        with pytest.raises(ValueError, match="dim seq_len is 7 elsewhere but 6 in K"):
            k(torch.empty(2, 7, 4, 8), torch.empty(2, 6, 2, 8), torch.empty(2, 7, 2, 8))


# ----- torch.export and AOTInductor

_RUN_EXPORTED = """
import sys, {imports}
io = torch.load(sys.argv[1] if len(sys.argv) > 1 else {io!r})
program = {load}
with torch.inference_mode():
    for x, y in zip(io["xs"], io["ys"]):
        torch.testing.assert_close(program(x), y, rtol=1e-5, atol=1e-5)
print("ok", len(client.resolver._kernels))
"""


def _export(encoder, tmp_path):
    xs = [torch.randn(b, ENCODER.seq_len, ENCODER.hidden) for b in (2, 5)]
    with torch.no_grad():
        batch = torch.export.Dim("batch", min=2, max=64)
        program = torch.export.export(encoder, (xs[0],), dynamic_shapes={"x": {0: batch}})
        torch.save({"xs": xs, "ys": [reference(encoder, x) for x in xs]}, tmp_path / "io.pt")
    return program


@pytest.mark.parametrize("imports", ["torch, client", "client, torch"])  # either order: isort puts client first
def test_exported_program_runs_in_a_fresh_process(encoder, shared_daemon, tmp_path, imports):
    program = _export(encoder, tmp_path)
    calls = [n for n in program.graph.nodes if n.op == "call_function" and str(n.target).startswith("kernel_service.")]
    assert len(calls) == 11
    spec = json.loads(calls[0].args[0])  # each call carries its kernel's canonical spec
    assert spec["kind"] == "rmsnorm" and spec["params"]["M"] is None and spec["target"] == "c"
    torch.export.save(program, tmp_path / "block.pt2")
    load = f"torch.export.load({str(tmp_path / 'block.pt2')!r}).module()"
    out = _fresh_process(_RUN_EXPORTED.format(imports=imports, io=str(tmp_path / "io.pt"), load=load), shared_daemon.socket)
    assert out.split()[0] == "ok" and out.split()[-1] == "8"  # eight distinct kernels resolved through the daemon


def test_aoti_package_runs_in_a_fresh_process(encoder, shared_daemon, tmp_path):
    program = _export(encoder, tmp_path)
    with torch.no_grad():  # as AOTInductor's own examples: its lowering runs the ops
        path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "block-aoti.pt2"))
    load = f"torch._inductor.aoti_load_package({path!r})"
    out = _fresh_process(_RUN_EXPORTED.format(imports="torch, client", io=str(tmp_path / "io.pt"), load=load), shared_daemon.socket)
    assert out.split()[0] == "ok"


def test_a_fresh_process_without_a_daemon_names_the_missing_service(encoder, tmp_path):
    program = _export(encoder, tmp_path)
    torch.export.save(program, tmp_path / "block.pt2")
    code = _RUN_EXPORTED.format(imports="torch, client", io=str(tmp_path / "io.pt"), load=f"torch.export.load({str(tmp_path / 'block.pt2')!r}).module()")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "KERNEL_SERVICE_SOCKET": str(tmp_path / "none.sock")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode != 0 and "no kernel service at" in proc.stderr


# ----- GPU: CUDA graphs, plain and through torch.compile

SMALL_LLAMA = BlockConfig(hidden=256, heads=4, kv_heads=2, ffn=512, seq_len=128, dtype="float16", target="sm_90a", causal=True)


@pytest.fixture(scope="module")
def gpu_client(tmp_path_factory):
    from devtools.launch import DaemonProcess

    base = tmp_path_factory.mktemp("gpu-daemon")
    with DaemonProcess(base / "cache", "--target", "sm_90a", workers=4, log_path=base / "daemon.log") as d:
        c = d.client()
        yield c
        c.close()


@pytest.fixture(scope="module")
def gpu_block(gpu_client):
    return ServedBlock(gpu_client, SMALL_LLAMA)


@needs_gpu
def test_cuda_graph_capture_plain_and_reduce_overhead(gpu_block):
    xs = [torch.randn(b, SMALL_LLAMA.seq_len, SMALL_LLAMA.hidden, device="cuda", dtype=torch.float16) for b in (2, 3)]
    with torch.inference_mode():
        want = [gpu_block(x) for x in xs]
        for x, w in zip(xs, want):
            assert rel_error(w, reference(gpu_block, x)) < 1e-2
        # Plain capture of the eager block, replayed on new inputs.
        static = xs[0].clone()
        gpu_block(static)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gpu_block(static)
        for x in (xs[0], torch.randn_like(xs[0])):
            static.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, gpu_block(x))
        # torch.compile's CUDA graphs: fullgraph, dynamic batch, the same results as eager.
        compiled = torch.compile(gpu_block, fullgraph=True, dynamic=True, mode="reduce-overhead")
        for _ in range(3):  # warm-up, record, replay
            for x, w in zip(xs, want):
                got = compiled(x).clone()
                torch.testing.assert_close(got, w, rtol=0, atol=0)


@needs_gpu
def test_served_ops_run_on_the_current_stream(gpu_block):
    x = torch.randn(2, SMALL_LLAMA.seq_len, SMALL_LLAMA.hidden, device="cuda", dtype=torch.float16)
    with torch.inference_mode():
        want = gpu_block(x)
        compiled = torch.compile(gpu_block, fullgraph=True, dynamic=True)
        compiled(x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s: a kernel on another stream would read x before this ends
            y = x * 1  # written only after the sleep, on the side stream
            got = compiled(y)
        torch.cuda.current_stream().wait_stream(side)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@needs_gpu
def test_cuda_calls_refuse_bad_inputs_as_the_checked_path_does(gpu_client):
    """A plain CUDA call with out=None lets TileLang's generated host code check the arguments
    (the fast path); every input it refuses still raises the error the checked path names,
    and a shared build's fixed size is still enforced."""
    c = gpu_client
    k = c.get_kernel("gemm", M=None, N=64, K=128, dtype="float16", trans_b=True, target="sm_90a")
    fixed = c.get_kernel("gemm", M=32, N=64, K=128, dtype="float16", trans_b=True, target="sm_90a")
    a = torch.randn(32, 128, device="cuda", dtype=torch.float16)
    w = torch.randn(64, 128, device="cuda", dtype=torch.float16)
    with torch.inference_mode():
        torch.testing.assert_close(k(a, w), a @ w.T, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(fixed(a, w), a @ w.T, rtol=1e-2, atol=1e-2)
        for call, err, match in (
            (lambda: k(a.float(), w), TypeError, "input A must be float16"),
            (lambda: k(a, w[:, :64]), ValueError, r"input B must have shape"),
            (lambda: k(a[:, None], w), ValueError, "input A must have 2 dims"),
            (lambda: k(torch.randn(128, 32, device="cuda", dtype=torch.float16).T, w), ValueError, "input A must be contiguous"),
            (lambda: k(a.cpu(), w), ValueError, "all inputs must be on one device"),
            (lambda: k(a, w.cpu()), ValueError, "all inputs must be on one device"),
            (lambda: k(a.cpu(), w.cpu()), ValueError, "built for cuda, inputs are on cpu"),
            (lambda: k(a), TypeError, "gemm takes 2 tensors"),
            (lambda: fixed(a[:16], w), ValueError, "this kernel was asked for with M=32"),
        ):
            with pytest.raises(err, match=match):
                call()
    with pytest.raises(RuntimeError, match="inference-only"):
        k(a, torch.nn.Parameter(w))


def test_same_named_kinds_of_two_daemons_both_load_and_only_the_op_is_refused(make_daemon):
    """Two daemons' plugins name a kind alike with other output counts: the torch op of that
    name is the first one's, and the second kernel still loads and runs on plain tensors;
    traced, it says which op holds the name."""
    one = make_daemon("--kernel-module", "tests.twin_kinds").client()
    pair = make_daemon("--kernel-module", "tests.twin_kinds", env={"TWIN_OUTPUTS": "2"}).client()
    single, double = one.get_kernel("twin", N=8), pair.get_kernel("twin", N=8)
    x = torch.randn(8)
    torch.testing.assert_close(single(x), 2 * x)
    y, z = double(x)
    torch.testing.assert_close(y, 2 * x)
    torch.testing.assert_close(z, 3 * x)
    torch.testing.assert_close(torch.compile(single, fullgraph=True)(x), 2 * x)
    with pytest.raises(RuntimeError, match=r"no torch op bound \(kernel_service::twin was registered for 1 output, this kernel has 2\)"):
        torch.compile(double, fullgraph=True)(x)
