"""The conventions a platform team expects (issue 49, item 11): every setting from the
environment, systemd's Type=notify, process_* metrics and metric names with their units, JSON
logs, TLS on the TCP listener, and bounded dependencies. Real daemons on real sockets, the real
CLI in subprocesses, a real certificate made by openssl."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import client
from compile_service.logs import JsonFormatter
from devtools.launch import DaemonProcess
from proto.paths import socket_address

ROOT = Path(__file__).resolve().parent.parent
RMSNORM = {"M": None, "N": 64, "dtype": "float32", "target": "c"}


def cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "compile_service.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def one_line_error(proc: subprocess.CompletedProcess, status: int) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == status and len(lines) == 1 and lines[0].startswith("kernel-service: "), proc.stderr
    return lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {name: float(value) for line in body.splitlines() if line and not line.startswith("#") for name, value in [line.rsplit(" ", 1)]}


@pytest.fixture
def started(tmp_path):
    """Daemons started here, stopped at the end of the test."""
    daemons: list[DaemonProcess] = []
    yield daemons
    for d in daemons:
        d.stop()


# ----- every setting from the environment; JSON logs


def test_a_daemon_configured_by_environment_alone_serves_as_told_and_logs_json(tmp_path, started):
    socket_path = Path(tmp_path.parent / f"ks-{os.getpid()}-env" / "ks.sock")  # short: Unix socket paths are limited
    port = free_port()
    env = {
        "KERNEL_SERVICE_SOCKET": str(socket_path), "KERNEL_SERVICE_CACHE_DIR": str(tmp_path / "cache"),
        "KERNEL_SERVICE_TARGET": "c", "KERNEL_SERVICE_WORKERS": "1", "KERNEL_SERVICE_MAX_SIZE": "1G", "KERNEL_SERVICE_GRACE": "5",
        "KERNEL_SERVICE_METRICS_ADDRESS": f"127.0.0.1:{port}", "KERNEL_SERVICE_LOG_LEVEL": "DEBUG", "KERNEL_SERVICE_LOG_FORMAT": "json",
    }  # fmt: skip
    d = DaemonProcess(tmp_path / "cache", socket=socket_path, log_path=tmp_path / "daemon.log", env=env)
    d.args = ["serve", "--exit-with-parent"]  # no flag: the environment alone
    started.append(d.start(timeout=120))
    c = d.client()
    c.get_kernel("rmsnorm", **{**RMSNORM, "target": None})  # the daemon's default target: "c", from its variable
    info = json.loads(cli("info", "--socket", str(socket_path), "--json").stdout)
    assert info["from"].startswith("the daemon running")
    s = info["settings"]
    told = {name: (s[name]["value"], s[name]["source"]) for name in ("target", "workers", "max_bytes", "grace", "metrics_address", "log_level", "log_format")}
    assert told == {
        "target": ("c", "$KERNEL_SERVICE_TARGET"), "workers": (1, "$KERNEL_SERVICE_WORKERS"), "max_bytes": (1 << 30, "$KERNEL_SERVICE_MAX_SIZE"),
        "grace": (5.0, "$KERNEL_SERVICE_GRACE"), "metrics_address": (f"127.0.0.1:{port}", "$KERNEL_SERVICE_METRICS_ADDRESS"),
        "log_level": ("DEBUG", "$KERNEL_SERVICE_LOG_LEVEL"), "log_format": ("json", "$KERNEL_SERVICE_LOG_FORMAT"),
    }  # fmt: skip
    assert scrape(port)["kernel_service_workers"] == 1
    c.close()
    assert d.stop() == 0
    lines = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
    assert {"time", "level", "logger", "message"} <= set(lines[0])
    said = {(line["level"], line["logger"]): line["message"] for line in lines}
    assert said[("INFO", "compile_service.server")] == "stopped" and any(line["level"] == "DEBUG" for line in lines)
    assert any(line["message"].startswith("kernel-service listening on") for line in lines)
    assert any(line["message"].startswith("compiled ") for line in lines)
    text_lines = [line for line in d.log().splitlines() if " INFO compile_service." in line]
    assert not text_lines, text_lines  # nothing of ours in the text format


def test_a_json_line_carries_the_exception():
    try:
        raise ValueError("a real failure")
    except ValueError:
        record = logging.getLogger("compile_service.test").makeRecord("compile_service.test", logging.ERROR, __file__, 1, "failed: %s", ("x",), sys.exc_info())
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "failed: x" and line["level"] == "ERROR" and line["logger"] == "compile_service.test"
    assert line["exception"].startswith("Traceback") and "ValueError: a real failure" in line["exception"] and line["time"].endswith("+00:00")


# ----- systemd's Type=notify


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_systemd_is_told_ready_once_the_socket_answers_and_stopping_at_a_drain(tmp_path, started, abstract):
    supervisor = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"ks-notify-{os.getpid()}-{time.time_ns()}"
    supervisor.bind("\0" + name if abstract else str(tmp_path / "notify"))
    supervisor.settimeout(120)
    d = DaemonProcess(
        tmp_path / "cache",
        "--target",
        "c",
        workers=1,
        log_path=tmp_path / "daemon.log",
        env={"NOTIFY_SOCKET": "@" + name if abstract else str(tmp_path / "notify")},
    )
    started.append(d.start(wait=False))
    try:
        assert supervisor.recv(4096) == b"READY=1"
        with grpc.insecure_channel(socket_address(d.socket)) as channel:  # one try, no wait: it must answer now
            assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        d.signal(15)
        assert supervisor.recv(4096) == b"STOPPING=1"
        assert d.proc.wait(60) == 0
    finally:
        supervisor.close()


# ----- metrics


def test_metrics_include_the_process_and_name_their_units_keeping_the_old_names(make_daemon):
    port = free_port()
    d = make_daemon("--metrics-address", f"127.0.0.1:{port}", "--memory-limit", "3G", workers=1)
    d.client().get_kernel("rmsnorm", **RMSNORM)
    metrics = scrape(port)
    assert metrics["process_resident_memory_bytes"] > 10 << 20 and metrics["process_cpu_seconds_total"] > 0
    assert {"process_open_fds", "process_start_time_seconds", "process_virtual_memory_bytes"} <= set(metrics)
    assert metrics["kernel_service_cache_bytes"] == metrics["kernel_service_bytes"] > 0
    assert metrics["kernel_service_memory_limit_bytes"] == metrics["kernel_service_memory_limit"] == 3 << 30
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "# HELP kernel_service_bytes Deprecated: kernel_service_cache_bytes" in body


# ----- TLS on the TCP listener


def self_signed(where: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1, made by the openssl CLI: (cert, key)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to make a certificate")
    where.mkdir(parents=True, exist_ok=True)
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    return self_signed(tmp_path_factory.mktemp("tls"))


def test_tcp_over_tls_serves_a_client_that_verifies_it_and_tells_the_others_why_not(make_daemon, certificate, tmp_path):
    cert, key = certificate
    address = f"127.0.0.1:{free_port()}"
    d = make_daemon("--tcp", address, "--tls-cert", str(cert), "--tls-key", str(key), workers=1)
    token = d.cache_dir / "tcp-token"
    with client.connect(address, token_file=token, tls_ca=cert) as c:
        kernel = c.get_kernel("rmsnorm", **RMSNORM)
        assert kernel.kind == "rmsnorm" and c.stats()["compiles"] == 1
    with client.connect(address, token_file=token) as plaintext, pytest.raises(client.ServiceUnavailable) as refused:
        plaintext.stats()
    assert "if the daemon serves TLS (--tls-cert), give its CA" in str(refused.value) and "KERNEL_SERVICE_TLS_CA" in str(refused.value)
    other_ca, _ = self_signed(tmp_path / "other")
    with client.connect(address, token_file=token, tls_ca=other_ca) as fooled, pytest.raises(client.ServiceUnavailable) as refused:
        fooled.stats()  # a server whose certificate this CA did not sign: no call reaches it
    assert "TLS failed" in str(refused.value) and "did not sign its certificate" in str(refused.value)
    # The CLI over TCP takes the CA from the variable.
    stats = cli("stats", "--socket", address, "--json", env={"KERNEL_SERVICE_TLS_CA": str(cert), "KERNEL_SERVICE_TOKEN_FILE": str(token)})
    assert stats.returncode == 0 and json.loads(stats.stdout)["compiles"] == 1, stats.stderr
    assert "tcp:" + address + " (TLS)" in d.log()


def test_tls_settings_are_refused_in_one_line(tmp_path, certificate):
    cert, key = certificate
    base = ["serve", "--socket", str(tmp_path / "s.sock"), "--cache-dir", str(tmp_path / "c"), "--tcp", "127.0.0.1:1"]
    line = one_line_error(cli(*base, "--tls-cert", str(cert)), 2)
    assert "--tls-cert and --tls-key go together" in line
    line = one_line_error(cli(*base, "--tls-cert", str(cert), "--tls-key", str(tmp_path / "missing.pem")), 2)
    assert f"--tls-key {tmp_path / 'missing.pem'}: cannot read it (No such file or directory)" in line
    (tmp_path / "not.pem").write_text("hello")
    line = one_line_error(cli(*base, "--tls-cert", str(tmp_path / "not.pem"), "--tls-key", str(key)), 2)
    assert "--tls-cert" in line and "not a PEM file" in line
    line = one_line_error(cli(*base[:5], env={"KERNEL_SERVICE_TLS_CERT": str(cert), "KERNEL_SERVICE_TLS_KEY": str(key)}), 2)
    assert "TLS is for the TCP listener; pass --tcp" in line
    assert not (tmp_path / "c").exists()  # refused before anything started


def test_a_client_told_an_unreadable_ca_says_so(tmp_path):
    with pytest.raises(client.ServiceUnavailable, match="cannot read the TLS CA .*missing.pem"):
        client.connect("127.0.0.1:1", tls_ca=tmp_path / "missing.pem")


# ----- dependencies


def test_redis_has_an_upper_bound():
    """store/resp.py builds on redis-py's private parser module: a major release may move it."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    redis = next(d for d in dependencies if d.startswith("redis"))
    assert "<9" in redis.replace(" ", ""), redis
