"""Faults survived: real daemons killed, restarted, starved of disk, fed corrupt
entries and hostile input. Every test runs real processes on real sockets."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

import client
from compile_service.store import LocalStore as Store
from proto.entry import MANIFEST
from kernels.reference import make_inputs, reference, tolerance
from proto.kernelservice.v1 import kernel_service_pb2 as pb
from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc
from tests.processes import alive, descendants

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("rmsnorm", "softmax", "swiglu")


def specs(n: int, base: int = 16) -> list[dict]:
    """n distinct cheap CPU kernels."""
    return [{"kind": KINDS[i % 3], "M": None, "N": base + 8 * i, "dtype": "float32", "target": "c"} for i in range(n)]


def get(c: client.Client, spec: dict):
    spec = dict(spec)
    return c.get_kernel(spec.pop("kind"), **spec)


def assert_correct(kernel) -> None:
    p = kernel.spec["params"]
    inputs = make_inputs(kernel.kind, p)
    torch.testing.assert_close(kernel(*inputs), reference(kernel.kind, p, inputs), **tolerance(p["dtype"]))


def verify_cli(cache_dir: Path, *extra: str) -> tuple[int, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "compile_service.cli", "verify", "--cache-dir", str(cache_dir), "--json", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.returncode, json.loads(out.stdout)


def prefetch_in_background(socket: Path, batch: list[dict]) -> subprocess.Popen:
    code = "import client, sys, json; client.connect(sys.argv[1]).prefetch(json.loads(sys.argv[2]), load=False)"
    return subprocess.Popen([sys.executable, "-c", code, str(socket), json.dumps(batch)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout: float = 90, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_kill_9_mid_burst_leaves_a_cache_a_new_daemon_serves(make_daemon):
    d = make_daemon()
    batch = specs(8)
    runner = prefetch_in_background(d.socket, batch)
    store = Store(d.cache_dir, create=False)
    # Kill once some entries are published and another compile is under way.
    wait_for(lambda: len(store.keys()) >= 2 and any(store.staging_dir.iterdir()), what="a published entry and a compile in progress")
    workers = descendants(d.proc.pid)
    d.proc.kill()
    d.proc.wait()
    runner.communicate(timeout=60)
    # Its compile workers (and multiprocessing's resource tracker) die with it.
    wait_for(lambda: not [p for p in workers if alive(p)], timeout=10, what="the killed daemon's workers to die")
    # Read-only verify: dead writers' staging dirs at most, never a corrupt entry.
    rc, report = verify_cli(d.cache_dir)
    assert {x["what"] for x in report["damage"]} <= {"staging"}, report
    assert report["entries_ok"] == len(store.keys()) >= 2

    d2 = make_daemon(cache_dir=d.cache_dir)  # sweeps the dead daemon's staging dirs
    rc, report = verify_cli(d.cache_dir)
    assert rc == 0 and report["damage"] == [], report
    c = d2.client()
    for spec in batch:
        assert_correct(get(c, spec))
    stats = c.stats()  # (entries may hold more than the batch: kernels/ may change under us)
    assert stats["corrupt"] == 0 and stats["failures"] == 0 and stats["entries"] >= len(batch)


def _rewrite_manifest(entry: Path, change) -> None:
    manifest = json.loads((entry / MANIFEST).read_text())
    change(manifest)
    (entry / MANIFEST).write_text(json.dumps(manifest))


def _garbage_abi(entry: Path) -> None:
    """A well-formed, self-consistent entry whose abi is nonsense."""
    from compile_service.fsutil import sha256_file

    meta = json.loads((entry / "entry.json").read_text())
    meta["abi"] = {"loader": "c", "params": "all of them"}
    (entry / "entry.json").write_text(json.dumps(meta))

    def fix(m):
        m["files"]["entry.json"] = {"size": (entry / "entry.json").stat().st_size, "sha256": sha256_file(entry / "entry.json")}

    _rewrite_manifest(entry, fix)


def _points_elsewhere(entry: Path, other: Path) -> None:
    def change(m):
        m["library"] = f"../{other.name}/kernel.so"
        m["files"][m["library"]] = m["files"]["kernel.so"]

    _rewrite_manifest(entry, change)


def _swapped(entry: Path, other: Path) -> None:
    """Another kernel's whole, consistent entry under this key: only the spec check catches it."""
    for f in entry.iterdir():
        f.unlink()
    for f in other.iterdir():
        shutil.copy(f, entry / f.name)
    _rewrite_manifest(entry, lambda m: m.update(key=entry.name))


CORRUPTIONS = {
    "truncated library": lambda e, o: (e / "kernel.so").write_bytes((e / "kernel.so").read_bytes()[:1000]),
    "zero-length files": lambda e, o: [f.write_bytes(b"") for f in e.iterdir()],
    "garbage entry.json": lambda e, o: (e / "entry.json").write_text("{not json"),
    "garbage abi": lambda e, o: _garbage_abi(e),
    "garbage manifest": lambda e, o: (e / MANIFEST).write_bytes(os.urandom(64)),
    "missing library": lambda e, o: (e / "kernel.so").unlink(),
    "missing manifest": lambda e, o: (e / MANIFEST).unlink(),
    "manifest points elsewhere": _points_elsewhere,
    "library is a symlink": lambda e, o: ((e / "kernel.so").unlink(), (e / "kernel.so").symlink_to(o / "kernel.so")),
    "another kernel's entry": _swapped,
}


def test_corrupt_entries_are_misses_and_rebuilt_never_wrong(make_daemon):
    d = make_daemon()
    c = d.client()
    batch = specs(len(CORRUPTIONS) + 1)
    entries = [get(c, s).path.parent for s in batch]
    other = entries[-1]  # left intact, the source of misdirection
    for (name, corrupt), entry in zip(CORRUPTIONS.items(), entries):
        corrupt(entry, other)

    rc, report = verify_cli(d.cache_dir)  # read-only: finds them, removes nothing
    assert rc == 1
    found = {Path(x["path"]).name for x in report["damage"] if x["what"] == "entry"}
    # The swapped entry is whole in itself; only a lookup that knows the spec can tell.
    assert found == {e.name for e in entries[: len(CORRUPTIONS) - 1]}
    assert all(e.exists() for e in entries)

    fresh = d.client()
    for spec, name in zip(batch, CORRUPTIONS):
        kernel = get(fresh, spec)
        assert kernel.outcome == "compiled", name
        assert kernel.spec["params"]["N"] == spec["N"] and kernel.kind == spec["kind"], name
        assert_correct(kernel)
    stats = fresh.stats()
    assert stats["corrupt"] == len(CORRUPTIONS) and stats["failures"] == 0
    assert verify_cli(d.cache_dir)[0] == 0
    assert get(d.client(), batch[-1]).outcome == "hit"


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs: a disk that really fills up."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs (a real full disk, not an injected error)")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mount)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):  # until ENOSPC
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)
    return filler


def test_full_disk_fails_the_save_cleanly_and_the_daemon_keeps_serving(make_daemon, small_fs):
    d = make_daemon(cache_dir=small_fs / "cache")
    c = d.client()
    warm, cold, later = specs(3)
    assert get(c, warm).outcome == "compiled"
    entries_before = Store(d.cache_dir, create=False).keys()
    filler = _fill(small_fs)

    with pytest.raises(client.ServiceError) as err:
        get(c, cold)
    assert err.value.code == "INTERNAL" and "No space left on device" in str(err.value)
    assert Store(d.cache_dir, create=False).keys() == entries_before  # nothing published
    assert list((d.cache_dir / "staging").iterdir()) == []  # staging cleaned
    assert get(d.client(), warm).outcome == "hit"  # still serving what it has
    assert c.stats()["failures"] == 1

    filler.unlink()
    assert_correct(get(c, cold))  # not remembered as the kernel's fault: retried at once
    assert_correct(get(c, later))
    assert verify_cli(d.cache_dir)[0] == 0


def test_restart_under_load_is_retried_not_failed(make_daemon):
    d = make_daemon()
    batch = specs(2)
    c0 = d.client()
    for s in batch:
        get(c0, s)
    errors, served, stop = [], [0], threading.Event()

    def agent():
        c = d.client(direct_hits=False)  # every request goes to the daemon
        while not stop.is_set():
            for s in batch:
                try:
                    c._memo.clear()  # ask the daemon every time, not this process's memo
                    assert_correct(get(c, s))
                    served[0] += 1
                except Exception as exc:  # noqa: BLE001
                    errors.append(exc)

    threads = [threading.Thread(target=agent) for _ in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: served[0] > 20, what="agents served")
    compiles = d.client().stats()["compiles"]
    d.stop()
    # A daemon that is gone fails a new client fast; a client that has seen one retries.
    t0 = time.monotonic()
    with pytest.raises(client.ServiceUnavailable):
        client.connect(d.socket).stats()
    assert time.monotonic() - t0 < 3
    time.sleep(1)
    before = served[0]
    d2 = make_daemon(cache_dir=d.cache_dir, socket=d.socket)
    wait_for(lambda: served[0] > before + 20, what="agents served by the new daemon")
    stop.set()
    for t in threads:
        t.join(60)
    assert errors == []
    assert d2.client().stats()["compiles"] == compiles  # nothing compiled again


def test_16_processes_asking_at_once_compile_each_kernel_once(make_daemon):
    d = make_daemon()
    batch = specs(3)
    code = (
        "import client, sys, json\n"
        "c = client.connect(sys.argv[1])\n"
        "out = []\n"
        "for s in json.loads(sys.argv[2]):\n"
        "    k = s.pop('kind'); out.append(c.get_kernel(k, **s).outcome)\n"
        "print(json.dumps(out))\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(d.socket), json.dumps(batch)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(16)
    ]
    outcomes = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        outcomes += json.loads(out.strip().splitlines()[-1])
    stats = d.client().stats()
    assert stats["compiles"] == len(batch) and stats["failures"] == 0
    assert outcomes.count("compiled") == len(batch) and len(outcomes) == 16 * len(batch)


def _param(value) -> pb.ParamValue:
    return pb.ParamValue(string_value=value) if isinstance(value, str) else pb.ParamValue(int_value=value)


HOSTILE = {
    "10 MB string param": pb.KernelSpec(kind="rmsnorm", target="c", params={"M": _param(8), "N": _param(8), "dtype": _param("x" * (10 << 20))}),
    "100k params": pb.KernelSpec(kind="rmsnorm", target="c", params={f"p{i}": _param(i) for i in range(100_000)}),
    "10 MB kind": pb.KernelSpec(kind="k" * (10 << 20), target="c"),
    "10 MB param name": pb.KernelSpec(kind="rmsnorm", target="c", params={"n" * (10 << 20): _param(1)}),
    "10 MB target": pb.KernelSpec(kind="rmsnorm", target="t" * (10 << 20), params={"N": _param(8)}),
    "absurd size": pb.KernelSpec(kind="rmsnorm", target="c", params={"M": _param(8), "N": _param(1 << 62), "dtype": _param("float32")}),
    "negative size": pb.KernelSpec(kind="rmsnorm", target="c", params={"M": _param(-(1 << 63)), "N": _param(8), "dtype": _param("float32")}),
    "NaN eps": pb.KernelSpec(kind="rmsnorm", target="c", params={"N": _param(8), "dtype": _param("float32"), "eps": pb.ParamValue(float_value=float("nan"))}),
    "empty spec": pb.KernelSpec(),
    "control characters": pb.KernelSpec(kind="rms\x00norm\n", target="c"),
}


def test_hostile_input_is_rejected_without_work_and_the_daemon_keeps_serving(shared_daemon):
    c = shared_daemon.client()
    stub = pb_grpc.KernelServiceStub(c._channel)
    before = c.stats()
    for name, spec in HOSTILE.items():
        with pytest.raises(grpc.RpcError) as err:
            stub.GetKernel(pb.GetKernelRequest(spec=spec), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert len(err.value.details()) < 2000, name  # no echo of the payload
    with pytest.raises(grpc.RpcError) as err:  # a huge batch of valid-looking specs
        list(stub.Prefetch(pb.PrefetchRequest(specs=[HOSTILE["absurd size"]] * 5000), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:  # past the message size limit: refused by gRPC itself
        stub.GetKernel(pb.GetKernelRequest(spec=pb.KernelSpec(kind="x" * (20 << 20))), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(client.InvalidSpec):  # the client validates first too
        c.get_kernel("rmsnorm", target="c", M=8, N=1 << 40, dtype="float32")

    after = c.stats()
    assert (after["compiles"], after["misses"], after["failures"]) == (before["compiles"], before["misses"], before["failures"])
    assert after["invalid"] >= before["invalid"] + len(HOSTILE)
    assert_correct(get(c, {"kind": "rmsnorm", "M": None, "N": 24, "dtype": "float32", "target": "c"}))


def test_past_the_queue_limit_is_resource_exhausted(make_daemon):
    d = make_daemon("--queue-limit", "1", workers=1)
    results, lock = [], threading.Lock()

    def ask(spec):
        try:
            r = get(d.client(), spec).outcome
        except client.ServiceError as exc:
            r = exc
        with lock:
            results.append(r)

    threads = [threading.Thread(target=ask, args=(s,)) for s in specs(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    refused = [r for r in results if isinstance(r, client.ServiceError)]
    assert "compiled" in results and refused, results
    assert all(r.code == "RESOURCE_EXHAUSTED" and "limit 1" in str(r) for r in refused)
    assert d.client().stats()["compiles"] == len(results) - len(refused)
