"""Read-only cache layers (serve --cache-layer): served as they are, never written, trusted as the cache is.

A layer here is what a builder daemon left in its cache, copied and made read-only
(directories 0555, files 0444, owned by root), as `bundle import --layer` lays one
out. The daemons under test run as root, which may write a read-only file: that
nothing in a layer changes is checked on the tree itself (every path's ctime, mtime,
mode, owner and bytes), not left to the permissions. The refusals run the daemon as
another user (tests/test_security.py's `world`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

import client
from devtools.launch import DaemonProcess
from proto.kernelservice.v1 import kernel_service_pb2 as pb
from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc
from proto.paths import entry_dir
from tests import test_security
from tests.test_security import ATTACKER, OWNER, world  # noqa: F401 - the fixture: processes of two unprivileged users

ROOT = Path(__file__).resolve().parent.parent
SHARED_KIND = ("--kernel-module", "tests.shared_kind")
NORM = {"M": None, "dtype": "float32"}  # rmsnorm, N given per test


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A cache as a builder daemon leaves it: rmsnorm N=8 and N=16, and row_double's runtime-M build."""
    base = tmp_path_factory.mktemp("layer-builder")
    with DaemonProcess(base / "cache", "--target", "c", *SHARED_KIND, workers=2, log_path=base / "daemon.log") as builder:
        c = builder.client()
        c.prefetch([{"kind": "rmsnorm", "target": "c", "N": n, **NORM} for n in (8, 16)] + [{"kind": "row_double", "target": "c", "M": None, "N": 8}])
        c.close()
    return base / "cache"


def make_layer(built: Path, path: Path, uid: int = 0, dir_mode: int = 0o555, file_mode: int = 0o444) -> Path:
    """A copy of the cache `built` at `path`, every directory and file `uid`'s, made read-only."""
    shutil.copytree(built, path, symlinks=True)
    for item in [path, *path.rglob("*")]:
        os.lchown(item, uid, uid)
        if not item.is_symlink():
            os.chmod(item, dir_mode if item.is_dir() else file_mode)
    return path


def snapshot(root: Path) -> dict:
    """Everything a write would change: each path's kind, mode, owner, inode, size, mtime and ctime, and a file's bytes."""
    out = {}
    for item in [root, *root.rglob("*")]:
        st = os.lstat(item)
        digest = hashlib.sha256(item.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None
        out[str(item.relative_to(root))] = (st.st_mode, st.st_uid, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest)
    return out


def norm(c, n: int):
    return c.get_kernel("rmsnorm", target="c", N=n, **NORM)


def in_dir(kernel, root: Path) -> bool:
    return Path(kernel.path).parent == entry_dir(root, kernel.key)


def test_a_read_only_layer_serves_hits_where_they_lie_and_is_never_written(make_daemon, built, tmp_path):
    layer = make_layer(built, tmp_path / "layer")
    before = snapshot(layer)
    # The flag replaces the variable (which names a layer that does not exist); a budget of one entry evicts.
    d = make_daemon(
        "--cache-layer", str(layer), "--max-entries", "1", "--evict-min-age", "0", *SHARED_KIND,
        env={"KERNEL_SERVICE_CACHE_LAYERS": str(tmp_path / "no-such-layer")},
    )  # fmt: skip
    asking = d.client(direct_hits=False)
    hit = norm(asking, 8)
    assert hit.outcome == "hit" and in_dir(hit, layer)  # the reply's entry_dir is the layer's: no copy
    assert asking.explain("rmsnorm", target="c", N=8, **NORM)["hit"]
    x = torch.randn(5, 8)
    doubled = asking.get_kernel("row_double", target="c", M=None, N=8)
    assert in_dir(doubled, layer)
    torch.testing.assert_close(doubled(x), 2 * x)
    direct = d.client()  # finds the entry in the layer itself, and asks nothing
    assert in_dir(norm(direct, 16), layer)
    asked = direct.stats()
    assert asked["hits"] - asked["direct_hits"] == 2  # the two asked for (direct hits are reported later)
    copy = asking.get_kernel("row_double", target="c", M=5, N=8)  # a copy of the layer's build, made in the cache
    assert in_dir(copy, d.cache_dir)
    torch.testing.assert_close(copy(x), 2 * x)
    with pytest.raises(client.KernelNotReady):  # a strict miss looks where builders publish, then says so
        norm(d.client(strict=True), 40)
    assert "failed" not in d.log_path.read_text()  # not a store's error turned into NOT_FOUND
    compiled = norm(asking, 24)  # a miss compiles into the cache, whose budget then evicts the copy
    assert compiled.outcome == "compiled" and in_dir(compiled, d.cache_dir)
    stats = asking.stats()
    assert (stats["compiles"], stats["derived"], stats["evictions"], stats["entries"]) == (1, 1, 1, 1), stats
    info = asking.service_info()
    assert info["cache_layers"] == [str(layer)] and json.loads(info["config_json"])["cache_layers"] == {"value": [str(layer)], "source": "--cache-layer"}
    for command in ("clear", "prune --max-size 0"):  # the cache's tools work on the cache, never on a layer
        assert cli(*command.split(), "--cache-dir", str(d.cache_dir)).returncode == 0
    d.stop()
    assert snapshot(layer) == before


def test_a_damaged_layer_entry_is_refused_never_deleted_and_rebuilt_in_the_cache(make_daemon, built, tmp_path):
    layer = make_layer(built, tmp_path / "layer")
    (tmp_path / "empty" / "entries").mkdir(parents=True)  # a layer holding nothing, searched first
    d = make_daemon(env={"KERNEL_SERVICE_CACHE_LAYERS": f"{tmp_path / 'empty'}:{layer}"})
    hit = norm(d.client(direct_hits=False), 8)
    assert in_dir(hit, layer)
    library = Path(hit.path)
    damaged = bytearray(library.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # a flipped bit in the image: same size, new bytes (root may write a 0444 file)
    library.write_bytes(damaged)
    before = snapshot(layer)
    stub = pb_grpc.KernelServiceStub(grpc.insecure_channel(f"unix:{d.socket}"))
    reply = stub.ReportCorrupt(pb.ReportCorruptRequest(key=hit.key), timeout=30)
    assert reply.removed and "sha256" in reply.reason  # refused from now on: "removed" from what is served
    rebuilt = norm(d.client(), 8)  # the direct-hit path refuses it too, then asks: a build into the cache
    assert rebuilt.outcome == "compiled" and in_dir(rebuilt, d.cache_dir)
    assert d.client().stats()["corrupt"] == 1
    d.stop()
    assert snapshot(layer) == before  # the damaged entry is still there, as it was
    assert f"cache layer {layer}: entry {hit.key[:16]} is corrupt or not trusted" in d.log()


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "compile_service.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_cache_commands_refuse_to_change_a_layer(built, tmp_path):
    layer = make_layer(built, tmp_path / "layer")
    before = snapshot(layer)
    for command in ("clear", "prune --max-size 0", "verify --repair"):
        done = cli(*command.split(), "--cache-dir", str(layer))
        assert done.returncode == 2 and f"{layer} is a read-only cache layer" in done.stderr, done.stderr
    assert cli("verify", "--cache-dir", str(layer)).returncode == 0  # checking one is fine
    assert snapshot(layer) == before


def test_a_layer_that_is_not_a_cache_stops_the_daemon_at_start(tmp_path):
    (tmp_path / "not-a-cache").mkdir()
    for layer, says in ((tmp_path / "missing", "does not exist"), (tmp_path / "not-a-cache", "is not a kernel cache (no entries/ directory)")):
        done = cli("serve", "--socket", str(tmp_path / "ks.sock"), "--cache-dir", str(tmp_path / "cache"), "--target", "c", "--cache-layer", str(layer))
        assert done.returncode == 1 and f"cache layer {layer} {says}" in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    done = cli("serve", "--socket", str(tmp_path / "ks.sock"), "--cache-dir", str(tmp_path / "cache"), "--cache-layer", str(tmp_path / "cache"))
    assert done.returncode == 2 and "is the cache directory itself" in done.stderr


def test_a_layer_given_as_the_cache_dir_is_refused_and_left_as_it_is(built, tmp_path):
    """A layer named by --cache-dir would be chmodded writable at start (the daemon runs as
    root in an image): the daemon refuses it, in one line, and changes nothing in it."""
    layer = make_layer(built, tmp_path / "layer")
    before = snapshot(layer)
    done = cli("serve", "--socket", str(tmp_path / "ks.sock"), "--cache-dir", str(layer), "--target", "c")
    assert done.returncode == 1 and f"cache directory {layer} is a read-only cache layer" in done.stderr and len(done.stderr.strip().splitlines()) == 1, (
        done.stderr
    )
    assert snapshot(layer) == before


# ----- as another user (tests/test_security.py's world): the daemon runs as ks-owner

second_user = test_security.pytestmark

SERVE_TWO = r"""
import json, sys, client
c = client.connect(sys.argv[1])
direct = c.get_kernel("rmsnorm", target="c", M=None, N=16, dtype="float32")
asked = client.connect(sys.argv[1], direct_hits=False).get_kernel("rmsnorm", target="c", M=None, N=8, dtype="float32")
print(json.dumps({"direct": [direct.key, str(direct.path)], "asked": [asked.key, str(asked.path), asked.outcome], "stats": c.stats()}))
"""


def _daemon(world, name: str, layer: Path, wait: bool = True):  # noqa: F811 - the fixture
    """ks-owner's daemon, with `layer` named by the variable."""
    home = world.home[OWNER]
    return world.daemon(cache=home / f"cache-{name}", socket=home / f"run-{name}" / "ks.sock", env={"KERNEL_SERVICE_CACHE_LAYERS": str(layer)}, wait=wait)


@second_user
def test_a_root_layer_serves_a_daemon_of_another_uid_and_its_agents(world, built):  # noqa: F811
    layer = make_layer(built, world.base / "layer-root")
    before = snapshot(layer)
    d = _daemon(world, "root", layer)
    out = world.json_of(OWNER, SERVE_TWO, d.socket)
    for key, path, *_ in (out["direct"], out["asked"]):
        assert Path(path).parent == entry_dir(layer, key)
    asked = out["stats"]["hits"] - out["stats"]["direct_hits"]  # the direct hit is reported within 10 s, or at exit
    assert out["asked"][2] == "hit" and asked == 1 and out["stats"]["compiles"] == 0
    d.stop()
    assert snapshot(layer) == before


@second_user
@pytest.mark.parametrize("how", ["another user's", "writable by others", "a symlink"])
def test_an_untrusted_layer_stops_the_daemon_with_one_line(world, built, how):  # noqa: F811
    path = world.base / f"layer-{how.replace(' ', '-').replace(chr(39), '')}"
    if how == "another user's":
        layer = make_layer(built, path, uid=world.attacker.pw_uid)
        says = f"is owned by uid {world.attacker.pw_uid} ({ATTACKER}), not by uid {world.owner.pw_uid} ({OWNER})"
    elif how == "writable by others":
        layer = make_layer(built, path)
        os.chmod(layer, 0o757)
        says = "is writable by group or others (mode 0757)"
    else:  # the layer's path leads somewhere else
        target = make_layer(built, world.shared / "elsewhere")
        layer = path
        layer.symlink_to(target)
        says = "is a symbolic link"
    log = _daemon(world, how.split()[0].strip("'"), layer, wait=False).refused()
    line = f"kernel-service: cache layer {layer} {says}"
    assert line in log and "--cache-layer" in log.split(line, 1)[1].splitlines()[0], log
    shutil.rmtree(layer, ignore_errors=True) if not layer.is_symlink() else layer.unlink()


@second_user
def test_a_symlink_planted_in_a_layer_is_never_followed(world, built):  # noqa: F811
    """A shard of the layer replaced by a link to a copy another user controls: the entries under it
    are refused by the daemon and by the agents' direct-hit path, and built into the cache instead."""
    layer = make_layer(built, world.base / "layer-planted")
    key = next(p.name for p in (layer / "entries").glob("*/*") if json.loads((p / "entry.json").read_text())["spec"]["params"].get("N") == 16)
    shard = layer / "entries" / key[:2]
    theirs = make_layer(built / "entries" / key[:2], world.home[ATTACKER] / "shard", uid=world.attacker.pw_uid, dir_mode=0o755, file_mode=0o644)
    os.chmod(shard.parent, 0o755)
    shutil.rmtree(shard)
    shard.symlink_to(theirs)
    os.chmod(shard.parent, 0o555)
    d = _daemon(world, "planted", layer)
    out = world.json_of(OWNER, SERVE_TWO, d.socket)
    direct_key, direct_path = out["direct"]
    assert direct_key == key and Path(direct_path).parent == entry_dir(world.home[OWNER] / "cache-planted", key)  # built, not theirs
    assert Path(out["asked"][1]).parent == entry_dir(layer, out["asked"][0])  # the rest of the layer serves
    assert out["stats"]["compiles"] == 1 and out["stats"]["corrupt"] == 1
    d.stop()
    assert "is a symbolic link" in d.log()
