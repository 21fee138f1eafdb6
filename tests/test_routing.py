"""One callable over several builds (KernelKind.dispatch, abi.dispatch) and per-call
workspaces (KernelKind.scratch, abi.scratch), through a real daemon on target "c"
with the test kind tests/routed_kind.py: Y = 2X from the build for M <= 4, 3X
(through a workspace) from the other, so every output shows which build ran."""

import json
import threading

import pytest
import torch

import client
import kernels
from compile_service import bundle
from compile_service.store import LocalStore
from client import loader
from proto import abi
from tests import routed_kind  # noqa: F401 - registers routed_scale in this process too

N = 8


@pytest.fixture
def routed(make_daemon):
    return make_daemon("--kernel-module", "tests.routed_kind")


def test_one_callable_routes_each_call_to_the_build_of_its_range(routed):
    c = routed.client()
    k = c.get_kernel("routed_scale", target="c", M=None, N=N).ready()
    assert [(upto, spec["params"]["schedule"]) for upto, spec in k.dispatch] == [(4, "small"), (None, "large")]
    assert k.abi["dispatch"]["dim"] == "M" and k.route(4).spec["params"]["schedule"] == "small" and k.route(5).spec["params"]["schedule"] == "large"
    for m, factor in ((1, 2), (4, 2), (5, 3), (37, 3)):
        x = torch.randn(m, N)
        torch.testing.assert_close(k(x), x * factor)
        out = torch.empty(m, N)
        assert k(x, out=out) is out
        torch.testing.assert_close(out, x * factor)
    # Through the torch op (what torch.compile and export call) too.
    x = torch.randn(9, N)
    torch.testing.assert_close(torch.ops.kernel_service.routed_scale(k.spec_json, [x]), x * 3)
    assert c.stats()["compiles"] == 2  # one build per range; the router itself is a copy


def test_a_cold_router_is_ready_after_one_build_and_routes_to_the_others_once_built(make_daemon, tmp_path):
    gate = tmp_path / "gate"
    d = make_daemon("--kernel-module", "tests.routed_kind", env={"ROUTED_SMALL_GATE": str(gate)})
    k = d.client().get_kernel("routed_scale", target="c", M=None, N=N)  # the small build waits at its gate
    x = torch.randn(2, N)
    torch.testing.assert_close(k(x), x * 3)  # the last range's build stands in: correct for every M
    with pytest.raises(TimeoutError, match="did not load within"):
        k.ready(timeout=0.5)
    gate.touch()
    assert k.ready(timeout=120) is k
    torch.testing.assert_close(k(x), x * 2)
    assert k.route(2).spec["params"]["schedule"] == "small"
    assert d.client().stats()["compiles"] == 2


def test_a_router_whose_other_build_never_comes_keeps_serving_and_ready_says_why(make_daemon, tmp_path):
    d = make_daemon("--kernel-module", "tests.routed_kind", env={"ROUTED_SMALL_GATE": str(tmp_path / "gate")})  # the gate never opens
    k = d.client().get_kernel("routed_scale", target="c", M=None, N=N)
    d.stop()  # the small build's answer never comes
    with pytest.raises(client.KernelServiceError):
        k.ready(timeout=120)
    x = torch.randn(2, N)
    torch.testing.assert_close(k(x), x * 3)  # still the last range's build, correct for every M
    assert k.route(2).spec["params"]["schedule"] == "large"


def test_a_warm_router_answers_after_one_load_and_loads_its_other_builds_in_the_background(routed):
    routed.client().get_kernel("routed_scale", target="c", M=None, N=N).ready()  # the cache holds both builds
    c = routed.client()

    def opened(spec: dict) -> loader.Kernel:
        return loader.open_published(*c.find(kernels.canonicalize(spec["kind"], spec["params"], spec["target"])))

    router = opened(json.loads(kernels.canonicalize("routed_scale", {"M": None, "N": N}, "c").to_json()))
    small_may_load, asked = threading.Event(), []

    def now(spec: dict) -> loader.Kernel:
        if spec["params"]["schedule"] == "small":
            small_may_load.wait(60)
        return opened(spec)

    router.load_routes(now, asked.append)
    assert router.route(2).spec["params"]["schedule"] == "large"  # answered before the small build loaded
    small_may_load.set()
    router.ready(timeout=60)
    assert router.route(2).spec["params"]["schedule"] == "small" and not asked  # from the cache, nothing fetched
    x = torch.randn(2, N)
    torch.testing.assert_close(router(x), x * 2)


def test_a_static_size_is_served_by_its_ranges_build(routed):
    c = routed.client()
    small, large = c.get_kernel("routed_scale", target="c", M=3, N=N), c.get_kernel("routed_scale", target="c", M=100, N=N)
    assert small.shared_build["spec"]["params"] == {"M": None, "N": N, "schedule": "small"} and small.abi["fixed"] == {"M": 3}
    assert large.shared_build["spec"]["params"] == {"M": None, "N": N, "schedule": "large"} and large.abi["fixed"] == {"M": 100}
    x = torch.randn(3, N)
    torch.testing.assert_close(small(x), x * 2)
    with pytest.raises(ValueError, match="M=3"):
        small(torch.randn(4, N))
    c.get_kernel("routed_scale", target="c", M=None, N=N)  # the router reuses both builds
    stats = c.stats()
    assert (stats["compiles"], stats["derived"]) == (2, 3)


def test_scratch_is_allocated_per_call_and_never_an_input_or_output(routed):
    k = routed.client().get_kernel("routed_scale", target="c", M=None, N=N, schedule="large")
    assert k.abi["scratch"] == [1] and k.input_names == ["X"] and k.output_names == ["Y"]
    assert "W" not in k.__doc__
    x = torch.randn(6, N)
    torch.testing.assert_close(k(x), x * 3)


def test_a_bundle_of_a_router_carries_every_build_it_routes_to(routed, tmp_path, make_daemon):
    routed.client().get_kernel("routed_scale", target="c", M=None, N=N).ready()
    routed.stop()
    spec = kernels.canonicalize("routed_scale", {"M": None, "N": N}, "c")
    out = tmp_path / "b.tar"
    assert bundle.export(LocalStore(routed.cache_dir), [spec], "none", out)["entries"] == 3
    serving = make_daemon("--no-compile", "--kernel-module", "tests.routed_kind", cache_dir=tmp_path / "fresh")
    bundle.import_(LocalStore(serving.cache_dir), out, "none", bundle.Policy(trust_unsigned=True))
    k = serving.client(strict=True).get_kernel("routed_scale", target="c", M=None, N=N)
    x = torch.randn(2, N)
    torch.testing.assert_close(k(x), x * 2)


def test_a_router_is_not_ready_until_every_build_is_there(routed, make_daemon):
    routed.client().get_kernel("routed_scale", target="c", M=None, N=N, schedule="small")
    routed.stop()
    serving = make_daemon("--no-compile", "--kernel-module", "tests.routed_kind", cache_dir=routed.cache_dir)
    with pytest.raises(client.KernelNotReady):
        serving.client(strict=True).get_kernel("routed_scale", target="c", M=None, N=N)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"scratch": [1, 1]}, "distinct"),
        ({"scratch": [2]}, "must not share"),
        ({"writes": [0, 0]}, "distinct"),
        ({"writes": [2]}, "must name inputs"),
        ({"writes": [1], "scratch": [1]}, "must name inputs"),
        ({"dispatch": {"dim": "K", "routes": []}}, "runtime dims"),
        ({"dispatch": {"dim": "M", "routes": [{"upto": 4, "spec": {"kind": "x", "params": {}, "target": "c"}}]}}, "end with null"),
        ({"dispatch": {"dim": "M", "routes": [{"upto": None, "spec": "x"}]}}, "spec"),
    ],
)
def test_the_abi_refuses_malformed_scratch_writes_and_routes(change, message):
    base = {
        "loader": "c",
        "symbol": "call",
        "device": "cpu",
        "outputs": [2],
        "dynamic": [{"name": "M", "dtype": "int32"}],
        "params": [{"name": n, "dtype": "float32", "shape": ["M", 8]} for n in ("X", "W", "Y")],
    }
    abi.check(base)
    with pytest.raises(abi.AbiError, match=message):
        abi.check({**base, **change})


def test_dispatch_tables_are_checked():
    kind = kernels.get_kind("routed_scale")
    spec = kernels.canonicalize("routed_scale", {"M": None, "N": N}, "c")
    dim, builds = kind.routes(spec)
    assert dim == "M" and [b.params["schedule"] for _, b in builds] == ["small", "large"]
    assert kind.routes(kernels.canonicalize("routed_scale", {"M": 3, "N": N}, "c")) is None
    original = routed_kind.RANGES
    try:
        routed_kind.RANGES = ((4, {"schedule": "small"}),)  # no open-ended last range
        with pytest.raises(TypeError, match="ending with None"):
            kind.routes(spec)
        routed_kind.RANGES = ((4, {"schedule": "small"}), (None, {}))  # a range that routes again
        with pytest.raises(TypeError, match="leave the choice open"):
            kind.routes(spec)
    finally:
        routed_kind.RANGES = original


def test_a_prefetched_router_loads_its_builds(routed):
    c = routed.client()
    (k,) = c.prefetch([{"kind": "routed_scale", "target": "c", "M": None, "N": N}])
    assert c.get_kernel("routed_scale", target="c", M=None, N=N) is k  # the memo: no second load
    k.ready(timeout=120)
    for m, factor in ((2, 2), (5, 3)):
        x = torch.randn(m, N)
        torch.testing.assert_close(k(x), x * factor)


def test_the_demo_says_a_router_is_one(routed):
    from devtools.demo import how_served

    events = []
    routed.client().prefetch([{"kind": "routed_scale", "target": "c", "M": None, "N": N}], load=False, progress=lambda done, total, e: events.append(e))
    assert how_served(events[0]["kernel"]) == "compiled as a router over 2 builds by M range"
