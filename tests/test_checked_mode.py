"""Checked mode (KERNEL_SERVICE_CHECK=1, client/checks.py): kv_attention's and rope's index
inputs are validated before the launch, and a bad one is a one-line ValueError naming it; off,
the same calls launch unchecked. Real daemon, real kernels, each mode in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CALLS = """
import json, sys, torch, client
kv = client.get_kernel("kv_attention", batch=None, heads=4, kv_heads=2, head_dim=8, paged=True, dtype="float32", target="c")
rope = client.get_kernel("rope", tokens=None, heads=4, kv_heads=2, head_dim=8, dtype="float32", target="c")
q, pages = torch.randn(2, 1, 4, 8), torch.randn(6, 16, 2, 8)  # 6 pages of 16 keys; 2 pages a sequence: 32 keys
table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
cache = torch.randn(64, 8)
cases = {
    "seq_lens past the cache": lambda: kv(q, pages, pages, torch.tensor([40, 5], dtype=torch.int32), table),
    "a page id past the pages": lambda: kv(q, pages, pages, torch.tensor([20, 5], dtype=torch.int32), torch.tensor([[0, 99], [2, 3]], dtype=torch.int32)),
    "a position past max_position": lambda: rope(torch.tensor([3, 64]), torch.randn(2, 4, 8), torch.randn(2, 2, 8), cache),
    "a negative position": lambda: rope(torch.tensor([-1, 3]), torch.randn(2, 4, 8), torch.randn(2, 2, 8), cache),
}
out = {}
for name, call in cases.items():
    if name not in sys.argv[1:]:
        continue
    try:
        call()
        out[name] = "ran"
    except ValueError as exc:
        out[name] = str(exc)
kv(q, pages, pages, torch.tensor([32, 17], dtype=torch.int32), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))  # valid: runs
print(json.dumps(out))
"""


def _run(socket, check: bool, *cases: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "KERNEL_SERVICE_CHECK"}
    env["KERNEL_SERVICE_SOCKET"] = str(socket)
    if check:
        env["KERNEL_SERVICE_CHECK"] = "1"
    run = subprocess.run([sys.executable, "-c", CALLS, *cases], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_checked_mode_names_bad_metadata_before_the_launch_and_is_off_by_default(shared_daemon):
    every = ("seq_lens past the cache", "a page id past the pages", "a position past max_position", "a negative position")
    checked = _run(shared_daemon.socket, True, *every)
    assert checked == {
        "seq_lens past the cache": "kv_attention: seq_lens[0] is 40, outside [0, 32] (the keys the cache holds)",
        "a page id past the pages": "kv_attention: block_table[0, 1] is 99, outside [0, 6) (the cache's pages)",
        "a position past max_position": "rope: positions[1] is 64, outside [0, 64) (the rows of cos_sin_cache)",
        "a negative position": "rope: positions[0] is -1, outside [0, 64) (the rows of cos_sin_cache)",
    }, checked
    # Off: nothing is read before the launch (rope's bad rows only come back as zeros; the
    # kv_attention cases would read out of bounds).
    assert set(_run(shared_daemon.socket, False, *every[2:]).values()) == {"ran"}
