"""Issue 49 item 7: the wheel's top-level `proto` and `kernels` share their names with proto-plus
and Hugging Face's `kernels`. A real wheel install of this project (pip --target), next to the
other distribution's files and metadata as pip would leave them, fails at import and at
`kernel-service info` with one line naming the other distribution and the remedy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "client", "compile_service", "kernels", "proto")
PROTO_PLUS = ("proto-plus", "1.26.1", "proto", ["__init__.py", "message.py", "marshal/__init__.py"])
HF_KERNELS = ("kernels", "0.10.4", "kernels", ["__init__.py", "layer.py", "utils.py"])


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory) -> Path:
    """This project installed from its wheel into a directory of its own, as pip installs it."""
    base = tmp_path_factory.mktemp("wheel")
    (base / "src").mkdir()
    for name in SOURCES:  # a copy: the build writes build/ and *.egg-info beside its sources
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, base / "src" / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, base / "src" / name)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation", "--target", str(base / "site"), str(base / "src")]
    subprocess.run(pip, check=True, capture_output=True, timeout=300)
    return base / "site"


@pytest.fixture
def site(wheel_site, tmp_path) -> Path:
    return Path(shutil.copytree(wheel_site, tmp_path / "site"))


def _install_other(where: Path, dist: tuple, overwrite_init: bool = True) -> None:
    """Another distribution's package and metadata, as pip leaves them (RECORD, no top_level.txt:
    what wheels built by hatchling or flit carry)."""
    name, version, package, files = dist
    info = where / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nSomeone else's package.\n")
    (info / "RECORD").write_text("".join(f"{package}/{f},,\n" for f in files) + f"{info.name}/RECORD,,\n")
    for f in files:
        path = where / package / f
        if path.name == "__init__.py" and path.exists() and not overwrite_init:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {name}\n")


def _run(args: list[str], pythonpath: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_SERVICE_") and k != "PYTHONPATH"}
    env.update(PYTHONPATH=pythonpath, KERNEL_SERVICE_SOCKET=str(cwd / "none.sock"), KERNEL_SERVICE_CACHE_DIR=str(cwd / "cache"))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_wheel_alone_imports_and_info_runs(site, tmp_path):
    imported = _run(["-c", "import client, kernels; print(client.__file__)"], str(site), tmp_path)
    assert imported.returncode == 0 and imported.stdout.startswith(str(site)), imported.stderr
    info = _run(["-m", "compile_service.cli", "info"], str(site), tmp_path)
    assert info.returncode == 0, info.stderr


@pytest.mark.parametrize(
    "other, overwrite_init",
    [(PROTO_PLUS, True), (PROTO_PLUS, False), (HF_KERNELS, True), (HF_KERNELS, False)],
    ids=["proto-plus-installed-after", "proto-plus-installed-before", "hf-kernels-after", "hf-kernels-before"],
)
def test_a_distribution_merged_into_our_package_fails_in_one_line(site, tmp_path, other, overwrite_init):
    name, version, package, _ = other
    _install_other(site, other, overwrite_init)
    imported = _run(["-c", "import client"], str(site), tmp_path)
    last = imported.stderr.strip().splitlines()[-1]
    assert imported.returncode == 1 and last.startswith("proto.clashes.PackageClash: "), imported.stderr
    assert f"`{package}`" in last and f"{name} {version}" in last and "environment of its own" in last and "sidecar image" in last, last
    info = _run(["-m", "compile_service.cli", "info"], str(site), tmp_path)
    assert info.returncode == 1 and info.stdout == "", info.stdout
    assert len(info.stderr.splitlines()) == 1, info.stderr
    line = info.stderr.strip()
    assert line.startswith("kernel-service: ") and f"{name} {version}" in line and "merged" in line, line


def test_a_distribution_elsewhere_on_sys_path_fails_in_one_line(tmp_path):
    """The source tree first on sys.path, proto-plus installed in a later directory: ours hides its."""
    other = tmp_path / "other-site"
    _install_other(other, PROTO_PLUS)
    imported = _run(["-c", "import client"], f"{ROOT}{os.pathsep}{other}", tmp_path)
    last = imported.stderr.strip().splitlines()[-1]
    assert imported.returncode == 1 and "proto-plus 1.26.1" in last and "hides the other" in last, imported.stderr
    # A copy of a package that no distribution claims is no clash (tests copy `kernels` to change it).
    shutil.rmtree(other / "proto_plus-1.26.1.dist-info")
    assert _run(["-c", "import client"], f"{ROOT}{os.pathsep}{other}", tmp_path).returncode == 0
