"""`kernel-service prewarm`: the running daemon builds what the manifests list and the cache
lacks, at prefetch priority; with --remote, this process fills the fleet tier (fill_tier)."""

from __future__ import annotations

import json

from .asking import ask
from .output import fail, progress
from .specs import label, load_manifests, params_of, summary, with_routes


def prewarm(args) -> int:
    import grpc

    from proto import channel, wire
    from proto.kernelservice.v1 import kernel_service_pb2 as pb
    from proto.kernelservice.v1 import kernel_service_pb2_grpc as pb_grpc
    from proto.manifest import ManifestError

    try:
        specs = with_routes(load_manifests(args.manifests))
    except ManifestError as exc:
        return fail(str(exc), 2)
    if args.remote:
        from .fill_tier import fill_tier

        return fill_tier(args, specs)
    address = channel.target(args.socket)
    try:  # one Prefetch may queue a quarter of the daemon's --queue-limit compiles: batches that fit
        config = json.loads(ask(args.socket, "GetServiceInfo", pb.GetServiceInfoRequest()).config_json or "{}")
    except ConnectionError as exc:
        return fail(str(exc))
    batch_size = max(1, min(wire.MAX_BATCH, config.get("queue_limit", {}).get("value", 1024) // 4))
    built, present, failed = [], [], []  # failed: (spec, reason)
    bar = progress(len(specs))
    todo = list(range(len(specs)))
    metadata = channel.auth_metadata(address)  # readable: GetServiceInfo above carried it
    with channel.open_channel(address) as ch:
        stub = pb_grpc.KernelServiceStub(ch)
        while todo:
            batch = todo[:batch_size]
            request = pb.PrefetchRequest(specs=[wire.spec_to_proto(specs[i]["kind"], params_of(specs[i]), specs[i]["target"]) for i in batch])
            try:
                for event in stub.Prefetch(request, timeout=args.timeout, metadata=metadata):
                    spec = specs[batch[event.index]]
                    if event.error_code:
                        failed.append((spec, f"{event.error_code}: {event.error_message}"))
                        word = "FAILED"
                    elif event.kernel.outcome == pb.OUTCOME_HIT:
                        present.append(spec)
                        word = "already there"
                    else:
                        built.append(spec)
                        word = "built"
                    bar(f"{word:<13} {label(spec)}")
            except grpc.RpcError as err:
                # One invalid spec fails a whole batch before any work: report it, and prewarm the rest.
                refused = channel.refused_spec(err, len(batch))
                if refused is None:
                    return fail(f"prewarm stopped: the daemon at {address} answered {err.code().name}: {err.details()}")
                i = batch[refused[0]]
                failed.append((specs[i], f"INVALID_ARGUMENT: {str(refused[1]).split(': ', 1)[-1]}"))
                bar(f"{'FAILED':<13} {label(specs[i])}")
                todo.remove(i)
                continue
            todo = todo[len(batch) :]
    return summary(built, present, failed, len(specs))
