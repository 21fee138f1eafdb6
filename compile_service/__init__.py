"""The kernel-compilation daemon: owns the cache, compiles each kernel once.

Modules, in the order a request flows through them:
    servicer   gRPC <-> domain (thin)
    scheduler  single-flight table, priority queue, compile pool
    compiler   the one place that calls TileLang (runs in worker processes)
    nvrtc      CUDA device code -> cubin in process, with precompiled headers
    store      on-disk entries: staging, atomic publish, integrity checks
    keys       canonical spec + toolchain fingerprint -> key
    server     process lifecycle: socket, health, signals, drain, workers forked from a zygote after SERVING
    metrics    the one metrics object (counters kept across restarts); exporter: its Prometheus view
    config, cpus, inductor, embedded, cli
(the developer tools built on it and the client, launch, redis_server and demo, are devtools/, which the wheel leaves out)
"""

__version__ = "0.1.0"
