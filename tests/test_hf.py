"""client.integrations.hf: kernelize() on tiny random-init transformers models, served on target "c".

One daemon for the module; each model is kernelized once (module fixtures) and compared with an
untouched copy of the same weights running transformers' own eager forward. transformers shares
`apply_rotary_pos_emb` between the models of a family, so the reference runs with its original
forward put back (`own_rotary`).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import os
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
hf = pytest.importorskip("client.integrations.hf")

from devtools.launch import DaemonProcess  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, ModernBertConfig, ModernBertModel  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.modernbert import modeling_modernbert  # noqa: E402

VOCAB = 128


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf-daemon")
    d = DaemonProcess(base / "cache", "--target", "c", workers=2, log_path=base / "daemon.log").start(timeout=120)
    c = d.client()
    yield d, c
    c.close()
    d.stop()


@contextlib.contextmanager
def own_rotary(*modeling):
    """transformers' own apply_rotary_pos_emb for the duration (the kernelized one is process-wide)."""
    saved = [(m, m.apply_rotary_pos_emb) for m in modeling]
    try:
        for m, fn in saved:
            m.apply_rotary_pos_emb = getattr(fn, "__wrapped__", fn)
        yield
    finally:
        for m, fn in saved:
            m.apply_rotary_pos_emb = fn


def llama(**extra):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **extra
    )
    return LlamaForCausalLM(cfg).eval()


# Layers 0 and 2 full, layer 1 sliding with a window of +-4 tokens (local_attention 8).
BERT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    global_attn_every_n_layers=2,
    local_attention=8,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    cls_token_id=1,
    sep_token_id=2,
)


def modernbert():
    torch.manual_seed(0)
    return ModernBertModel(ModernBertConfig(**BERT)).eval()


@pytest.fixture(scope="module")
def llamas(daemon):
    ref = llama()
    model = hf.kernelize(copy.deepcopy(ref), client=daemon[1], backend="kernel-service")
    return ref, model


@pytest.fixture(scope="module")
def berts(daemon):
    ref = modernbert()
    model = hf.kernelize(copy.deepcopy(ref), client=daemon[1], backend="kernel-service")
    return ref, model


def served(model):
    return sum(model.kernel_service.calls.values())


def test_llama_swapped_and_matches(llamas):
    ref, model = llamas
    r = model.kernel_service
    assert r.backend == "kernel-service" and not r.kept, r
    assert set(r.swapped.values()) == {"rmsnorm", "add_rmsnorm", "swiglu", "rope", "attention + kv_attention"}
    assert type(model.model.layers[0].input_layernorm).forward is modeling_llama.LlamaRMSNorm.forward  # the class is untouched
    assert model.model.layers[0].input_layernorm.forward.__func__ is hf.RMSNormLayer.forward
    assert model.config._attn_implementation == hf.ATTN
    assert modeling_llama.apply_rotary_pos_emb.__wrapped__ is not modeling_llama.apply_rotary_pos_emb  # replaced, the original kept
    assert model.state_dict().keys() == ref.state_dict().keys()
    ids = torch.randint(3, VOCAB, (2, 11))
    before = dict(r.calls)
    with torch.inference_mode():
        out = model(ids).logits
        with own_rotary(modeling_llama):
            want = ref(ids).logits
    # 2 layers: a norm, rope, attention, the residual add with the second norm, MLP each; plus the final norm
    assert {k: r.calls[k] - before.get(k, 0) for k in r.calls} == {"rmsnorm": 3, "add_rmsnorm": 2, "rope": 2, "attention": 2, "swiglu": 2}
    assert not r.fallbacks
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_llama_padded_batch(llamas, monkeypatch):
    ref, model = llamas
    ids = torch.randint(3, VOCAB, (3, 10))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, 7:] = 0  # right padding
    n = served(model)
    with torch.inference_mode(), counted_kernels(model, monkeypatch) as launches:
        out = model(ids, attention_mask=mask).logits
    with torch.inference_mode(), own_rotary(modeling_llama):
        want = ref(ids, attention_mask=mask).logits
    assert launches == {"varlen": 2} and served(model) - n == 11  # one causal varlen call per layer
    valid = mask.bool()
    torch.testing.assert_close(out[valid], want[valid], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("padding, cache", [("left", "dynamic"), ("none", "dynamic"), ("left", "static"), ("none", "static")])
def test_llama_generate(llamas, monkeypatch, padding, cache):
    """generate() matches transformers' own, and each decode step is one kv_attention launch per
    layer: with left padding each sequence's cache is rotated to start at its first key; a static
    cache's mask hides the keys past the current one (a run from key 0: no rotation)."""
    ref, model = llamas
    ids = torch.randint(3, VOCAB, (3, 6))
    mask = torch.ones_like(ids)
    if padding == "left":  # as generate pads
        mask[0, :2] = 0
        mask[2, :5] = 0
    options = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    if cache == "static":
        options["cache_implementation"] = "static"
    r = model.kernel_service
    kv = r.calls["kv_attention"]
    with torch.inference_mode():
        with counted_kernels(model, monkeypatch) as launches:
            got = model.generate(ids, **options)
        with own_rotary(modeling_llama):
            want = ref.generate(ids, **options)
    assert torch.equal(got, want)
    assert r.calls["kv_attention"] - kv == 2 * 4  # every decode step after the prefill, in both layers
    assert launches["kv"] == 2 * 4, launches


def attention_modules(model):
    return [m for m in model.modules() if hf.served.ATTR in m.__dict__ and m.__dict__[hf.served.ATTR].kind == "attention"]


def attention_entries(model):
    return [vars(m)[hf.served.ATTR] for m in attention_modules(model)]


def counting(counts, name, fn):
    """fn, counting its calls in counts[name]."""

    def call(*args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)

    return call


def count_kernels(mp, counts, module, **names):
    """The module's served entry, its kernels (fields named in `names`) counting their calls under those names."""
    entry = vars(module)[hf.served.ATTR]
    counted = {field: counting(counts, name, getattr(entry, field)) for field, name in names.items() if getattr(entry, field) is not None}
    mp.setitem(vars(module), hf.served.ATTR, dataclasses.replace(entry, **counted))


@contextlib.contextmanager
def counted_kernels(model, monkeypatch):
    """Counts each attention kernel's calls: the unmasked one ("plain"), the varlen one and kv_attention ("kv")."""
    counts = collections.Counter()
    with monkeypatch.context() as mp:
        for m in attention_modules(model):
            count_kernels(mp, counts, m, kernel="plain", varlen="varlen", kv_attention="kv")
        yield counts


def test_modernbert_swapped_and_matches_padded(berts, monkeypatch):
    """A padded batch longer than the sliding layer's window: every layer, full and sliding, is one
    varlen attention call for the whole batch (not one per sequence), matching transformers' eager."""
    ref, model = berts
    r = model.kernel_service
    assert r.backend == "kernel-service"
    assert set(r.swapped.values()) == {"layernorm", "rope", "attention + rope", "geglu"} and not r.kept, r
    assert all(v == "layernorm" for k, v in r.swapped.items() if "norm" in k)
    assert [k for k, v in r.swapped.items() if v == "geglu"] == [f"layers.{i}.mlp" for i in range(3)]
    assert model.layers[0].mlp.forward.__func__ is hf.GeGLUMLPLayer.forward
    windows = [e.window for e in attention_entries(model)]
    assert windows == [0, 4, 0]  # layer 1 slides: local_attention 8 -> keys within 4 on each side
    assert all(e.varlen.spec["params"]["varlen"] for e in attention_entries(model))
    ids = torch.randint(3, VOCAB, (4, 12))  # longer than the sliding layer's window
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding
    mask[2, 5:] = 0
    mask[3, :3] = 0  # left padding
    before, fb = dict(r.calls), r.fallbacks["attention"]
    with torch.inference_mode(), counted_kernels(model, monkeypatch) as launches:
        out = model(ids, attention_mask=mask).last_hidden_state
    with torch.inference_mode(), own_rotary(modeling_modernbert):
        want = ref(ids, attention_mask=mask).last_hidden_state
    assert launches == {"varlen": 3}  # one call per layer for the whole batch
    assert r.calls["attention"] - before["attention"] == 3 and r.fallbacks["attention"] == fb
    assert r.calls["layernorm"] - before["layernorm"] > 0 and r.calls["rope"] - before["rope"] == 3 and r.calls["geglu"] - before["geglu"] == 3
    valid = mask.bool()
    torch.testing.assert_close(out[valid], want[valid], atol=2e-5, rtol=1e-4)
    with torch.inference_mode(), counted_kernels(model, monkeypatch) as launches:
        out = model(ids).last_hidden_state  # no padding: the sliding layer still needs its window
    with torch.inference_mode(), own_rotary(modeling_modernbert):
        want = ref(ids).last_hidden_state
    assert launches == {"plain": 2, "varlen": 1}
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    short = ids[:, :4]  # within the window (no mask at all): the sliding layer is the plain kernel too
    with torch.inference_mode(), counted_kernels(model, monkeypatch) as launches:
        out = model(short).last_hidden_state
    with torch.inference_mode(), own_rotary(modeling_modernbert):
        want = ref(short).last_hidden_state
    assert launches == {"plain": 3}
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_modernbert_residual_adds_are_fused(berts, monkeypatch):
    """Each encoder layer adds the attention output in its mlp_norm kernel (layernorm with
    `residual`) and the MLP output in the MLP's Wo GEMM: neither the separate mlp_norm kernel
    nor the MLP module's own forward runs, and the output matches transformers' eager."""
    ref, model = berts
    assert all(model.kernel_service.swapped[f"layers.{i}"] == "layernorm" for i in range(3))
    counts = collections.Counter()
    for i, layer in enumerate(model.layers):
        assert layer.forward.__func__ is hf.EncoderLayer.forward
        assert vars(layer)[hf.served.ATTR].kernel.spec["params"]["residual"]
        count_kernels(monkeypatch, counts, layer, kernel="residual")
        count_kernels(monkeypatch, counts, layer.mlp_norm, kernel="mlp_norm")
        monkeypatch.setitem(vars(layer.mlp), "forward", counting(counts, "mlp", layer.mlp.forward))
    ids = torch.randint(3, VOCAB, (3, 10))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.inference_mode():
        out = model(ids, attention_mask=mask).last_hidden_state
    with torch.inference_mode(), own_rotary(modeling_modernbert):
        want = ref(ids, attention_mask=mask).last_hidden_state
    assert counts == {"residual": 3}
    valid = mask.bool()
    torch.testing.assert_close(out[valid], want[valid], atol=2e-5, rtol=1e-4)


def test_modernbert_attention_takes_q_k_and_v_from_one_rope_call(berts, monkeypatch):
    """ModernBERT's attention module is served whole: rope's packed form reads Q and K in Wqkv's
    output and copies V out (v_out), and the attention kernel takes those three: neither the
    process-wide rotary wrapper nor the module's own forward runs."""
    ref, model = berts
    r = model.kernel_service
    assert all(r.swapped[f"layers.{i}.attn"] == "attention + rope" for i in range(3))
    counts = collections.Counter()
    ((by_dtype, key, wrapper),) = [(by_dtype, k, e) for by_dtype in hf.rope.ROPE.values() for k, e in by_dtype.items() if e.report is r]
    monkeypatch.setitem(by_dtype, key, dataclasses.replace(wrapper, kernel=counting(counts, "copying rope", wrapper.kernel)))
    for layer in model.layers:
        assert layer.attn.forward.__func__ is hf.QKVAttentionLayer.forward
        assert vars(layer.attn)[hf.served.ATTR].qkv_rope.spec["params"]["v_out"]
        count_kernels(monkeypatch, counts, layer.attn, qkv_rope="qkv_rope", varlen="varlen")
    ids = torch.randint(3, VOCAB, (3, 10))
    mask = torch.ones_like(ids)
    mask[2, 7:] = 0
    before = dict(r.calls)
    with torch.inference_mode():
        out = model(ids, attention_mask=mask).last_hidden_state
    with torch.inference_mode(), own_rotary(modeling_modernbert):
        want = ref(ids, attention_mask=mask).last_hidden_state
    assert counts == {"qkv_rope": 3, "varlen": 3}
    assert r.calls["rope"] - before.get("rope", 0) == 3 and r.calls["attention"] - before.get("attention", 0) == 3
    valid = mask.bool()
    torch.testing.assert_close(out[valid], want[valid], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("act, served", [("gelu_pytorch_tanh", True), ("gelu_new", False), ("silu", False)])
def test_modernbert_mlp_is_served_for_torchs_gelu_only(daemon, act, served):
    """geglu serves F.gelu (exact, and tanh: gelu_pytorch_tanh); another activation keeps the
    MLP's own forward, saying why; outputs match transformers' either way."""
    torch.manual_seed(0)
    ref = ModernBertModel(ModernBertConfig(**{**BERT, "num_hidden_layers": 1, "hidden_activation": act})).eval()
    model = hf.kernelize(copy.deepcopy(ref), client=daemon[1], backend="kernel-service")
    r = model.kernel_service
    assert (r.swapped.get("layers.0.mlp") == "geglu") is served, r
    if not served:
        assert "not torch's GELU" in r.kept["layers.0.mlp"]
    ids = torch.randint(3, VOCAB, (2, 7))
    with torch.inference_mode():
        out = model(ids).last_hidden_state
        with own_rotary(modeling_modernbert):
            want = ref(ids).last_hidden_state
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_modernbert_other_masks_keep_sdpa_or_raise_under_strict(berts, daemon):
    """A 4D mask that is not padding (here: a random pattern) keeps sdpa, call by call; under
    strict=True the call raises, naming the module."""
    ref, model = berts
    ids = torch.randint(3, VOCAB, (2, 12))
    odd = torch.rand(2, 1, 12, 12, generator=torch.Generator().manual_seed(1)) < 0.6
    odd |= torch.eye(12, dtype=torch.bool)
    masks = {"full_attention": odd, "sliding_attention": odd}
    fb = model.kernel_service.fallbacks["attention"]
    with torch.inference_mode():
        out = model(ids, attention_mask=masks).last_hidden_state
        with own_rotary(modeling_modernbert):
            want = ref(ids, attention_mask=masks).last_hidden_state
    assert model.kernel_service.fallbacks["attention"] - fb == 3
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    strict = hf.kernelize(copy.deepcopy(ref), client=daemon[1], backend="kernel-service", strict=True, warmup=False)
    with pytest.raises(RuntimeError, match=r"strict=True.*layers\.0\.attn.*not padding"), torch.inference_mode():
        strict(ids, attention_mask=masks)


def test_compile_fullgraph_matches(llamas):
    ref, model = llamas
    ids = torch.randint(3, VOCAB, (2, 8))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # dynamo's graph capture; Inductor's C++ builds are slow on 2 cores
    with torch.inference_mode():
        out = compiled(ids, use_cache=False).logits
        with own_rotary(modeling_llama):
            want = ref(ids, use_cache=False).logits
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_export_shows_kernel_service_ops(berts):
    _, model = berts
    ids = torch.randint(3, VOCAB, (2, 6))
    with torch.no_grad():
        ep = torch.export.export(model, (), {"input_ids": ids})
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"kernel_service.layernorm.default", "kernel_service.rope.default", "kernel_service.attention.default"} <= ops, sorted(ops)
    with torch.no_grad(), own_rotary(modeling_modernbert):
        torch.testing.assert_close(ep.module()(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state, atol=2e-5, rtol=1e-4)


def test_training_falls_back_to_own_forward(llamas):
    _, model = llamas
    r = model.kernel_service
    n = served(model)
    model.train()
    try:
        loss = model(torch.randint(3, VOCAB, (1, 5)), labels=torch.randint(3, VOCAB, (1, 5))).loss
        loss.backward()
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)
    assert served(model) == n and r.fallbacks["rmsnorm"] >= 5
    with pytest.warns(RuntimeWarning, match="training mode.*using 'eager'"):
        trained = hf.kernelize(llama().train(), backend="kernel-service", warmup=False)
    assert trained.kernel_service.backend == "eager"


def test_a_call_with_grad_enabled_warns_once_and_counts_every_fallback(daemon):
    model = hf.kernelize(llama(), client=daemon[1], backend="kernel-service", warmup=False)
    ids = torch.randint(3, VOCAB, (1, 5))
    with pytest.warns(RuntimeWarning, match=r"grad enabled.*torch\.inference_mode\(\)") as caught:
        model(ids)
        model(ids)
    assert sum("inference_mode" in str(w.message) for w in caught) == 1
    r = model.kernel_service
    assert not r.calls and dict(r.fallbacks) == {"add_rmsnorm": 4, "rmsnorm": 10, "rope": 4, "attention": 4, "swiglu": 4}, r.fallbacks


def test_a_model_called_in_another_dtype_counts_every_fallback_rope_included(daemon):
    """Every served module of a model kernelized in float32 and called in float64 runs its own
    forward, and says so in the report; rope, served through the modeling module's process-wide
    function, counted too (it was left out)."""
    model = hf.kernelize(llama(), client=daemon[1], backend="kernel-service", warmup=False)
    model.double()
    with torch.inference_mode():
        model(torch.randint(3, VOCAB, (1, 5)))
    r = model.kernel_service
    assert not r.calls and dict(r.fallbacks) == {"add_rmsnorm": 2, "rmsnorm": 5, "rope": 2, "attention": 2, "swiglu": 2}, r.fallbacks

    # An attention option the kernel does not take (a scaling of its own): sdpa, counted too.
    model.float()
    q, kv = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 5, 16)
    with torch.inference_mode():
        hf.attention.attention(model.model.layers[0].self_attn, q, kv, kv, None, scaling=0.5)
    assert r.fallbacks["attention"] == 3 and not r.calls, r


def test_backend_policy(daemon, monkeypatch):
    _, c = daemon
    m = hf.kernelize(llama(), client=c)  # auto on the CPU: eager, no warning
    assert m.kernel_service.backend == "eager" and "CUDA" in m.kernel_service.reason and not m.kernel_service.swapped
    assert hf.kernelize(llama(), backend="eager").kernel_service.backend == "eager"
    with pytest.raises(ValueError, match="backend must be one of"):
        hf.kernelize(llama(), backend="fast")
    # bfloat16 is not served on target "c": every module keeps its forward, and the backend falls back
    with pytest.warns(RuntimeWarning, match="'kernel-service' is unavailable.*using 'eager'") as caught:
        bf = hf.kernelize(llama().to(torch.bfloat16), client=c, backend="kernel-service", warmup=False)
    message = str(caught[0].message)
    assert "\n" not in message and len(message) < 200, message  # one short line: the details are in the report
    assert bf.kernel_service.backend == "eager" and "kept" in bf.kernel_service.reason
    assert bf.kernel_service.kept and all("bfloat16" in why for why in bf.kernel_service.kept.values())
    # strict: the backend asked for, or an error; auto on the CPU would be eager
    with pytest.raises(RuntimeError, match=r"strict=True.*'auto' would be 'eager'"):
        hf.kernelize(llama(), client=c, strict=True)
    with pytest.raises(RuntimeError, match=r"strict=True.*model\.layers\.0\b.*float32"):
        hf.kernelize(llama().to(torch.bfloat16), client=c, backend="kernel-service", strict=True)
    # no daemon on the socket
    import client

    gone = client.connect(daemon[0].socket.parent / "nobody.sock")
    with pytest.warns(RuntimeWarning, match="'kernel-service' is unavailable.*ServiceUnavailable.*using 'eager'"):
        assert hf.kernelize(llama(), client=gone, backend="kernel-service").kernel_service.backend == "eager"
    with pytest.raises(RuntimeError, match="strict=True.*unavailable"):
        hf.kernelize(llama(), client=gone, backend="kernel-service", strict=True)


def test_strict_names_a_kept_module(daemon):
    # A GELU MLP is not what swiglu serves: kept by default, an error under strict
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = hf.kernelize(llama(hidden_act="gelu"), client=daemon[1], backend="kernel-service", warmup=False)
    assert m.kernel_service.kept["model.layers.0.mlp"].startswith("activation 'gelu'")
    assert "model.layers.0.mlp" not in m.kernel_service.swapped
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.mlp.*gelu"):
        hf.kernelize(llama(hidden_act="gelu"), client=daemon[1], backend="kernel-service", strict=True)


def test_a_decoder_layer_fuses_only_what_is_served(daemon):
    """Llama's decoder layer drops its residual adds around what is served: a kept MLP (GELU) is added
    after its own forward, and a layer whose post-attention norm is not Llama's RMSNorm keeps its own
    forward, named in `kept`. Outputs match eager either way."""
    ref = llama(hidden_act="gelu")
    ref.model.layers[1].post_attention_layernorm = torch.nn.RMSNorm(64, eps=1e-6)
    model = hf.kernelize(copy.deepcopy(ref), client=daemon[1], backend="kernel-service", warmup=False)
    r = model.kernel_service
    assert r.swapped["model.layers.0"] == "add_rmsnorm" and "model.layers.1" not in r.swapped
    assert r.kept["model.layers.1"].startswith("post_attention_layernorm is not Llama's RMSNorm"), r.kept
    ids = torch.randint(3, VOCAB, (2, 7))
    with torch.inference_mode():
        out = model(ids).logits
        with own_rotary(modeling_llama):
            want = ref(ids).logits
    assert dict(r.calls) == {"rmsnorm": 3, "add_rmsnorm": 1, "rope": 2, "attention": 2} and not r.fallbacks, r
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_a_decoder_layer_whose_mlp_cannot_be_served_counts_one_fallback(daemon):
    """The layer is served but its MLP, left in training mode, is not: the MLP runs its own forward
    once, counted once as a fallback, and the output still matches eager."""
    ref = llama()
    model = hf.kernelize(copy.deepcopy(ref), client=daemon[1], backend="kernel-service", warmup=False)
    model.model.layers[0].mlp.train()
    ids = torch.randint(3, VOCAB, (1, 6))
    with torch.inference_mode():
        out = model(ids).logits
        with own_rotary(modeling_llama):
            want = ref(ids).logits
    r = model.kernel_service
    assert dict(r.fallbacks) == {"swiglu": 1} and r.calls["swiglu"] == 1 and r.calls["add_rmsnorm"] == 2, r
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_no_hugging_face_kernels_distribution():
    """The integration applies the HF `kernels` layer contract itself: no `kernels` distribution is
    installed (it would share `site-packages/kernels/` with this project's package), and transformers,
    deciding by package metadata, does not take this project's `kernels` for Hugging Face's."""
    import importlib.metadata
    import sys

    import kernels
    from transformers.integrations import hub_kernels
    from transformers.utils import import_utils

    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("kernels")
    assert hasattr(kernels, "kinds") and not hasattr(kernels, "kernelize")  # `kernels` is the project's
    assert not import_utils.is_kernels_available() and not hub_kernels._kernels_enabled
    assert "kernels.layer" not in sys.modules and "client.integrations.hf" in sys.modules
    for layer in (hf.RMSNormLayer, hf.SwiGLUMLPLayer, hf.LayerNormLayer, hf.RotaryLayer):  # the layer contract
        assert layer.can_torch_compile and not layer.has_backward and "__init__" not in vars(layer)


def test_rope_rows_are_made_once_per_cos_and_sin():
    """Every layer of a type gets the same cos/sin: their rows for `rope` are made once per forward."""
    cos, sin = torch.randn(1, 6, 8), torch.randn(1, 6, 8)
    positions, cache = hf.rope.rope_rows(cos, sin, 3, torch.float32)
    assert torch.equal(positions, torch.arange(6).repeat(3)) and torch.equal(cache, torch.cat((cos[0, :, :4], sin[0, :, :4]), dim=-1))
    again = hf.rope.rope_rows(cos, sin, 3, torch.float32)
    assert again[0] is positions and again[1] is cache
    other = hf.rope.rope_rows(cos, torch.randn(1, 6, 8), 3, torch.float32)  # another sin: made again
    assert other[1] is not cache and not torch.equal(other[1], cache)


@pytest.mark.parametrize("tensor_offset", [False, True])
def test_a_causal_decode_step_s_mask_is_sdpa_s(tensor_offset):
    """A decode step's mask, made the short way (attention._decode_mask), equals transformers'
    sdpa_mask: past the current key, padding on either side, a 2D mask shorter or longer than the
    keys, an offset of the keys, the position as a static cache's tensor."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    g = torch.Generator().manual_seed(0)
    for kv_length, q_offset, kv_offset, mask_len in ((10, 6, 0, 7), (10, 9, 0, 10), (8, 9, 2, 10), (10, 4, 0, 12), (6, 3, 0, None)):
        two_d = None if mask_len is None else torch.rand(3, mask_len, generator=g) > 0.3
        args = dict(batch_size=3, q_length=1, kv_length=kv_length, kv_offset=kv_offset, mask_function=causal_mask_function, attention_mask=two_d)
        position = torch.tensor([q_offset]) if tensor_offset else q_offset
        got = hf.attention.mask(q_offset=position, allow_is_causal_skip=False, device=torch.device("cpu"), **args)
        want = sdpa_mask(q_offset=q_offset, allow_is_causal_skip=False, **args)
        assert got.shape == (3, 1, 1, kv_length) and torch.equal(got, want), (kv_length, q_offset, kv_offset, mask_len)
