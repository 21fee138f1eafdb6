"""Startup time: from a fresh agent process's start to a ready model, and to its first output.

    python benchmark/startup.py [--layers 2] [--prompt-tokens 2048] [--variants served_cold,eager,...]
        [--workers N] [--json out.json] [--plot out.png] [--work-dir DIR]      # on a CUDA host
    python benchmark/startup.py --small      # anywhere: tiny layers, float32, target "c" (what CI runs)

This project's `vllm bench startup`. The model is --layers decoder layers of
benchmark/decode_step.py's Llama-3-8B shape (hidden 4096, 32 query / 8 KV heads of
128, FFN 14336, bfloat16; --small: hidden 256, 4/2 heads of 64, FFN 512, float32 on
target "c"), random weights (one seed per layer), run once over a prompt of
--prompt-tokens tokens of one fresh sequence (decode_step's prefill chunk: causal
attention over the prompt's own keys, which rope also writes into each layer's
paged KV cache). The layers share their kernels: 9 distinct kernels, whatever
--layers. The output is the last layer's x' + r' (no LM head). The served form is
decode_step's ServedLayer, the torch form its torch_layer (HF's separate
projections), on the same weights.

Terms. Every time is in seconds from the agent process's start (the parent's clock
just before it spawns the child), so the interpreter's start and the imports count:

  ready         the model can run: its weights made on the device and every kernel at
                hand. served: fetched and loaded (on a cold cache, compiled by the
                daemon first). tilelang: compiled, or loaded from TileLang's disk cache.
                torch.compile: the first forward has returned (it is where compiling
                happens), so ready = first output; reduce-overhead on CUDA: the second
                forward too, which records the CUDA graph later calls replay (phase
                `graph`). eager: the weights made.
  first output  the first forward's output copied to the host (the device synchronized).
                TileLang's variants have none: a JITKernel takes its PrimFunc's raw
                arguments (outputs and workspaces the caller allocates, in the order the
                service's loader reads from the kernel's ABI), so there is no model to
                run on them short of rewriting that loader; they stop at ready.

Each variant runs in a fresh child process of this script (so each pays its own
imports), one after another, on a quiet machine (a variant's own daemon is stopped, its
workers gone, before the next starts; the sidecar's workers have warmed up before its
first agent, and it builds nothing when a variant starts: a router's other ranges, built
in the background after served_cold's agent took its kernels, are done), in this order:

  served_cold                   a daemon already up on a fresh cache, its workers
                                warmed up; the agent's first step, before its own
                                `import torch`, sends the 9 kernels' specs
                                (client.prefetch(specs, wait=False)), and it takes
                                them (result()) once its weights are made
  served_cold_from_serve        a daemon on a fresh cache started at the same moment as
                                the agent, which sends its specs as served_cold's does
                                (the client retries a socket not there yet for 2 s),
                                waits until the daemon serves (after making its
                                weights) and takes them
  served_warm                   served_cold's daemon and cache, now holding every kernel
                                (filled untimed if served_cold did not run)
  served_warm_graphs            served_warm, then the forward captured in a CUDA graph
                                (decode_step.graphed: three eager forwards on a side
                                stream, the capture); ready once captured, the first
                                output a replay (CUDA only: left out on the CPU)
  tilelang_cold                 TileLang alone: tilelang.par_compile of the PrimFuncs the
                                service would build (kernels.get_kind(kind).build), a
                                fresh TILELANG_CACHE_DIR
  tilelang_warm                 the same, TILELANG_CACHE_DIR holding them (filled by
                                tilelang_cold, or by an untimed run of it)
  compile_<mode>_cold           torch.compile(fullgraph=True, dynamic=False) of the torch
                                model, mode default or reduce-overhead, a fresh
                                TORCHINDUCTOR_CACHE_DIR
  compile_<mode>_warm           the same in a second process on the shared Inductor
                                directory (client.use_shared_inductor_cache(): the
                                sidecar daemon's); the first process, untimed, fills it
  eager                         the torch model, eager
  eager_beside_warm_up          eager again, started as a daemon on a fresh cache
                                beside it says SERVING: the daemon's zygote imports
                                TileLang and its workers warm up (on a CUDA host: lower
                                the kinds' examples, parse their headers) while the
                                agent starts; against eager, what a daemon's start costs
                                an agent on the same host
  eager_beside_restart          the same beside a daemon restarted on a cache that holds
                                the layer's kernels: its zygote imports TileLang, and
                                no worker warms up (nothing shows it will build)

Every variant but TileLang's saves its output; each is compared with eager's (relative
error), and a mismatch fails the run. Besides ready and first output, each variant
reports where its time went: imports (from the process's start), weights, kernels,
forward. Before the first variant, this tree's packages are byte-compiled (untimed), as an
installed client's are: torch and TileLang come with theirs, and under
PYTHONDONTWRITEBYTECODE an agent would otherwise compile ours at every start.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))


def child_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="startup.py _child")
    p.add_argument("role", choices=("served", "tilelang", "compile", "eager"))
    p.add_argument("--t0", type=float, required=True)
    p.add_argument("--config", required=True, help="the LayerConfig as JSON")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--specs", help="the layer's kernels, as client.prefetch specs in JSON (served)")
    p.add_argument("--socket")
    p.add_argument("--wait-for-daemon", action="store_true")
    p.add_argument("--graphs", action="store_true")
    p.add_argument("--compile-mode", choices=tuple(COMPILE_MODES))
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def send_early(a: argparse.Namespace):
    """A served agent's first step, before its own `import torch` (seconds on a GPU host): it sends
    its kernels' specs, and the daemon builds them while the agent imports and makes its weights."""
    import client

    c = client.connect(a.socket)
    return c, c.prefetch(json.loads(a.specs), wait=False)


COMPILE_MODES = {"default": None, "reduce_overhead": "reduce-overhead"}  # variant name part -> torch.compile mode
CHILD = child_args(sys.argv[2:]) if __name__ == "__main__" and sys.argv[1:2] == ["_child"] else None
EARLY = send_early(CHILD) if CHILD is not None and CHILD.role == "served" else None

import torch  # noqa: E402

import decode_step  # noqa: E402  (benchmark/decode_step.py, next to this file)
from decode_step import LayerConfig  # noqa: E402
from devtools.bytecode import compile_tree  # noqa: E402

VARIANTS = (
    "served_cold",
    "served_cold_from_serve",
    "served_warm",
    "served_warm_graphs",
    "tilelang_cold",
    "tilelang_warm",
    "compile_default_cold",
    "compile_default_warm",
    "compile_reduce_overhead_cold",
    "compile_reduce_overhead_warm",
    "eager",
    "eager_beside_warm_up",
    "eager_beside_restart",
)


# ----------------------------------------------------------------------------
# The model, in both forms.


def layer_specs(cfg: LayerConfig) -> list[dict]:
    """The 9 distinct kernels of a layer over a cfg.prefill-token prompt, as client.prefetch specs."""
    return [*decode_step.kernel_specs(cfg).values(), decode_step.prefill_attention_spec(cfg, cfg.prefill)]


def device_of(cfg: LayerConfig) -> str:
    return "cpu" if cfg.target == "c" else "cuda"


class Model:
    """L decoder layers over one prompt: layer i has the weights of seed i and its own KV cache."""

    def __init__(self, cfg: LayerConfig, layers: int):
        device = device_of(cfg)
        self.cfg = cfg
        self.weights = [decode_step.make_weights(cfg, device, seed=i) for i in range(layers)]
        # One step's inputs per layer, for its caches; the first layer's x and r are the prompt.
        self.steps = [decode_step.make_step(cfg, 1, cfg.prefill, device) for _ in range(layers)]

    def forward_torch(self) -> torch.Tensor:
        """The torch model: what eager runs and torch.compile compiles."""
        x, r = self.steps[0].x, self.steps[0].r
        for w, s in zip(self.weights, self.steps):
            x, r = decode_step.torch_layer(x, r, s.positions, s.batch_of, s.k_cache, s.v_cache, w, self.cfg, s.q_len, True)
        return x + r

    def forward_served(self, layers: list) -> torch.Tensor:
        """The same model on served kernels: `layers` are decode_step.ServedLayers on self.weights."""
        x, r = self.steps[0].x, self.steps[0].r
        for layer, s in zip(layers, self.steps):
            x, r = layer(x, r, s.positions, s.slots, s.paged, s.batch, s.q_len)
        return x + r

    def served_layers(self, c) -> list:
        attend, _ = decode_step.attention_kernel(c, self.cfg, 1, self.cfg.prefill, set())
        return [decode_step.ServedLayer(c, self.cfg, w, attend) for w in self.weights]


# ----------------------------------------------------------------------------
# Child roles: each runs in a fresh process, prints "phase NAME SECONDS" as each phase ends,
# "@" per kernel at hand, and a final JSON line {"result": ...} on stdout.


class Clock:
    """The phases of a child's start, one after the other: `imports` (from the process's start,
    t0: the parent's time.time() just before it spawned us), then each phase's own seconds;
    `ready` and `first_output` in seconds from the process's start."""

    def __init__(self, t0: float):
        self.t0 = self.last = t0
        self.phases: dict[str, float] = {}
        self.ready: float | None = None
        self.first_output: float | None = None

    def done(self, phase: str) -> float:
        """Ends `phase`; returns the seconds from the process's start."""
        now = time.time()
        self.phases[phase], self.last = now - self.last, now
        print(f"phase {phase} {now - self.t0:.3f}", flush=True)
        return now - self.t0

    def result(self) -> dict:
        return {"ready_s": self.ready, "first_output_s": self.first_output, "phases_s": self.phases}


def host_copy(out: torch.Tensor) -> torch.Tensor:
    """The output on the host, in float32: what `first output` waits for."""
    if out.is_cuda:
        torch.cuda.synchronize()
    return out.float().cpu()


def count_outcomes(kernels: list) -> dict:
    outcomes = {}
    for k in kernels:
        outcomes[k.outcome] = outcomes.get(k.outcome, 0) + 1
    return outcomes


def child_served(clock: Clock, cfg: LayerConfig, layers: int, early: tuple, wait_for_daemon: bool, out_path: Path, graphs: bool = False) -> dict:
    """`early`: the client and the PendingPrefetch send_early made before `import torch`."""
    c, pending = early
    clock.done("imports")
    model = Model(cfg, layers)
    clock.done("weights")
    if wait_for_daemon:  # the daemon was started with us: no socket yet, or not serving yet
        from devtools.launch import wait_serving

        wait_serving(c.address, timeout=600)
        clock.done("waiting_for_daemon")
    kernels = pending.result()  # sent before `import torch`; asked again now, so a daemon that came up since gets it
    for _ in kernels:
        print("@", flush=True)
    failed = [k for k in kernels if isinstance(k, Exception)]
    if failed:
        raise failed[0]
    served = model.served_layers(c)
    if not graphs:
        clock.ready = clock.done("kernels")
        with torch.inference_mode():
            torch.save(host_copy(model.forward_served(served)), out_path)
        clock.first_output = clock.done("forward")
        return {"outcomes": count_outcomes(kernels)}
    for layer in served:  # every range of a router before the capture
        layer.ready()
    clock.done("kernels")
    out = {}
    with torch.inference_mode():
        replay = decode_step.graphed(lambda: out.update(y=model.forward_served(served)))
        clock.ready = clock.done("capture")
        replay()
        torch.save(host_copy(out["y"]), out_path)
    clock.first_output = clock.done("forward")
    return {"outcomes": count_outcomes(kernels)}


def child_tilelang(clock: Clock, cfg: LayerConfig, layers: int) -> dict:
    from compile_speed import _tilelang_setup, _trace  # prints "@" per kernel compiled or loaded

    tilelang, _, counts = _tilelang_setup()
    clock.done("imports")
    Model(cfg, layers)
    clock.done("weights")
    traced = [_trace(spec) for spec in layer_specs(cfg)]
    targets = {json.dumps(target, sort_keys=True) for _, target in traced}
    assert len(targets) == 1, f"the layer's kernels have several TileLang targets: {targets}"
    kernels = tilelang.par_compile([func for func, _ in traced], target=traced[0][1])
    assert all(callable(k) for k in kernels)
    clock.ready = clock.done("kernels")
    return dict(counts)  # compiled, loaded: TileLang's disk cache misses and hits


def child_compile(clock: Clock, cfg: LayerConfig, layers: int, mode: str | None, socket: str, out_path: Path) -> dict:
    import client

    # A set TORCHINDUCTOR_CACHE_DIR (the cold variants') wins; otherwise the daemon's directory.
    cache = client.connect(socket).use_shared_inductor_cache()
    clock.done("imports")
    model = Model(cfg, layers)
    clock.done("weights")
    compiled = torch.compile(model.forward_torch, fullgraph=True, dynamic=False, mode=mode)
    with torch.inference_mode():
        torch.save(host_copy(compiled()), out_path)
        clock.ready = clock.first_output = clock.done("forward")  # tracing and compiling included
        if mode == "reduce-overhead" and torch.cuda.is_available():
            host_copy(compiled())  # the second call records the CUDA graph that later calls replay
            clock.ready = clock.done("graph")
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {"inductor_cache": cache.source, "fxgraph_hits": inductor["fxgraph_cache_hit"], "fxgraph_misses": inductor["fxgraph_cache_miss"]}


def child_eager(clock: Clock, cfg: LayerConfig, layers: int, out_path: Path) -> dict:
    clock.done("imports")
    model = Model(cfg, layers)
    clock.ready = clock.done("weights")
    with torch.inference_mode():
        torch.save(host_copy(model.forward_torch()), out_path)
    clock.first_output = clock.done("forward")
    return {}


def child_main(a: argparse.Namespace) -> None:
    clock = Clock(a.t0)
    cfg = LayerConfig(**json.loads(a.config))
    if a.role == "served":
        extra = child_served(clock, cfg, a.layers, EARLY or send_early(a), a.wait_for_daemon, a.out, a.graphs)
    elif a.role == "tilelang":
        extra = child_tilelang(clock, cfg, a.layers)
    elif a.role == "compile":
        extra = child_compile(clock, cfg, a.layers, COMPILE_MODES[a.compile_mode], a.socket, a.out)
    else:
        extra = child_eager(clock, cfg, a.layers, a.out)
    print(json.dumps({"result": {**clock.result(), **extra}}), flush=True)


# ----------------------------------------------------------------------------
# The parent: daemons, children, variants.


class Bench:
    """What every variant shares: the model's shape, the flags, a work directory, the sidecar daemon."""

    def __init__(self, args, cfg: LayerConfig):
        self.args, self.cfg, self.layers = args, cfg, args.layers
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="ks-startup-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.seq = iter(range(1, 1 << 30))
        self.daemons = []  # every daemon started, stopped by close()
        self._sidecar = None
        self.sidecar_has_kernels = False  # its cache holds the layer's kernels
        self.tilelang_cache = None  # a TILELANG_CACHE_DIR holding the layer's kernels, once one does

    def fresh_dir(self, name: str) -> Path:
        path = self.work / f"{name}-{next(self.seq)}"
        path.mkdir()
        return path

    def start_daemon(self, name: str, wait: bool = True, cache: Path | None = None):
        """A daemon on `cache` (default: a fresh one)."""
        from devtools.launch import DaemonProcess

        workers = ["--workers", str(self.args.workers)] if self.args.workers else []
        cache = cache or self.fresh_dir(f"{name}-cache")
        daemon = DaemonProcess(cache, "--target", self.cfg.target, *workers, log_path=cache.with_suffix(".log"))
        self.daemons.append(daemon)
        return daemon.start(wait=wait)

    def sidecar(self):
        """The host's daemon, up before the agents come: a fresh cache, every worker warmed up."""
        if self._sidecar is None:
            progress("sidecar", "starting a daemon on a fresh cache")
            self._sidecar = self.start_daemon("sidecar")
            self._sidecar.wait_workers_ready()
        return self._sidecar

    def quiet(self, timeout: float = 600) -> None:
        """Waits until the sidecar (if up) builds nothing and its workers are ready: a router's
        other ranges, built in the background after an agent took its kernels, would otherwise
        run beside the next variant's agent."""
        if self._sidecar is None:
            return
        deadline = time.monotonic() + timeout
        with self._sidecar.client() as c:
            while (stats := c.stats())["in_flight"] or stats["workers_ready"] < stats["workers"]:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the sidecar is still busy after {timeout:g} s: {stats['in_flight']} builds in flight")
                time.sleep(0.1)

    def close(self) -> None:
        for daemon in self.daemons:
            daemon.stop()
        if not self.args.work_dir:
            shutil.rmtree(self.work, ignore_errors=True)

    def child(self, name: str, role: str, env: dict | None = None, t0: float | None = None, **flags) -> dict:
        """Runs this script's `role` in a fresh process, relaying its progress; returns its result,
        with the path of its saved output (if any) as "output"."""
        out = self.work / f"{name}-{next(self.seq)}.pt"
        log = out.with_suffix(".log")
        args = [
            sys.executable,
            str(Path(__file__).resolve()),
            "_child",
            role,
            "--config",
            json.dumps(asdict(self.cfg)),
            "--layers",
            str(self.layers),
            "--out",
            str(out),
        ]
        if role == "served":
            flags["specs"] = json.dumps(layer_specs(self.cfg))
        for flag, value in flags.items():
            if value is True:
                args.append(f"--{flag.replace('_', '-')}")
            elif value not in (None, False):
                args += [f"--{flag.replace('_', '-')}", str(value)]
        t0 = time.time() if t0 is None else t0
        args += ["--t0", repr(t0)]
        with open(log, "w") as log_file:
            proc = subprocess.Popen(args, cwd=ROOT, env=child_env(env or {}), stdout=subprocess.PIPE, stderr=log_file, text=True)
            timed_out = threading.Event()

            def kill():
                timed_out.set()
                proc.kill()

            killer = threading.Timer(self.args.child_timeout, kill)
            killer.start()
            result, kernels = None, 0
            try:
                for line in proc.stdout:
                    if line.startswith("@"):
                        kernels += 1
                        progress(name, f"kernel {kernels}/{len(layer_specs(self.cfg))} at hand")
                    elif line.startswith("phase "):
                        _, phase, seconds = line.split()
                        progress(name, f"{phase} at {float(seconds):.2f} s")
                    elif line.startswith('{"result"'):
                        result = json.loads(line)["result"]
                rc = proc.wait()
            finally:
                killer.cancel()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if timed_out.is_set():
            raise RuntimeError(f"{name}: killed after {self.args.child_timeout:g} s (--child-timeout); its log: {log}")
        if rc != 0 or result is None:
            raise RuntimeError(f"{name}: the child exited with status {rc}; the end of {log}:\n{log.read_text()[-3000:]}")
        if out.exists():
            result["output"] = out
        return result


def child_env(changes: dict) -> dict:
    """Our environment with `changes`: a value of None unsets the variable."""
    env = {**os.environ, **changes}
    return {k: v for k, v in env.items() if v is not None}


def progress(name: str, what: str) -> None:
    print(f"[{name}] {what}", file=sys.stderr, flush=True)


def compiles(daemon) -> int:
    """The daemon's builds so far (an agent's early batch is answered as hits or joins once built)."""
    with daemon.client() as c:
        return c.stats()["compiles"]


def variant_served_cold(b: Bench) -> dict:
    daemon = b.sidecar()
    before = compiles(daemon)
    result = b.child("served_cold", "served", socket=daemon.socket)
    b.sidecar_has_kernels = True
    return {**result, "daemon_compiled": compiles(daemon) - before}


def variant_served_cold_from_serve(b: Bench) -> dict:
    t0 = time.time()
    daemon = b.start_daemon("from_serve", wait=False)
    try:
        result = b.child("served_cold_from_serve", "served", t0=t0, socket=daemon.socket, wait_for_daemon=True)
        return {**result, "daemon_compiled": compiles(daemon)}
    finally:
        daemon.stop()


def warm_sidecar(b: Bench, name: str):
    """The sidecar, its cache holding every kernel (filled untimed if served_cold did not run)."""
    daemon = b.sidecar()
    if not b.sidecar_has_kernels:
        progress(name, "filling the daemon's cache (untimed)")
        fill(daemon, b.cfg)
        b.sidecar_has_kernels = True
    return daemon


def fill(daemon, cfg) -> None:
    """Build the layer's kernels into the daemon's cache, loading none here."""
    with daemon.client() as c:
        failed = [k for k in c.prefetch(layer_specs(cfg), load=False) if isinstance(k, Exception)]
    if failed:
        raise failed[0]


def variant_served_warm(b: Bench) -> dict:
    return b.child("served_warm", "served", socket=warm_sidecar(b, "served_warm").socket)


def variant_served_warm_graphs(b: Bench) -> dict:
    return b.child("served_warm_graphs", "served", socket=warm_sidecar(b, "served_warm_graphs").socket, graphs=True)


def variant_tilelang_cold(b: Bench) -> dict:
    cache = b.fresh_dir("tilelang-cache")
    result = b.child("tilelang_cold", "tilelang", env={"TILELANG_CACHE_DIR": str(cache)})
    b.tilelang_cache = b.tilelang_cache or cache
    return result


def variant_tilelang_warm(b: Bench) -> dict:
    if b.tilelang_cache is None:
        progress("tilelang_warm", "filling TileLang's cache (untimed)")
        variant_tilelang_cold(b)
    return b.child("tilelang_warm", "tilelang", env={"TILELANG_CACHE_DIR": str(b.tilelang_cache)})


def compile_cold(b: Bench, mode: str) -> dict:
    cache = b.fresh_dir(f"inductor-{mode}")
    return b.child(f"compile_{mode}_cold", "compile", env={"TORCHINDUCTOR_CACHE_DIR": str(cache)}, socket=b.sidecar().socket, compile_mode=mode)


def compile_warm(b: Bench, mode: str) -> dict:
    """A first process fills the sidecar's Inductor directory (untimed); the second one is timed."""
    daemon = b.sidecar()
    name = f"compile_{mode}_warm"
    shared_env = {"TORCHINDUCTOR_CACHE_DIR": None, "TRITON_CACHE_DIR": None}  # unset: the daemon's directory applies
    progress(name, "a first process fills the shared Inductor directory (untimed)")
    b.child(f"{name}-first", "compile", env=shared_env, socket=daemon.socket, compile_mode=mode)
    return b.child(name, "compile", env=shared_env, socket=daemon.socket, compile_mode=mode)


def variant_eager(b: Bench) -> dict:
    return b.child("eager", "eager")


def variant_eager_beside_warm_up(b: Bench) -> dict:
    daemon = b.start_daemon("beside")
    try:
        return b.child("eager_beside_warm_up", "eager")
    finally:
        daemon.stop()


def variant_eager_beside_restart(b: Bench) -> dict:
    cache = b.fresh_dir("restart-cache")
    progress("eager_beside_restart", "filling a cache (untimed)")
    filler = b.start_daemon("restart", cache=cache)
    try:
        fill(filler, b.cfg)
    finally:
        filler.stop()
    daemon = b.start_daemon("restart", cache=cache)
    try:
        return b.child("eager_beside_restart", "eager")
    finally:
        daemon.stop()


def run_variant(b: Bench, name: str) -> dict:
    for mode in COMPILE_MODES:
        if name == f"compile_{mode}_cold":
            return compile_cold(b, mode)
        if name == f"compile_{mode}_warm":
            return compile_warm(b, mode)
    return globals()[f"variant_{name}"](b)


# ----------------------------------------------------------------------------
# Report.


def compare_outputs(rows: dict, tol: float) -> list[str]:
    """Each variant's output against eager's (relative error into the row); returns the mismatches."""
    problems = []
    if "output" not in rows.get("eager", {}):
        return problems
    reference = torch.load(rows["eager"]["output"])
    for name, row in rows.items():
        output = row.pop("output", None)
        if output is None or name == "eager":
            continue
        row["rel_error_vs_eager"] = err = decode_step.rel_error(torch.load(output), reference)
        if not err < tol:
            problems.append(f"{name}: output differs from eager's by {err:.2e} (relative; tolerance {tol:.0e})")
    rows["eager"].pop("output", None)
    return problems


def notes(row: dict) -> str:
    out = []
    if "outcomes" in row:
        out.append("kernels " + ", ".join(f"{n} {k}" for k, n in sorted(row["outcomes"].items())))
    if "daemon_compiled" in row:
        out.append(f"the daemon compiled {row['daemon_compiled']}")
    if "compiled" in row:
        out.append(f"TileLang compiled {row['compiled']}, loaded {row['loaded']}")
    if "fxgraph_hits" in row:
        out.append(f"Inductor dir: {row['inductor_cache']}, FX graph cache hits {row['fxgraph_hits']}, misses {row['fxgraph_misses']}")
    if "graph" in row["phases_s"]:
        out.append(f"its CUDA graph recorded in {row['phases_s']['graph']:.2f} s (a second forward)")
    if "waiting_for_daemon" in row["phases_s"]:
        out.append(f"waited {row['phases_s']['waiting_for_daemon']:.2f} s for the daemon")
    if "rel_error_vs_eager" in row:
        out.append(f"vs eager {row['rel_error_vs_eager']:.1e}")
    return "; ".join(out)


def table(report: dict) -> str:
    def s(value):
        return "-" if value is None else f"{value:.2f}"

    rows = [("variant", "ready s", "first output s", "imports s", "weights s", "kernels s", "forward s", "notes")]
    for name, r in report["variants"].items():
        if "error" in r:
            rows.append((name, "FAILED", "", "", "", "", "", r["error"].strip().splitlines()[-1][:120]))
            continue
        ph = r["phases_s"]
        rows.append((name, s(r["ready_s"]), s(r["first_output_s"]), s(ph["imports"]), s(ph["weights"]), s(ph.get("kernels")), s(ph.get("forward")), notes(r)))
    widths = [max(len(r[i]) for r in rows) for i in range(7)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r[:7], widths))) + "  " + r[7] for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    cfg = report["config"]
    head = (
        f"{report['layers']} layers (hidden {cfg['hidden']}, {cfg['heads']}/{cfg['kv_heads']} heads of {cfg['head_dim']}, ffn {cfg['ffn']}), "
        f"{cfg['prefill']}-token prompt, {cfg['dtype']}, target {cfg['target']}; {report['device']}, {report['cpu_count']} CPUs; "
        "seconds from the agent process's start"
    )
    return "\n".join([head, *lines])


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed (pip install '.[bench]'); no plot written", file=sys.stderr)
        return
    rows = {name: r for name, r in report["variants"].items() if "error" not in r}
    names = list(rows)[::-1]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(names) + 1.5))
    left = [0.0] * len(names)
    colors = {"imports": "tab:gray", "weights": "tab:olive", "waiting_for_daemon": "tab:purple", "kernels": "tab:blue", "forward": "tab:green"}
    for phase, color in colors.items():
        widths = [rows[n]["phases_s"].get(phase, 0.0) for n in names]
        ax.barh(names, widths, left=left, color=color, label=phase.replace("_", " "))
        left = [a + w for a, w in zip(left, widths)]
    for i, n in enumerate(names):
        r = rows[n]
        label = f" ready {r['ready_s']:.2f}s" + (f", first output {r['first_output_s']:.2f}s" if r["first_output_s"] is not None else "")
        ax.annotate(label, (left[i], i), va="center", fontsize=8)
    ax.set_xlabel("seconds from the agent process's start (lower is better)")
    cfg = report["config"]
    ax.set_title(f"{report['layers']} layers, hidden {cfg['hidden']}, {cfg['dtype']}, target {cfg['target']}, {report['device']}")
    ax.legend(loc="lower right", fontsize=8)
    ax.margins(x=0.35)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}", file=sys.stderr)


def config_for(args) -> LayerConfig:
    cuda = torch.cuda.is_available()
    if not cuda and not args.small:
        sys.exit(
            "benchmark/startup.py needs a CUDA GPU for Llama-3-8B-shaped layers (torch.cuda.is_available() is False); "
            "--small runs tiny layers on the CPU (float32, target 'c')"
        )
    cfg = decode_step.SMALL if args.small else LayerConfig()
    if cuda:
        cfg = replace(cfg, dtype=args.dtype or "bfloat16", target="auto")
    elif args.dtype:
        sys.exit("on the CPU (target 'c') the layers run in float32; leave --dtype out")
    if args.prompt_tokens:
        cfg = replace(cfg, prefill=args.prompt_tokens)
    # The rope table covers the prompt; decode_step's kv_len (decode steps) plays no part here.
    return replace(cfg, kv_len=cfg.prefill)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_child"]:
        child_main(CHILD or child_args(argv[1:]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2); they share their kernels")
    p.add_argument("--prompt-tokens", type=int, help="tokens of the prompt the first output is computed on (default 2048; 48 with --small)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--small", action="store_true", help="tiny layers; without a GPU, float32 on target 'c' (a smoke test for CI)")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), help="on a GPU (default bfloat16)")
    p.add_argument("--workers", type=int, help="the daemons' compile workers (default: the daemon's own, the CPU quota)")
    p.add_argument("--child-timeout", type=float, default=1800, help="seconds before a variant's process is killed (default 1800)")
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("--plot", help="write a PNG bar chart here (needs matplotlib)")
    p.add_argument("--work-dir", help="where caches, outputs and logs go (default: a new temp dir, removed at the end)")
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        p.error(f"unknown variant(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(VARIANTS)}")
    if args.layers < 1:
        p.error("--layers must be at least 1")
    cfg = config_for(args)
    if device_of(cfg) != "cuda" and "served_warm_graphs" in variants:
        variants.remove("served_warm_graphs")  # CUDA graphs: nothing to capture on the CPU
        if not variants:
            p.error("served_warm_graphs needs a CUDA device")

    compile_tree()  # as an installed client's are (devtools/bytecode.py)
    b = Bench(args, cfg)
    print(
        f"startup: {args.layers} layers, {len(layer_specs(cfg))} kernels, target {cfg.target}, variants {', '.join(variants)}; work dir {b.work}",
        file=sys.stderr,
    )
    rows, failed = {}, []
    try:
        for name in sorted(variants, key=VARIANTS.index):  # cold before warm: warm variants reuse the caches
            try:
                b.quiet()
                load_before = os.getloadavg()[0]
                rows[name] = run_variant(b, name)
                # Other work on the host skews every number; the load average shows whether there was any.
                rows[name]["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            except Exception as exc:  # one broken variant should not throw away the others' minutes
                print(f"variant {name} failed: {exc}", file=sys.stderr)
                failed.append(name)
                rows[name] = {"error": str(exc)[-2000:]}
        problems = compare_outputs(rows, tol=1e-4 if cfg.dtype == "float32" else 5e-2)
    finally:
        b.close()
    report = {
        "layers": args.layers,
        "kernels": len(layer_specs(cfg)),
        "config": asdict(cfg),
        "small": args.small,
        "device": torch.cuda.get_device_name() if device_of(cfg) == "cuda" else "cpu",
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "host": platform.node(),
        "python": platform.python_version(),
        "variants": rows,
        "problems": problems,
    }
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    if failed:
        print(f"failed variants: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or problems else 0


if __name__ == "__main__":
    sys.exit(main())
