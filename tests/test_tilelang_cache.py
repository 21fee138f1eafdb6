"""TileLang's own API through the daemon (issue #46): processes that call `@tilelang.jit`,
`tilelang.compile` and `par_compile` with KERNEL_SERVICE_TILELANG=1 (no code change) against a
real daemon on a real socket, real TileLang compiles for target "c"; and the rule of what may
travel (kernels.program), held against TileLang's own lists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from kernels import program
from proto import wire
from proto.kernelservice.v1 import kernel_service_pb2 as pb
from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent

# An engine's process: runs the steps named on its command line, prints one JSON line.
AGENT = r"""
import json, os, sys, warnings
warnings.simplefilter("always")
caught = []
warnings.showwarning = lambda message, category, *rest: caught.append(f"{category.__name__}: {message}")
import torch, tilelang
from tests import tilelang_programs as tp
out = {"steps": []}
x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
try:
    for step in sys.argv[1:]:
        if step == "scale":
            k = tp.scale(4)
            out["steps"].append({"err": float((k(x) - 2 * x).abs().max()), "type": type(k).__name__, "source": k.get_kernel_source()})
        elif step == "eager":
            out["steps"].append({"err": float((tp.eager_add(x, x) - 2 * x).abs().max())})
        elif step == "include":
            k = tp.with_include(4)
            out["steps"].append({"err": float((k(x[0]) - 3 * x[0]).abs().max())})
        elif step == "par":
            kernels = tilelang.par_compile([tp.shift(4, float(b)) for b in range(3)], out_idx=[-1], target="c")
            out["steps"].append({"err": max(float((k(x[0]) - x[0] - b).abs().max()) for b, k in enumerate(kernels))})
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
import client.tilelang
out["installed"] = client.tilelang.installed() is not None
out["warnings"] = caught
print(json.dumps(out))
"""


def agent(socket, tmp: Path, *steps: str, name: str = "agent", **env) -> subprocess.Popen:
    """A process that runs TileLang code with KERNEL_SERVICE_TILELANG=1 and its own TileLang cache."""
    environment = {
        **os.environ,
        "KERNEL_SERVICE_TILELANG": "1",
        "KERNEL_SERVICE_SOCKET": str(socket),
        "TILELANG_CACHE_DIR": str(tmp / f"tilelang-{name}"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        **env,
    }
    return subprocess.Popen([sys.executable, "-c", AGENT, *steps], cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def own_kernels(tmp: Path, name: str = "agent") -> list[Path]:
    """The kernels TileLang's own disk cache holds for one agent."""
    return [p for p in (tmp / f"tilelang-{name}").rglob("*") if p.is_file() and "kernels" in p.parts]


def counters(daemon) -> dict:
    c = daemon.client()
    try:
        return c.stats()
    finally:
        c.close()


def test_three_processes_get_one_compile_by_the_daemon_and_tilelangs_cache_stays_empty(make_daemon, tmp_path):
    import tilelang

    from tests import tilelang_programs as tp

    d = make_daemon()
    procs = [agent(d.socket, tmp_path, "scale", "eager", name=f"a{i}") for i in range(3)]
    results = [result(p) for p in procs]
    for i, r in enumerate(results):
        assert "error" not in r and r["installed"], r
        assert [s["err"] for s in r["steps"]] == [0.0, 0.0]
        assert r["steps"][0]["type"] == "JITKernel"  # what tilelang.compile returns
        assert own_kernels(tmp_path, f"a{i}") == []
        assert r["warnings"] == []
    stats = counters(d)
    assert stats["compiles"] == 2, stats  # two kernels, each compiled once for the three processes
    # The same CUDA-or-C source TileLang's own compile makes.
    ours = tilelang.compile(tp.scale.get_tir(4), out_idx=[-1], target="c")
    assert results[0]["steps"][0]["source"] == ours.get_kernel_source()
    # A fourth process finds both in the cache itself: no request reaches the daemon.
    again = result(agent(d.socket, tmp_path, "scale", "eager", name="late"))
    assert [s["err"] for s in again["steps"]] == [0.0, 0.0]
    after = counters(d)
    asked = ("compiles", "misses")  # and GetKernel's hits: hits less the direct ones the processes reported
    assert [after[n] for n in asked] + [after["hits"] - after["direct_hits"]] == [stats[n] for n in asked] + [stats["hits"] - stats["direct_hits"]]
    assert after["direct_hits"] == stats["direct_hits"] + 2  # the late process's two, reported at its exit


def test_a_strict_process_gets_kernel_not_ready_naming_the_kernel(make_daemon, tmp_path):
    d = make_daemon()
    r = result(agent(d.socket, tmp_path, "scale", KERNEL_SERVICE_STRICT="1"))
    assert r["error"].startswith("KernelNotReady: kernel tilelang main (program "), r
    assert "is not in the cache" in r["error"]
    assert counters(d)["compiles"] == 0
    assert own_kernels(tmp_path) == []


def test_a_recorded_app_prewarmed_or_bundled_serves_a_strict_process_with_no_compile(make_daemon, tmp_path):
    recorder = make_daemon()
    r = result(agent(recorder.socket, tmp_path, "scale", "eager", "par", name="rec", KERNEL_SERVICE_APP="engine"))
    assert "error" not in r, r
    manifest = tmp_path / "engine.json"
    cli = [sys.executable, "-m", "compile_service.cli"]
    subprocess.run([*cli, "manifest", "--app", "engine", "--cache-dir", str(recorder.cache_dir), "-o", str(manifest)], cwd=ROOT, check=True)
    assert sum(1 for spec in json.loads(manifest.read_text())["kernels"] if spec["kind"] == program.KIND) == 5  # scale, eager_add, 3 shifts

    server = make_daemon()
    subprocess.run([*cli, "prewarm", str(manifest), "--socket", str(server.socket)], cwd=ROOT, check=True, capture_output=True)
    built = counters(server)["compiles"]
    assert built == 5
    r = result(agent(server.socket, tmp_path, "scale", "eager", "par", name="strict", KERNEL_SERVICE_STRICT="1"))
    assert "error" not in r and [s["err"] for s in r["steps"]] == [0.0, 0.0, 0.0], r
    assert counters(server)["compiles"] == built
    assert own_kernels(tmp_path, "strict") == []

    # A signed bundle of the recorded programs feeds a serve-only host, which compiles nothing.
    bundle, key = tmp_path / "engine.tar", tmp_path / "builder.pub"
    subprocess.run(
        [*cli, "bundle", "export", "--manifest", str(manifest), "--cache-dir", str(recorder.cache_dir), "-o", str(bundle)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    key.write_text(subprocess.run([*cli, "bundle", "key", "--cache-dir", str(recorder.cache_dir)], cwd=ROOT, check=True, capture_output=True, text=True).stdout)
    fresh = tmp_path / "serve-only"
    subprocess.run([*cli, "bundle", "import", str(bundle), "--cache-dir", str(fresh), "--trusted-key", str(key)], cwd=ROOT, check=True, capture_output=True)
    serve_only = make_daemon("--no-compile", cache_dir=fresh)
    r = result(agent(serve_only.socket, tmp_path, "scale", "eager", "par", name="serve-only", KERNEL_SERVICE_STRICT="1"))
    assert "error" not in r and [s["err"] for s in r["steps"]] == [0.0, 0.0, 0.0], r
    assert counters(serve_only)["compiles"] == 0


def test_with_no_daemon_tilelang_compiles_here_with_one_warning_and_strict_raises(tmp_path):
    nowhere = tmp_path / "run" / "ks.sock"
    r = result(agent(nowhere, tmp_path, "scale", "eager", "par"))
    assert "error" not in r and [s["err"] for s in r["steps"]] == [0.0, 0.0, 0.0], r
    assert len(r["warnings"]) == 1 and "TileLangCacheWarning" in r["warnings"][0] and "compiles in this process" in r["warnings"][0], r["warnings"]
    assert len(own_kernels(tmp_path)) > 0  # TileLang's own cache took them
    strict = result(agent(nowhere, tmp_path, "scale", name="strict", KERNEL_SERVICE_STRICT="1"))
    assert strict["error"].startswith("KernelNotReady: kernel tilelang main"), strict
    assert "no kernel service answers" in strict["error"] or "no kernel service at" in strict["error"]
    assert own_kernels(tmp_path, "strict") == []


def test_with_the_daemon_down_kernels_in_the_cache_still_load(make_daemon, tmp_path):
    """The daemon's ServiceInfo left in the cache root lets a process started with the daemon down
    load the programs the cache holds, with no warning and nothing compiled in the process."""
    d = make_daemon()
    assert "error" not in result(agent(d.socket, tmp_path, "scale", "eager", name="first"))
    d.stop()
    r = result(agent(d.socket, tmp_path, "scale", "eager", KERNEL_SERVICE_CACHE_DIR=str(d.cache_dir)))
    assert "error" not in r and [s["err"] for s in r["steps"]] == [0.0, 0.0] and r["warnings"] == [], r
    assert own_kernels(tmp_path) == []


def test_a_kernel_that_cannot_travel_compiles_here_with_a_warning_and_the_daemon_refuses_it(make_daemon, tmp_path):
    import tilelang

    from client.tilelang import _resolve, program_spec
    from tests import tilelang_programs as tp

    d = make_daemon()
    r = result(agent(d.socket, tmp_path, "include", "scale"))
    assert "error" not in r and [s["err"] for s in r["steps"]] == [0.0, 0.0], r
    assert len(r["warnings"]) == 1 and "C source other than #define lines" in r["warnings"][0], r["warnings"]
    stats = counters(d)
    assert stats["compiles"] == 1 and stats["local_compiles"] == 1, stats  # scale; the kernel with an #include compiled in the process, reported

    # Sent anyway (a client of another rule): refused before any work, naming the part.
    func = tp.with_include.get_tir(4)
    context, configs = _resolve("c", None, None, None)
    doc = json.loads(program_spec(tp.scale.get_tir(4), [-1], context, configs, None).params[program.FIELD])
    doc["ir"] = json.loads(tilelang.tvm.ir.save_json(func))
    spec = wire.spec_to_proto(program.KIND, {program.FIELD: json.dumps(doc)}, "c")
    stub = pb_grpc.KernelServiceStub(grpc.insecure_channel(f"unix:{d.socket}"))
    with pytest.raises(grpc.RpcError) as refused:
        stub.GetKernel(pb.GetKernelRequest(spec=spec), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("program.ir: ")
    assert counters(d)["compiles"] == 1


def test_par_compile_is_one_batch_on_the_daemon(make_daemon, tmp_path):
    d = make_daemon()
    r = result(agent(d.socket, tmp_path, "par"))
    assert "error" not in r and r["steps"][0]["err"] == 0.0, r
    stats = counters(d)
    assert stats["compiles"] == 3 and stats["misses"] == 3, stats
    assert own_kernels(tmp_path) == []


def test_install_and_uninstall_in_process(make_daemon, tmp_path, monkeypatch):
    import tilelang
    import torch

    import client
    from tests import tilelang_programs as tp

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "tilelang-agent"))
    d = make_daemon()
    x = torch.arange(4, dtype=torch.float32)
    client.install_tilelang_cache(d.socket)
    try:
        first = tilelang.compile(tp.shift(4, 5.0), out_idx=[-1], target="c")
        assert torch.equal(first(x), x + 5)
        assert tilelang.compile(tp.shift(4, 5.0), out_idx=[-1], target="c") is first  # one object per program, as TileLang's memory cache
        assert counters(d)["compiles"] == 1
    finally:
        client.uninstall_tilelang_cache()
    assert client.tilelang.installed() is None
    tilelang.compile(tp.shift(4, 6.0), out_idx=[-1], target="c")  # TileLang's own again
    assert counters(d)["compiles"] == 1


# ----- what may travel (kernels.program), without a daemon


def _doc(**change) -> dict:
    from client.tilelang import _resolve, program_spec
    from tests import tilelang_programs as tp

    context, configs = _resolve("c", None, None, None)
    doc = json.loads(program_spec(tp.scale.get_tir(4), [-1], context, configs, None).params[program.FIELD])
    doc.update(change)
    return doc


@pytest.mark.parametrize(
    "flag, travels",
    [
        ("-O3", True),
        ("--use_fast_math", True),
        ("-DNDEBUG", True),
        ("-U__CUDA_NO_HALF_OPERATORS__", True),
        ("-Wno-deprecated-declarations", True),
        ("--ptxas-options=-v,--register-usage-level=10", True),
        ("-I/root", False),
        ("-include", False),
        ("--include-path=/root", False),
        ("@/root/flags", False),
        ("-o", False),
        ("-Xcompiler=-include/root/x", False),
        ("-Wl,-T,/root/x", False),
        ('-DX="y"', False),
        ("--ptxas-options=--output-file=/tmp/x", False),
    ],
)
def test_compile_flags_that_name_no_file_travel(flag, travels):
    doc = _doc(compile_flags=[flag])
    if travels:
        program.check_program(doc)
    else:
        with pytest.raises(program.NotTravelling, match="compile_flags"):
            program.check_program(doc)


def test_the_pass_config_lists_cover_tilelangs_own():
    from tilelang.transform import PassConfigKey

    theirs = {k.value for k in PassConfigKey}
    assert theirs == program.PASS_CONFIGS | program.PASS_CONFIGS_REFUSED
    assert not program.PASS_CONFIGS & program.PASS_CONFIGS_REFUSED
    with pytest.raises(program.NotTravelling, match="writes files"):
        program.check_program(_doc(pass_configs={"tl.dump_ir_path": "/root"}))
    with pytest.raises(program.NotTravelling, match="compile flag"):
        program.check_program(_doc(pass_configs={"tl.device_compile_flags": ["-include", "/root/x"]}))
    program.check_program(_doc(pass_configs={"tl.disable_warp_specialized": True, "tl.Simplify": {"transitively_prove_inequalities": True}}))


@pytest.mark.parametrize(
    "text, travels",
    [
        ("shared.dyn", True),
        ("#define grid_x() ((int)gridDim.x)\n", True),  # the zoo's prelude
        ('#include "/root/secret"', False),
        ("#define X 1\n#include </root/secret>\n", False),
        ('#define S "x"', False),
        ("x); } __attribute__((constructor)) void f() { ", False),
        ('f"\n#include "/etc/shadow', False),
        ("??=include", False),
        ("%:include", False),
        ("caf\u00e9", False),
    ],
)
def test_strings_of_the_ir_carry_no_c_source(text, travels):
    if travels:
        program.check_string(text, "ir")
    else:
        with pytest.raises(program.NotTravelling):
            program.check_string(text, "ir")


def test_ir_graphs_are_bounded_and_refer_only_backwards():
    doc = _doc()
    nodes = doc["ir"]["nodes"]
    program.check_program(doc)
    cyclic = json.loads(json.dumps(doc))
    cyclic["ir"]["nodes"].append({"type": "ffi.Array", "data": [len(nodes)]})  # itself
    with pytest.raises(program.NotTravelling, match="not to one before it"):
        program.check_ir(cyclic["ir"])
    alien = json.loads(json.dumps(doc))
    alien["ir"]["nodes"][0] = {"type": "ffi.Module", "data": {}}
    with pytest.raises(program.NotTravelling, match="does not travel"):
        program.check_ir(alien["ir"])
    deep = {"root_index": 0, "nodes": [{"type": "None"}, {"type": "ir.IntImm", "data": {"span": 0, "dtype": "int32", "value": 1}}]}
    for _ in range(program.MAX_DEPTH + 1):
        deep["nodes"].append({"type": "tirx.Add", "data": {"span": 0, "dtype": "int32", "a": len(deep["nodes"]) - 1, "b": 1}})
    with pytest.raises(program.NotTravelling, match="levels deep"):
        program.check_ir(deep)
    for target in ({"kind": "llvm"}, {"kind": "cuda", "arch": "sm_99"}, {"kind": "c", "libs": ["x"]}):
        with pytest.raises(program.NotTravelling, match="target"):
            program.check_program(_doc(target=target))


def test_the_key_is_the_same_wherever_the_code_lives(tmp_path):
    """Spans are stripped: the same kernel traced from another file, at other lines, is the same
    program."""
    from client.tilelang import _resolve, program_spec

    moved = tmp_path / "moved"
    moved.mkdir()
    source = (ROOT / "tests" / "tilelang_programs.py").read_text()
    (moved / "elsewhere.py").write_text("\n\n\n" + source)
    sys.path.insert(0, str(moved))
    try:
        import elsewhere

        from tests import tilelang_programs as tp

        context, configs = _resolve("c", None, None, None)
        here = program_spec(tp.scale.get_tir(4), [-1], context, configs, None)
        there = program_spec(elsewhere.scale.get_tir(4), [-1], context, configs, None)
        assert here == there
        assert str(ROOT) not in here.params[program.FIELD]
    finally:
        sys.path.remove(str(moved))
        sys.modules.pop("elsewhere", None)


def test_with_the_variable_unset_python_starts_as_before():
    """The .pth line installed with the package arms nothing unless KERNEL_SERVICE_TILELANG=1."""
    code = "import sys; print(sorted(type(f).__name__ for f in sys.meta_path if type(f).__name__ == 'AfterTileLang'), 'client' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "KERNEL_SERVICE_TILELANG"}
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    on = subprocess.run([sys.executable, "-c", code], env={**env, "KERNEL_SERVICE_TILELANG": "1"}, capture_output=True, text=True, check=True).stdout.split()
    assert off == ["[]", "False"]
    assert on == ["['AfterTileLang']", "False"]  # armed, and nothing imported until TileLang is


def test_the_daemons_workers_never_route_their_builds_to_a_daemon(make_daemon, tmp_path):
    """A daemon started with KERNEL_SERVICE_TILELANG=1 still builds in its workers."""
    d = make_daemon(env={"KERNEL_SERVICE_TILELANG": "1"})
    start = time.monotonic()
    r = result(agent(d.socket, tmp_path, "scale"))
    assert "error" not in r and r["steps"][0]["err"] == 0.0, r
    assert time.monotonic() - start < 120
    assert counters(d)["compiles"] == 1
