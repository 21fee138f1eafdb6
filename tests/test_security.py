"""The threat model: another local user against a daemon and the agents of a first one.

Runs as root (as CI does) and creates two unprivileged users: `ks-owner` runs
the daemon and its agents, `ks-attacker` runs every attack. Neither is root,
since root bypasses the very permission checks under test. Each attack must
end with nothing run, changed or deleted, or with a clear refusal at start.
The "victim" daemon shared by most tests runs in group mode (--mode 0750), and
the attacker is given the owner's group where an attack needs to talk to it:
group members are the least trusted callers the daemon serves.

Where the interpreter lies under a directory the two users cannot search (a
pyenv under /root, 0700), their processes run in a private mount namespace in
which that directory is replaced by one that shows the interpreter and nothing
else (`_Launcher`); the host is left as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket as sockets
import stat
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

import client
from devtools.launch import wait_serving
from proto import wire
from proto.kernelservice.v1 import kernel_service_pb2 as pb
from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
OWNER, ATTACKER = "ks-owner", "ks-attacker"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None, reason="the threat-model tests run as root (as CI does): they create two unprivileged users"
)

# ----------------------------------------------------------------------------- users and processes


def _user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", name], capture_output=True)
        return pwd.getpwnam(name)  # (another run may have made it meanwhile: fine)


# In a private mount namespace: a tmpfs over the unsearchable directory ($1), with only the
# directory the interpreter lives in ($2, bound from the original) inside; then drop to the user.
NAMESPACE = r"""
set -e
mount -t tmpfs -o size=1m,mode=0755 ks-security /mnt
mkdir /mnt/keep
mount --bind "$2" /mnt/keep
mount -t tmpfs -o size=1m,mode=0755 ks-security "$1"
mkdir -p "$2"
mount --move /mnt/keep "$2"
uid=$3; gid=$4; groups=$5; shift 5
exec setpriv --reuid="$uid" --regid="$gid" $groups -- "$@"
"""


class _Launcher:
    """Runs commands as an unprivileged user, directly or through NAMESPACE."""

    def __init__(self):
        self.hidden: tuple[str, str] | None = None
        interpreter = Path(os.path.realpath(sys.executable))
        for parent in reversed(interpreter.parents):
            if parent != Path("/") and not os.stat(parent).st_mode & stat.S_IXOTH:
                inside = interpreter.relative_to(parent).parts[0]
                self.hidden = (str(parent), str(parent / inside))
                break

    def argv_and_options(self, user: pwd.struct_passwd, argv: list[str], groups: tuple[int, ...]) -> tuple[list[str], dict]:
        if self.hidden is None:
            return argv, {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": list(groups)}
        group_flag = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
        wrapper = ["unshare", "--mount", "--propagation", "private", "sh", "-c", NAMESPACE, "sh", *self.hidden, str(user.pw_uid), str(user.pw_gid), group_flag]
        return wrapper + argv, {}


class World:
    """The two users, their directories, and how to run things as them."""

    def __init__(self, base: Path):
        self.base = base
        self.owner, self.attacker = _user(OWNER), _user(ATTACKER)
        self.launcher = _Launcher()
        # The owner's home is group-readable: the owner's group (the group-mode agents) may reach
        # the victim daemon's socket and cache in it; the attacker only when given that group.
        self.home = {OWNER: base / "owner", ATTACKER: base / "attacker"}
        for name, user, mode in ((OWNER, self.owner, 0o750), (ATTACKER, self.attacker, 0o755)):
            self.home[name].mkdir(mode=mode)
            os.chown(self.home[name], user.pw_uid, user.pw_gid)
            os.chmod(self.home[name], mode)
        self.shared = base / "shared"  # like /tmp: anyone may create things in it
        self.shared.mkdir()
        os.chmod(self.shared, 0o1777)
        self.daemons: list[Daemon] = []

    def user(self, name: str) -> pwd.struct_passwd:
        return self.owner if name == OWNER else self.attacker

    def popen(self, name: str, argv: list[str], groups: tuple[int, ...] = (), env: dict | None = None, umask: int = 0o022, **options) -> subprocess.Popen:
        user = self.user(name)
        argv, as_user = self.launcher.argv_and_options(user, argv, groups)
        environment = {"HOME": str(self.home[name]), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "TMPDIR": "/tmp", **(env or {})}
        return subprocess.Popen(argv, cwd=ROOT, env=environment, umask=umask, **as_user, **options)

    def python(
        self, name: str, code: str, *args: str, groups: tuple[int, ...] = (), env: dict | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        proc = self.popen(
            name, [sys.executable, "-c", code, *map(str, args)], groups=groups, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def json_of(self, name: str, code: str, *args: str, **options) -> dict:
        done = self.python(name, code, *args, **options)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    def daemon(self, *extra: str, cache: Path, socket: Path, umask: int = 0o022, env: dict | None = None, wait: bool = True) -> Daemon:
        d = Daemon(self, cache, socket, extra, umask, env)
        self.daemons.append(d)
        return d.start(wait)

    def group(self) -> tuple[int, ...]:
        """The owner's group, for an attacker who is one of the group-mode agents."""
        return (self.owner.pw_gid,)


class Daemon:
    def __init__(self, world: World, cache: Path, socket: Path, extra: tuple, umask: int, env: dict | None):
        self.world, self.cache, self.socket, self.extra, self.umask, self.env = world, cache, socket, extra, umask, env
        self.log_path = world.base / f"daemon-{len(world.daemons)}.log"
        self.proc: subprocess.Popen | None = None
        self._stub = None

    def start(self, wait: bool) -> Daemon:
        argv = [
            sys.executable,
            "-m",
            "compile_service.cli",
            "serve",
            "--socket",
            str(self.socket),
            "--cache-dir",
            str(self.cache),
            "--target",
            "c",
            "--workers",
            "1",
            *self.extra,
        ]
        with open(self.log_path, "a") as log:
            self.proc = self.world.popen(OWNER, argv, env=self.env, umask=self.umask, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            wait_serving(f"unix:{self.socket}", 120, self.proc)
        return self

    def refused(self, status: int = 1) -> str:
        """The error of a daemon that must refuse to start, with exit `status` (fails at once if it serves instead)."""
        deadline = time.monotonic() + 120
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, self.log()
            if self.socket.exists():
                with contextlib.suppress(TimeoutError, RuntimeError):
                    wait_serving(f"unix:{self.socket}", 0.5, self.proc)
                    self.stop()
                    pytest.fail(f"the daemon started instead of refusing:\n{self.log()}")
            time.sleep(0.1)
        assert self.proc.returncode == status, self.log()
        return self.log()

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stub(self) -> pb_grpc.KernelServiceStub:
        """Raw calls from this (root) test process: root may connect to any socket."""
        if self._stub is None:
            self._stub = pb_grpc.KernelServiceStub(grpc.insecure_channel(f"unix:{self.socket}", options=[("grpc.max_receive_message_length", 16 << 20)]))
        return self._stub

    def stats(self) -> pb.Stats:
        return self.stub().GetStats(pb.GetStatsRequest(), timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def world():
    base = Path(tempfile.mkdtemp(prefix="ks-sec-", dir="/tmp"))
    os.chmod(base, 0o755)
    w = World(base)
    probe = w.python(OWNER, "import client, grpc")
    if probe.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip(f"cannot run the package as an unprivileged user here: {probe.stderr.strip()[-300:]}")
    yield w
    for d in w.daemons:
        d.stop()
    shutil.rmtree(base, ignore_errors=True)


def free_port() -> int:
    with sockets.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def victim(world):
    """The owner's daemon, in group mode, TCP on loopback, started with umask 0 (the daemon
    must not depend on its umask), with the test kinds (a compile that crashes its worker)."""
    crash_dir = world.home[OWNER] / "crash-counts"
    crash_dir.mkdir()
    os.chown(crash_dir, world.owner.pw_uid, world.owner.pw_gid)
    d = world.daemon(
        "--mode",
        "0750",
        "--queue-limit",
        "16",
        "--kernel-module",
        "tests.failing_kind",
        "--tcp",
        f"127.0.0.1:{free_port()}",
        cache=world.home[OWNER] / "cache",
        socket=world.home[OWNER] / "run" / "ks.sock",
        umask=0,
        env={"KS_TEST_CRASH_DIR": str(crash_dir)},
    )
    d.tcp = d.extra[d.extra.index("--tcp") + 1]
    return d


def rmsnorm(n: int, target: str = "c", **more) -> pb.KernelSpec:
    return wire.spec_to_proto("rmsnorm", {"M": None, "N": n, "dtype": "float32", **more}, target)


def tree(path: Path) -> dict:
    """Everything under `path` (links not followed): what an attack must leave as it was."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [".", *dirnames, *filenames]:
            p = Path(dirpath) / name
            st = os.lstat(p)
            content = p.read_bytes() if stat.S_ISREG(st.st_mode) else os.readlink(p) if stat.S_ISLNK(st.st_mode) else None
            out[str(p)] = (st.st_mode, st.st_uid, content)
    return out


# ----------------------------------------------------------------------------- the attacker's tools

# A library whose mere loading is the attack: its constructor leaves a marker file.
EVIL_C = r"""
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void pwned(void) { int fd = open(MARKER, O_CREAT | O_WRONLY, 0666); if (fd >= 0) close(fd); }
int call(void *x, void *w, void *y, int m) { return 0; }
"""

# A fake kernel service: answers every GetKernel with an entry of its own (the evil library,
# with an entry.json matching what was asked, so only trust checks can stop a client), and
# reports its own directory as the cache root.
FAKE_SERVER = r"""
import hashlib, json, os, sys, time
from concurrent import futures
import grpc
import kernels
from proto import wire
from proto.kernelservice.v1 import kernel_service_pb2 as pb, kernel_service_pb2_grpc as pb_grpc

address, root, library = sys.argv[1:4]
key = "ab" + "0" * 62
entry = os.path.join(root, "entries", key[:2], key)
os.makedirs(entry, exist_ok=True)
data = open(library, "rb").read()
with open(os.path.join(entry, "kernel.so"), "wb") as f:
    f.write(data)
abi = {"loader": "c", "symbol": "call", "device": "cpu", "dynamic": [{"name": "M", "dtype": "int32"}], "outputs": [2],
       "params": [{"name": "X", "dtype": "float32", "shape": ["M", 64]}, {"name": "W", "dtype": "float32", "shape": [64]}, {"name": "Y", "dtype": "float32", "shape": ["M", 64]}]}

class Fake(pb_grpc.KernelServiceServicer):
    def GetKernel(self, request, context):
        kind, params, target = wire.spec_from_proto(request.spec)
        spec = kernels.canonicalize(kind, params, target or "c").to_json()
        with open(os.path.join(entry, "entry.json"), "w") as f:
            json.dump({"spec": json.loads(spec), "abi": abi}, f)
        artifact = pb.KernelArtifact(key=key, entry_dir=entry, library="kernel.so", library_sha256=hashlib.sha256(data).hexdigest(),
                                     library_size=len(data), abi_json=json.dumps(abi), canonical_spec=spec)
        return pb.GetKernelResponse(artifact=artifact, cached_result=True, outcome=pb.OUTCOME_HIT)
    def GetServiceInfo(self, request, context):
        return pb.ServiceInfo(cache_dir=root, inductor_dir=os.path.join(root, "torchinductor"))
    def ReportCorrupt(self, request, context):
        return pb.ReportCorruptResponse()
    def GetStats(self, request, context):
        return pb.Stats()

server = grpc.server(futures.ThreadPoolExecutor(4))
pb_grpc.add_KernelServiceServicer_to_server(Fake(), server)
port = server.add_insecure_port(address)
server.start()
if address.startswith("unix:"):
    os.chmod(address[5:], 0o777)
print(port, flush=True)
time.sleep(600)
"""

# An agent of the owner asking for one kernel; prints what happened (never raises).
AGENT = r"""
import json, sys, client
options = json.loads(sys.argv[2])
try:
    k = client.connect(sys.argv[1], **options).get_kernel("rmsnorm", M=None, N=64, dtype="float32", target="c")
    print(json.dumps({"outcome": k.outcome, "path": str(k.path)}))
except Exception as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""


@pytest.fixture(scope="module")
def evil(world):
    """The attacker's library and a world-writable directory for its marker."""
    home = world.home[ATTACKER]
    marks = home / "marks"
    done = world.python(
        ATTACKER,
        "import os, subprocess, sys; home = sys.argv[1]; os.mkdir(home + '/marks'); os.chmod(home + '/marks', 0o777);"
        "open(home + '/evil.c', 'w').write(sys.argv[2]);"
        "subprocess.run(['gcc', '-shared', '-fPIC', '-DMARKER=\"' + home + '/marks/pwned\"', '-o', home + '/evil.so', home + '/evil.c'], check=True)",
        home,
        EVIL_C,
    )
    if done.returncode != 0:
        pytest.skip(f"the attacker cannot build a library here (gcc): {done.stderr[-300:]}")
    return home / "evil.so", marks / "pwned"


def fake_server(world, address: str, root: Path, library: Path, groups=()) -> tuple[subprocess.Popen, str]:
    proc = world.popen(
        ATTACKER,
        [sys.executable, "-c", FAKE_SERVER, address, str(root), str(library)],
        groups=groups,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    port = proc.stdout.readline().strip()
    assert port, proc.stderr.read()
    return proc, port


# ----------------------------------------------------------------------------- 1, 4: the cache root


def test_a_cache_root_another_user_made_is_refused_and_left_alone(world):
    """Finding 1: the attacker makes the cache root before the daemon's first start and plants
    an entry of their own in it. The daemon refuses the root, and changes nothing in it."""
    cache = world.shared / "cache-made-by-attacker"
    world.python(
        ATTACKER,
        "import os, sys; r = sys.argv[1]; os.makedirs(r + '/entries/ab/' + 'ab' * 32); os.mkdir(r + '/staging');"
        "open(r + '/entries/ab/' + 'ab' * 32 + '/kernel.so', 'w').write('evil'); os.chmod(r, 0o700)",
        cache,
    )
    before = tree(cache)
    error = world.daemon(cache=cache, socket=world.home[OWNER] / "run-1" / "ks.sock", wait=False).refused()
    assert f"cache directory {cache} is owned by uid {world.attacker.pw_uid} ({ATTACKER}), not by uid {world.owner.pw_uid} ({OWNER})" in error
    assert error.strip().count("\n") == 0, error  # one line
    assert tree(cache) == before  # not chmodded, nothing created, nothing served
    # `verify` run by the owner refuses it the same way, rather than calling the planted entry ok.
    done = world.python(OWNER, "from compile_service.cli import main; import sys; sys.exit(main(['verify', '--cache-dir', sys.argv[1]]))", cache)
    assert done.returncode == 2 and f"is owned by uid {world.attacker.pw_uid}" in done.stderr


def test_links_planted_in_a_cache_root_are_never_followed(world):
    """Finding 4: a cache root left world-writable is refused before anything in it is touched;
    in a root that is the owner's, a link where the daemon expects one of its own files or
    directories is refused too, and what it points at is left as it was."""
    precious = world.home[OWNER] / "precious"
    world.python(
        OWNER,
        "import os, sys; p = sys.argv[1]; os.makedirs(p + '/keep/a'); os.makedirs(p + '/keep/b'); os.chmod(p + '/keep', 0o755);"
        "open(p + '/notes.txt', 'w').write('mine')",
        precious,
    )
    before = tree(precious)

    # The owner made a 0777 cache root (umask 0, say); the attacker plants links in it.
    cache = world.shared / "cache-777"
    world.python(OWNER, "import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777)", cache)
    world.python(
        ATTACKER,
        "import os, sys; c, p = sys.argv[1:3]; os.symlink(p + '/keep', c + '/staging'); os.symlink(p + '/keep', c + '/torchinductor');"
        "os.symlink(p + '/notes.txt', c + '/daemon.pid')",
        cache,
        precious,
    )
    error = world.daemon(cache=cache, socket=world.home[OWNER] / "run-2" / "ks.sock", wait=False).refused()
    assert f"cache directory {cache} is writable by group or others (mode 0777)" in error
    assert tree(precious) == before

    # A root of the owner's, with one link (left by whoever) where each of the daemon's own things goes.
    for i, (name, target) in enumerate(
        (("daemon.pid", "notes.txt"), ("daemon.lock", "notes.txt"), ("staging", "keep"), ("torchinductor", "keep"), ("device-binaries", "keep"))
    ):
        cache = world.home[OWNER] / f"cache-link-{i}"
        world.python(
            OWNER, "import os, sys; os.mkdir(sys.argv[1], 0o700); os.symlink(sys.argv[3], sys.argv[1] + '/' + sys.argv[2])", cache, name, precious / target
        )
        error = world.daemon(cache=cache, socket=world.home[OWNER] / f"run-link-{i}" / "ks.sock", wait=False).refused()
        assert f"{cache / name} is a symbolic link" in error, error
        assert tree(precious) == before, name


# ----------------------------------------------------------------------------- 2, 5: the socket


def test_a_socket_directory_another_user_controls_is_refused(world):
    """Finding 2: the attacker squats the socket's directory (0755 or 0777) and plants a link
    where the daemon writes its pid. The daemon refuses to start, and writes nothing."""
    notes = world.home[OWNER] / "notes-2.txt"
    world.python(OWNER, "import sys; open(sys.argv[1], 'w').write('mine')", notes)
    for mode in (0o755, 0o777):
        run = world.shared / f"run-{mode:o}"
        world.python(
            ATTACKER,
            "import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], int(sys.argv[2], 8)); os.symlink(sys.argv[3], sys.argv[1] + '/ks.sock.pid')",
            run,
            f"{mode:o}",
            notes,
        )
        before = tree(run)
        error = world.daemon(cache=world.home[OWNER] / f"cache-sock-{mode:o}", socket=run / "ks.sock", wait=False).refused()
        assert f"socket directory {run} is owned by uid {world.attacker.pw_uid} ({ATTACKER})" in error, error
        assert tree(run) == before and notes.read_text() == "mine"


def test_a_file_at_the_socket_path_is_not_deleted(world):
    """Finding 5: only a socket is ever removed as stale."""
    run = world.home[OWNER] / "run-5"
    world.python(OWNER, "import os, sys; os.mkdir(sys.argv[1], 0o700); open(sys.argv[1] + '/ks.sock', 'w').write('not a socket')", run)
    error = world.daemon(cache=world.home[OWNER] / "cache-5", socket=run / "ks.sock", wait=False).refused()
    assert f"{run / 'ks.sock'} exists and is not a socket; refusing to remove it" in error
    assert (run / "ks.sock").read_text() == "not a socket"


def test_agents_use_only_a_daemon_of_the_expected_uid(world, evil):
    """Finding 2, the client's side: the attacker's fake server, in a directory of theirs, and a
    server of another uid (root's, here) in a directory of the owner's, are both refused by
    the owner's agents before any call; nothing of theirs is loaded."""
    library, marker = evil
    attacker_dir = world.home[ATTACKER] / "run"
    world.python(ATTACKER, "import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o755)", attacker_dir)
    fake, _ = fake_server(world, f"unix:{attacker_dir}/ks.sock", world.home[ATTACKER] / "fake-cache", library)
    try:
        result = world.json_of(OWNER, AGENT, attacker_dir / "ks.sock", "{}")
        assert result["error"] == "UntrustedService" and f"socket directory {attacker_dir} is owned by uid {world.attacker.pw_uid}" in result["message"], result
    finally:
        fake.kill()

    owner_dir = world.home[OWNER] / "run-peer"
    owner_dir.mkdir(mode=0o755)
    os.chown(owner_dir, world.owner.pw_uid, world.owner.pw_gid)
    server = grpc.server(futures.ThreadPoolExecutor(2))  # not the owner's: its uid is root's
    server.add_insecure_port(f"unix:{owner_dir}/ks.sock")
    server.start()
    try:
        os.chmod(owner_dir / "ks.sock", 0o777)
        result = world.json_of(OWNER, AGENT, owner_dir / "ks.sock", "{}")
        assert result["error"] == "UntrustedService" and "runs as uid 0, not as the daemon's uid" in result["message"], result
    finally:
        server.stop(None)
    assert not marker.exists()


# ----------------------------------------------------------------------------- 3: TCP


def test_tcp_calls_need_the_token_and_a_fake_server_cannot_make_agents_load_its_code(world, victim, evil):
    """Finding 3: without the daemon's token the attacker gets UNAUTHENTICATED for everything; a
    fake server on a port the attacker bound first gets the owner's agent to load nothing."""
    code = (
        "import grpc, json, sys\nfrom proto.kernelservice.v1 import kernel_service_pb2 as pb, kernel_service_pb2_grpc as pb_grpc\n"
        "stub = pb_grpc.KernelServiceStub(grpc.insecure_channel(sys.argv[1]))\nout = {}\n"
        "for name, call, req in (('stats', stub.GetStats, pb.GetStatsRequest()), ('kernel', stub.GetKernel, pb.GetKernelRequest(spec=pb.KernelSpec(kind='rmsnorm', target='c', params={'N': pb.ParamValue(int_value=24), 'dtype': pb.ParamValue(string_value='float32')})))):\n"
        "    for token in (None, 'Bearer ' + '0' * 64):\n"
        "        try:\n            call(req, timeout=30, metadata=[('authorization', token)] if token else None); out[name] = 'OK'\n"
        "        except grpc.RpcError as e:\n            out.setdefault(name, []).append(e.code().name)\n"
        "print(json.dumps(out))"
    )
    before = victim.stats()
    assert world.json_of(ATTACKER, code, victim.tcp) == {"stats": ["UNAUTHENTICATED"] * 2, "kernel": ["UNAUTHENTICATED"] * 2}
    assert (victim.stats().compiles, victim.stats().misses) == (before.compiles, before.misses)
    token = victim.cache / "tcp-token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and token.stat().st_uid == world.owner.pw_uid

    library, marker = evil
    fake, port = fake_server(world, "127.0.0.1:0", world.home[ATTACKER] / "fake-tcp-cache", library)
    try:
        result = world.json_of(OWNER, AGENT, f"127.0.0.1:{port}", json.dumps({"token_file": str(token)}))
    finally:
        fake.kill()
    assert (
        result["error"] == "CorruptArtifact"
        and f"is owned by uid {world.attacker.pw_uid} ({ATTACKER}), not by uid {world.owner.pw_uid} ({OWNER})" in result["message"]
    ), result
    assert not marker.exists()


ZERO_STATS = r"""
import json, sys, grpc
from proto.kernelservice.v1 import kernel_service_pb2 as pb, kernel_service_pb2_grpc as pb_grpc
stub = pb_grpc.KernelServiceStub(grpc.insecure_channel("unix:" + sys.argv[1]))
out = []
for metadata in (None, (("kernel-service-admin", "0" * 64),)):
    try:
        stub.ZeroStats(pb.ZeroStatsRequest(), timeout=30, metadata=metadata)
        out.append(["OK", ""])
    except grpc.RpcError as e:
        out.append([e.code().name, e.details()])
print(json.dumps(out))
"""


def test_a_group_member_cannot_zero_the_counters(world, victim):
    """Issue 32, finding 6: a group member of a --mode 0750 cache, who may connect to its (0660)
    socket, zeroed the persistent counters. ZeroStats now needs the admin secret the daemon
    writes owner-only under its cache root; without it, PERMISSION_DENIED, and nothing zeroed."""
    victim.stub().GetKernel(pb.GetKernelRequest(spec=rmsnorm(40)), timeout=120)  # something counted
    before = victim.stats()
    refused = world.json_of(ATTACKER, ZERO_STATS, victim.socket, groups=world.group())
    assert [code for code, _ in refused] == ["PERMISSION_DENIED"] * 2 and "admin-token" in refused[0][1], refused
    cli = world.python(
        ATTACKER,
        "from compile_service.cli import main; import sys; sys.exit(main(['zero-stats', '--socket', sys.argv[1]]))",
        victim.socket,
        groups=world.group(),
        env={"KERNEL_SERVICE_DAEMON_UID": str(world.owner.pw_uid)},  # a group member trusts the owner's daemon, as group mode says
    )
    assert cli.returncode != 0 and "zero-stats is for the daemon's owner" in cli.stderr, cli.stderr
    after = victim.stats()
    assert after.compiles == before.compiles > 0 and after.hits >= before.hits and after.stats_since == before.stats_since
    admin = victim.cache / "admin-token"
    assert stat.S_IMODE(admin.stat().st_mode) == 0o600 and admin.stat().st_uid == world.owner.pw_uid


# ----------------------------------------------------------------------------- 6, 7: memory and the queue

UNKNOWN_FIELDS = r"""
import sys, grpc
from proto.kernelservice.v1 import kernel_service_pb2 as pb

def varint(n):
    out = b""
    while True:
        byte, n = n & 0x7F, n >> 7
        out += bytes([byte | (0x80 if n else 0)])
        if not n:
            return out

spec = pb.KernelSpec(kind="rmsnorm", target="c", params={"M": pb.ParamValue(null_value=0), "N": pb.ParamValue(int_value=40), "dtype": pb.ParamValue(string_value="float32")}).SerializeToString()
channel = grpc.insecure_channel("unix:" + sys.argv[1], options=[("grpc.max_send_message_length", 16 << 20)])
call = channel.unary_unary("/kernelservice.v1.KernelService/GetKernel")
filler = bytes(10 << 20)
for i in range(int(sys.argv[2])):
    payload = i.to_bytes(4, "little") + filler[4:]  # every request's unknown field is different
    inner = spec + varint(1000 << 3 | 2) + varint(len(payload)) + payload  # field 1000, length-delimited: unknown
    reply = pb.GetKernelResponse.FromString(call(b"\x0a" + varint(len(inner)) + inner, timeout=60))
    assert reply.artifact.library_size > 0
print("ok")
"""


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def test_unknown_fields_are_not_kept(world, victim):
    """Finding 6: 200 requests from a group-mode agent, each a valid spec carrying a 10 MB unknown
    field (each a different one): served as hits, and the daemon's memory grows < 50 MB."""
    warm = world.python(ATTACKER, UNKNOWN_FIELDS, victim.socket, 3, groups=world.group())
    assert warm.stdout.strip() == "ok", warm.stderr[-2000:]
    before = _rss(victim.proc.pid)
    done = world.python(ATTACKER, UNKNOWN_FIELDS, victim.socket, 200, groups=world.group(), timeout=300)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
    grown = _rss(victim.proc.pid) - before
    assert grown < 50 << 20, f"the daemon's RSS grew by {grown >> 20} MB"


PREFETCH = r"""
import grpc, json, sys, time
from proto.kernelservice.v1 import kernel_service_pb2 as pb, kernel_service_pb2_grpc as pb_grpc
specs = [pb.KernelSpec(kind="gemm", target="c", params={"M": pb.ParamValue(int_value=32), "N": pb.ParamValue(int_value=n), "K": pb.ParamValue(int_value=32), "dtype": pb.ParamValue(string_value="float32")}) for n in json.loads(sys.argv[2])]
stream = pb_grpc.KernelServiceStub(grpc.insecure_channel("unix:" + sys.argv[1])).Prefetch(pb.PrefetchRequest(specs=specs), timeout=120)
try:
    first = next(stream)
    print(json.dumps({"first": first.index}), flush=True)
    if sys.argv[3] == "cancel":
        stream.cancel()
    else:
        time.sleep(float(sys.argv[3]))
except grpc.RpcError as e:
    print(json.dumps({"error": e.code().name, "message": e.details()}), flush=True)
"""


def wait_for(predicate, timeout: float = 60, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_one_caller_cannot_fill_the_queue_and_a_cancelled_prefetch_gives_its_compiles_back(world, victim):
    """Finding 7, with --queue-limit 16: one Prefetch may queue a quarter of it (4) and all
    prefetches half (8); a group-mode agent asking for the whole queue is refused with nothing
    left queued, and the owner's blocking request is served. A cancelled Prefetch drops the
    compiles it queued that have not started."""
    before = victim.stats()
    attack = world.popen(
        ATTACKER,
        [sys.executable, "-c", PREFETCH, str(victim.socket), json.dumps(list(range(8, 8 + 16 * 8, 8))), "30"],
        groups=world.group(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = json.loads(attack.stdout.readline() or "{}")
        assert line.get("error") == "RESOURCE_EXHAUSTED" and "may queue at most 4 compiles" in line["message"], (
            line,
            attack.stderr.read() if attack.poll() is not None else "",
        )
        wait_for(lambda: victim.stats().in_flight == 0, 60, "the refused batch's compiles to be given back")
        # The owner's agent is served meanwhile (its compile has room whatever prefetches hold).
        reply = victim.stub().GetKernel(pb.GetKernelRequest(spec=rmsnorm(56)), timeout=120)
        assert reply.outcome == pb.OUTCOME_COMPILED
    finally:
        attack.kill()
    assert victim.stats().compiles - before.compiles <= 2  # the victim's, and at most one the batch had started

    # A prefetch within its share, cancelled after its first kernel: the rest never compile.
    before = victim.stats()
    cancelled = world.python(ATTACKER, PREFETCH, victim.socket, json.dumps([200, 208, 216, 224]), "cancel", groups=world.group())
    assert "first" in cancelled.stdout, cancelled.stderr[-2000:]
    wait_for(lambda: victim.stats().in_flight == 0, 30, "the cancelled prefetch's compiles to be dropped")
    assert victim.stats().compiles - before.compiles <= 2  # the first one, and one already running at most


# ----------------------------------------------------------------------------- 8, 9, 10: validation


def test_validation_is_exact(victim):
    """Findings 8, 9, 10: targets match whole, ASCII-only, known archs; undecodable requests are
    INVALID_ARGUMENT (no traceback in the log); -0.0 is 0.0. Nothing compiles for the bad ones."""
    stub = victim.stub()
    before = victim.stats()
    for target in ("sm_90a\n", "sm_\u0669\u0660a", "sm_999", "sm_90a ", "c\n"):
        with pytest.raises(grpc.RpcError) as err:
            stub.GetKernel(pb.GetKernelRequest(spec=rmsnorm(64, target=target)), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("target:"), target
    call = grpc.insecure_channel(f"unix:{victim.socket}").unary_unary("/kernelservice.v1.KernelService/GetKernel")
    for garbage in (b"\xff\xff\xff", b"\x0a\x05abc"):
        with pytest.raises(grpc.RpcError) as err:
            call(garbage, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    after = victim.stats()
    assert (after.compiles, after.failures, after.misses) == (before.compiles, before.failures, before.misses)
    assert "Exception deserializing" not in victim.log()

    first = stub.GetKernel(pb.GetKernelRequest(spec=rmsnorm(48, eps=0.0)), timeout=120)
    second = stub.GetKernel(pb.GetKernelRequest(spec=rmsnorm(48, eps=-0.0)), timeout=120)
    assert second.outcome == pb.OUTCOME_HIT and second.artifact.key == first.artifact.key


# ----------------------------------------------------------------------------- 11, 12: integrity


def _flip_a_bit_keeping_the_mtime(path: Path) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_content_changed_with_its_mtime_restored_is_seen_and_rebuilt(victim):
    """Finding 11: the daemon's hit check sees the change (ctime), rebuilds, never serves it."""
    stub = victim.stub()
    entry = Path(stub.GetKernel(pb.GetKernelRequest(spec=rmsnorm(72)), timeout=120).artifact.entry_dir)
    assert stub.GetKernel(pb.GetKernelRequest(spec=rmsnorm(72)), timeout=120).outcome == pb.OUTCOME_HIT  # in the daemon's index
    corrupt = victim.stats().corrupt
    _flip_a_bit_keeping_the_mtime(entry / "kernel.so")
    again = stub.GetKernel(pb.GetKernelRequest(spec=rmsnorm(72)), timeout=120)
    assert again.outcome == pb.OUTCOME_COMPILED and victim.stats().corrupt == corrupt + 1


def test_an_agent_that_finds_a_corrupt_library_gets_it_rebuilt(world, victim, monkeypatch):
    """Finding 11, the client's side: corruption the daemon could not see (here made between its
    answer and the load) is reported (ReportCorrupt), the entry re-hashed, removed and rebuilt,
    and the agent gets a working kernel from one retry."""
    import torch

    from client import loader

    real, calls = loader.load, []

    def corrupt_first(record, **kwargs):
        calls.append(record.entry.path)
        if len(calls) == 1:
            _flip_a_bit_keeping_the_mtime(record.entry.path / record.entry.library)
        return real(record, **kwargs)

    monkeypatch.setattr(loader, "load", corrupt_first)
    corrupt = victim.stats().corrupt
    c = client.connect(victim.socket, daemon_uid=world.owner.pw_uid)
    kernel = c.get_kernel("rmsnorm", M=None, N=80, dtype="float32", target="c")
    assert len(calls) == 2 and kernel.outcome == "compiled" and victim.stats().corrupt == corrupt + 1
    x, w = torch.randn(3, 80), torch.randn(80)
    torch.testing.assert_close(kernel(x, w), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w, rtol=1e-4, atol=1e-4)

    # ReportCorrupt itself: a whole entry is re-hashed and kept; a damaged one removed, saying why.
    stub = victim.stub()
    assert stub.ReportCorrupt(pb.ReportCorruptRequest(key=kernel.key), timeout=30) == pb.ReportCorruptResponse()
    _flip_a_bit_keeping_the_mtime(kernel.path)
    reply = stub.ReportCorrupt(pb.ReportCorruptRequest(key=kernel.key), timeout=30)
    assert reply.removed and "sha256" in reply.reason and not kernel.path.parent.exists()
    with pytest.raises(grpc.RpcError) as err:
        stub.ReportCorrupt(pb.ReportCorruptRequest(key="../../etc"), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_an_entry_directory_replaced_by_a_link_is_not_served(world, victim):
    """Finding 12: an entry directory swapped for a link to a copy elsewhere is not a hit; the
    link is removed (not what it points to) and the entry rebuilt."""
    stub = victim.stub()
    entry = Path(stub.GetKernel(pb.GetKernelRequest(spec=rmsnorm(88)), timeout=120).artifact.entry_dir)
    elsewhere = world.home[OWNER] / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.chown(elsewhere, world.owner.pw_uid, world.owner.pw_gid)
    shutil.move(entry, elsewhere / entry.name)
    os.symlink(elsewhere / entry.name, entry)
    os.lchown(entry, world.owner.pw_uid, world.owner.pw_gid)
    again = stub.GetKernel(pb.GetKernelRequest(spec=rmsnorm(88)), timeout=120)
    assert again.outcome == pb.OUTCOME_COMPILED
    assert not entry.is_symlink() and entry.is_dir() and (elsewhere / entry.name / "kernel.so").exists()


# ----------------------------------------------------------------------------- 13, 14


def test_a_worker_crash_is_retried_then_reported_and_never_remembered(victim):
    """Finding 13: a build whose worker dies once is retried on a fresh worker and served; one
    whose worker dies twice is ABORTED as a crash, and the next request compiles again."""
    stub = victim.stub()

    def crashing(n, times):
        return pb.GetKernelRequest(spec=wire.spec_to_proto("crashing", {"N": n, "times": times}, "c"))

    assert stub.GetKernel(crashing(8, 1), timeout=180).outcome == pb.OUTCOME_COMPILED
    with pytest.raises(grpc.RpcError) as err:
        stub.GetKernel(crashing(16, 2), timeout=180)
    assert err.value.code() == grpc.StatusCode.ABORTED and "worker crashed" in err.value.details()
    assert stub.GetKernel(crashing(16, 2), timeout=180).outcome == pb.OUTCOME_COMPILED  # not remembered


def test_everything_the_daemon_creates_is_owner_only_whatever_the_umask(world, victim):
    """Finding 14: the victim daemon was started with umask 0, in group mode: nothing it or its
    workers made is writable by the group or readable by others; lock, pid and token files
    are the owner's alone. A start that fails after binding leaves no socket behind."""
    victim.stub().GetKernel(pb.GetKernelRequest(spec=rmsnorm(96)), timeout=120)  # a published entry
    loose = []
    for top in (victim.cache, victim.socket.parent):
        for path, (mode, uid, _) in tree(top).items():
            if path != str(victim.socket) and (mode & 0o027 or uid != world.owner.pw_uid):
                loose.append((path, oct(mode), uid))
    assert loose == []
    for name in ("daemon.lock", "daemon.pid", "tcp-token"):
        assert stat.S_IMODE((victim.cache / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE((victim.cache / "device-binaries").stat().st_mode) == 0o750
    assert stat.S_IMODE(victim.socket.stat().st_mode) == 0o660

    failed = world.daemon("--tcp", victim.tcp, cache=world.home[OWNER] / "cache-14", socket=world.home[OWNER] / "run-14" / "ks.sock", umask=0, wait=False)
    assert "cannot listen on tcp" in failed.refused()
    assert not os.path.lexists(failed.socket)


# ----------------------------------------------------------------------------- bundles: who wrote the file, who signed it
# (issue 32, item 1: root imported a bundle another user wrote, re-sealed around their own .so)

# Run by the attacker: the bundle at argv[1] with every kernel.so swapped for the attacker's
# library and bundle.json's digests re-sealed around it (keys do not depend on a library's
# bytes), its signature kept, stripped or replaced by the attacker's own; written to argv[2].
RESEAL = r"""
import hashlib, io, json, os, sys, tarfile
source, out, how = sys.argv[1:4]
evil = b"\x7fELF the attacker's library"
with tarfile.open(source) as tar:
    members = [(m.name, tar.extractfile(m).read()) for m in tar]
index = json.loads(members[0][1])
sha = hashlib.sha256(evil).hexdigest()
for e in index["entries"]:
    e["files"]["kernel.so"] = {"size": len(evil), "sha256": sha}
used = {f["sha256"] for e in index["entries"] for f in e["files"].values()}
raw = json.dumps(index).encode()
keep = [(n, d) for n, d in members[1:] if n.startswith("blobs/") and n[6:] in used]
sig = [m for m in members if m[0] == "bundle.sig"]
if how == "resigned":
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from compile_service import provenance
    sig = [("bundle.sig", provenance.sign(Ed25519PrivateKey.generate(), raw))]
elif how == "stripped":
    sig = []
with tarfile.open(out, "w") as tar:
    for name, data in [("bundle.json", raw), *sig, *keep, ("blobs/" + sha, evil)]:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
os.chmod(out, 0o666)
"""


@pytest.fixture(scope="module")
def builder_bundle(world):
    """A bundle signed by a builder root trusts (its key and public key in root's directory),
    readable by everyone in the shared directory."""
    from tests.test_bundles import good, new_key, signed, write

    from compile_service import provenance

    key = new_key()
    trusted = world.base / "root-only"
    trusted.mkdir(mode=0o755)
    (trusted / "builder.pub").write_text(provenance.public_pem(key))
    bundle = write(world.shared / "builder.tar", signed(good(), key))
    os.chmod(bundle, 0o644)
    return bundle, trusted / "builder.pub"


def _import(*args: str, as_user: str | None = None, world=None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "compile_service.cli", "bundle", "import", *args, "--cuda-compiler-id", "nvrtc-13.0"]
    if as_user is None:
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    proc = world.popen(as_user, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_bundle_import_refuses_a_file_another_user_wrote(world, builder_bundle):
    """The attack as reported: the attacker's re-sealed bundle, theirs and mode 0666, imported by
    root (and by the daemon's owner): refused for who wrote it, before anything is read."""
    bundle, pub = builder_bundle
    evil = world.shared / "evil.tar"
    made = world.python(ATTACKER, RESEAL, str(bundle), str(evil), "kept")
    assert made.returncode == 0 and os.stat(evil).st_uid == world.attacker.pw_uid, made.stderr
    cache = world.base / "root-cache-owner-check"
    refused = _import(str(evil), "--cache-dir", str(cache), "--trusted-key", str(pub), "--trust-unsigned")
    assert refused.returncode == 1 and f"is owned by uid {world.attacker.pw_uid} ({ATTACKER}), neither you (uid 0) nor root" in refused.stderr, refused.stderr
    as_owner = _import(str(evil), "--cache-dir", str(world.home[OWNER] / "bundle-cache"), "--trust-unsigned", as_user=OWNER, world=world)
    assert (
        as_owner.returncode == 1 and f"is owned by uid {world.attacker.pw_uid} ({ATTACKER}), neither you (uid {world.owner.pw_uid}) nor root" in as_owner.stderr
    )
    assert not (cache / "entries").exists() or not any((cache / "entries").iterdir())


def test_bundle_import_refuses_a_file_others_may_write(world, builder_bundle):
    """The owner's own bundle, left writable by group or others (umask 0, a shared directory):
    anyone of them could have swapped its bytes. A key file is held to the same rule."""
    bundle, pub = builder_bundle
    for mode in (0o666, 0o664):
        mine = world.shared / f"owners-{mode:o}.tar"
        copied = world.python(
            OWNER,
            "import shutil, os, sys; shutil.copyfile(sys.argv[1], sys.argv[2]); os.chmod(sys.argv[2], int(sys.argv[3], 8))",
            str(bundle),
            str(mine),
            f"{mode:o}",
        )
        assert copied.returncode == 0, copied.stderr
        refused = _import(str(mine), "--cache-dir", str(world.home[OWNER] / "bundle-cache"), "--trust-unsigned", as_user=OWNER, world=world)
        assert refused.returncode == 1 and f"is writable by group or others (mode {mode:04o})" in refused.stderr, refused.stderr
    os.chmod(mine, 0o644)
    accepted = _import(str(mine), "--cache-dir", str(world.home[OWNER] / "bundle-cache"), "--trust-unsigned", as_user=OWNER, world=world)
    assert accepted.returncode == 0 and "imported 2 entries" in accepted.stdout, accepted.stderr

    attackers_key = world.shared / "attackers.pub"
    assert world.python(ATTACKER, "import shutil, sys; shutil.copyfile(sys.argv[1], sys.argv[2])", str(pub), str(attackers_key)).returncode == 0
    loose_key = world.base / "root-only" / "loose.pub"
    shutil.copyfile(pub, loose_key)
    os.chmod(loose_key, 0o666)
    for key, why in ((attackers_key, f"owned by uid {world.attacker.pw_uid}"), (loose_key, "writable by group or others")):
        refused = _import(str(bundle), "--cache-dir", str(world.base / "root-cache-keys"), "--trusted-key", str(key))
        assert refused.returncode == 1 and f"trusted key {key} is" in refused.stderr and why in refused.stderr, refused.stderr


def test_bundle_import_refuses_a_library_no_trusted_key_signed(world, builder_bundle):
    """Root copies the attacker's bundle (now root's file, so only the signature can tell): the
    re-sealed index with the builder's signature kept, re-signed by the attacker, or unsigned,
    is refused; nothing is published. The builder's own bundle imports."""
    bundle, pub = builder_bundle
    cache = world.base / "root-cache-signatures"
    for how, why in (("kept", "bundle.sig does not match bundle.json"), ("resigned", "which is not a trusted key"), ("stripped", "not signed")):
        theirs = world.shared / f"evil-{how}.tar"
        made = world.python(ATTACKER, RESEAL, str(bundle), str(theirs), how)
        assert made.returncode == 0, made.stderr
        copy = world.base / "root-only" / f"evil-{how}.tar"
        shutil.copyfile(theirs, copy)
        os.chmod(copy, 0o644)
        refused = _import(str(copy), "--cache-dir", str(cache), "--trusted-key", str(pub))
        assert refused.returncode == 1 and why in refused.stderr, (how, refused.stderr)
    assert not (cache / "entries").exists() or not any((cache / "entries").iterdir())
    no_key = _import(str(bundle), "--cache-dir", str(cache))
    assert no_key.returncode == 1 and "not a trusted key (no trusted key was given)" in no_key.stderr
    trusted = _import(str(bundle), "--cache-dir", str(cache), "--trusted-key", str(pub))
    assert trusted.returncode == 0 and "imported 2 entries" in trusted.stdout and "a trusted key" in trusted.stdout, trusted.stderr


# ----------------------------------------------------------------------------- round two (#32): the CLI's trust checks

CLI = "import sys; from compile_service.cli import main; sys.exit(main(sys.argv[1:]))"

# Holds a socket's instance lock and writes a pid of the attacker's choosing next to it.
SQUAT_LOCK = (
    "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); fcntl.flock(fd, fcntl.LOCK_EX);"
    "open(sys.argv[2], 'w').write(sys.argv[3]); print('held', flush=True); time.sleep(120)"
)

# A root process that notes any SIGTERM it gets.
ROOT_BYSTANDER = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: open(sys.argv[1], 'w').write('hit')); print('up', flush=True); time.sleep(120)"
)


def _stop_as_root(socket: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CLI, "stop", "--socket", str(socket), "--timeout", "60"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_stop_signals_only_the_daemon_serving_the_socket(world, tmp_path):
    """#32 item 2: root runs `kernel-service stop --socket PATH` where the attacker controls PATH's
    directory and names a pid next to it: a root process, or one of their own that is no daemon,
    or any pid in a directory everyone may write. Nothing is signalled, no `kill -9` is advised.
    The owner's real daemon, in the owner's directory, is stopped as before."""
    marker = tmp_path / "bystander-got-sigterm"
    bystander = subprocess.Popen([sys.executable, "-c", ROOT_BYSTANDER, str(marker)], stdout=subprocess.PIPE, text=True)
    squatters = []
    try:
        assert bystander.stdout.readline().strip() == "up"
        attacker_dir = world.home[ATTACKER] / "run-stop"
        world.python(ATTACKER, "import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o755)", attacker_dir)
        shared_socket = world.shared / "ks-stop.sock"
        cases = (
            (attacker_dir / "ks.sock", lambda squatter: bystander.pid, f"process {bystander.pid} runs as uid 0"),
            (attacker_dir / "ks2.sock", lambda squatter: squatter.pid, "is not a kernel-service daemon"),
            (shared_socket, lambda squatter: bystander.pid, f"the socket directory {world.shared} is writable by group or others"),
        )
        for socket, pid_of, why in cases:
            lock, pid_file = Path(f"{socket}.lock"), Path(f"{socket}.pid")
            squatter = world.popen(ATTACKER, [sys.executable, "-c", SQUAT_LOCK, str(lock), str(pid_file), "0"], stdout=subprocess.PIPE, text=True)
            squatters.append(squatter)
            assert squatter.stdout.readline().strip() == "held"
            world.python(ATTACKER, "import sys; open(sys.argv[1], 'w').write(sys.argv[2])", pid_file, str(pid_of(squatter)))
            done = _stop_as_root(socket)
            assert done.returncode == 1 and why in done.stderr and "refusing to signal it" in done.stderr, done
            assert "kill -9" not in done.stdout + done.stderr
            assert squatter.poll() is None and bystander.poll() is None and not marker.exists()
    finally:
        for proc in (bystander, *squatters):
            proc.kill()
            proc.wait()

    owner_dir = world.home[OWNER] / "run-stop-owner"
    d = world.daemon(cache=world.home[OWNER] / "cache-stop", socket=owner_dir / "ks.sock")
    done = _stop_as_root(d.socket)
    assert done.returncode == 0 and f"stopped the daemon on {d.socket} (pid {d.proc.pid})" in done.stdout, done
    assert d.proc.wait(30) == 0


def test_the_cli_refuses_a_daemon_the_client_would_refuse(world, evil):
    """#32 item 6, the CLI's peer checks: `kernel-service stats`, run by the owner, against the
    attacker's fake server in a directory of theirs, and against a server of another uid (root's)
    in the owner's own directory: both refused with the client's reasons, nothing printed."""
    library, _ = evil
    attacker_dir = world.home[ATTACKER] / "run-cli"
    world.python(ATTACKER, "import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o755)", attacker_dir)
    fake, _ = fake_server(world, f"unix:{attacker_dir}/ks.sock", world.home[ATTACKER] / "fake-cli-cache", library)
    try:
        done = world.python(OWNER, CLI, "stats", "--socket", attacker_dir / "ks.sock")
    finally:
        fake.kill()
        fake.wait()
    assert done.returncode == 1 and done.stdout == "", done
    assert f"the socket directory {attacker_dir} is owned by uid {world.attacker.pw_uid}" in done.stderr, done.stderr

    owner_dir = world.home[OWNER] / "run-cli-peer"
    owner_dir.mkdir(mode=0o755)
    os.chown(owner_dir, world.owner.pw_uid, world.owner.pw_gid)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_KernelServiceServicer_to_server(type("Fake", (pb_grpc.KernelServiceServicer,), {"GetStats": lambda self, r, c: pb.Stats(compiles=7)})(), server)
    server.add_insecure_port(f"unix:{owner_dir}/ks.sock")
    server.start()
    try:
        os.chmod(owner_dir / "ks.sock", 0o777)
        done = world.python(OWNER, CLI, "stats", "--json", "--socket", owner_dir / "ks.sock")
    finally:
        server.stop(None)
    assert done.returncode == 1 and done.stdout == "" and "runs as uid 0, not as the daemon's uid" in done.stderr, done


# ----------------------------------------------------------------------------- round three (#47): plugins

# A kernel module whose mere import is the attack: it leaves a marker naming the uid it ran as.
EVIL_PLUGIN = "import os\nopen(os.environ['KS_TEST_MARKER'], 'w').write(str(os.getuid()))\n"


def _as_root(*args: str, env: dict, marker: Path) -> subprocess.CompletedProcess:
    """`kernel-service ARGS` run by root; one that serves instead of refusing is stopped once the
    module it imported has run (or after a timeout), and then fails the test."""
    proc = subprocess.Popen([sys.executable, "-c", CLI, *args], cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc.poll() is None:
        proc.terminate()
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_kernel_module_another_user_could_write_is_refused_before_it_runs(world):
    """#47 item 1: the attacker's module, in a directory of theirs, named by root's `serve
    --kernel-module` and `kinds --kernel-module` and by the owner's daemon; and the owner's own
    module in a directory the owner left group-writable. Each is refused in one line naming the
    path and its owner (exit 2), and the module never runs. Root's copy of the same module, in a
    directory of root's under /tmp, is imported."""
    marks = world.base / "plugin-marks"
    marks.mkdir()
    os.chmod(marks, 0o777)  # whoever imports the module can leave its marker
    theirs = world.home[ATTACKER] / "plugins"
    made = world.python(ATTACKER, "import os, sys; os.mkdir(sys.argv[1]); open(sys.argv[1] + '/evil_kinds.py', 'w').write(sys.argv[2])", theirs, EVIL_PLUGIN)
    assert made.returncode == 0, made.stderr
    owned_by_them = f"{world.home[ATTACKER]} is owned by uid {world.attacker.pw_uid} ({ATTACKER}), neither you"  # the first directory on the way

    def env(name: str, plugins: Path) -> dict:
        return {"PYTHONPATH": str(plugins), "KS_TEST_MARKER": str(marks / name), "KERNEL_SERVICE_SOCKET": str(world.base / "no-daemon" / "ks.sock")}

    for command, name in (
        (["kinds", "--kernel-module", "evil_kinds"], "root-kinds"),
        (
            [
                "serve",
                "--socket",
                str(world.base / "root-plugin-run" / "ks.sock"),
                "--cache-dir",
                str(world.base / "root-plugin-cache"),
                "--target",
                "c",
                "--workers",
                "1",
                "--kernel-module",
                "evil_kinds",
            ],
            "root-serve",
        ),
    ):
        done = _as_root(*command, env=env(name, theirs), marker=marks / name)
        assert not (marks / name).exists(), f"root's {command[0]} ran the attacker's module"
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and owned_by_them in lines[0] and "--kernel-module evil_kinds" in lines[0], done.stderr

    as_owner = world.daemon(
        "--kernel-module",
        "evil_kinds",
        cache=world.home[OWNER] / "cache-plugin",
        socket=world.home[OWNER] / "run-plugin" / "ks.sock",
        env=env("owner-serve", theirs),
        wait=False,
    )
    error = as_owner.refused(status=2)
    assert owned_by_them in error and error.strip().count("\n") == 0 and not (marks / "owner-serve").exists(), error

    loose = world.home[OWNER] / "loose-plugins"
    made = world.python(
        OWNER,
        "import os, sys; os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o775); open(sys.argv[1] + '/evil_kinds.py', 'w').write(sys.argv[2])",
        loose,
        EVIL_PLUGIN,
    )
    assert made.returncode == 0, made.stderr
    loose_daemon = world.daemon(
        "--kernel-module",
        "evil_kinds",
        cache=world.home[OWNER] / "cache-plugin-2",
        socket=world.home[OWNER] / "run-plugin-2" / "ks.sock",
        env=env("owner-loose", loose),
        wait=False,
    )
    error = loose_daemon.refused(status=2)
    assert f"{loose} is writable by group or others (mode 0775)" in error and not (marks / "owner-loose").exists(), error

    ours = world.base / "root-plugins"
    ours.mkdir(mode=0o755)
    (ours / "evil_kinds.py").write_text(EVIL_PLUGIN)
    done = _as_root("kinds", "--json", "--kernel-module", "evil_kinds", env=env("root-own", ours), marker=marks / "root-own-never")
    assert done.returncode == 0 and (marks / "root-own").read_text() == "0", done.stderr


# ----------------------------------------------------------------------------- TileLang programs sent as IR (issue 46)

SEND_PROGRAMS = r"""
import grpc, json, sys
from proto import wire
from proto.kernelservice.v1 import kernel_service_pb2 as pb, kernel_service_pb2_grpc as pb_grpc
stub = pb_grpc.KernelServiceStub(grpc.insecure_channel("unix:" + sys.argv[1], options=[("grpc.max_send_message_length", 16 << 20)]))
out = []
for name, text in json.load(open(sys.argv[2])):
    try:
        reply = stub.GetKernel(pb.GetKernelRequest(spec=wire.spec_to_proto("tilelang", {"program": text}, "c")), timeout=300)
        files = sorted(p.name for p in __import__("pathlib").Path(reply.artifact.entry_dir).iterdir())
        out.append([name, "OK", json.dumps(files)])
    except grpc.RpcError as e:
        out.append([name, e.code().name, e.details()])
print(json.dumps(out))
"""


def test_a_tilelang_program_cannot_make_a_root_daemon_read_its_files(world, tmp_path):
    """Issue 46: a second local user, in a root daemon's group (--mode 0750), sends TileLang
    programs as IR that would make a compiler read root's secret: an #include in a prelude
    (T.import_source), a call_extern name that breaks out into source, -include and @file compile
    flags (also as a pass config), and a pass config that writes files. Each is refused with
    INVALID_ARGUMENT before any work, naming the part, the secret is in no answer, and nothing is
    compiled; a plain program from the same user builds (the channel is open to them)."""
    import json as json_

    import tilelang  # noqa: F401

    from client.tilelang import _resolve, program_spec
    from kernels import program
    from tests import tilelang_programs as tp

    base = world.base / "rootd"
    base.mkdir(mode=0o750)
    secret = base / "secret"
    secret.write_text("ROOT-SECRET-7f3a9c")
    os.chmod(secret, 0o600)
    context, configs = _resolve("c", None, None, None)

    def text(func, **change) -> str:
        doc = json_.loads(program_spec(func, [-1], context, configs, None, check=False).params[program.FIELD])
        doc.update(change)
        return json_.dumps(doc)

    plain = tp.shift(4, 1.0)
    attacks = [
        ("prelude include", text(tp.with_source(4, f'#include "{secret}"\n'))),
        ("extern name", text(tp.calling(4, f'f(); }}\n#include "{secret}"\nint g() {{ return 0'))),
        ("include flag", text(plain, compile_flags=["-include", str(secret)])),
        ("include flag joined", text(plain, compile_flags=[f"-include{secret}"])),
        ("response file", text(plain, compile_flags=[f"@{secret}"])),
        ("flag in pass config", text(plain, pass_configs={"tl.device_compile_flags": [f"-include {secret}"]})),
        ("dump path", text(plain, pass_configs={"tl.enable_dump_ir": True, "tl.dump_ir_path": str(base)})),
    ]
    requests = world.shared / "programs.json"
    requests.write_text(json_.dumps([*attacks, ("plain", text(plain))]))
    os.chmod(requests, 0o644)

    from devtools.launch import DaemonProcess

    daemon = DaemonProcess(base / "cache", "--mode", "0750", "--target", "c", socket=base / "run" / "ks.sock", workers=1, log_path=tmp_path / "daemon.log")
    daemon.start(timeout=120)
    try:
        answers = world.json_of(ATTACKER, SEND_PROGRAMS, daemon.socket, requests, groups=(0,), timeout=600)
        stats = daemon.client().stats()
    finally:
        daemon.stop()
    by_name = {name: (code, details) for name, code, details in answers}
    for name, _ in attacks:
        code, details = by_name[name]
        assert code == "INVALID_ARGUMENT" and details.startswith("program."), (name, code, details)
        assert "ROOT-SECRET" not in details
    assert by_name["plain"][0] == "OK", by_name["plain"]
    assert stats["compiles"] == 1 and stats["invalid"] == len(attacks), stats
    assert "ROOT-SECRET" not in daemon.log()
