"""The command line as scripts and new users meet it: each daemon setting declared once (flag,
variable, default, help) and generated into `serve`, `info` and docs/cli.md; failures in one
line. Real daemons, the real CLI in subprocesses."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compile_service.cli import build_parser
from compile_service.commands.daemon import exited
from compile_service.commands.flags_markdown import cli_markdown
from compile_service.config import SETTINGS, ServiceConfig, parse_size

ROOT = Path(__file__).resolve().parent.parent
RMSNORM = {"M": None, "N": 64, "dtype": "float32", "target": "c"}

# Every flag and variable scripts may use today, with the setting it sets: renaming one breaks them.
FLAGS = {
    "--socket": "socket", "--cache-dir": "cache_dir", "--workers": "workers", "--target": "target", "--grace": "grace",
    "--queue-limit": "queue_limit", "--kernel-module": "kernel_modules", "--plugin": "plugins", "--no-entry-points": "entry_points",
    "--failure-ttl": "failure_ttl", "--max-size": "max_bytes", "--max-entries": "max_entries", "--evict-min-age": "evict_min_age",
    "--mode": "mode", "--tcp": "tcp", "--metrics-address": "metrics_address", "--allow-remote": "allow_remote",
    "--cuda-compiler": "cuda_compiler", "--worker-start": "worker_start", "--no-compile": "no_compile", "--cuda-compiler-id": "cuda_compiler_id", "--remote": "remote",
    "--remote-read-only": "remote_read_only", "--remote-lease-seconds": "remote_lease_seconds", "--remote-timeout": "remote_timeout",
    "--remote-ttl": "remote_ttl",
    "--cache-layer": "cache_layers",
    "--compile-timeout": "compile_timeout", "--memory-limit": "memory_limit",
    "--tls-cert": "tls_cert", "--tls-key": "tls_key", "--log-level": "log_level", "--log-format": "log_format",
}  # fmt: skip
BEFORE_COMMAND = {"--log-level", "--log-format"}  # flags of every command, given before it
# The variables scripts and clients already use: the one naming rule (KERNEL_SERVICE_<FLAG>) keeps them.
VARIABLES = {
    "KERNEL_SERVICE_SOCKET": "socket", "KERNEL_SERVICE_CACHE_DIR": "cache_dir", "KERNEL_SERVICE_REMOTE": "remote",
    "KERNEL_SERVICE_CUDA_COMPILER": "cuda_compiler", "KERNEL_SERVICE_CUDA_COMPILER_ID": "cuda_compiler_id",
    "KERNEL_SERVICE_WORKER_START": "worker_start", "KERNEL_SERVICE_WORKERS": "workers",
    "KERNEL_SERVICE_CACHE_LAYERS": "cache_layers",
    "KERNEL_SERVICE_COMPILE_TIMEOUT": "compile_timeout", "KERNEL_SERVICE_MEMORY_LIMIT": "memory_limit",
}  # fmt: skip


def cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "compile_service.cli", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def one_line_error(proc: subprocess.CompletedProcess, status: int) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == status and len(lines) == 1 and lines[0].startswith("kernel-service: "), proc.stderr
    return lines[0]


def resolve(argv: list[str], env: dict) -> ServiceConfig:
    args = build_parser().parse_args(["serve", *argv])
    return ServiceConfig.resolve(env=env, **{name: getattr(args, name) for name in SETTINGS})


def test_docs_cli_md_is_the_generated_text():
    assert (ROOT / "docs" / "cli.md").read_text() == cli_markdown(build_parser()), "regenerate it: python -m compile_service.cli flags-markdown > docs/cli.md"
    assert cli("flags-markdown").stdout == cli_markdown(build_parser())


def test_every_flag_and_variable_keeps_its_name_and_setting():
    from compile_service.build import devices
    from proto.paths import CACHE_DIR_ENV, SOCKET_ENV

    assert {s.flag: name for name, s in SETTINGS.items()} == FLAGS
    variables = {s.env: name for name, s in SETTINGS.items()}
    assert variables.items() >= VARIABLES.items() and len(variables) == len(SETTINGS)  # every setting has one
    assert {SOCKET_ENV, CACHE_DIR_ENV, devices.ENV, devices.ID_ENV} <= set(variables)  # as clients and the compilers read them
    parser = build_parser()
    serve = {a.dest: a for a in next(a for a in parser._actions if a.dest == "command").choices["serve"]._actions}
    top = {a.dest: a for a in parser._actions}
    assert all(flag in (top if flag in BEFORE_COMMAND else serve)[FLAGS[flag]].option_strings for flag in FLAGS)


def test_every_setting_has_a_variable_named_by_one_rule(tmp_path):
    """A container set up by environment alone sets what the flags set (issue 49, item 11)."""
    for name, s in SETTINGS.items():
        plural = "S" if s.form == "repeat" else ""
        assert s.env == "KERNEL_SERVICE_" + s.flag.removeprefix("--").upper().replace("-", "_") + plural, name
    env = {
        "KERNEL_SERVICE_TARGET": "c", "KERNEL_SERVICE_WORKERS": "3", "KERNEL_SERVICE_MAX_SIZE": "2G", "KERNEL_SERVICE_GRACE": "7",
        "KERNEL_SERVICE_METRICS_ADDRESS": "127.0.0.1:9464", "KERNEL_SERVICE_LOG_LEVEL": "debug", "KERNEL_SERVICE_LOG_FORMAT": "json",
        "KERNEL_SERVICE_NO_ENTRY_POINTS": "1", "KERNEL_SERVICE_ALLOW_REMOTE": "yes", "KERNEL_SERVICE_NO_COMPILE": "0",
        "KERNEL_SERVICE_KERNEL_MODULES": "tests.routed_kind,tests.shared_kind", "KERNEL_SERVICE_MODE": "0750",
    }  # fmt: skip
    proc = cli("info", "--socket", str(tmp_path / "none.sock"), "--json", env=env)
    s = json.loads(proc.stdout)["settings"]
    shown = {name: s[name]["value"] for name in ("target", "workers", "max_bytes", "grace", "metrics_address", "log_level", "log_format")}
    assert shown == {
        "target": "c",
        "workers": 3,
        "max_bytes": 2 << 30,
        "grace": 7.0,
        "metrics_address": "127.0.0.1:9464",
        "log_level": "DEBUG",
        "log_format": "json",
    }
    assert s["grace"]["source"] == "$KERNEL_SERVICE_GRACE" and s["log_format"]["source"] == "$KERNEL_SERVICE_LOG_FORMAT"
    assert (s["entry_points"]["value"], s["allow_remote"]["value"], s["no_compile"]["value"]) == (False, True, False)
    assert s["kernel_modules"]["value"] == ["tests.routed_kind", "tests.shared_kind"] and s["mode"]["value"] == "0750"
    for variable, value, said in [
        ("KERNEL_SERVICE_LOG_FORMAT", "xml", "$KERNEL_SERVICE_LOG_FORMAT must be text or json, got 'xml'"),
        ("KERNEL_SERVICE_NO_COMPILE", "maybe", "$KERNEL_SERVICE_NO_COMPILE: expected 1 (or true, yes, on)"),
        ("KERNEL_SERVICE_LOG_LEVEL", "loud", "$KERNEL_SERVICE_LOG_LEVEL: unknown level 'loud'"),
    ]:
        assert said in one_line_error(cli("info", "--socket", str(tmp_path / "none.sock"), env={variable: value}), 2)


def test_a_flag_wins_over_its_variable_which_wins_over_the_default(tmp_path):
    env = {
        "KERNEL_SERVICE_SOCKET": str(tmp_path / "env.sock"),
        "KERNEL_SERVICE_CACHE_DIR": str(tmp_path / "env-cache"),
        "KERNEL_SERVICE_REMOTE": "redis://env-host:6379/0",
    }
    flags = resolve(["--socket", str(tmp_path / "flag.sock"), "--cache-dir", str(tmp_path / "flag-cache"), "--remote", "redis://flag-host:6379/0"], env)
    assert (flags.socket, flags.cache_dir, flags.remote) == (tmp_path / "flag.sock", tmp_path / "flag-cache", "redis://flag-host:6379/0")
    assert {flags.sources[n] for n in ("socket", "cache_dir", "remote")} == {"--socket", "--cache-dir", "--remote"}
    variables = resolve([], env)
    assert (variables.socket, variables.cache_dir, variables.remote) == (tmp_path / "env.sock", tmp_path / "env-cache", "redis://env-host:6379/0")
    assert variables.sources["remote"] == "$KERNEL_SERVICE_REMOTE" and variables.sources["cache_dir"] == "$KERNEL_SERVICE_CACHE_DIR"
    defaults = resolve([], {"XDG_CACHE_HOME": str(tmp_path)})
    assert defaults.cache_dir == tmp_path / "kernel-service" and defaults.remote is None and "remote" not in defaults.sources
    served_only = resolve(["--no-compile", "--cuda-compiler-id", "nvcc-12.8.93"], {"KERNEL_SERVICE_CUDA_COMPILER_ID": "nvrtc-13.0"})
    assert served_only.cuda_compiler_id == "nvcc-12.8.93" and served_only.cuda_compiler == "nvcc"
    assert resolve(["--no-compile"], {"KERNEL_SERVICE_CUDA_COMPILER_ID": "nvrtc-13.0"}).cuda_compiler == "nvrtc"


def test_info_names_the_flags_that_exist(tmp_path):
    argv = ["--max-size", "1G", "--kernel-module", "tests.routed_kind", "--plugin", "scaled_add", "--no-entry-points", "--mode", "0750"]
    info = json.loads(cli("info", "--socket", str(tmp_path / "none.sock"), *argv, "--json").stdout)
    s = info["settings"]
    assert s["max_bytes"] == {"value": 1 << 30, "source": "--max-size"} and s["kernel_modules"] == {"value": ["tests.routed_kind"], "source": "--kernel-module"}
    assert s["plugins"]["source"] == "--plugin" and s["entry_points"] == {"value": False, "source": "--no-entry-points"} and s["mode"]["value"] == "0750"
    flags = set(FLAGS)
    named = {word for item in s.values() for word in re.findall(r"--[a-z-]+", item["source"])}
    assert named <= flags, named - flags
    text = cli("info", "--socket", str(tmp_path / "none.sock"), *argv).stdout
    assert "--max-bytes" not in text and "--kernel-modules" not in text and "--entry-points" not in text


def test_info_shows_only_the_settings_docs_cli_md_lists(tmp_path):
    """What `info` shows, a user looks up in docs/cli.md's settings table: nothing more."""
    shown = set(json.loads(cli("info", "--socket", str(tmp_path / "none.sock"), "--json").stdout)["settings"])
    listed = set(re.findall(r"^\| `(\w+)` \| `--", (ROOT / "docs" / "cli.md").read_text(), re.MULTILINE))
    assert shown == listed == set(SETTINGS), (shown ^ listed) | (shown ^ set(SETTINGS))


def test_every_size_flag_says_that_its_units_are_binary():
    assert parse_size("10G") == 10 << 30 and parse_size("512M") == 512 << 20
    text = (ROOT / "docs" / "cli.md").read_text()
    size_rows = [line for line in text.splitlines() if "512M" in line]
    assert len(size_rows) == 3, size_rows  # --memory-limit, --max-size, prune --max-size
    for row in size_rows:
        assert "10G is 10 GiB" in row, row


def test_a_bad_kernel_module_is_one_line_and_says_how_the_daemon_finds_it(tmp_path):
    base = ["serve", "--socket", str(tmp_path / "s.sock"), "--cache-dir", str(tmp_path / "c"), "--target", "c", "--workers", "1"]
    line = one_line_error(cli(*base, "--kernel-module", "tests.routed_kind:missing"), 2)
    assert "--kernel-module tests.routed_kind:missing" in line and "no attribute 'missing'" in line
    # What a module the daemon cannot import says (the README's tests.routed_kind, outside the repository).
    line = one_line_error(cli(*base, "--kernel-module", "no_such_kernels_module"), 2)
    assert "no module named 'no_such_kernels_module'" in line and "set PYTHONPATH" in line and "install it" in line
    assert not (tmp_path / "s.sock").exists()


def test_a_bad_worker_start_is_one_line_for_serve_and_prewarm(tmp_path):
    from proto import manifest

    bad = {"KERNEL_SERVICE_WORKER_START": "fork"}
    serve = ["serve", "--socket", str(tmp_path / "s.sock"), "--cache-dir", str(tmp_path / "c"), "--target", "c", "--workers", "1"]
    assert "$KERNEL_SERVICE_WORKER_START must be zygote or spawn, got 'fork'" in one_line_error(cli(*serve, env=bad), 2)
    assert not (tmp_path / "s.sock").exists()
    path = tmp_path / "app.json"
    path.write_text(json.dumps(manifest.make("app", [{"kind": "rmsnorm", "target": "c", "params": {"M": None, "N": 64, "dtype": "float32"}}])))
    line = one_line_error(cli("prewarm", str(path), "--remote", "redis://127.0.0.1:1/0", env=bad), 2)
    assert "$KERNEL_SERVICE_WORKER_START must be zygote or spawn, got 'fork'" in line


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["serve", "--compile-timeout", "nan"], {}, "--compile-timeout"),
        (["serve", "--compile-timeout", "inf"], {}, "--compile-timeout"),
        (["serve", "--compile-timeout", "1e309"], {}, "--compile-timeout"),
        (["serve", "--grace", "-3"], {}, "--grace"),
        (["serve", "--grace", "nan"], {}, "--grace"),
        (["serve", "--queue-limit", "0"], {}, "--queue-limit"),
        (["serve", "--queue-limit", "-1"], {}, "--queue-limit"),
        (["serve", "--workers", "99999999999999999999"], {}, "--workers"),
        (["serve", "--workers", "abc"], {}, "--workers"),
        (["serve"], {"KERNEL_SERVICE_WORKERS": "abc"}, "$KERNEL_SERVICE_WORKERS"),
        (["stop", "--timeout", "-1"], {}, "--timeout"),
        (["prune", "--max-size", "1G", "--min-age", "-5"], {}, "--min-age"),
    ],
)
def test_a_bad_number_is_one_line_naming_the_flag_and_what_it_accepts(args, env, named, tmp_path):
    """Issue 47, item 9: refused before any work (no daemon starts, stop signals nothing)."""
    where = ["--socket", str(tmp_path / "s.sock")] if args[0] in ("serve", "stop") else ["--cache-dir", str(tmp_path / "c")]
    line = one_line_error(cli(*args, *where, env=env, timeout=60), 2)
    assert named in line and re.search(r"expected a (whole )?number", line), line
    assert not (tmp_path / "s.sock").exists()


def test_a_busy_metrics_port_leaves_the_daemon_serving_without_metrics(make_daemon):
    """Issue 47, item 8: another user may bind the metrics port first; the daemon serves anyway,
    warns, and its metrics health says NOT_SERVING while the daemon's own says SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from compile_service.server import METRICS_HEALTH, SERVICE_NAME
    from proto.paths import socket_address

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        d = make_daemon("--metrics-address", f"127.0.0.1:{taken.getsockname()[1]}", workers=1)
        with grpc.insecure_channel(socket_address(d.socket)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            status = {name: stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status for name in ("", SERVICE_NAME, METRICS_HEALTH)}
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert status == {"": serving, SERVICE_NAME: serving, METRICS_HEALTH: not_serving}
    assert d.client().get_kernel("rmsnorm", M=None, N=24, dtype="float32", target="c").outcome == "compiled"
    assert "NOT SERVING METRICS" in d.log() and "--metrics-address" in d.log()


def test_a_busy_tcp_port_is_one_line_and_no_drain_warning(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = cli(
            "serve", "--socket", str(tmp_path / "s.sock"), "--cache-dir", str(tmp_path / "c"), "--target", "c", "--workers", "1", "--tcp", f"127.0.0.1:{port}"
        )
    line = one_line_error(proc, 1)
    assert f"cannot listen on tcp 127.0.0.1:{port}" in line and "choose another --tcp address" in line
    assert not (tmp_path / "s.sock").exists()


def test_serving_only_starts_no_workers_and_says_so(make_daemon):
    d = make_daemon("--no-compile")
    assert d.client().stats()["workers"] == 0
    d.stop()
    started = next(line for line in d.log().splitlines() if "listening on" in line)
    assert "no compile workers" in started and "workers starting" not in started


def test_kinds_labels_a_none_default_as_the_kinds_choice(tmp_path):
    text = cli("kinds", env={"KERNEL_SERVICE_SOCKET": str(tmp_path / "none.sock")}).stdout
    gemm = text[text.index("\ngemm  ") :]
    threads = next(line for line in gemm.splitlines() if line.split()[:1] == ["threads"])
    m = next(line for line in gemm.splitlines() if line.split()[:1] == ["M"])
    assert "runtime size" not in threads and "default None: the kind chooses" in threads
    assert "required, None: runtime size" in m


def test_ls_prune_and_stop_agree_with_the_cache_and_the_process(make_daemon):
    d = make_daemon("--kernel-module", "tests.shared_kind")
    c = d.client()
    for m in (3, 8):  # copies of the runtime-M build: three entries, one library blob
        c.get_kernel("row_double", M=m, N=16, target="c")
    c.get_kernel("rmsnorm", **RMSNORM)
    listed = cli("ls", "--cache-dir", str(d.cache_dir)).stdout
    assert listed.count("M=None") == 2, listed  # a runtime size is shown, not hidden
    for entry in (d.cache_dir / "entries").glob("*/*"):  # a use is recorded on disk at most once a minute: age them past it
        os.utime(entry, (time.time() - 120,) * 2)
    from compile_service.store import LocalStore

    orphan = LocalStore(d.cache_dir, create=False).blobs.path("ab" * 32)  # a blob a killed writer stored, linked by no entry
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"x" * 4096)
    pruned = cli("prune", "--cache-dir", str(d.cache_dir), "--max-size", "1", "--min-age", "0")
    logged = re.search(r"cache now (\d+) entries, (\d+) bytes", pruned.stderr)
    summary = re.search(r"now holds (\d+) entries, ([\d.]+ \w+)", pruned.stdout)
    assert logged and summary, (pruned.stdout, pruned.stderr)
    from compile_service.commands.output import human_bytes

    assert (logged.group(1), human_bytes(int(logged.group(2)))) == summary.groups()  # one number for what is left
    pid = d.proc.pid
    stopped = cli("stop", "--socket", str(d.socket))
    assert stopped.returncode == 0 and f"pid {pid}" in stopped.stdout
    assert exited(pid)  # gone (or a zombie awaiting its parent's wait) by the time stop returns
    assert d.proc.wait(10) == 0


# ----- #32 item 5: long errors reach the client as what they are, and Explain has them whole


def test_a_long_compile_error_is_a_compile_error_and_explain_has_it_whole(make_daemon):
    """A compile error of 8-12 KB (newlines and non-ASCII cost 3 bytes each in gRPC's metadata,
    whose limit is 8 KB) reaches the client as CompileError, cut in the middle; the client's and
    the CLI's explain give its full text, and the daemon's log has it."""
    import client

    d = make_daemon("--kernel-module", "tests.failing_kind", workers=1)
    c = d.client()
    for size, accents in ((8_500, False), (12_000, True)):
        try:
            c.get_kernel("verbose_failure", N=size // 100, size=size, accents=accents, target="c")
            raise AssertionError("it compiled")
        except client.CompileError as exc:
            message = str(exc)
        assert "characters cut" in message and "`kernel-service explain`" in message and "line 000000" in message, message[:300]
        full = c.explain("verbose_failure", N=size // 100, size=size, accents=accents, target="c")["failure"]
        middle = f"line {size // 2 // (37 if accents else 29):06d}"  # cut from the client's copy
        assert full.startswith("RuntimeError: e") and middle in full and middle not in message, full[:200]
        assert len(full) > size and "characters cut" not in full
    shown = cli("explain", "verbose_failure", f"N={120}", "size=12000", "accents=true", "--target", "c", "--socket", str(d.socket))
    assert shown.returncode == 1 and "failure    RuntimeError: error" in shown.stdout and shown.stdout.count("échec") > 300, shown.stdout[-500:]
    assert d.log().count("échec") > 300  # the daemon's log has it whole too


def test_a_long_fleet_failure_record_is_a_compile_error(make_daemon, tmp_path):
    """A failure record of 10 KB another host left in the fleet tier: a CompileError here too."""
    import client
    from compile_service.store.remote import failed_key
    from devtools import redis_server
    from tests.marks import require_redis_server

    require_redis_server()
    with redis_server.RedisProcess(log_path=tmp_path / "redis.log") as redis:
        d = make_daemon("--remote", redis.url(), workers=1)
        c = d.client()
        spec = dict(M=None, N=136, dtype="float32", target="c")
        key = c.explain("rmsnorm", **spec)["key"]
        error = "".join(f"nvcc: error at line {i}: ☠\n" for i in range(400))
        with redis.admin() as r:
            r.set(failed_key(key), json.dumps({"host": "builder-7", "error": error, "at": time.time()}), px=60_000)
        try:
            c.get_kernel("rmsnorm", **spec)
            raise AssertionError("it compiled")
        except client.CompileError as exc:
            assert "failed on builder-7" in str(exc) and "characters cut" in str(exc), str(exc)[-300:]
        assert error in c.explain("rmsnorm", **spec)["failure"]


# ----- #32 items 5 and 6: clear removes what it says, and follows no link planted in the cache root


def _cache_with_device_binaries(root: Path) -> list[Path]:
    """A cache root as a daemon leaves it, with two device binaries (and a lock) the compile workers kept."""
    from compile_service.store import LocalStore

    LocalStore(root)
    binaries = root / "device-binaries" / "nvrtc-13.0"
    binaries.mkdir(parents=True, mode=0o700)
    os.chmod(root / "device-binaries", 0o700)
    files = [binaries / "ab12.cubin", binaries / "cd34.cubin"]
    for f in files:
        f.write_bytes(b"\0" * 1000)
    (binaries / "ab12.cubin.lock").write_bytes(b"")
    return files


def test_clear_removes_the_device_binaries_it_says_it_removes(tmp_path):
    files = _cache_with_device_binaries(tmp_path / "cache")
    listed = cli("ls", "--cache-dir", str(tmp_path / "cache"))
    assert "2.0 KiB in all" in listed.stdout, listed.stdout  # counted, as a daemon counts them
    done = cli("clear", "--cache-dir", str(tmp_path / "cache"))
    assert done.returncode == 0 and "removed 0 entries and 2 device binaries" in done.stdout and "2.0 KiB freed" in done.stdout, done
    assert not any(f.exists() for f in files)


def test_clear_and_eviction_follow_no_link_planted_in_the_cache_root(tmp_path):
    """`blobs/` and `device-binaries/` replaced by links to another directory: `clear` and a
    daemon's eviction (LocalStore.evict) neither count nor delete what those links point to."""
    from compile_service.store import Budget, LocalStore
    from tests.plant import host_toolchain, plant, spec_of

    precious = tmp_path / "precious"
    (precious / "ab").mkdir(parents=True)
    kept = [precious / "ab" / ("ab" * 32), precious / "notes.cubin"]
    for f in kept:
        f.write_bytes(b"mine" * 100)
    everything = Budget(max_bytes=0, max_entries=0, min_age=float("-inf"))
    for i, how in enumerate(("clear", "evict")):
        cache = tmp_path / f"cache-{i}"
        _cache_with_device_binaries(cache)
        spec = spec_of("rmsnorm", "c", M=None, N=64, dtype="float32")
        plant(LocalStore(cache), spec, host_toolchain(spec, "nvrtc-13.0"))  # an entry: its removal collects blobs
        for name in ("blobs", "device-binaries"):
            subprocess.run(["rm", "-rf", str(cache / name)], check=True)
            (cache / name).symlink_to(precious, target_is_directory=True)
        if how == "clear":
            done = cli("clear", "--cache-dir", str(cache))
            assert done.returncode == 0 and "removed 1 entries and 0 device binaries" in done.stdout, done
        else:
            assert LocalStore(cache, create=False, extra_usage=(cache / "device-binaries",)).evict(everything) == 1
        assert all(f.read_bytes() == b"mine" * 100 for f in kept), how


def test_stop_recognises_every_way_a_daemon_is_started():
    """The command lines `kernel-service stop` takes for a daemon (stopping._serve_args): the
    console script (run directly or by its interpreter), the module (devtools/launch.py and the
    tests start it so), with or without the logging flags; anything else is not a daemon."""
    from compile_service.stopping import _serve_args

    daemons = (
        ["/venv/bin/kernel-service", "serve", "--socket", "s"],
        ["/venv/bin/python3.11", "/venv/bin/kernel-service", "--log-level", "DEBUG", "serve", "--socket", "s"],
        ["python", "-u", "-m", "compile_service.cli", "serve", "--socket", "s"],
        ["python", "-mcompile_service.cli", "--log-level=INFO", "serve", "--socket", "s"],
        ["/venv/bin/kernel-service", "--log-format", "json", "--log-level=INFO", "serve", "--socket", "s"],
    )
    for argv in daemons:
        assert _serve_args(argv) == ["--socket", "s"], argv
    for argv in (
        ["python", "-m", "compile_service.cli", "stats", "--socket", "s"],
        ["python", "-c", "import x", "kernel-service", "serve"],
        ["sleep", "100", "kernel-service", "serve"],
        ["python", "-m", "other.cli", "serve"],
        [],
    ):
        assert _serve_args(argv) is None, argv
