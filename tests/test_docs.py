"""docs/ hold code that users copy: each page's Python blocks run here as written, and the
claims about code that a block cannot show are checked against the code.

How a page's blocks run: in page order, in one fresh interpreter per page (a block may use what
an earlier block of its page defined), in an empty temporary directory, against a real daemon
(target "c") that $KERNEL_SERVICE_SOCKET names. A block that cannot run on a CPU-only machine
(it needs a GPU, or a production host's files) is marked, visibly in the page's source, on the
line right before its fence, with the reason:

    <!-- docs-test: skip (needs a GPU) -->

Shell blocks are not run (they start daemons, or import bundles on production hosts):
tests/test_readme.py checks each `kernel-service` line in them against the CLI's own parser,
and runs the README's Quickstart.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md"))
SKIP = re.compile(r"^<!-- docs-test: skip \((?P<why>[^)]+)\) -->$")
SESSION_MARK = "KERNEL_SERVICE_TEST_SESSION"  # conftest's mark on every process a test starts
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```$", re.DOTALL | re.MULTILINE)

# Runs the block files named in argv, in one namespace: a traceback names the block's file, and
# code that reads its own source (TileLang's decorators) finds it.
RUNNER = """
import sys
scope = {"__name__": "__main__"}
for path in sys.argv[1:]:
    exec(compile(open(path).read(), path, "exec"), scope)
"""


def python_blocks(page: Path) -> list[tuple[str, str, str | None]]:
    """(name, source, why it is skipped or None) of each Python block of `page`."""
    text = page.read_text()
    found = []
    for i, m in enumerate(b for b in FENCE.finditer(text) if b.group(2) == "python"):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.match(before)
        found.append((f"docs/{page.name} python block {i}", textwrap.dedent(m.group(3)), skip.group("why") if skip else None))
    return found


def test_every_skip_mark_stands_right_before_a_python_block_with_its_reason():
    for page in PAGES:
        lines = page.read_text().splitlines()
        for n, line in enumerate(lines):
            if "docs-test:" in line:
                assert SKIP.match(line), f"docs/{page.name}:{n + 1}: write it as <!-- docs-test: skip (the reason) -->"
                assert n + 1 < len(lines) and lines[n + 1].lstrip().startswith("```python"), (
                    f"docs/{page.name}:{n + 1}: a skip mark right before a ```python fence"
                )


RUNNABLE = [page for page in PAGES if any(why is None for _, _, why in python_blocks(page))]


@pytest.mark.parametrize("page", RUNNABLE, ids=[p.name for p in RUNNABLE])
def test_the_python_blocks_of_a_page_run_as_written(page, shared_daemon, tmp_path):
    files = []
    for name, source, why in python_blocks(page):
        if why is None:
            files.append(tmp_path / (re.sub(r"\W+", "_", name.removeprefix("docs/")) + ".py"))  # kernels_md_python_block_1.py
            files[-1].write_text(source)
    # The user's environment, as the page assumes it: no settings but the daemon's socket (and
    # conftest's session mark, which finds a process left behind).
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_SERVICE_") or k == SESSION_MARK}
    env.update(KERNEL_SERVICE_SOCKET=str(shared_daemon.socket), HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, "-c", RUNNER, *map(str, files)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"docs/{page.name}: a block failed:\n{run.stdout[-2000:]}\n{run.stderr[-6000:]}"


def test_the_client_page_says_what_prefetch_returns_as_the_code_does(shared_daemon):
    """docs/client.md's prefetch block prints each result's type: an invalid spec's InvalidSpec
    comes back in its slot and the rest is built."""
    c = shared_daemon.client()
    try:
        calls = []
        bad = {"kind": "rmsnorm", "M": None, "N": 0, "dtype": "float32", "target": "c"}
        results = c.prefetch([{"kind": "softmax", "M": None, "N": 64, "dtype": "float32", "target": "c"}, bad], progress=calls.append)
    finally:
        c.close()
    assert [type(r).__name__ for r in results] == ["Kernel", "InvalidSpec"] and "specs[1]" in str(results[1])
    assert [e["index"] for e in calls] == [1, 0], "a one-argument progress gets each event, invalid specs first"
    assert "# ['Kernel', 'InvalidSpec']" in (ROOT / "docs" / "client.md").read_text()


def test_the_kernels_page_lists_each_kinds_inputs_in_the_order_the_kernel_takes_them(cpu_kernel):
    """docs/kernels.md's zoo table: the inputs column names a kernel's inputs in call order."""
    table = (ROOT / "docs" / "kernels.md").read_text().split("## The zoo", 1)[1]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| [^|]*\| (.*) \|$", table, re.MULTILINE)}
    kernels = {
        "kv_attention": cpu_kernel("kv_attention", batch=None, heads=4, kv_heads=2, head_dim=8, paged=True, dtype="float32"),
        "rope": cpu_kernel("rope", tokens=None, heads=4, kv_heads=2, head_dim=8, dtype="float32"),
        "add_rmsnorm": cpu_kernel("add_rmsnorm", M=None, N=64, dtype="float32"),
    }
    for kind, k in kernels.items():
        cell = rows[kind].split("->")[0]
        where = [re.search(rf"`{name}\b", cell) for name in k.input_names]
        assert all(where), f"docs/kernels.md's {kind} row does not name every input of {k.input_names}: {cell}"
        assert [w.start() for w in where] == sorted(w.start() for w in where), f"docs/kernels.md lists {kind}'s inputs in another order than {k.input_names}"
