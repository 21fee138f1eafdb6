"""What each `kernel-service` command does; compile_service/cli.py parses the command line and
calls one of these with its arguments. Each command returns its exit status; every failure is
one line on stderr (output.fail), naming the problem and the fix.

Modules: daemon (serve, stop, info, stats, zero-stats), cache (ls, prune, clear, verify, kinds,
manifest, explain), bundle (bundle export|import|verify|info|key), prewarm (through a daemon),
fill_tier (prewarm --remote: no daemon), asking (one call to a running daemon), specs (manifests
and how a spec is shown), output (failures, sizes, times, progress), flags_markdown (docs/cli.md).
"""
