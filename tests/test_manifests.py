"""No compiling while serving: manifests recorded from real traffic, prewarm, strict clients and
serve-only daemons. Real daemons, real compiles (target "c")."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

import client
import tests.failing_kind  # noqa: F401  (the client validates `broken` locally, as the daemon does)
from compile_service.config import ServiceConfig
from proto import manifest
from proto.kernelservice.v1 import kernel_service_pb2 as pb
from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent

# What an agent asks for while it serves: every kernel checked against torch.
AGENT = textwrap.dedent(
    """
    import json, sys, torch
    import client
    from kernels import reference
    c = client.connect(sys.argv[1])  # the application's name and strictness come from the environment
    outcomes = []
    for spec in json.loads(sys.argv[2]):
        kind = spec.pop("kind")
        try:
            k = c.get_kernel(kind, target="c", **spec)
        except client.KernelNotReady as exc:
            outcomes.append(f"not ready: {exc}")
            continue
        x = reference.make_inputs(kind, k.spec["params"])
        torch.testing.assert_close(k(*x), reference.reference(kind, k.spec["params"], x), **reference.tolerance("float32"))
        outcomes.append(k.outcome)
    print(json.dumps({"outcomes": outcomes, "app": c.app, "strict": c.strict}))
    """
)

SPECS = [
    {"kind": "gemm", "M": None, "N": 40, "K": 24, "dtype": "float32", "trans_b": True},
    {"kind": "rmsnorm", "M": None, "N": 64, "dtype": "float32"},
    {"kind": "softmax", "M": None, "N": 48, "dtype": "float32"},
]


def agent(socket, specs, **env) -> dict:
    import os

    proc = subprocess.run(
        [sys.executable, "-c", AGENT, str(socket), json.dumps(specs)], cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "compile_service.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_record_manifest_prewarm_then_serve_strict_with_no_compile(make_daemon, tmp_path):
    recording = make_daemon()
    first = agent(recording.socket, SPECS, KERNEL_SERVICE_APP="llama-test")
    assert first == {"outcomes": ["compiled"] * 3, "app": "llama-test", "strict": False}
    agent(recording.socket, SPECS[:1], KERNEL_SERVICE_APP="llama-test")  # asked again: recorded once

    out = tmp_path / "llama-test.json"
    written = cli("manifest", "--app", "llama-test", "--cache-dir", str(recording.cache_dir), "-o", str(out))
    assert written.returncode == 0, written.stderr
    m = json.loads(out.read_text())
    assert (m["format"], m["version"], m["app"]) == ("kernel-service-manifest", 1, "llama-test")
    assert [(k["kind"], k["target"]) for k in m["kernels"]] == [("gemm", "c"), ("rmsnorm", "c"), ("softmax", "c")]
    assert m["kernels"][1]["params"] == {"M": None, "N": 64, "dtype": "float32", "eps": 1e-6, "threads": None}  # canonical
    assert len(out.read_text().splitlines()) == 7 + 3  # readable: one kernel per line

    fresh = make_daemon()  # another host: an empty cache
    warmed = cli("prewarm", str(out), "--socket", str(fresh.socket))
    assert warmed.returncode == 0, warmed.stderr
    assert "built 3, already there 0, failed 0" in warmed.stdout
    assert warmed.stdout.count("[") >= 3  # a progress line per kernel (not a terminal: no bar)
    again = cli("prewarm", str(out), "--socket", str(fresh.socket))
    assert again.returncode == 0 and "built 0, already there 3, failed 0" in again.stdout

    before = fresh.client().stats()
    strict = agent(fresh.socket, SPECS, KERNEL_SERVICE_STRICT="1")
    assert strict == {"outcomes": ["hit"] * 3, "app": "", "strict": True}
    after = fresh.client().stats()
    assert after["compiles"] == before["compiles"] == 3 and after["not_ready"] == 0


def test_a_strict_miss_raises_at_once_and_compiles_nothing(make_daemon):
    d = make_daemon()
    strict = d.client(strict=True)
    spec = {"M": None, "N": 72, "dtype": "float32"}
    with pytest.raises(client.KernelNotReady) as err:
        strict.get_kernel("rmsnorm", target="c", **spec)
    message = str(err.value)
    assert '"kind":"rmsnorm"' in message and '"N":72' in message and f"(key {err.value.key})" in message and len(err.value.key) == 64
    assert "the request asked for no compile (a strict client)" in message and "no entry of kind rmsnorm" in message
    fix = message.splitlines()[-1]  # and how to have it ready
    assert "`kernel-service prewarm MANIFEST`" in fix and "`kernel-service bundle import BUNDLE`" in fix and "strict=False" in fix and "--no-compile" in fix
    assert isinstance(err.value, client.KernelServiceError) and isinstance(err.value, LookupError)
    stats = d.client().stats()
    assert (stats["compiles"], stats["misses"], stats["in_flight"], stats["entries"], stats["not_ready"]) == (0, 0, 0, 0, 1)

    assert d.client().get_kernel("rmsnorm", target="c", **spec).outcome == "compiled"  # a lenient client compiles it
    assert strict.get_kernel("rmsnorm", target="c", **spec).outcome == "hit"
    results = strict.prefetch([{"kind": "rmsnorm", "target": "c", **spec}, {"kind": "rmsnorm", "target": "c", **spec, "N": 80}], load=False)
    assert results[0] == "hit" and isinstance(results[1], client.KernelNotReady) and "N=80 vs 72" in str(results[1])
    assert str(results[1]).splitlines()[-1] == fix
    assert d.client().stats()["compiles"] == 1


def test_strict_and_app_from_the_environment(monkeypatch):
    monkeypatch.setenv("KERNEL_SERVICE_STRICT", "1")
    monkeypatch.setenv("KERNEL_SERVICE_APP", "svc.v2_x-1")
    c = client.connect("/nonexistent.sock")
    assert (c.strict, c.app) == (True, "svc.v2_x-1")
    assert client.connect("/nonexistent.sock", strict=False, app="other").strict is False
    monkeypatch.setenv("KERNEL_SERVICE_APP", "../etc")
    with pytest.raises(client.InvalidSpec, match="^app: application names are 1-64 characters"):
        client.connect("/nonexistent.sock")


def test_a_serve_only_daemon_answers_misses_without_compiling(make_daemon):
    builder = make_daemon()
    builder.client().get_kernel("rmsnorm", target="c", M=None, N=64, dtype="float32")
    builder.stop()
    serving = make_daemon("--no-compile", cache_dir=builder.cache_dir)
    c = serving.client()  # not strict: the daemon itself compiles nothing
    assert c.get_kernel("rmsnorm", target="c", M=None, N=64, dtype="float32").outcome == "hit"
    with pytest.raises(client.KernelNotReady, match=r"this daemon compiles nothing \(serve --no-compile\); .*N=96 vs 64"):
        c.get_kernel("rmsnorm", target="c", M=None, N=96, dtype="float32")
    stats = c.stats()  # counters go on from the builder's (kept in the cache): its one compile
    assert (stats["workers"], stats["compiles"], stats["not_ready"]) == (0, 1, 1)
    assert "--no-compile" in serving.log()


def test_cuda_compiler_id_is_for_serve_only_daemons():
    with pytest.raises(ValueError, match="--cuda-compiler-id needs --no-compile"):
        ServiceConfig.resolve(socket="/tmp/x.sock", cache_dir="/tmp/x", workers=1, cuda_compiler_id="nvrtc-13.0", env={})
    with pytest.raises(ValueError, match="e.g. nvrtc-13.0 or nvcc-13.0.88; got 'gcc-12'"):
        ServiceConfig.resolve(socket="/tmp/x.sock", cache_dir="/tmp/x", workers=1, cuda_compiler_id="gcc-12", no_compile=True, env={})
    cfg = ServiceConfig.resolve(socket="/tmp/x.sock", cache_dir="/tmp/x", workers=1, no_compile=True, env={"KERNEL_SERVICE_CUDA_COMPILER_ID": "nvcc-12.8.93"})
    assert cfg.device.id == "nvcc-12.8.93" and cfg.device.unavailable_reason()


def test_applications_are_recorded_once_per_spec_across_restarts(make_daemon):
    d = make_daemon()
    c = d.client(app="svc")
    c.get_kernel("rmsnorm", target="c", M=None, N=64, dtype="float32")
    c.prefetch(
        [
            {"kind": "rmsnorm", "target": "c", "M": None, "N": 64, "dtype": "float32"},
            {"kind": "softmax", "target": "c", "M": None, "N": 48, "dtype": "float32"},
        ],
        load=False,
    )
    d.client(app="other").get_kernel("rmsnorm", target="c", M=None, N=64, dtype="float32")
    d.stop()
    d2 = make_daemon(cache_dir=d.cache_dir)
    d2.client(app="svc").get_kernel("rmsnorm", target="c", M=None, N=64, dtype="float32")  # known after a restart
    d2.client(app="svc").get_kernel("softmax", target="c", M=None, N=16, dtype="float32")
    # In the cache already: a client without an app would load it without asking; one with an app asks.
    d2.client(app="late").get_kernel("rmsnorm", target="c", M=None, N=64, dtype="float32")
    assert [json.loads(line)["kind"] for line in (d.cache_dir / "apps" / "late.jsonl").read_text().splitlines()] == ["rmsnorm"]
    lines = (d.cache_dir / "apps" / "svc.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["rmsnorm", "softmax", "softmax"]
    assert oct((d.cache_dir / "apps" / "svc.jsonl").stat().st_mode & 0o777) == oct(0o600)

    # A name that could leave apps/ is refused over the wire, before anything is recorded.
    with grpc.insecure_channel(f"unix:{d2.socket}") as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.KernelServiceStub(channel).GetKernel(pb.GetKernelRequest(spec=pb.KernelSpec(kind="rmsnorm"), app="../../x"), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("app: ")
    assert sorted(p.name for p in (d.cache_dir / "apps").iterdir()) == ["late.jsonl", "other.jsonl", "svc.jsonl"]

    missing = cli("manifest", "--app", "nobody", "--cache-dir", str(d.cache_dir))
    assert missing.returncode == 1 and "recorded: late, other, svc" in missing.stderr
    printed = cli("manifest", "--app", "other", "--cache-dir", str(d.cache_dir))
    assert printed.returncode == 0 and manifest.specs(json.loads(printed.stdout)) == [
        {"kind": "rmsnorm", "target": "c", "M": None, "N": 64, "dtype": "float32", "eps": 1e-6, "threads": None}
    ]


def test_prewarm_reports_failures_with_reasons_and_exits_non_zero(make_daemon, tmp_path):
    d = make_daemon("--kernel-module", "tests.failing_kind")
    specs = [
        {"kind": "rmsnorm", "target": "c", "params": {"M": None, "N": 32, "dtype": "float32"}},
        {"kind": "broken", "target": "c", "params": {"N": 8}},
        {"kind": "conv3d", "target": "c", "params": {"M": 1}},
    ]
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"format": "kernel-service-manifest", "version": 1, "app": None, "kernels": specs}))
    result = cli("prewarm", str(path), "--socket", str(d.socket))
    assert result.returncode == 1, result.stderr
    assert "built 1, already there 0, failed 2 (of 3 kernels)" in result.stdout
    assert "failed: broken N=8 on c: FAILED_PRECONDITION:" in result.stdout
    assert "failed: conv3d M=1 on c: INVALID_ARGUMENT: unknown kernel kind 'conv3d'" in result.stdout

    path.write_text(json.dumps({"format": "kernel-service-manifest", "version": 2, "kernels": []}))
    newer = cli("prewarm", str(path), "--socket", str(d.socket))
    assert newer.returncode == 2 and "manifest version 2, this kernel-service reads version 1" in newer.stderr
    path.write_text("[]")
    assert "not a kernel-service manifest" in cli("prewarm", str(path), "--socket", str(d.socket)).stderr


def test_client_prefetch_takes_a_manifest(make_daemon, tmp_path):
    d = make_daemon()
    m = manifest.make("x", [{"kind": "rmsnorm", "target": "c", "params": {"M": None, "N": 24, "dtype": "float32"}}])
    path = tmp_path / "m.json"
    path.write_text(manifest.dumps(m))
    c = d.client()
    assert c.prefetch(str(path), load=False) == ["compiled"]
    assert c.prefetch(m, load=False) == ["hit"]
    [kernel] = c.prefetch(path)
    assert kernel.spec["params"]["N"] == 24
    with pytest.raises(manifest.ManifestError, match="not a kernel-service manifest"):
        c.prefetch({"kernels": []})


def test_a_strict_client_without_a_daemon_only_reads_the_cache(tmp_path):
    code = textwrap.dedent(
        """
        import sys, client
        c = client.connect(sys.argv[1], fallback=True, strict=True, cache_dir=sys.argv[2])
        try:
            c.get_kernel("rmsnorm", target="c", M=None, N=64, dtype="float32")
        except client.KernelNotReady as exc:
            print(exc, "| tilelang imported:", "tilelang" in sys.modules)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "no-daemon.sock"), str(tmp_path / "cache")], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "(a strict client; no daemon answered); no entry of kind rmsnorm" in out.stdout and out.stdout.strip().endswith("tilelang imported: False")
    assert not list((tmp_path / "cache" / "entries").iterdir())  # nothing compiled


def test_serving_only_still_copies_a_shared_build_that_is_there(make_daemon):
    builder = make_daemon("--kernel-module", "tests.shared_kind")
    builder.client().get_kernel("row_double", target="c", M=None, N=8)  # the runtime-M build
    builder.stop()
    serving = make_daemon("--no-compile", "--kernel-module", "tests.shared_kind", cache_dir=builder.cache_dir)
    c = serving.client(strict=True)
    copy = c.get_kernel("row_double", target="c", M=5, N=8)  # its own entry: a copy, nothing compiled
    assert copy.abi["fixed"] == {"M": 5}
    with pytest.raises(client.KernelNotReady, match="N=16 vs 8"):  # no build of N=16 to copy
        c.get_kernel("row_double", target="c", M=5, N=16)
    stats = c.stats()  # counters go on from the builder's (kept in the cache): its one compile
    assert (stats["compiles"], stats["derived"], stats["not_ready"]) == (1, 1, 1)


def test_prewarm_sends_batches_the_daemon_accepts(make_daemon, tmp_path):
    d = make_daemon("--queue-limit", "8")  # one Prefetch may queue 2 compiles
    m = manifest.make("x", [{"kind": "rmsnorm", "target": "c", "params": {"M": None, "N": n, "dtype": "float32"}} for n in (8, 16, 24, 32, 40)])
    path = tmp_path / "m.json"
    path.write_text(manifest.dumps(m))
    with pytest.raises(client.ServiceError, match="a Prefetch may queue at most 2 compiles"):
        d.client().prefetch(m, load=False)  # all at once: refused
    warmed = cli("prewarm", str(path), "--socket", str(d.socket))
    assert warmed.returncode == 0 and "built 5, already there 0, failed 0" in warmed.stdout, warmed.stdout + warmed.stderr


# ----- #32 item 5: nested or ill-typed manifests are a ManifestError, one line, no traceback


def _hostile_manifests(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, what the one-line error must say)."""
    kernel = {"kind": "rmsnorm", "target": "c", "params": {"M": None, "N": 64, "dtype": "float32"}}
    deep = '{"format": "kernel-service-manifest", "version": 1, "app": "x", "kernels": [' + "[" * 100_000 + "]" * 100_000 + "]}"
    listed = manifest.make("x", [{**kernel, "params": {**kernel["params"], "N": [64, 128]}}])
    nested_param = manifest.make("x", [{**kernel, "params": {**kernel["params"], "N": {"a": [[[1]]]}}}])
    out = {}
    for name, text, why in (
        ("deep", deep, "nested more than 32 levels deep"),
        ("list", json.dumps(listed), "kernels[0].params.N is a list; parameter values are numbers, strings, true/false or null"),
        ("dict", json.dumps(nested_param), "kernels[0].params.N is a dict"),
    ):
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        out[name] = (path, why)
    return out


def test_nested_or_ill_typed_manifests_are_one_line_errors(shared_daemon, tmp_path):
    """prewarm (against a running daemon), bundle export --manifest and client.prefetch(path):
    a manifest nested 100,000 deep, or with a list- or object-valued parameter."""
    c = shared_daemon.client()
    for name, (path, why) in _hostile_manifests(tmp_path).items():
        for argv in (
            ("prewarm", str(path), "--socket", str(shared_daemon.socket)),
            ("bundle", "export", "--manifest", str(path), "-o", str(tmp_path / "b.tar")),
        ):
            done = cli(*argv)
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1 and why in lines[0] and "Traceback" not in done.stderr, (name, argv[0], done.stderr[-500:])
        with pytest.raises(manifest.ManifestError, match=why.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
            c.prefetch(path)
        with pytest.raises(manifest.ManifestError):
            manifest.load(path)


# ----- #47 item 10: a file to read that is a device or a fifo is refused in one line, never read


def _bounded(*args) -> subprocess.CompletedProcess:
    """The CLI, with its memory capped and a time limit: a command that reads /dev/zero fails
    the test rather than the machine."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_DATA, (4 << 30, 4 << 30))

    return subprocess.run([sys.executable, "-m", "compile_service.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, preexec_fn=cap)


def test_every_command_refuses_a_device_or_a_fifo_in_one_line(shared_daemon, tmp_path):
    """prewarm (against a running daemon), bundle export --manifest, bundle info, bundle import and
    client.prefetch(path), given /dev/zero or a fifo no one writes: each says what the path is
    in one line, at once (before, prewarm read /dev/zero forever and waited on the fifo)."""
    import os

    fifo = tmp_path / "manifest.fifo"
    os.mkfifo(fifo)
    for path, what in ((Path("/dev/zero"), "a character device"), (fifo, "a fifo")):
        for argv, noun in (
            (("prewarm", str(path), "--socket", str(shared_daemon.socket)), "manifest"),
            (("bundle", "export", "--manifest", str(path), "-o", str(tmp_path / "b.tar")), "manifest"),
            (("bundle", "info", str(path)), "bundle"),
            (("bundle", "import", str(path), "--cache-dir", str(tmp_path / "cache"), "--trust-unsigned"), "bundle"),
        ):
            done = _bounded(*argv)
            lines = done.stderr.strip().splitlines()
            assert done.returncode in (1, 2) and len(lines) == 1, (argv, done.stderr[-500:])
            assert f"{noun} {path} is {what}, not a regular file; refusing to read it" in lines[0], (argv, lines)
        with pytest.raises(manifest.ManifestError, match=f"is {what}, not a regular file"):
            shared_daemon.client().prefetch(path)
