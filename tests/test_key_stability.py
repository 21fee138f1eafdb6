"""Keys are the same on every host with the same toolchain: no path, host name, user, PID,
CUDA_HOME or PATH layout in them (issue: a bundle built on one machine must hit on another)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A plugin kind that imports the framework: its source digest spans two roots.
PLUGIN = """
from kernels.registry import register
from kernels.spec import KernelKind, dim, dtype_param


@register
class Scale(KernelKind):
    name = "scale_plugin"
    params = (dim("N"), dtype_param())
"""

COMPUTE = r"""
import json, os, platform, socket, sys
if os.environ.get("PRETEND_HOST"):  # what a key must never read
    socket.gethostname = lambda: os.environ["PRETEND_HOST"]
    platform.node = lambda: os.environ["PRETEND_HOST"]
import kernels
from kernels import plugins
from compile_service.build import devices
from compile_service.keys import cache_key

plugins.load(("scale_plugin_module",), entry_points=False)
specs = [
    ("gemm", {"M": None, "N": 256, "K": 128}),
    ("attention", {"batch": 1, "heads": 8, "kv_heads": 2, "seq_len": None, "head_dim": 64}),
    ("rmsnorm", {"M": 8, "N": 512}),
    ("swiglu", {"M": None, "N": 512}),
    ("softmax", {"M": None, "N": 512}),
    ("scale_plugin", {"N": 64}),
]
compilers = sorted({devices.get(devices.NVCC).id, devices.get(devices.NVRTC).id if devices.get(devices.NVRTC).unavailable_reason() is None else "nvrtc-none"})
keys = {}
for kind, params in specs:
    for target, dtype in (("c", "float32"), ("sm_90a", "float16")):
        for cc in compilers:
            keys[f"{kind} {target} {cc}"] = cache_key(kernels.canonicalize(kind, {**params, "dtype": dtype}, target), cc)
print(json.dumps({"keys": keys, "kernels_from": kernels.__file__, "compilers": compilers}))
"""


def _install(base: Path, src: str, plugin_dir: str) -> dict:
    """A copy of the packages keys are made of under `base/src`, the plugin under `base/plugin_dir`."""
    for package in ("kernels", "compile_service", "proto"):
        shutil.copytree(ROOT / package, base / src / package, ignore=shutil.ignore_patterns("__pycache__"))
    (base / plugin_dir).mkdir(parents=True)
    (base / plugin_dir / "scale_plugin_module.py").write_text(PLUGIN)
    for d in ("home", "tmp", "work"):
        (base / d).mkdir()
    return {"PYTHONPATH": f"{base / src}{os.pathsep}{base / plugin_dir}", "HOME": str(base / "home"), "TMPDIR": str(base / "tmp")}


def _keys(env: dict, cwd: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", COMPUTE], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_keys_do_not_depend_on_paths_hosts_users_or_the_cuda_layout(tmp_path):
    # The toolkit (nvcc and the headers NVRTC compiles against), wherever this machine has it.
    homes = [os.environ.get("CUDA_HOME"), "/usr/local/cuda", shutil.which("nvcc") and str(Path(shutil.which("nvcc")).resolve().parent.parent)]
    cuda_home = next((h for h in homes if h and (Path(h) / "bin" / "nvcc").exists()), None)
    base_env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "PYTHONPATH")}

    # Host A: CUDA found through CUDA_HOME; the plugin's root sorts before the framework's.
    a = tmp_path / "a"
    env_a = {
        **base_env,
        **_install(a, "src", "plugins/aa"),
        "CUDA_HOME": cuda_home or "/nonexistent",
        "PATH": "/usr/bin:/bin",
        "USER": "alice",
        "LOGNAME": "alice",
    }
    # Host B: another root and depth, nvcc only through a PATH entry that is a link to the
    # toolkit's bin, another user and host name; the plugin's root sorts after the framework's.
    b = tmp_path / "b" / "deep" / "er"
    env_b = {**base_env, **_install(b, "lib/src", "zz/plugins"), "USER": "bob", "LOGNAME": "bob", "PRETEND_HOST": "pod-10-0-3-7"}
    if cuda_home:
        (b / "cuda-bin").symlink_to(Path(cuda_home) / "bin")
        env_b["PATH"] = f"{b / 'cuda-bin'}:/usr/bin:/bin"
    env_b["KERNEL_SERVICE_CACHE_DIR"] = str(b / "cache")

    one, two = _keys(env_a, a / "work"), _keys(env_b, b / "work")
    assert one["kernels_from"].startswith(str(a)) and two["kernels_from"].startswith(str(b))  # the copies, not this checkout
    assert one["compilers"] == two["compilers"]
    if cuda_home:
        assert not any(c.endswith(("-none", "-unknown")) for c in one["compilers"] if c.startswith("nvcc")), one["compilers"]
    # The inputs do tell kernels apart (CPU keys hold no CUDA compiler: one per kind).
    assert len(set(one["keys"].values())) == 6 * (1 + len(one["compilers"]))
    assert one["keys"] == two["keys"]
