"""Developer tools built on the daemon and the client, the top of the import layers (nothing in
proto/, kernels/, compile_service/ or client/ imports them) and not shipped in the wheel: a
daemon as a child process (launch), a loopback redis-server (redis_server), the demo workload
(demo: `make demo`, or `python -m devtools.demo [CACHE_DIR [SOCKET]]` from the repository)."""
