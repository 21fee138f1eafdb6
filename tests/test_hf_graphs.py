"""kernelize(graphs=...): a served model's forward captured in CUDA graphs per (batch, tokens) bucket.

On the CPU: what runs inside a capture (a bucket-padded call, with no host read of any tensor)
gives the call's own outputs, and asking for graphs where there is no CUDA says why (or raises
under strict). On a GPU: the capture itself, replays, and the calls no bucket serves.
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
hf = pytest.importorskip("client.integrations.hf")

from client.integrations.hf import graphs  # noqa: E402
from devtools.launch import DaemonProcess  # noqa: E402
from tests.marks import needs_gpu  # noqa: E402
from tests.test_hf import BERT, VOCAB, llama, modernbert, own_rotary  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.modernbert import modeling_modernbert  # noqa: E402


def start_daemon(tmp_path_factory, *flags):
    base = tmp_path_factory.mktemp("graphs-daemon")
    d = DaemonProcess(base / "cache", *flags, workers=2, log_path=base / "daemon.log").start(timeout=300)
    return d, d.client()


@pytest.fixture(scope="module")
def cpu_daemon(tmp_path_factory):
    d, c = start_daemon(tmp_path_factory, "--target", "c")
    yield c
    c.close()
    d.stop()


@contextlib.contextmanager
def no_host_reads():
    """Any read of a tensor's values on the host (what a capture cannot do) fails the test."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("__bool__", "item", "tolist"):
            mp.setattr(torch.Tensor, name, _no_host_read)
        mp.setattr(torch, "equal", _no_host_read)
        yield


def _no_host_read(*args, **kwargs):
    raise AssertionError("a tensor was read on the host inside the captured forward")


def test_the_captured_forward_reads_nothing_on_the_host_and_matches(cpu_daemon):
    """A call padded up to its bucket (batch and tokens), run as a capture runs it: the valid
    positions equal transformers' eager forward, full and sliding layers alike."""
    ref = modernbert()
    model = hf.kernelize(copy.deepcopy(ref), client=cpu_daemon, backend="kernel-service")
    ids = torch.randint(3, VOCAB, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    assert graphs._one_run_per_row(mask) and not graphs._one_run_per_row(torch.tensor([[1, 0, 1]]))
    g = graphs._Graph(4, 16, torch.device("cpu"), BERT["pad_token_id"])
    g.load(ids, mask)
    with torch.no_grad(), no_host_reads():
        g.out = graphs.run(model.forward, g, {})
    out = g.outputs(3, 12).last_hidden_state
    with torch.inference_mode(), own_rotary(modeling_modernbert):
        want = ref(ids, attention_mask=mask).last_hidden_state
    assert out.shape == want.shape
    valid = mask.bool()
    torch.testing.assert_close(out[valid], want[valid], atol=2e-5, rtol=1e-4)


def test_a_causal_lm_s_head_runs_after_what_its_graph_captures(cpu_daemon):
    """A causal LM's graph leaves its head out (the logits it holds are the hidden states the head
    reads), and a call's logits are the head's output of its own rows: the forward's logits, in a
    tensor of the call's own. A model without a head (an encoder) has nothing to leave out."""
    model = hf.kernelize(llama(), client=cpu_daemon, backend="kernel-service")
    g = graphs._Graph(2, 16, torch.device("cpu"), 0)
    g.load(torch.randint(3, VOCAB, (2, 11)), None)
    with torch.no_grad(), no_host_reads():
        whole = graphs.run(model.forward, g, {"use_cache": False})
        head, why = graphs._head(model, whole)
        with graphs._without(head):
            g.out = graphs.run(model.forward, g, {"use_cache": False})
    assert head is model.lm_head and not why and type(model.lm_head).forward is torch.nn.Linear.forward and "forward" not in vars(head)
    assert g.out.logits.shape == (2, 16, model.config.hidden_size)
    g.head = head
    with torch.inference_mode():
        got = g.outputs(1, 9).logits
    assert got.shape == (1, 9, VOCAB) and got.untyped_storage().data_ptr() != g.out.logits.untyped_storage().data_ptr()
    torch.testing.assert_close(got, whole.logits[:1, :9], atol=1e-6, rtol=1e-5)
    assert graphs._head(hf.kernelize(modernbert(), client=cpu_daemon, backend="kernel-service"), whole) == (None, "")


class Softcapped(modeling_llama.LlamaForCausalLM):
    """Gemma 2's final soft-capping: the logits change after the head."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = torch.tanh(out.logits / 30.0) * 30.0
        return out


class Upcast(modeling_llama.LlamaForCausalLM):
    """Logits recast after the head (as models that upcast them to float32 do)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits.double()
        return out


@pytest.mark.parametrize(
    "cls, why",
    [
        (modeling_llama.LlamaForCausalLM, ""),
        (Softcapped, "its logits after the replay differ from the whole forward's"),
        (Upcast, "the forward without it fails: RuntimeError"),
    ],
)
def test_a_head_is_left_out_only_where_the_logits_come_out_the_same(cls, why):
    """The capture's check, on the forward run as a capture runs it: the head after the forward
    without it gives the whole forward's logits bit for bit, or the head stays in the graph and
    says why (logits changed or recast after the head); the head's own forward is back either way."""
    model = cls(llama().config).eval()
    g = graphs._Graph(2, 16, torch.device("cpu"), 0)
    g.load(torch.randint(3, VOCAB, (2, 11)), None)
    with torch.no_grad():
        whole = graphs.run(model.forward, g, {"use_cache": False})
        got = graphs._head_after(lambda: graphs.run(model.forward, g, {"use_cache": False}), model.lm_head, whole.logits)
    assert got.startswith(why) and bool(got) == bool(why)
    assert "forward" not in vars(model.lm_head)


@pytest.mark.parametrize("padded, mode", [(False, torch.inference_mode), ("left", torch.inference_mode), ("left", torch.no_grad), ("gap", torch.no_grad)])
def test_a_captured_decode_step_reads_nothing_on_the_host_and_matches(cpu_daemon, padded, mode):
    """generate with a static cache, each decode step run as a capture runs it (every sequence's
    keys gathered to the front, in graphs.step_capture's mode): the tokens transformers' eager
    generate picks, from served kernels, whichever mode generate runs in, and whatever the mask
    (left padding, or a gap in a prompt's keys)."""
    ref = llama()
    model = hf.kernelize(copy.deepcopy(ref), client=cpu_daemon, backend="kernel-service")
    ids = torch.randint(3, VOCAB, (3, 8))
    mask = torch.ones_like(ids)
    if padded == "left":
        mask[1, :3] = 0  # left padding, as a tokenizer pads for generate
        mask[2, :1] = 0
    elif padded == "gap":
        mask[1, 2:4] = 0  # keys a sequence does not see, between keys it sees
        mask[2, :1] = 0
    forward, steps = model.forward, []

    def as_captured(*args, **kwargs):
        if kwargs.get("past_key_values") is None or kwargs["input_ids"].shape[1] != 1:
            return forward(*args, **kwargs)
        before = sum(model.kernel_service.fallbacks.values())
        with graphs.step_capture(graphs._static_layers(kwargs["past_key_values"])), no_host_reads():
            out = forward(*args, **kwargs)
        steps.append(sum(model.kernel_service.fallbacks.values()) - before)  # modules that ran their own forward
        return out

    model.forward = as_captured
    before = model.kernel_service.calls["kv_attention"]
    gen = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    with mode():
        got = model.generate(ids, **gen)
        with own_rotary(modeling_llama):
            want = ref.generate(ids, **gen)
    assert steps == [0] * 5 and torch.equal(got, want)
    assert model.kernel_service.calls["kv_attention"] - before == 5 * 2  # every step's layers served


def test_graphs_where_there_is_no_cuda_say_why_or_raise_under_strict(cpu_daemon):
    with pytest.raises(ValueError, match="bucket"):
        hf.kernelize(modernbert(), client=cpu_daemon, backend="kernel-service", graphs=[(0, 8)])
    with pytest.raises(ValueError, match="at least one"):
        hf.kernelize(modernbert(), client=cpu_daemon, backend="kernel-service", graphs=[])
    with pytest.warns(RuntimeWarning, match="graphs not captured.*CUDA"):
        model = hf.kernelize(modernbert(), client=cpu_daemon, backend="kernel-service", graphs=[(2, 8)])
    r = model.kernel_service
    assert r.backend == "kernel-service" and "CUDA" in r.graphs.reason and not r.graphs.buckets
    with torch.inference_mode():
        model(torch.randint(3, VOCAB, (2, 8)))  # runs as without graphs
    with pytest.raises(RuntimeError, match="strict.*graphs"):
        hf.kernelize(modernbert(), client=cpu_daemon, backend="kernel-service", strict=True, graphs=[(2, 8)])


# ----- on a GPU


@pytest.fixture(scope="module")
def cuda_daemon(tmp_path_factory):
    d, c = start_daemon(tmp_path_factory)
    yield c
    c.close()
    d.stop()


@needs_gpu
def test_a_captured_encoder_replays_its_buckets_and_counts_the_rest(cuda_daemon):
    torch.manual_seed(0)
    ref = modernbert().to("cuda", torch.bfloat16)
    served = hf.kernelize(copy.deepcopy(ref), client=cuda_daemon, backend="kernel-service", strict=True)
    # Not strict: the calls below that no bucket serves run the model's own forward (a mask with a
    # gap keeps sdpa), which strict would refuse.
    model = hf.kernelize(copy.deepcopy(ref), client=cuda_daemon, backend="kernel-service", graphs=[(4, 16), (8, 32)])
    stats = model.kernel_service.graphs
    assert stats.buckets == [(4, 16), (8, 32)] and stats.capture_s > 0 and not stats.reason
    ids = torch.randint(3, VOCAB, (3, 12), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, :3] = 0
    with torch.inference_mode():
        first = model(ids, attention_mask=mask).last_hidden_state
        again = model(input_ids=ids[:2, :5]).last_hidden_state  # a second replay of the same bucket
        plain = served(ids, attention_mask=mask).last_hidden_state
        with own_rotary(modeling_modernbert):
            want = ref(ids, attention_mask=mask).last_hidden_state
    assert dict(stats.replays) == {(4, 16): 2}
    valid = mask.bool()
    torch.testing.assert_close(first[valid], plain[valid], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(first[valid], want[valid], atol=5e-2, rtol=5e-2)
    assert again.shape == (2, 5, BERT["hidden_size"]) and first.data_ptr() != again.data_ptr()
    with torch.inference_mode():
        model(torch.randint(3, VOCAB, (9, 8), device="cuda"))  # no bucket holds 9 sequences
        gap = torch.ones((2, 8), dtype=torch.long, device="cuda")
        gap[0, 3] = 0
        model(torch.randint(3, VOCAB, (2, 8), device="cuda"), attention_mask=gap)
    model(torch.randint(3, VOCAB, (2, 8), device="cuda"))  # grad enabled: the model's own forwards
    assert sum(stats.replays.values()) == 2 and sum(stats.uncaptured.values()) == 3, stats.uncaptured


@needs_gpu
def test_a_captured_causal_lm_replays_prefill_without_a_cache_only(cuda_daemon):
    ref = llama().to("cuda", torch.bfloat16)
    model = hf.kernelize(copy.deepcopy(ref), client=cuda_daemon, backend="kernel-service", strict=True, graphs=[(2, 16)])
    ids = torch.randint(3, VOCAB, (2, 16), device="cuda")
    with torch.inference_mode():
        got = model(ids, use_cache=False).logits
        part = model(ids[:1, :9], use_cache=False).logits  # padded up to the bucket; the head reads its own rows
        model(ids)  # use_cache defaults on: a cache is not captured
        with own_rotary(modeling_llama):
            want = ref(ids, use_cache=False).logits
            want_part = ref(ids[:1, :9], use_cache=False).logits
    stats = model.kernel_service.graphs
    assert dict(stats.replays) == {(2, 16): 2} and sum(stats.uncaptured.values()) == 1 and stats.head == "after the replay", stats
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(part, want_part, atol=5e-2, rtol=5e-2)


def prefilled_cache(model, seed):
    """A static cache as generate makes one, after a 5-token prefill of 2 sequences."""
    from transformers.cache_utils import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=16)
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
    return cache, out


def contents(layers) -> list:
    return [t.clone() for layer in layers for t in graphs._tensors(layer)]


def test_a_decode_graph_takes_a_new_cache_of_its_layout_and_a_cache_still_alive_keeps_its_own():
    """generate makes a static cache per call: the step's graph takes the new one (its contents
    copied into the tensors the graph reads and writes, which it then holds), and the cache that
    held them, still alive, keeps its own contents in tensors of its own."""
    model = llama()
    (a, _), (b, _) = prefilled_cache(model, 0), prefilled_cache(model, 1)
    la, lb = graphs._static_layers(a), graphs._static_layers(b)
    want_a, want_b = contents(la), contents(lb)
    assert graphs._layout(la) == graphs._layout(lb) and not all(torch.equal(x, y) for x, y in zip(want_a, want_b))
    step = graphs._Step({}, la)  # as captured on a's tensors
    assert step.holds(la) and not step.holds(lb)
    step.adopt(lb)
    assert step.holds(lb) and not step.holds(la)
    assert all(torch.equal(x, y) for x, y in zip(contents(lb), want_b)) and all(torch.equal(x, y) for x, y in zip(contents(la), want_a))
    mine = {t.data_ptr() for layer in lb for t in graphs._tensors(layer)}
    assert not mine & {t.data_ptr() for layer in la for t in graphs._tensors(layer)}, "a and b share a tensor"
    step.adopt(la)  # and back: each cache still its own
    assert step.holds(la) and all(torch.equal(x, y) for x, y in zip(contents(la), want_a)) and all(torch.equal(x, y) for x, y in zip(contents(lb), want_b))


def test_a_replayed_step_answers_with_the_call_s_own_cache():
    """The output a step's graph keeps does not hold the cache it was captured with (generate goes
    on with the cache the output names): a replay's output names the call's cache."""
    model = llama()
    (a, out), (b, _) = prefilled_cache(model, 0), prefilled_cache(model, 1)
    where = [k for k, v in out.items() if v is a]
    assert where == ["past_key_values"]
    kept = graphs._put_cache(out, where, None)
    assert kept.past_key_values is None
    replayed = graphs._put_cache(graphs._cut(kept), where, b)
    assert replayed.past_key_values is b and replayed["past_key_values"] is b and torch.equal(replayed.logits, kept.logits)


@needs_gpu
def test_generate_replays_its_decode_steps_from_one_capture(cuda_daemon):
    ref = llama().to("cuda", torch.bfloat16)
    served = hf.kernelize(copy.deepcopy(ref), client=cuda_daemon, backend="kernel-service")
    model = hf.kernelize(copy.deepcopy(ref), client=cuda_daemon, backend="kernel-service", graphs=[(2, 1)])
    assert model.generation_config.cache_implementation == "static" and model.generation_config.disable_compile
    ids = torch.randint(3, VOCAB, (2, 8), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    gen = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        got = model.generate(ids, **gen)
        again = model.generate(ids, **gen)  # a new cache of the same layout: the step's graph takes it
        want = served.generate(ids, cache_implementation="static", disable_compile=True, **gen)
    stats = model.kernel_service.graphs
    first = stats.uncaptured["a decode step's first call (it is captured at its second)"]
    # 7 decode steps a generate: the first generate's first step runs eagerly, every other is replayed
    assert stats.steps == 1 and first == 1 and stats.replays[(2, 1)] == 2 * 7 - 1, stats
    assert torch.equal(got, want) and torch.equal(again, got)
