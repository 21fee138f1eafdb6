"""The house's seams, held by tests: who imports whom, per-kind keys, plugins served to
clients that never import them, one build path, bytes stored once."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import client

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "tests" / "plugin_pkg"


# The layers, lowest first: a module imports only its own layer and those below it.
# benchmark/ and tests/ sit above them all: they use the packages, no package imports them.
LAYERS = {"proto": 0, "kernels": 1, "compile_service": 2, "client": 3, "devtools": 4, "benchmark": 5, "tests": 5}
PACKAGES = ("proto", "kernels", "compile_service", "client", "devtools")


def _modules() -> dict[str, Path]:
    """Every module of the project's packages, by dotted name."""
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(module: str, path: Path, modules: dict) -> set[str]:
    """What `module` imports, anywhere in the file (a function's lazy import counts as much as a
    module-level one): each name resolved to the project module it loads (`from . import loader`
    is client.loader, `from .errors import X` is client.errors), other names as written."""

    def known(name: str) -> str:
        prefix = name
        while prefix and prefix not in modules:
            prefix = prefix.rpartition(".")[0]
        return prefix or name

    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(known(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".") if node.level else node.module
            out.update(known(f"{base}.{a.name}") if f"{base}.{a.name}" in modules else known(base) for a in node.names)
    out.discard(module)
    return out


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, path, modules) for m, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among the project's modules, as [a, b, ..., a]; None when there is none."""
    done, path = set(), []

    def visit(m):
        path.append(m)
        for n in sorted(graph[m] & graph.keys()):
            if n in path:
                return path[path.index(n) :] + [n]
            if n not in done and (found := visit(n)):
                return found
        done.add(path.pop())
        return None

    return next((found for m in sorted(graph) if m not in done and (found := visit(m))), None)


def test_no_module_imports_one_that_imports_it_back():
    """No import cycle, counting every import: a lazy (function-level) import only hides a loop
    from the load order, the two modules still need each other. Break a loop by passing the
    dependency in (a callback, a resolver), never by moving the import into a function."""
    cycle = _cycle(_import_graph())
    assert cycle is None, "an import loop: " + " -> ".join(cycle)


def test_no_package_imports_a_layer_above_its_own():
    """proto < kernels < compile_service < client < devtools < benchmark, tests: every import
    (module- or function-level) points to the module's own layer or a lower one, with no exemption."""
    upward = {m: sorted(i for i in imported if LAYERS.get(i.split(".")[0], -1) > LAYERS[m.split(".")[0]]) for m, imported in _import_graph().items()}
    assert {m: i for m, i in upward.items() if i} == {}


def test_the_client_imports_only_the_contract_and_the_embedding_api():
    for m, imported in _import_graph().items():
        if m.split(".")[0] == "client":
            daemon = {i for i in imported if i.split(".")[0] == "compile_service"}
            assert daemon <= {"compile_service.embedded"}, f"{m} imports daemon internals: {sorted(daemon)}"


def test_the_import_graph_sees_lazy_and_relative_imports():
    """The graph the two tests above read: known edges of each kind are in it."""
    graph = _import_graph()
    assert "client.loader" in graph["client.api"]  # from . import loader
    assert "client.errors" in graph["client.api"]  # from .errors import ...
    assert "compile_service.embedded" in graph["client.fallback"]  # a function-level import
    assert "kernels.spec" in graph["kernels"] and "compile_service.fsutil" in graph["compile_service.store.local"]  # from ..fsutil import


def test_importing_the_manifest_format_loads_no_kernel_module():
    code = "import sys, proto.manifest, proto.entry, proto.wire; print(sorted(m for m in sys.modules if m.split('.')[0] in ('kernels', 'compile_service', 'client')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_invalid_spec_is_one_class_under_every_name():
    import kernels
    import kernels.spec
    import proto.errors

    assert kernels.InvalidSpec is kernels.spec.InvalidSpec is client.InvalidSpec is proto.errors.InvalidSpec
    assert issubclass(client.CorruptArtifact, proto.errors.EntryRefused)


def _digests(kernels_parent: Path) -> dict:
    code = "import json, kernels; print(json.dumps({k: kernels.source_digest(k) for k in kernels.kinds()}))"
    path = f"{kernels_parent}{os.pathsep}{ROOT}"  # the copied kernels first; the contract they build on (proto) from the tree
    out = subprocess.run([sys.executable, "-c", code], cwd=kernels_parent, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_editing_one_kind_changes_that_kinds_keys_and_no_others(tmp_path):
    shutil.copytree(ROOT / "kernels", tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    before = _digests(tmp_path)
    with open(tmp_path / "kernels" / "softmax.py", "a") as f:
        f.write("\n# an edit\n")
    with open(tmp_path / "kernels" / "reference.py", "a") as f:  # the test helper shapes no kernel
        f.write("\n# an edit\n")
    after = _digests(tmp_path)
    assert {k for k in before if before[k] != after[k]} == {"softmax"}
    with open(tmp_path / "kernels" / "tiling.py", "a") as f:  # framework code every zoo kind imports
        f.write("\n# an edit\n")
    before = _digests(tmp_path)
    assert {k for k, v in before.items() if v != after[k]} == {
        "gemm",
        "attention",
        "kv_attention",
        "rmsnorm",
        "softmax",
        "swiglu",
        "geglu",
        "add_rmsnorm",
        "layernorm",
        "rope",
    }
    for policy, kind in (("gemm_tuning.py", "gemm"), ("kv_splits.py", "kv_attention")):  # a kind's tuning policy is its own module
        with open(tmp_path / "kernels" / policy, "a") as f:
            f.write("\n# an edit\n")
        after = _digests(tmp_path)
        assert {k for k in before if before[k] != after[k]} == {kind}, policy
        before = after


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """The example plugin installed as a package (its entry points included) into a private site dir."""
    site = tmp_path_factory.mktemp("plugin-site")
    build = tmp_path_factory.mktemp("plugin-build")
    shutil.copytree(PLUGIN, build / "src")
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", "--target", str(site), str(build / "src")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return site


def test_an_installed_plugin_is_served_to_a_client_that_never_imports_it(make_daemon, plugin_site):
    d = make_daemon(env={"PYTHONPATH": str(plugin_site)})
    c = d.client()
    kinds = {k["name"]: k for k in c.kinds()}
    assert {"scaled_add", "row_scale", "gemm", "rmsnorm"} <= set(kinds)
    assert kinds["row_scale"]["origin"].startswith("entry point row_scale (ks-example-plugin 0.1.0)")
    assert [p["name"] for p in kinds["row_scale"]["params"]] == ["N", "scale", "dtype"] and kinds["row_scale"]["params"][0]["required"]

    add = c.get_kernel("scaled_add", N=None, alpha=0.5, target="c")  # a class-style kind
    x, y = torch.randn(37), torch.randn(37)
    torch.testing.assert_close(add(x, y), x + 0.5 * y)
    scale = c.get_kernel("row_scale", N=24, scale=3.0, target="c")  # a @tilelang.jit factory, runtime M
    for m in (5, 19):
        x, w = torch.randn(m, 24), torch.randn(24)
        torch.testing.assert_close(scale(x, w), x * 3.0 * w)
    assert "ks_example_plugin" not in sys.modules  # served without the client ever importing it

    with pytest.raises(client.InvalidSpec, match="scale"):  # the daemon validates against the plugin's schema
        c.get_kernel("row_scale", N=24, scale="big", target="c")
    # In a batch, the spec the daemon refuses fails its own slot; the others are served.
    batch = c.prefetch([{"kind": "row_scale", "N": 24, "scale": "big", "target": "c"}, {"kind": "row_scale", "N": 24, "scale": 3.0, "target": "c"}])
    assert isinstance(batch[0], client.InvalidSpec) and batch[0].field == "specs[0].scale" and batch[1] is scale

    out = subprocess.run(
        [sys.executable, "-m", "compile_service.cli", "kinds", "--json", "--socket", str(d.socket)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    listed = {k["name"] for k in json.loads(out.stdout)}
    assert {"scaled_add", "row_scale", "gemm", "attention", "rmsnorm", "softmax", "swiglu"} <= listed


def _comparable(entry_dir: Path) -> dict:
    meta = json.loads((entry_dir / "entry.json").read_text())
    for volatile in ("created", "compile_seconds", "phases", "device_compiled", "worker"):
        meta.pop(volatile, None)
    manifest = json.loads((entry_dir / "manifest.json").read_text())
    return {"meta": meta, "files": sorted(manifest["files"]), "library": manifest["library"]}


def test_the_daemon_and_the_fallback_publish_identical_entries(make_daemon, tmp_path):
    spec = {"M": None, "N": 48, "eps": 1e-5, "dtype": "float32"}
    d = make_daemon()
    served = d.client().get_kernel("rmsnorm", target="c", **spec)
    local = client.connect(tmp_path / "no-daemon.sock", fallback=True, cache_dir=tmp_path / "local-cache").get_kernel("rmsnorm", target="c", **spec)
    assert local.outcome == "compiled" and local.key == served.key
    assert _comparable(Path(local.path).parent) == _comparable(Path(served.path).parent)


def test_a_shared_build_copy_adds_no_second_copy_of_the_library(make_daemon):
    d = make_daemon("--kernel-module", "tests.shared_kind")
    c = d.client()
    kernels_ = [c.get_kernel("row_double", M=m, N=16, target="c") for m in (3, 8)]
    x = torch.randn(8, 16)
    torch.testing.assert_close(kernels_[1](x), 2 * x)
    with pytest.raises(ValueError, match="M=8"):
        kernels_[1](torch.randn(3, 16))
    stats = c.stats()
    assert stats["compiles"] == 1 and stats["derived"] == 2
    libraries = [os.stat(k.path) for k in kernels_]
    assert libraries[0].st_ino == libraries[1].st_ino  # one inode: the blob, linked from both entries
    blobs = [p for p in (d.cache_dir / "blobs").rglob("*") if p.is_file()]
    library_blobs = [b for b in blobs if b.stat().st_ino == libraries[0].st_ino]
    assert len(library_blobs) == 1 and library_blobs[0].stat().st_nlink == 4  # blob + the build + 2 copies
