"""`kernel-service prewarm --remote`: no daemon. This process builds, with a daemon's own store,
scheduler and workers (server.assemble), what the manifests list and the fleet tier lacks, and
uploads it there (the write-behind of a daemon on the tier, waited for); it serves nothing.
Builds stay in --cache-dir, by default a temporary directory removed at the end."""

from __future__ import annotations

import time
from pathlib import Path

from .output import fail, progress
from .specs import label, params_of, summary


def _tier_config(args, queue_limit: int):
    """A daemon's configuration for this prewarm: its flags, else their variables, as serve
    resolves them; it compiles and writes the tier whatever the environment says. ValueError: a bad flag."""
    from ..config import ServiceConfig

    given = {
        "cache_dir": args.cache_dir,
        "workers": args.workers,
        "worker_start": args.worker_start,
        "cuda_compiler": args.cuda_compiler,
        "kernel_modules": args.kernel_modules,
        "remote": args.remote,
        "queue_limit": queue_limit,
    }
    return ServiceConfig.resolve(**given, remote_read_only=False, no_compile=False, cache_layers=())


def fill_tier(args, specs: list[dict]) -> int:
    import dataclasses
    import shutil
    import tempfile

    import kernels
    from kernels import plugins
    from kernels.spec import InvalidSpec

    from ..config import without_password
    from ..metrics import Metrics
    from ..scheduler import URGENT
    from ..server import assemble
    from ..store.remote import TierUnavailable

    try:
        cfg = _tier_config(args, len(specs) + 1)
        plugins.load(**cfg.plugin_args)
    except (ValueError, ImportError, LookupError) as exc:  # KernelModuleError included
        return fail(str(exc), 2)
    url = without_password(args.remote)
    root = cfg.cache_dir if args.cache_dir else Path(tempfile.mkdtemp(prefix="kernel-service-prewarm-"))
    cfg = dataclasses.replace(cfg, cache_dir=root)
    built = None
    try:
        # No zygote unless there is something to build: start_workers below.
        built = assemble(cfg, cfg.device, Metrics(), early_workers=False)
        store, scheduler, fleet = built.local, built.scheduler, built.local.claims
        wanted, failed = [], []  # wanted: (manifest spec, canonical spec); failed: (spec, reason)
        for spec in specs:
            try:
                wanted.append((spec, kernels.canonicalize(spec["kind"], params_of(spec), spec["target"])))
            except InvalidSpec as exc:
                failed.append((spec, f"INVALID_ARGUMENT: {exc}"))
        builds = {id(c): scheduler.build_keys(c) for _, c in wanted}
        every = sorted({k for keys in builds.values() for k in keys})
        try:
            there = dict(zip(every, fleet.tier.present(every)))
        except TierUnavailable as exc:
            return fail(f"cannot reach the fleet tier {url}: {exc}")
        bar = progress(len(specs))
        for spec, reason in failed:
            bar(f"{'FAILED':<13} {label(spec)}")
        present = [spec for spec, c in wanted if all(there[k] for k in builds[id(c)])]
        for spec in present:
            bar(f"{'already there':<13} {label(spec)}")
        todo = [(spec, c) for spec, c in wanted if not all(there[k] for k in builds[id(c)])]
        if todo:
            scheduler.start_workers()  # forked from the zygote once its TileLang import is done: only when there is something to build
        pending = {scheduler.request(c, URGENT)[0]: spec for spec, c in todo}
        done = []
        deadline = time.monotonic() + args.timeout
        for future in _as_completed(pending, deadline):
            spec = pending[future]
            if future.exception() is None:
                done.append(spec)
                bar(f"{'built':<13} {label(spec)}")
            else:
                failed.append((spec, f"{type(future.exception()).__name__}: {future.exception()}"))
                bar(f"{'FAILED':<13} {label(spec)}")
        failed += [(spec, f"not built within --timeout {args.timeout:g}s") for future, spec in pending.items() if not future.done()]
        # Uploaded? A build found in --cache-dir was never queued for upload: share it now.
        fleet.flush(max(1.0, deadline - time.monotonic()))
        ids = {id(spec) for spec in done}
        keys = sorted({k for spec, c in wanted if id(spec) in ids for k in builds[id(c)]})
        for key, up in zip(keys, fleet.tier.present(keys)):
            entry = None if up else store.lookup(key)
            if entry is not None:
                fleet.share(entry)
        fleet.flush(max(1.0, deadline - time.monotonic()))
        missing = {k for k, up in zip(keys, fleet.tier.present(keys)) if not up}
        for spec, c in wanted:
            if id(spec) in ids and missing & set(builds[id(c)]):
                done.remove(spec)
                failed.append((spec, f"built, but not in the fleet tier {url} after uploading (see the warnings above)"))
    except TierUnavailable as exc:
        return fail(f"the fleet tier {url} failed: {exc}")
    except OSError as exc:
        return fail(f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}")
    finally:
        if built is not None:
            built.scheduler.shutdown(10.0)
            built.local.close()
        if not args.cache_dir:
            shutil.rmtree(root, ignore_errors=True)
    return summary(done, present, failed, len(specs), f" in the fleet tier {url}")


def _as_completed(futures, deadline: float):
    """concurrent.futures.as_completed until `deadline` (time.monotonic()); what is left then is not yielded."""
    import concurrent.futures as cf

    try:
        yield from cf.as_completed(futures, timeout=max(0.0, deadline - time.monotonic()))
    except cf.TimeoutError:
        return
