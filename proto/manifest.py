"""Manifests: the kernels an application needs, as a file people read and tools replay.

    {"format": "kernel-service-manifest", "version": 1, "app": "llama3-8b",
     "kernels": [{"kind": "gemm", "target": "sm_90a",
                  "params": {"M": null, "N": 14336, "K": 4096, "dtype": "float16", ...}}, ...]}

One canonical spec per kernel (every default filled in), with its resolved
target. The daemon records what each application asks for (compile_service.apps);
`kernel-service manifest --app NAME` writes it in this form; `kernel-service
prewarm`, `client.prefetch(manifest)` and `kernel-service bundle export` read
it. Application names are defined here too: both sides check them.
"""

from __future__ import annotations

import json
import os
import re

from .errors import InvalidSpec
from .jsondepth import load_json
from .trust import NotRegularFile, open_regular

FORMAT = "kernel-service-manifest"
VERSION = 1
MAX_KERNELS = 100_000  # per manifest (a recorded application keeps fewer: compile_service.apps)
WRITE_ONE = "write one with `kernel-service manifest --app NAME -o FILE`"
_APP = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")


class ManifestError(ValueError):
    """A file that is not a manifest this version reads; the message names the problem."""


def check_app(name: str) -> str:
    """`name` if it can name an application (and its file under <cache>/apps/), else InvalidSpec."""
    if not isinstance(name, str) or not _APP.fullmatch(name):
        raise InvalidSpec("app", f"application names are 1-64 characters of A-Z a-z 0-9 . _ - not starting with a dot, got {name!r}")
    return name


def make(app: str | None, specs: list[dict]) -> dict:
    """A manifest of canonical specs ({"kind", "params", "target"}), in the order given."""
    kernels = [{"kind": s["kind"], "target": s["target"], "params": s["params"]} for s in specs]
    return {"format": FORMAT, "version": VERSION, "app": app, "kernels": kernels}


def dumps(manifest: dict) -> str:
    """Readable JSON: one kernel per line."""
    head = "".join(f"  {json.dumps(k)}: {json.dumps(v)},\n" for k, v in manifest.items() if k != "kernels")
    kernels = ",\n".join(f"    {json.dumps(k, sort_keys=True)}" for k in manifest["kernels"])
    return f'{{\n{head}  "kernels": [\n{kernels}\n  ]\n}}\n'


PARAM_TYPES = (bool, int, float, str, type(None))  # what a parameter's value may be (proto.wire sends these)


def load(source: str | os.PathLike | dict) -> dict:
    """A manifest from a path or an already loaded dict, checked; raises ManifestError."""
    where = "manifest"
    if not isinstance(source, dict):
        where = str(source)
        try:
            with os.fdopen(open_regular(source, "manifest"), encoding="utf-8") as f:
                text = f.read()
        except NotRegularFile as exc:
            raise ManifestError(str(exc)) from None
        except OSError as exc:
            raise ManifestError(f"{where}: cannot read it: {exc.strerror or exc}") from None
        except ValueError as exc:  # not UTF-8
            raise ManifestError(f"{where}: not a text file ({exc})") from None
        try:
            source = load_json(text)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{where}: not JSON ({exc}); {WRITE_ONE}") from None
        except ValueError as exc:  # nested too deep
            raise ManifestError(f"{where}: not JSON this reads: {exc}; {WRITE_ONE}") from None
    if not isinstance(source, dict) or source.get("format") != FORMAT:
        raise ManifestError(f'{where}: not a kernel-service manifest (no "format": "{FORMAT}"); {WRITE_ONE}')
    if source.get("version") != VERSION:
        raise ManifestError(f"{where}: manifest version {source.get('version')!r}, this kernel-service reads version {VERSION}; upgrade kernel-service")
    kernels = source.get("kernels")
    if not isinstance(kernels, list):
        raise ManifestError(f'{where}: "kernels" must be a list')
    if len(kernels) > MAX_KERNELS:
        raise ManifestError(f"{where}: {len(kernels)} kernels, at most {MAX_KERNELS}; split it")
    for i, k in enumerate(kernels):
        if not (isinstance(k, dict) and isinstance(k.get("kind"), str) and isinstance(k.get("target"), str) and isinstance(k.get("params"), dict)):
            raise ManifestError(f"{where}: kernels[{i}] must be an object with a string kind and target and a params object")
        for name, value in k["params"].items():
            if not isinstance(value, PARAM_TYPES):
                raise ManifestError(
                    f"{where}: kernels[{i}].params.{name} is a {type(value).__name__}; parameter values are numbers, strings, true/false or null"
                )
    return source


def specs(manifest: str | os.PathLike | dict) -> list[dict]:
    """The manifest's kernels as `prefetch` takes them: {"kind", "target", **params}."""
    return [{**k["params"], "kind": k["kind"], "target": k["target"]} for k in load(manifest)["kernels"]]
