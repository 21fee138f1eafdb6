"""torch.compile of a small model in a fresh process: cold vs warm through the shared Inductor directory.

    python benchmark/inductor_cache.py [--runs 3]

Starts a daemon on a fresh cache. The first fresh process compiles with an
empty Inductor directory (cold); the next ones find its graphs there (warm).
Each reports the wall time of its first compiled call (tracing, Inductor,
the C++/Triton build or cache load, and the call) and Inductor's FX graph
cache counters.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devtools.launch import DaemonProcess  # noqa: E402

AGENT = textwrap.dedent(
    """
    import json, sys, time
    import torch
    import client
    cache = client.connect(sys.argv[1]).use_shared_inductor_cache()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.LayerNorm(1024),
        torch.nn.Linear(1024, 1024), torch.nn.SiLU(), torch.nn.Linear(1024, 256),
    ).to(device)
    x = torch.randn(64, 256, device=device)
    t = time.perf_counter()
    torch.compile(model)(x)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    from torch._dynamo.utils import counters
    print(json.dumps({"seconds": seconds, "source": cache.source, "device": device,
                      "hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"]}))
    """
)


def agent(socket: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    proc = subprocess.run([sys.executable, "-c", AGENT, str(socket)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="warm processes to run (default 3)")
    args = parser.parse_args()
    with DaemonProcess(Path(tempfile.mkdtemp(prefix="ks-inductor-")) / "cache") as daemon:
        cold = agent(daemon.socket)
        warm = [agent(daemon.socket) for _ in range(args.runs)]
        stats = daemon.client().stats()
    median = statistics.median(w["seconds"] for w in warm)
    print(f"device {cold['device']}; Inductor directory {stats['inductor_dir']} ({stats['inductor_entries']} files, {stats['inductor_bytes'] / 1e6:.1f} MB)")
    print(f"cold: {cold['seconds']:.2f} s (fx graph cache misses {cold['miss']}, hits {cold['hit']})")
    print(f"warm: {median:.2f} s median of {len(warm)} (misses {warm[-1]['miss']}, hits {warm[-1]['hit']}); cold/warm {cold['seconds'] / median:.1f}x")
    return 0 if all(w["hit"] > 0 and w["miss"] == 0 for w in warm) else 1


if __name__ == "__main__":
    sys.exit(main())
