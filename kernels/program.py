"""A TileLang program sent as IR: the kind "tilelang", what such a request may hold, and its one
canonical form.

Code written against TileLang (`@tilelang.jit`, `tilelang.compile`, `par_compile`) in an
engine's own process reaches the daemon as its PrimFunc's IR (`tvm.ir.save_json`, which
round-trips a TileLang PrimFunc exactly; spans stripped, so the text names no file or line),
with the options TileLang's own compile takes. The daemon never imports the sender's Python:
it loads the IR in a compile worker and builds what TileLang's cache would hold
(compile_service.build.programs). The request travels as one parameter, `program`, a JSON
document:

    {"ir": {...},                 the PrimFunc's IR graph: {"root_index", "nodes", "metadata"}
     "name": "main",              its global symbol, for messages
     "target": {...},             TileLang's resolved target (str(Target) as JSON), "c" or "cuda"
     "target_host": {...} | null,
     "execution_backend": "tvm_ffi" | "cython",
     "out_idx": [-1] | null,      as TileLang's cache receives it
     "pass_configs": {...},       normalized as TileLang's cache normalizes them
     "compile_flags": [...] | null}

This module decides, without TileLang, what may travel; the rule is that nothing in a request can
make a compiler read, embed or write a file, or run code when a library loads:

- every string of the IR is printable ASCII without quotes, backslashes, `#`, braces or
  semicolons (what C source needs to include or embed a file, or to define code), except
  preludes made only of `#define NAME(args) body` lines (the zoo's `grid_x`); other
  `T.import_source` / `T.Kernel(prelude=...)` source does not travel;
- compile flags come from a short list (optimisation levels, fast math, line info, `-D`/`-U`
  macros, register limits, ptxas's verbose options), none of which names a path;
- pass configs are TileLang 0.1.15's keys, less those that write files or take Python;
- node types are TVM's IR, TIR and TileLang nodes; the graph has at most MAX_NODES nodes, each
  referring only to nodes before it, at most MAX_DEPTH deep (a deeper graph crashes TVM's loader).

What does not travel is compiled in the sender's process by TileLang itself (client.tilelang),
with a warning that says why; the daemon refuses it with INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
import re

from proto.jsondepth import load_json
from proto.wire import MAX_PROGRAM
from proto.wire import PROGRAM as FIELD  # the one parameter; the wire carries it in KernelSpec.program

from .registry import register
from .spec import CUDA_ARCHS, CanonicalSpec, InvalidSpec, KernelKind, Param, Target, parse_target

KIND = "tilelang"
MAX_NODES = 1 << 20
MAX_DEPTH = 512  # the zoo's deepest graph is under 40; TVM's loader recurses once per level
MAX_STRING = 1 << 16
BACKENDS = ("tvm_ffi", "cython")  # the execution backends whose artifacts the daemon builds and loads

_TYPE_PREFIXES = ("ir.", "tirx.", "relax.", "tl.")
_TYPES = frozenset({"None", "bool", "int", "float", "ffi.String", "ffi.Array", "ffi.Map", "ffi.Shape"})
_CONTAINERS = frozenset({"ffi.Array", "ffi.Map"})  # data: node references only
_BOXED = frozenset({"int", "float", "bool"})  # data: the value itself
# Integer fields that hold values, not node references (so they may exceed the node's index).
_VALUES = frozenset(
    {
        ("ir.IntImm", "value"),
        ("ir.FloatImm", "value"),
        ("tirx.Buffer", "data_alignment"),
        ("tirx.Buffer", "offset_factor"),
        ("tirx.Buffer", "buffer_type"),
        ("tirx.For", "kind"),
        ("tirx.IterVar", "iter_type"),
        ("relax.ShapeStructInfo", "ndim"),
        ("relax.TensorStructInfo", "ndim"),
    }
)

_UNSAFE = re.compile(r"[\"'\\#{};`]|%:|\?\?|[^ -~]")
_DEFINE = re.compile(r"#define [A-Za-z_][A-Za-z0-9_]*(\([A-Za-z0-9_, ]*\))?( [^\n]*)?")

# Pass configs that travel: TileLang 0.1.15's keys (tilelang.transform.PassConfigKey), less the
# ones that write files (dump paths, visualization, output dirs), print, or take Python (extra
# lowering passes). tests/test_programs.py holds this list to TileLang's own.
PASS_CONFIGS = frozenset(
    """tl.Simplify transitively_prove_inequalities convert_boolean_to_and_of_ors apply_constraints_to_boolean_branches
    propagate_knowns_to_prove_conditional propagate_knowns_to_simplify_expressions enable_simplify_let_inline
    tl.disable_buffer_init_check tl.disable_data_race_check tl.disable_prelower_semantic_check tl.disable_warp_specialized
    tl.enable_auto_schedule tl.enable_auto_warp_specialization tl.enable_fast_math tl.ptxas_register_usage_level
    tl.device_compile_flags tl.emit_line_directives tl.config_index_bitwidth tl.layout_cost_model tl.reducer_force_baseline
    tl.disable_tma_lower tl.disable_safe_memory_legalize tl.disable_vectorize_256 tl.enable_fp32x2_reduction
    tl.enable_async_copy tl.enable_lower_ldgstg tl.enable_lower_ldgstg_predicated tl.disable_wgmma
    tl.debug_merge_shared_memory_allocations tl.enable_aggressive_shared_memory_merge tl.disable_shared_memory_reuse
    tl.disable_shuffle_elect tl.disable_loop_unswitching tl.loop_unswitching_allow_non_trivial_else
    tl.if_stmt_binding_inline_replayable_binds tl.disable_thread_storage_sync tl.force_let_inline
    tl.storage_rewrite_detect_inplace tir.enable_equiv_terms_in_cse_tir tirx.disable_cse_tir tirx.Simplify
    tirx.disable_storage_rewrite tirx.disable_vectorize tirx.use_async_copy tirx.enable_debug tirx.merge_static_smem
    tirx.noalias tl.disable_out_of_bound_warning""".split()
)
# ... and the ones that do not (kept here so that a new TileLang key is a decision, not an accident).
PASS_CONFIGS_REFUSED = frozenset(
    """tl.enable_reducer_plan_verbose tl.enable_vectorize_planner_verbose tl.ast_print_enable tl.layout_visualization_enable
    tl.layout_visualization_formats tirx.add_lower_pass cuda.kernels_output_dir tl.enable_dump_ir tl.dump_ir_path
    tl.pass_profile tl.pass_profile_threshold_ms""".split()
)
DEVICE_FLAGS = "tl.device_compile_flags"  # a pass config holding compile flags: the flags' rule applies

_PTXAS = r"(-v|--verbose|--warn-on-spills|--warn-on-local-memory-usage|-O[0-3]|--register-usage-level=[0-9]{1,2}|--allow-expensive-optimizations=(true|false))"
_FLAGS = re.compile(
    "|".join(
        [
            r"-O[0-3s]",
            r"--?use_fast_math",
            r"--?lineinfo",
            r"--generate-line-info",
            r"-w",
            r"-W(no-)?[a-z][a-z0-9-]*",
            r"-D[A-Za-z_][A-Za-z0-9_]*(=[A-Za-z0-9_.+-]*)?",
            r"-U[A-Za-z_][A-Za-z0-9_]*",
            r"--?(ftz|prec-div|prec-sqrt|fmad)=(true|false)",
            r"--?maxrregcount=[0-9]{1,4}",
            rf"(--ptxas-options=|-Xptxas=){_PTXAS}(,{_PTXAS})*",
            r"--expt-relaxed-constexpr|--expt-extended-lambda|--extended-lambda",
            r"--?std=c\+\+(14|17|20)",
        ]
    )
)


class NotTravelling(InvalidSpec):
    """A program that may not be sent to the daemon: `field` names the part, the message why."""


def _refuse(part: str, why: str):
    raise NotTravelling(f"{FIELD}.{part}", why)


def check_string(text: str, where: str) -> None:
    """A string of the IR: plain ASCII that cannot carry C source, or a prelude of #define lines."""
    if len(text) > MAX_STRING:
        _refuse(where, f"a string of {len(text)} characters, at most {MAX_STRING}")
    if "\n" in text or text.startswith("#"):
        for line in text.split("\n"):
            match = _DEFINE.fullmatch(line)
            if line and (match is None or _UNSAFE.search(match.group(2) or "")):
                _refuse(
                    where,
                    f"C source other than #define lines (T.import_source or a T.Kernel prelude: {line[:60]!r}); "
                    "it could make the compiler read or embed a file, so it is compiled where it is written",
                )
        return
    bad = _UNSAFE.search(text)
    if bad:
        _refuse(where, f"a string holding {bad.group(0)!r} ({text[:60]!r}), which could reach generated C source")


def check_flags(flags, where: str) -> list[str] | None:
    if flags is None:
        return None
    flags = [flags] if isinstance(flags, str) else flags
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        _refuse(where, "expected a list of strings")
    for flag in flags:
        if not _FLAGS.fullmatch(flag):
            _refuse(where, f"compile flag {flag[:60]!r} is not one that travels (no flag that names a file, -I, -include, -o, @file, -X...)")
    return list(flags)


def _scalar(value) -> bool:
    return value is None or isinstance(value, (bool, int, float)) or (isinstance(value, str) and not _UNSAFE.search(value))


def check_pass_configs(configs) -> dict:
    if configs is None:
        return {}
    if not isinstance(configs, dict):
        _refuse("pass_configs", "expected a mapping")
    for key, value in configs.items():
        if key not in PASS_CONFIGS:
            why = "writes files, prints or takes Python" if key in PASS_CONFIGS_REFUSED else "is not a TileLang 0.1.15 pass config"
            _refuse("pass_configs", f"{str(key)[:60]!r} {why}")
        if key == DEVICE_FLAGS:
            check_flags(value, f"pass_configs.{key}")
        elif isinstance(value, dict):
            if not all(isinstance(k, str) and _scalar(k) and _scalar(v) for k, v in value.items()):
                _refuse(f"pass_configs.{key}", "expected plain values")
        elif not _scalar(value):
            _refuse(f"pass_configs.{key}", f"expected a bool, number or plain string, got {type(value).__name__}")
    return configs


def check_target(target, where: str, host: bool = False) -> dict | None:
    """TileLang's resolved target as JSON: kind "c", or "cuda" with an arch TileLang builds for
    (a host: "c" or "llvm"); attribute values plain."""
    if target is None and host:
        return None
    if not isinstance(target, dict):
        _refuse(where, "expected a target as JSON (str(tvm.target.Target))")
    kinds = ("c", "llvm") if host else ("c", "cuda")
    if target.get("kind") not in kinds:
        _refuse(where, f"target kind {str(target.get('kind'))[:20]!r} does not travel; only {' and '.join(kinds)}")
    if target["kind"] == "cuda" and target.get("arch") not in CUDA_ARCHS:
        _refuse(where, f"CUDA arch {str(target.get('arch'))[:20]!r} is not one TileLang 0.1.15 builds for")
    for key, value in target.items():
        if key == "host":
            check_target(value, f"{where}.host", host=True)
        elif key == "libs" or not _scalar(key) or not (_scalar(value) or (isinstance(value, list) and all(_scalar(v) for v in value))):
            _refuse(where, f"target attribute {str(key)[:40]!r} does not travel")
    return target


def _scan(value, field, refs: list, strings: list) -> None:
    """Collects (field, integer) into `refs` and every string (dict keys too) into `strings`."""
    kind = type(value)
    if kind is int:
        refs.append((field, value))
    elif kind is str:
        strings.append(value)
    elif kind is list:
        for item in value:
            _scan(item, field, refs, strings)
    elif kind is dict:
        for name, item in value.items():
            strings.append(name)
            _scan(item, name, refs, strings)


def check_strings(strings: list[str], where: str) -> None:
    """check_string on each, the plain ones (nearly all) with one search over them joined."""
    if strings and max(map(len, strings)) > MAX_STRING:
        _refuse(where, f"a string of {max(map(len, strings))} characters, at most {MAX_STRING}")
    if _UNSAFE.search(" ".join(strings)):  # a space joins them: it cannot complete a digraph or trigraph
        for text in strings:
            check_string(text, where)


def check_ir(ir) -> dict:
    """A PrimFunc's IR graph as tvm.ir.save_json writes it, bounded and safe to load."""
    if not isinstance(ir, dict) or not isinstance(ir.get("nodes"), list) or not isinstance(ir.get("root_index"), int):
        _refuse("ir", "expected a TVM IR graph (tvm.ir.save_json): root_index and nodes")
    extra = sorted(set(ir) - {"root_index", "nodes", "metadata"})
    if extra:
        _refuse("ir", f"unexpected field {extra[0][:40]!r} (tensor constants do not travel)")
    nodes = ir["nodes"]
    if not 0 < len(nodes) <= MAX_NODES or not 0 <= ir["root_index"] < len(nodes):
        _refuse("ir", f"expected 1 to {MAX_NODES} nodes and a root among them")
    strings: list[str] = []
    _scan(ir.get("metadata", {}), None, [], strings)
    depth = [0] * len(nodes)
    for i, node in enumerate(nodes):
        kind = node.get("type") if type(node) is dict else None
        if type(kind) is not str or not (kind in _TYPES or kind.startswith(_TYPE_PREFIXES)):
            _refuse("ir", f"node {i}: type {str(kind)[:40]!r} does not travel (only TVM IR, TIR and TileLang nodes)")
        if len(node) > 2 or (len(node) == 2 and "data" not in node):
            _refuse("ir", f"node {i}: unexpected fields")
        refs: list = []
        _scan(node.get("data"), None, refs, strings)
        deepest = 0
        if kind not in _BOXED:
            for field, ref in refs:
                if kind not in _CONTAINERS and (kind, field) in _VALUES:
                    continue
                # Any other integer may be a reference: only to a node before this one (a forward
                # or self reference can make a cycle, which TVM's loader follows until it crashes).
                # Values in fields not listed in _VALUES count as references too: the depth is
                # then an upper bound, and a value past the node's index refuses the program.
                if not 0 <= ref < i:
                    _refuse("ir", f"node {i} ({kind}): field {field or 'item'} refers to node {ref}, not to one before it")
                if depth[ref] > deepest:
                    deepest = depth[ref]
        depth[i] = deepest + 1
        if deepest >= MAX_DEPTH:
            _refuse("ir", f"nested more than {MAX_DEPTH} levels deep")
    check_strings(strings, "ir")
    if nodes[ir["root_index"]].get("type") != "tirx.PrimFunc":
        _refuse("ir", "the root is not a PrimFunc")
    return ir


def check_program(doc) -> dict:
    """The program document, checked; raises NotTravelling naming the part that may not travel."""
    if not isinstance(doc, dict):
        _refuse("", "expected a JSON object")
    fields = {"ir", "name", "target", "target_host", "execution_backend", "out_idx", "pass_configs", "compile_flags"}
    if set(doc) != fields:
        _refuse(sorted(set(doc) ^ fields)[0], f"a program has exactly the fields {', '.join(sorted(fields))}")
    if not isinstance(doc["name"], str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", doc["name"]):
        _refuse("name", "expected the PrimFunc's global symbol, an identifier")
    if doc["execution_backend"] not in BACKENDS:
        _refuse("execution_backend", f"{str(doc['execution_backend'])[:20]!r} does not travel; only {', '.join(BACKENDS)}")
    out_idx = doc["out_idx"]
    if out_idx is not None and not (
        isinstance(out_idx, list) and len(out_idx) <= 64 and all(isinstance(i, int) and not isinstance(i, bool) and -1024 < i < 1024 for i in out_idx)
    ):
        _refuse("out_idx", "expected null or a list of parameter indices")
    check_target(doc["target"], "target")
    check_target(doc["target_host"], "target_host", host=True)
    check_pass_configs(doc["pass_configs"])
    check_flags(doc["compile_flags"], "compile_flags")
    check_ir(doc["ir"])
    return doc


def canonical_text(doc: dict) -> str:
    """The one text of a checked program: what its key hashes."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)


def service_target(doc: dict) -> str:
    """The daemon's name for the program's target: "c", or its CUDA arch."""
    return "c" if doc["target"]["kind"] == "c" else doc["target"]["arch"]


def parse(text: str) -> dict:
    """The document in a program's text, bounded (raises NotTravelling)."""
    if not isinstance(text, str):
        _refuse("", f"expected the program's JSON text, got {type(text).__name__}")
    if len(text) > MAX_PROGRAM:
        _refuse("", f"{len(text)} characters, at most {MAX_PROGRAM}")
    try:
        return load_json(text, max_depth=16)
    except ValueError as exc:
        _refuse("", f"not JSON: {exc}")


@register
class TileLangProgram(KernelKind):
    """Any TileLang PrimFunc, sent as IR by client.tilelang (TileLang's own API, served)."""

    name = KIND
    doc = "A TileLang program sent as IR by a process that runs TileLang's own API (client.install_tilelang_cache)."
    params = (Param(FIELD, str, doc="the program as JSON: its IR, target, out_idx, pass_configs, compile_flags (kernels.program)"),)
    artifact = "tilelang"  # TileLang's own cache entry (compile_service.build.programs), loaded by TileLang

    def canonicalize(self, raw: dict, target: Target) -> CanonicalSpec:
        extra = sorted(set(raw) - {FIELD})
        if extra or FIELD not in raw:
            raise InvalidSpec(extra[0] if extra else FIELD, f"kind {KIND!r} takes one parameter, {FIELD!r}")
        doc = check_program(parse(raw[FIELD]))
        if str(target) != service_target(doc) and not target.auto:
            raise InvalidSpec("target", f"the program is for {service_target(doc)!r}, not {target.describe()}")
        return CanonicalSpec(KIND, {FIELD: canonical_text(doc)}, parse_target(service_target(doc)))

    def build(self, p: dict, target: Target):
        """The PrimFunc (loaded in a compile worker; TileLang imported there)."""
        import tvm

        return tvm.ir.load_json(json.dumps(json.loads(p[FIELD])["ir"]))

    def label(self, p: dict, target: Target) -> str:
        import hashlib

        doc = json.loads(p[FIELD])
        return f"tilelang {doc['name']} (program {hashlib.sha256(p[FIELD].encode()).hexdigest()[:12]}, target {target})"
