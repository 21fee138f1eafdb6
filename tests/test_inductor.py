"""torch.compile in agent processes shares the daemon's persistent Inductor directory."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

AGENT = textwrap.dedent(
    """
    import json, sys, time, warnings
    import client
    c = client.connect(sys.argv[1])
    compile_first = sys.argv[2] == "compile-first"
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x = torch.randn(4, 16)
    if compile_first:
        torch.compile(model)(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = c.use_shared_inductor_cache()
    t = time.perf_counter()
    torch.compile(model)(x)
    from torch._dynamo.utils import counters
    print(json.dumps({
        "path": str(cache.path), "source": cache.source, "seconds": time.perf_counter() - t,
        "hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"],
        "warnings": [str(w.message) for w in caught],
    }))
    """
)


def agent(socket, env_extra: dict, mode: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "XDG_CACHE_HOME", "KERNEL_SERVICE_CACHE_DIR")}
    env.update(env_extra)
    proc = subprocess.run([sys.executable, "-c", AGENT, str(socket), mode], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_process_hits_the_fx_graph_cache_through_the_daemon_dir(make_daemon, tmp_path):
    d = make_daemon()
    a = agent(d.socket, {"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert a["source"] == "daemon" and a["path"] == str(d.cache_dir / "torchinductor")
    assert a["miss"] >= 1 and a["hit"] == 0
    b = agent(d.socket, {"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert b["source"] == "daemon" and b["hit"] >= 1 and b["miss"] == 0
    assert stat.S_IMODE(os.stat(a["path"]).st_mode) == stat.S_IMODE(os.stat(d.cache_dir).st_mode) == 0o700
    stats = d.client().stats()
    assert stats["inductor_dir"] == a["path"] and stats["inductor_entries"] > 0 and stats["inductor_bytes"] > 0


def test_existing_setting_wins_and_no_daemon_falls_back_to_the_cache_root(tmp_path):
    mine = tmp_path / "mine"
    r = agent(tmp_path / "nobody.sock", {"TORCHINDUCTOR_CACHE_DIR": str(mine)})
    assert r["source"] == "environment" and r["path"] == str(mine) and any(mine.iterdir())

    r = agent(tmp_path / "nobody.sock", {"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    fallback = tmp_path / "xdg" / "kernel-service" / "torchinductor"
    assert r["source"] == "fallback" and r["path"] == str(fallback)
    assert stat.S_IMODE(fallback.stat().st_mode) == 0o700

    # The cache root a daemon would use is the client's too: $KERNEL_SERVICE_CACHE_DIR before XDG.
    r = agent(tmp_path / "nobody.sock", {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "KERNEL_SERVICE_CACHE_DIR": str(tmp_path / "mine-too")})
    assert r["source"] == "fallback" and r["path"] == str(tmp_path / "mine-too" / "torchinductor")
    assert stat.S_IMODE((tmp_path / "mine-too").stat().st_mode) == 0o700


def test_calling_after_the_first_compile_warns(tmp_path):
    r = agent(tmp_path / "nobody.sock", {"XDG_CACHE_HOME": str(tmp_path / "xdg")}, "compile-first")
    assert any("before the first torch.compile" in w for w in r["warnings"])
