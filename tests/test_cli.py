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

from compile_service.cli import _exited, build_parser, cli_markdown
from compile_service.config import SETTINGS, ServiceConfig

ROOT = Path(__file__).resolve().parent.parent
RMSNORM = {"M": None, "N": 64, "dtype": "float32", "target": "c"}

# Every flag and variable scripts may use today, with the setting it sets: renaming one breaks them.
FLAGS = {
    "--socket": "socket", "--cache-dir": "cache_dir", "--workers": "workers", "--target": "target", "--grace": "grace",
    "--queue-limit": "queue_limit", "--kernel-module": "kernel_modules", "--plugin": "plugins", "--no-entry-points": "entry_points",
    "--failure-ttl": "failure_ttl", "--max-size": "max_bytes", "--max-entries": "max_entries", "--evict-min-age": "evict_min_age",
    "--mode": "mode", "--tcp": "tcp", "--metrics-address": "metrics_address", "--allow-remote": "allow_remote",
    "--cuda-compiler": "cuda_compiler", "--no-compile": "no_compile", "--cuda-compiler-id": "cuda_compiler_id", "--remote": "remote",
    "--remote-read-only": "remote_read_only", "--remote-lease-seconds": "remote_lease_seconds", "--remote-timeout": "remote_timeout",
    "--remote-ttl": "remote_ttl", "--compile-timeout": "compile_timeout", "--memory-limit": "memory_limit",
}  # fmt: skip
VARIABLES = {
    "KERNEL_SERVICE_SOCKET": "socket", "KERNEL_SERVICE_CACHE_DIR": "cache_dir", "KERNEL_SERVICE_REMOTE": "remote",
    "KERNEL_SERVICE_CUDA_COMPILER": "cuda_compiler", "KERNEL_SERVICE_CUDA_COMPILER_ID": "cuda_compiler_id",
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
    assert (ROOT / "docs" / "cli.md").read_text() == cli_markdown(), "regenerate it: python -m compile_service.cli flags-markdown > docs/cli.md"
    assert cli("flags-markdown").stdout == cli_markdown()


def test_every_flag_and_variable_keeps_its_name_and_setting():
    assert {s.flag: name for name, s in SETTINGS.items()} == FLAGS
    assert {s.env: name for name, s in SETTINGS.items() if s.env} == VARIABLES
    serve = {a.dest: a for a in next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]._actions}
    assert all(FLAGS[flag] in serve and flag in serve[FLAGS[flag]].option_strings for flag in FLAGS)


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


def test_a_bad_kernel_module_is_one_line_and_says_how_the_daemon_finds_it(tmp_path):
    base = ["serve", "--socket", str(tmp_path / "s.sock"), "--cache-dir", str(tmp_path / "c"), "--target", "c", "--workers", "1"]
    line = one_line_error(cli(*base, "--kernel-module", "tests.routed_kind:missing"), 2)
    assert "--kernel-module tests.routed_kind:missing" in line and "no attribute 'missing'" in line
    # What a module the daemon cannot import says (the README's tests.routed_kind, outside the repository).
    line = one_line_error(cli(*base, "--kernel-module", "no_such_kernels_module"), 2)
    assert "no module named 'no_such_kernels_module'" in line and "set PYTHONPATH" in line and "install it" in line
    assert not (tmp_path / "s.sock").exists()


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
    from compile_service.cli import _human_bytes

    assert (logged.group(1), _human_bytes(int(logged.group(2)))) == summary.groups()  # one number for what is left
    pid = d.proc.pid
    stopped = cli("stop", "--socket", str(d.socket))
    assert stopped.returncode == 0 and f"pid {pid}" in stopped.stdout
    assert _exited(pid)  # gone (or a zombie awaiting its parent's wait) by the time stop returns
    assert d.proc.wait(10) == 0
