"""benchmark/compile_speed.py: the zoo's shape, and a --quick run's JSON schema and invariants.

Timings are never asserted: they depend on the machine. What must hold on any
machine: every mode built every kernel, cold modes compiled each kernel once,
warm modes compiled nothing, and the daemon compiled each kernel once however
many agents asked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmark" / "compile_speed.py"
MODES = (
    "baseline",
    "tilelang",
    "service",
    "from_serve",
    "layer",
    "layer_from_serve",
    "stampede_tilelang",
    "stampede_service",
    "warm_tilelang",
    "warm_service",
    "service_under_load",
)

sys.path.insert(0, str(ROOT / "benchmark"))
import zoo  # noqa: E402


def _key(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True)


@pytest.mark.parametrize("target", ["c", "sm_90a"])
def test_zoo_is_the_published_one(target):
    specs = zoo.build_zoo(target, scale=3)
    assert len(specs) == 126
    assert len({_key(s) for s in specs}) == 126  # every kernel distinct
    unit = specs[:42]
    counts = {kind: sum(s["kind"] == kind for s in unit) for kind in ("gemm", "attention", "rmsnorm", "swiglu", "softmax")}
    assert counts == {"gemm": 24, "attention": 6, "rmsnorm": 4, "swiglu": 4, "softmax": 4}
    rows = [s.get("M", s.get("seq_len")) for s in specs]
    assert rows == [256 + 128 * k for k in range(126)]
    # qkv N = hidden + 2 * kv_heads * head_dim, from the real configs
    assert {(s["N"], s["K"]) for s in unit if s["kind"] == "gemm"} == {
        (3072, 2048),
        (5632, 2048),
        (4608, 3584),
        (18944, 3584),
        (6144, 4096),
        (14336, 4096),
        (7168, 5120),
        (13824, 5120),
    }
    if target == "c":
        assert {s["dtype"] for s in specs} == {"float32"}


def test_zoo_gemms_are_served_by_shared_builds_on_cuda():
    import compile_speed

    # One build per GEMM (K, tiling) with M and N left to run time, one per attention config with
    # seq_len left to run time, one per row kernel: 12 + 6 + 36; CPU kernels never share.
    assert compile_speed._builds_needed(zoo.build_zoo("sm_90a", scale=3)) == (54, 90)
    assert compile_speed._builds_needed(zoo.build_zoo("c", scale=3)) == (126, 0)


def test_salt_shares_no_kernel_with_other_salts():
    seen = [{_key(s) for s in zoo.build_zoo("c", scale=2, salt=salt)} for salt in range(3)]
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2]) and not (seen[0] & seen[2])


def test_unknown_mode_is_refused():
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--modes", "service,nope"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "nope" in out.stderr


def test_quick_run_builds_every_kernel_in_every_mode(tmp_path):
    out_json = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out_json), "--work-dir", str(tmp_path / "work")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "stampede_service" in proc.stdout  # the table
    report = json.loads(out_json.read_text())

    n = report["kernels"]
    assert n == 6 and report["target"] == "c" and report["quick"] is True
    assert isinstance(report["cpu_quota"], int) and report["cpu_quota"] >= 1
    assert set(report["modes"]) == set(MODES)
    layer = len(zoo.llama_layer("c"))
    for name, mode in report["modes"].items():
        assert "error" not in mode, f"{name} failed: {mode.get('error')}"
        assert isinstance(mode["wall_s"], float) and mode["wall_s"] > 0, name
        assert isinstance(mode["compiles"], int), name
        want = layer if name.startswith("layer") else n
        assert mode["kernels"] == want, f"{name} built {mode['kernels']} of {want} kernels"

    modes = report["modes"]
    for name in ("baseline", "tilelang", "service", "from_serve", "service_under_load"):  # each on a fresh cache
        assert modes[name]["compiles"] == n, name
    for name in ("layer", "layer_from_serve"):  # the layer's kernels, each built once on a fresh cache
        assert modes[name]["compiles"] == layer, name
    assert 0 < modes["layer"]["prefetch_s"] and modes["layer_from_serve"]["wall_s"] >= modes["layer_from_serve"]["startup_s"]
    for name in ("warm_tilelang", "warm_service"):
        assert modes[name]["compiles"] == 0, name
    # The point of the service: one compile per kernel however many agents ask.
    assert modes["stampede_service"]["compiles"] == n and modes["stampede_service"]["derived"] == 0  # CPU kernels never share a build
    # TileLang alone: at least once per kernel, at most once per kernel per agent.
    assert n <= modes["stampede_tilelang"]["compiles"] <= n * report["processes"]
    assert len(modes["stampede_tilelang"]["per_process"]) == report["processes"]
    assert all(p["compiled"] + p["loaded"] == n for p in modes["stampede_tilelang"]["per_process"])

    eff = modes["service"]["parallel_efficiency"]
    assert isinstance(eff, float) and eff > 0
    assert modes["service"]["workers"] >= 1
    for name in ("first_s", "all_s", "first_after_import_s", "all_after_import_s"):
        assert modes["warm_service"][name] >= 0 and modes["warm_tilelang"][name] >= 0
    assert modes["service_under_load"]["hit_requests"] > 0
    serve = modes["from_serve"]
    assert 0 < serve["startup_s"] <= serve["first_from_start_s"] <= serve["all_from_start_s"] and serve["ready_s"] > 0
    assert modes["tilelang"]["first_from_start_s"] <= modes["tilelang"]["all_from_start_s"]
    assert set(modes["service"]["idle_s"]) == {"ramp", "between", "tail", "workers_used"}
    assert set(report["goals"]) >= {"service_parallel_efficiency", "stampede_service_compiles_once", "service_throughput_under_load"}


def test_hit_load_runs_every_phase_without_errors(tmp_path):
    out_json = tmp_path / "hits.json"
    args = [
        "--requests",
        "400",
        "--threads",
        "4",
        "--direct-processes",
        "1,2",
        "--kernels",
        "2",
        "--hot",
        "2",
        "--cold",
        "2",
        "--max-entries",
        "3",
        "--cold-fraction",
        "0.05",
        "--json",
        str(out_json),
    ]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark" / "hit_load.py"), *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out_json.read_text())
    assert set(report) == {"hits", "direct", "direct_2p", "floor", "evict"}
    for phase, r in report.items():
        assert r["requests"] == 400 and r["errors"] == 0 and r["wrong"] == 0, (phase, r)
        assert r["throughput_rps"] > 0 and r["p50_ms"] <= r["p99_ms"]
    assert report["hits"]["daemon"]["hits"] == 400 and report["hits"]["daemon"]["compiles"] == 0
    for phase in ("direct", "direct_2p"):  # no GetKernel reached the daemon
        assert (report[phase]["daemon"]["hits"], report[phase]["daemon"]["misses"], report[phase]["checked"]) == (0, 0, 8), phase
    assert report["evict"]["daemon"]["evictions"] > 0  # cold kernels pushed others out of a 3-entry budget


def test_fleet_benchmark_builds_each_kernel_once_and_fetches_every_one(tmp_path):
    from tests.marks import require_redis_server

    require_redis_server()
    out_json = tmp_path / "fleet.json"
    args = ["--quick", "--hosts", "2", "--modes", "fleet,fetch", "--fetches", "12", "--json", str(out_json), "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark" / "fleet.py"), *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(out_json.read_text())
    n = report["kernels"]
    assert n == 6 and report["hosts"] == 2
    fleet, fetch = report["modes"]["fleet"], report["modes"]["fetch"]
    assert fleet["compiles"] == n and fleet["remote_hits"] == n and fleet["remote_errors"] == 0  # one build each, the other host read it
    assert fetch["samples"] >= 12 and 0 < fetch["p50_ms"] <= fetch["p99_ms"] and fetch["get_kernel_samples"] == n
    assert report["goals"]["fleet_compiles_once"]["met"]


# ----- benchmark/decode_step.py: its layer and checks, on the CPU (timing needs a GPU)


def test_decode_step_checks_a_served_layer_against_torch_on_the_cpu(shared_daemon):
    import argparse

    import decode_step

    cfg = decode_step.LayerConfig(hidden=64, heads=2, kv_heads=1, head_dim=32, ffn=96, kv_len=21, prefill=12, page_size=16, dtype="float32", target="c")
    c = shared_daemon.client()
    kinds = {k["name"] for k in c.kinds()}
    args = argparse.Namespace(check_only=True)
    w = decode_step.make_weights(cfg, "cpu")
    for residual in ("gemm", "norm"):
        cfg = decode_step.replace(cfg, residual=residual)
        for batch, q_len in ((3, 1), (1, cfg.prefill)):
            row = decode_step.run_case(c, cfg, w, batch, q_len, kinds, args, None)
            assert row["problems"] == [], row
    c.close()


def test_decode_step_without_cuda_says_how_to_check_on_the_cpu():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmark" / "decode_step.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert out.returncode != 0 and "needs a CUDA GPU" in out.stderr and "--small --check-only" in out.stderr


# ----- benchmark/startup.py: a fresh agent's start to a ready model, on the CPU

STARTUP = ROOT / "benchmark" / "startup.py"
# One torch.compile variant of four, for time (a cold compile takes 17 s on 2 cores, a warm one two processes); ~65 s in all.
STARTUP_VARIANTS = ("served_cold", "served_cold_from_serve", "served_warm", "tilelang_cold", "tilelang_warm", "compile_default_cold", "eager")


def test_startup_small_times_every_variant_and_served_outputs_match_eager(tmp_path):
    out_json = tmp_path / "startup.json"
    args = ["--small", "--workers", "2", "--variants", ",".join(STARTUP_VARIANTS), "--json", str(out_json), "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(
        [sys.executable, str(STARTUP), *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "served_cold_from_serve" in proc.stdout  # the table
    report = json.loads(out_json.read_text())
    assert report["layers"] == 2 and report["kernels"] == 9 and report["problems"] == []
    assert report["config"]["target"] == "c" and report["config"]["dtype"] == "float32"
    variants = report["variants"]
    assert set(variants) == set(STARTUP_VARIANTS)
    for name, v in variants.items():
        assert "error" not in v, f"{name} failed: {v.get('error')}"
        assert v["ready_s"] > 0 and all(seconds >= 0 for seconds in v["phases_s"].values()), (name, v)
        assert v["phases_s"]["imports"] > 0, name
        if not name.startswith("tilelang"):  # TileLang's variants stop at ready
            assert v["first_output_s"] >= v["ready_s"], (name, v)
    for name in ("served_cold", "served_cold_from_serve", "served_warm", "compile_default_cold"):
        assert variants[name]["rel_error_vs_eager"] < 1e-4, name
    compiled = variants["compile_default_cold"]
    assert compiled["ready_s"] == compiled["first_output_s"] and (compiled["inductor_cache"], compiled["fxgraph_misses"]) == ("environment", 1)
    # The agent sends its batch before `import torch` and takes it later: what the take sees of
    # kernels built meanwhile is a hit or a join; the daemon's count says each was compiled once.
    for name in ("served_cold", "served_cold_from_serve"):
        assert sum(variants[name]["outcomes"].values()) == 9 and set(variants[name]["outcomes"]) <= {"compiled", "joined", "hit"}, name
        assert variants[name]["daemon_compiled"] == 9, name
    assert variants["served_warm"]["outcomes"] == {"hit": 9}
    assert (variants["tilelang_cold"]["compiled"], variants["tilelang_warm"]["compiled"], variants["tilelang_warm"]["loaded"]) == (9, 0, 9)
    assert "waiting_for_daemon" in variants["served_cold_from_serve"]["phases_s"]


def test_startup_refuses_an_unknown_variant():
    out = subprocess.run([sys.executable, str(STARTUP), "--small", "--variants", "served_cold,nope"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "nope" in out.stderr


def test_hf_models_small_checks_every_variant_and_times_reduce_overhead_again_in_a_fresh_process(tmp_path):
    """benchmark/hf_models.py --small, the prefill: each variant's output against eager's, and
    compile-ro made ready again in a fresh process of the script (fresh_ready_s; the graphs
    variant needs CUDA)."""
    pytest.importorskip("transformers")
    out_json = tmp_path / "hf.json"
    args = ["--small", "--only", "prefill", "--reps", "1", "--rounds", "1", "--json", str(out_json)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmark" / "hf_models.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = {r["variant"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert set(rows) == {"eager", "compile", "compile-ro", "kernel-service"}
    assert all(r["workload"] == "llama prefill" and r["max_diff"] < 1e-4 and r["ready_s"] > 0 for r in rows.values()), rows
    assert rows["kernel-service"]["swapped"] > 0 and not rows["kernel-service"]["fallbacks"]
    assert rows["compile-ro"]["fresh_ready_s"] > 0
    assert [v for v, r in rows.items() if "fresh_ready_s" in r] == ["compile-ro"]
    assert "in a fresh process" in proc.stdout


def test_user_kernels_case_table_covers_issue_30s_styles(tmp_path):
    """benchmark/user_kernels.py (GPU only): its case table and the daemons it would start."""
    import user_kernels

    table = user_kernels.case_table()
    assert len(table) >= 8 and len({c["name"] for c in table}) == len(table)
    styles = " ".join(s for c in table for s in c["styles"])
    for style in ("plain", "eager", "autotuned", "in-place", "several per module", "TL_ENABLE_FAST_MATH", "TL_DISABLE_WARP_SPECIALIZED"):
        assert style in styles, style
    assert all(c["module"] in user_kernels.EXAMPLES for c in table)
    cases = user_kernels._cases()
    groups = user_kernels.daemon_groups(cases)
    assert sorted(m for g in groups for m in g) == sorted({c.module for c in cases})
    for group in groups:  # no kind name served by two modules of one daemon
        names = [{c.kind for c in cases if c.module == m} for m in group]
        assert all(not (a & b) for i, a in enumerate(names) for b in names[i + 1 :])
    script = ROOT / "benchmark" / "user_kernels.py"
    listed = subprocess.run([sys.executable, str(script), "--list"], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert listed.returncode == 0 and all(c["name"] in listed.stdout for c in table)
    missing = subprocess.run(
        [sys.executable, str(script), "--examples", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert missing.returncode == 2 and "example_gemm.py" in missing.stderr


def test_tilelang_cache_small_runs_every_part_on_the_cpu(tmp_path):
    """benchmark/tilelang_cache.py --small (issue 46), every part: the daemon compiles each cold
    kernel once for all processes while TileLang alone compiles them in each; warm processes
    compile nothing; par_compile builds the quick zoo; served kernels give TileLang's own source
    and outputs. Timings are not asserted."""
    out = tmp_path / "tilelang_cache.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmark" / "tilelang_cache.py"),
            "--small",
            "--processes",
            "2",
            "--rounds",
            "1",
            "--json",
            str(out),
            "--work-dir",
            str(tmp_path / "w"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["cold_tilelang_1"]["compiles"] == 8
    assert report["cold_tilelang_2"]["compiles"] >= 8
    served = report["cold_service_2"]
    assert served["compiles"] == 8 and served["tilelang_compiles_in_processes"] == 0
    assert all(r["served"] and not r["warnings"] for r in served["per_process"])
    assert report["warm"]["tilelang"]["compiled"] == 0 and report["warm"]["service"]["compiled"] == 0
    par = report["par_compile"]
    assert par["tilelang"]["built"] == par["service"]["built"] == par["service"]["compiles"] == len(zoo.QUICK)
    assert report["speed"]["same_source"] and report["speed"]["same_output"]
    assert report["goals"]["cold: service compiles each kernel once"]
