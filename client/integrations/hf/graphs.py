"""A kernelized model's forward captured in CUDA graphs, one per (batch, tokens) bucket.

Outside graphs a served model pays Python's launch overhead layer by layer, where torch.compile's
"reduce-overhead" mode replays one CUDA graph. Served kernels are plain launches on torch's
current stream, so the whole forward can be captured as it is, in milliseconds per bucket:

    graphs = Graphs(model, [(32, 512), (8, 128)])  # (batch, tokens)
    graphs.capture()  # kernelize(model, graphs=...) does this at warm-up
    model(input_ids=ids, attention_mask=mask)  # replays the smallest bucket that holds it

A bucket of one token, (batch, 1), is a decode step of `generate` with a static cache
(`cache_implementation="static"`, which kernelize then makes the model's default): each step's
inputs are the same shapes and the cache's tensors keep their addresses, so the step is captured
once per cache layout and batch, at its second call (the first runs eagerly: it loads what the
step needs), and replayed from then on. generate makes a new cache per call: the graph adopts it
(its contents copied into the tensors the graph reads and writes, which the new cache then holds),
so later calls replay from their first step; the graph keeps one cache's tensors per layout
alive, as long as the model (or until `release()`).

A forward call is padded up to its bucket: its ids with the pad token, its attention mask with zeros
(each sequence's keys are its mask's one run of ones, so the padding changes nothing the call
sees), and the outputs are cut back to the call's batch and tokens and copied out of the graph's
memory (they stay valid after the next call, unlike reduce-overhead's). A causal LM's head (its
`nn.Linear` output embedding) is left out of the graph and runs after each replay, writing the
call's own logits: the largest output is then never copied (a 2048-token call of a 128k
vocabulary: 525 MB). It is left out only where the logits come out the same as the whole
forward's, checked at capture; `graphs.head` says which. A call no bucket serves
(longer, another keyword, grad enabled, a mask with a gap) runs the forward uncaptured, as
without graphs, and is counted in `model.kernel_service.graphs`.

The capture rule: every kernel, and every range of a routed kernel, is at hand before a capture,
and nothing compiles, loads or reads a tensor's values on the host inside one. Each bucket's
forward therefore runs eagerly at its own shapes first (loading what it needs), and while
`capturing()` the attention path takes the mask as given (a forward bucket's 2D mask is checked
on the host before each replay instead of the 4D mask inside the forward; a decode step's
attention serves any mask, so its mask is not checked).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import threading
import time
import warnings
import weakref

import torch

_STATE = threading.local()


def capturing() -> bool:
    """Whether a graph's forward is being warmed or captured on this thread: the mask was checked
    to be padding before the forward, so the attention path must not read it on the host."""
    return getattr(_STATE, "capturing", False)


@contextlib.contextmanager
def _capturing():
    _STATE.capturing = True
    try:
        yield
    finally:
        _STATE.capturing = False


@dataclasses.dataclass
class GraphStats:
    """`model.kernel_service.graphs`: the buckets captured, and the calls each served."""

    buckets: list = dataclasses.field(default_factory=list)  # (batch, tokens), captured
    replays: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # bucket -> calls replayed
    steps: int = 0  # decode steps captured (one per static cache and batch)
    uncaptured: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # why -> calls run without a graph
    capture_s: float = 0.0  # warm-up and capture, all buckets
    head: str = ""  # a causal LM's head: "after the replay", or why it stays in the graph ('': no head)
    reason: str = ""  # why nothing was captured ('' when the buckets were)


def buckets(given) -> list[tuple[int, int]]:
    """The (batch, tokens) buckets, smallest first; ValueError for anything else."""
    out = set()
    for b in given:
        try:
            batch, tokens = (int(x) for x in b)
        except (TypeError, ValueError):
            raise ValueError(f"graphs: a bucket is (batch, tokens), got {b!r}") from None
        if batch < 1 or tokens < 1:
            raise ValueError(f"graphs: a bucket's batch and tokens are at least 1, got {b!r}")
        out.add((batch, tokens))
    if not out:
        raise ValueError("graphs: give at least one (batch, tokens) bucket")
    return sorted(out, key=lambda bt: (bt[0] * bt[1], bt))


def _one_run_per_row(mask: torch.Tensor) -> bool:
    """Whether each row of a 2D 0/1 mask is one run of ones (padding on either side): one sync."""
    seen = mask != 0
    j = torch.arange(mask.shape[1], device=mask.device)
    lo = torch.where(seen, j, mask.shape[1]).amin(1)
    hi = torch.where(seen, j + 1, 0).amax(1)
    ok = (seen.sum(1) == (hi - lo).clamp(min=0)).all() & ((mask == 0) | (mask == 1)).all()
    return bool(ok)


class _Graph:
    """One bucket: its static inputs, its graph, and the outputs the graph writes."""

    def __init__(self, batch: int, tokens: int, device, pad: int):
        self.batch, self.tokens, self.pad = batch, tokens, pad
        self.ids = torch.full((batch, tokens), pad, dtype=torch.long, device=device)
        self.mask = torch.ones((batch, tokens), dtype=torch.long, device=device)
        self.graph = None
        self.out = None
        self.head = None  # the output embedding, run after the replay (None: inside the graph, or none)

    def load(self, ids: torch.Tensor, mask: torch.Tensor | None) -> None:
        """A call's inputs into the static ones, padded: pad tokens the mask hides."""
        b, s = ids.shape
        self.ids[:b, :s].copy_(ids)
        self.mask[:b, :s].copy_(mask if mask is not None else torch.ones_like(ids))
        self.ids[:b, s:].fill_(self.pad)
        self.mask[:b, s:].zero_()
        self.ids[b:].fill_(self.pad)
        self.mask[b:].zero_()
        self.mask[b:, 0] = 1  # a padding sequence of one token: no row without a key

    def outputs(self, b: int, s: int):
        """The graph's outputs as a call of [b, s] gets them (_cut)."""
        return _cut(self.out, (self.batch, self.tokens), (b, s), self.head)


class Graphs:
    """The model's forward, replayed from a CUDA graph per bucket (see the module's docstring)."""

    def __init__(self, model, given, *, fixed: dict | None = None, stats: GraphStats | None = None):
        self.model = model
        self.forward = model.forward  # the forward as kernelize left it (bound; served modules inside)
        self.__signature__ = inspect.signature(self.forward)  # what generate reads off model.forward
        self.buckets = buckets(given)
        self.fixed = dict(fixed or {})  # keyword arguments every captured call passes (use_cache=False)
        self.stats = stats if stats is not None else GraphStats()
        self.pad = getattr(model.config, "pad_token_id", None) or 0
        self.steps = _Steps({b for b, t in self.buckets if t == 1}, self.forward, self.stats)
        self.device = next(model.parameters()).device
        self._graphs: dict[tuple[int, int], _Graph] = {}

    def capture(self) -> "Graphs":
        """Warms and captures every bucket (largest first, sharing one memory pool); then the
        model's forward replays them."""
        if self.device.type != "cuda":
            raise RuntimeError(f"graphs: CUDA graphs need the model on a CUDA device, it is on {self.device}")
        t = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for batch, tokens in sorted((bt for bt in self.buckets if bt[1] > 1), key=lambda bt: -bt[0] * bt[1]):
            # Normal tensors, not inference ones, so calls under no_grad may write the inputs too.
            with torch.inference_mode(False), torch.no_grad():
                g = _Graph(batch, tokens, self.device, self.pad)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):  # loads every kernel this shape needs; cuBLAS picks its algorithms
                        whole = self._run(g)
                torch.cuda.current_stream().wait_stream(side)
                self._record(g, pool, whole)
            self._graphs[(batch, tokens)] = g
        torch.cuda.synchronize()
        self.stats.buckets = list(self.buckets)
        self.stats.capture_s += time.perf_counter() - t
        self.model.forward = self  # an instance attribute: the class and other models are untouched
        return self

    def _record(self, g: _Graph, pool, whole) -> None:
        """Captures g's forward; a causal LM's head after the replay where that gives `whole`'s
        logits (the forward's own, run eagerly on the same inputs), else inside the graph."""
        head, why = _head(self.model, whole)
        if head is not None:
            why = _head_after(lambda: self._capture_and_replay(g, pool), head, whole["logits"])
            g.head = None if why else head
        if g.head is None:
            self._capture(g, pool)
        if why:  # a bucket that keeps its head says why
            self.stats.head = why
        elif g.head is not None and not self.stats.head:
            self.stats.head = "after the replay"

    def _capture(self, g: _Graph, pool) -> None:
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=pool, capture_error_mode="thread_local"):
            g.out = self._run(g)

    def _capture_and_replay(self, g: _Graph, pool):
        self._capture(g, pool)
        g.graph.replay()
        return g.out

    def release(self) -> None:
        """Puts the model's own forward back and frees the graphs."""
        if self.model.__dict__.get("forward") is self:
            self.model.__dict__["forward"] = self.forward
        self._graphs.clear()
        self.steps.graphs.clear()

    def _run(self, g: _Graph):
        return run(self.forward, g, self.fixed)

    def _why_not(self, args, kwargs) -> str:
        if args:
            return "positional arguments besides input_ids"
        if set(kwargs) - {"input_ids", "attention_mask", *self.fixed}:
            return "keywords " + ", ".join(sorted(set(kwargs) - {"input_ids", "attention_mask", *self.fixed}))
        for k, v in self.fixed.items():
            if kwargs.get(k, None) is not v:
                return f"{k} other than {v} (captured with {k}={v})"
        if self.model.training or torch.is_grad_enabled():
            return "training mode or grad enabled"
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.device != self.device or ids.dtype.is_floating_point:
            return "input_ids that are not integer [batch, tokens] on the model's device"
        mask = kwargs.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != ids.shape or mask.device != self.device):
            return "an attention_mask that is not [batch, tokens] on the model's device"
        return ""

    def __call__(self, *args, **kwargs):
        if args and "input_ids" not in kwargs:
            args, kwargs = args[1:], {"input_ids": args[0], **kwargs}
        if kwargs.get("past_key_values") is not None:
            return self.steps(self.model, args, kwargs)
        why = self._why_not(args, kwargs)
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        g = None if why else self._bucket(*ids.shape)
        if g is None:
            self.stats.uncaptured[why or f"no bucket holds batch {ids.shape[0]} x {ids.shape[1]} tokens"] += 1
            return self.forward(*args, **kwargs)
        if mask is not None and not _one_run_per_row(mask):
            self.stats.uncaptured["a mask whose rows are not one run of ones"] += 1
            return self.forward(*args, **kwargs)
        g.load(ids, mask)
        g.graph.replay()
        self.stats.replays[(g.batch, g.tokens)] += 1
        return g.outputs(*ids.shape)

    def _bucket(self, batch: int, tokens: int) -> _Graph | None:
        for bt in self.buckets:  # smallest first
            if bt[0] >= batch and bt[1] >= tokens:
                return self._graphs.get(bt)
        return None


def install(model, given, backend: str, strict: bool) -> GraphStats:
    """kernelize's graphs step: the served forward captured per bucket, or why not (a warning;
    strict raises)."""
    stats = GraphStats()
    why = ""
    if backend != "kernel-service":
        why = f"the backend is {backend!r}, not 'kernel-service'"
    elif next(model.parameters()).device.type != "cuda":
        why = "CUDA graphs need the model on a CUDA device"
    if not why:
        fixed = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
        try:
            Graphs(model, given, fixed=fixed, stats=stats).capture()
        except Exception as exc:  # a forward that cannot be captured (a host read inside it, say)
            why = f"capture failed: {type(exc).__name__}: {exc}"
    if not why:
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            gen.disable_compile = True  # generate would torch.compile the graphed forward
            if any(t == 1 for _, t in stats.buckets) and gen.cache_implementation is None:
                gen.cache_implementation = "static"  # decode steps are captured with a static cache
        return stats
    stats.reason = why
    if strict:
        raise RuntimeError(f"kernelize(strict=True): graphs were asked for and not captured: {why}")
    warnings.warn(f"kernelize: graphs not captured ({why}); the model runs without them", RuntimeWarning, stacklevel=3)
    return stats


def _static_layers(cache) -> list | None:
    """The cache's layers when each keeps its tensors at fixed addresses and its position on the
    device (transformers' StaticLayer; its sliding form counts on the host), else None."""
    try:
        from transformers.cache_utils import StaticLayer
    except ImportError:
        return None
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not StaticLayer or not layer.is_initialized for layer in layers):
        return None
    return layers


def _tensors(layer) -> tuple:
    return layer.keys, layer.values, layer.cumulative_length


def _layout(layers) -> tuple:
    """What a step's graph fixes of a cache: each layer's tensors' shapes and dtypes, and whether
    they are inference tensors (a cache made under inference_mode writes in place only there)."""
    return tuple((t.shape, t.dtype, t.is_inference()) for layer in layers for t in _tensors(layer))


class _Step:
    """One decode step's graph: its tensor inputs copied into static ones, and the cache tensors it
    reads and writes (held here, so that they outlive the cache they were made for)."""

    def __init__(self, kwargs: dict, layers):
        self.inputs = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        self.targets = list(self.inputs.values())
        self.tensors = [_tensors(layer) for layer in layers]
        self.holders = [weakref.ref(layer) for layer in layers]  # the layers that hold them now
        self.graph = None
        self.out = None
        self.cache_at: list = []  # where the output holds the cache (keys, or indices of a tuple)

    def holds(self, layers) -> bool:
        return all(layer.keys is mine[0] for layer, mine in zip(layers, self.tensors))

    def adopt(self, layers) -> None:
        """Serves a new cache of the captured one's layout: its contents go into the graph's
        tensors, which it then holds. A cache that held them and is still alive gets copies, so
        that each cache keeps its own contents."""
        with torch.inference_mode(self.tensors[0][0].is_inference()), torch.no_grad():
            for i, layer in enumerate(layers):
                mine, before = self.tensors[i], self.holders[i]()
                if before is not None and before is not layer and before.keys is mine[0]:
                    before.keys, before.values, before.cumulative_length = (t.clone() for t in mine)
                for m, t in zip(mine, _tensors(layer)):
                    m.copy_(t)
                layer.keys, layer.values, layer.cumulative_length = mine
                self.holders[i] = weakref.ref(layer)


class _Steps:
    """Decode steps of the batches asked for: each (cache, batch, input shapes) runs eagerly once,
    is captured at its second call and replayed after."""

    LIMIT = 16  # graphs kept: a new cache (another max length) each generate would otherwise grow them

    def __init__(self, batches: set, forward, stats: GraphStats):
        self.batches, self.forward, self.stats = batches, forward, stats
        self.graphs: dict[tuple, _Step] = {}
        self.seen: set = set()
        # A static cache's layers and layout, once per cache: its tensors keep their shapes, and
        # walking every layer each step costs a deep model host time on every token.
        self._caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _static(self, cache) -> tuple | None:
        """The cache's (layers, layout) if it is static (_static_layers), else None."""
        known = self._caches.get(cache)
        if known is None:
            layers = _static_layers(cache)
            if layers is None:
                return None
            known = self._caches[cache] = (layers, _layout(layers))
        return known

    def _why_not(self, model, args, kwargs, static) -> str:
        ids = kwargs.get("input_ids")
        if not self.batches:
            return "a decode step (no (batch, 1) bucket asked for)"
        if args or not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1:
            return "a call with a cache that is not one decode step of input_ids"
        if ids.shape[0] not in self.batches:
            return f"a decode step of batch {ids.shape[0]} (no ({ids.shape[0]}, 1) bucket)"
        if model.training or torch.is_grad_enabled():
            return "training mode or grad enabled"
        if static is None:
            return "a decode step with a cache that is not static (generate(..., cache_implementation='static'))"
        return ""

    def __call__(self, model, args, kwargs):
        cache = kwargs["past_key_values"]
        static = self._static(cache)
        why = self._why_not(model, args, kwargs, static)
        if why:
            self.stats.uncaptured[why] += 1
            return self.forward(*args, **kwargs)
        layers, layout = static
        key = tuple(sorted((k, (v.shape, v.dtype) if isinstance(v, torch.Tensor) else layout if v is cache else id(v)) for k, v in kwargs.items()))
        step = self.graphs.get(key)
        if step is None:
            if key not in self.seen or len(self.graphs) >= self.LIMIT:  # the first call loads what the step needs
                if len(self.seen) > 4 * self.LIMIT:  # keys that never repeat must not pile up
                    self.seen.clear()
                self.seen.add(key)
                self.stats.uncaptured["a decode step's first call (it is captured at its second)"] += 1
                return self.forward(*args, **kwargs)
            step = self._capture(kwargs, layers)
            self.graphs[key] = step
        else:
            if not step.holds(layers):  # another cache of this layout (generate makes one per call)
                step.adopt(layers)
            torch._foreach_copy_(step.targets, [kwargs[k] for k in step.inputs])  # one call, not one per input
        step.graph.replay()
        self.stats.replays[(kwargs["input_ids"].shape[0], 1)] += 1
        return _put_cache(_cut(step.out), step.cache_at, cache)  # the call's own cache, which generate goes on with

    def _capture(self, kwargs: dict, layers) -> _Step:
        """Records the step (capture runs nothing: the cache does not advance); the replay after it
        is this call's own step."""
        t = time.perf_counter()
        with torch.inference_mode(False), torch.no_grad():  # normal tensors: a replay copies into them under any mode
            step = _Step(kwargs, layers)
        others = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}  # the cache: not kept after
        step.graph = torch.cuda.CUDAGraph()
        with step_capture(layers), torch.cuda.graph(step.graph, capture_error_mode="thread_local"):
            out = self.forward(**step.inputs, **others)
        cache = kwargs["past_key_values"]
        step.cache_at = [k for k, v in (out.items() if hasattr(out, "keys") else enumerate(out)) if v is cache]
        step.out = _put_cache(out, step.cache_at, None)  # the step keeps the cache's tensors, not the cache
        self.stats.steps += 1
        self.stats.capture_s += time.perf_counter() - t
        return step


@contextlib.contextmanager
def step_capture(layers):
    """The mode a decode step is captured in (also how a test runs one without CUDA): the mode its
    static cache's tensors were made in, since the step writes them in place and an inference
    tensor allows that only in inference mode; grad off (inference_mode(False) turns it on, and
    with grad on every served module would run its own forward); the mask taken as checked."""
    with torch.inference_mode(layers[0].keys.is_inference()), torch.no_grad(), _capturing():
        yield


def run(forward, g: _Graph, fixed: dict):
    """The forward a graph captures, on its static inputs (also how a test runs it without CUDA)."""
    with _capturing():
        return forward(input_ids=g.ids, attention_mask=g.mask, **fixed)


def _head(model, out) -> tuple:
    """(head, '') when the model's output embedding is a plain nn.Linear whose output is `out`'s
    logits, else (None, why); (None, '') for a model without one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        return None, ""
    if type(head) is not torch.nn.Linear or not hasattr(out, "keys") or not isinstance(out.get("logits"), torch.Tensor):
        return None, "not an nn.Linear whose output is the logits"
    return head, ""


def _head_after(outputs, head, logits: torch.Tensor) -> str:
    """'' when `head` run on the logits of the forward without it (`outputs()`, called with the
    head left out) gives the whole forward's `logits`, else why not."""
    try:
        with _without(head):
            held = outputs()["logits"]
        if torch.equal(head(held), logits):
            return ""
    except Exception as exc:  # a forward that reshapes or recasts its logits after the head, say
        return f"the forward without it fails: {type(exc).__name__}: {exc}"
    return "its logits after the replay differ from the whole forward's"


@contextlib.contextmanager
def _without(head):
    """`head` passes its input through (an instance attribute: the class and other modules are
    untouched), so a forward's logits are the hidden states the head would read."""
    head.forward = _identity
    try:
        yield
    finally:
        del head.forward


def _identity(x):
    return x


def _put_cache(out, where: list, cache):
    """`out` with `cache` at `where` (keys of a ModelOutput, or indices of a tuple)."""
    if not where:
        return out
    if hasattr(out, "keys"):
        for k in where:
            out[k] = cache
        return out
    items = list(out)
    for i in where:
        items[i] = cache
    return type(out)(items)


def _cut(out, bucket: tuple[int, int] | None = None, call: tuple[int, int] | None = None, head=None):
    """The graph's outputs as the call's own, copied out of the graph's memory; with a bucket,
    cut to the call's [batch, tokens] where they are the bucket's; with a `head`, the logits are
    that head's output of what the graph left in their place (no copy)."""
    batch, tokens = bucket or (-1, -1)
    b, s = call or (-1, -1)

    def view(t):
        if t.dim() >= 2 and t.shape[0] == batch and t.shape[1] == tokens:
            return t[:b, :s]
        if t.dim() >= 1 and t.shape[0] == batch:
            return t[:b]
        return t

    def cut(t):
        return view(t).clone() if isinstance(t, torch.Tensor) else t

    def field(k, v):
        if k == "logits" and head is not None:
            return head(view(v))
        return tuple(cut(x) for x in v) if isinstance(v, tuple) else cut(v)

    if isinstance(out, torch.Tensor):
        return cut(out)
    if isinstance(out, tuple) and not hasattr(out, "keys"):
        return type(out)(cut(t) if not isinstance(t, tuple) else tuple(cut(x) for x in t) for t in out)
    return type(out)(**{k: field(k, v) for k, v in out.items()})
