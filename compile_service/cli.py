"""`kernel-service`: the command line, parsed here and run by compile_service/commands/: serve,
stop, info, stats, zero-stats (commands.daemon); ls, prune, clear, verify, kinds, manifest,
explain (commands.cache); prewarm (commands.prewarm, commands.fill_tier); bundle
export|import|verify|info|key (commands.bundle); flags-markdown (commands.flags_markdown).

A flag that names one of the daemon's settings is made from its Setting (config.SETTINGS):
its name, variable, type and choices are declared once; a command says only what it means to it.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from .commands import bundle, cache, daemon, prewarm
from .commands.flags_markdown import flags_markdown
from .commands.output import fail


def _flag_type(parse):
    """An argparse type from a parse function (a setting's, a Range's): its ValueError's message is what argparse says."""
    if parse is str:
        return None

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def _setting_help(name: str, setting) -> str:
    from .config import shown_default

    if setting.form == "switch":
        return f"{setting.help} (or ${setting.env}=1)"
    more = f"repeatable, ${setting.env} holds several, '{setting.split}'-separated; " if setting.form == "repeat" else ""
    return f"{setting.help} ({more}default: ${setting.env}, else {shown_default(name)})"


def _add_setting_flag(p, name: str, help: str, **more) -> argparse.Action:
    """The flag of setting `name` as one command takes it: its name, metavar, type, choices and
    form from the settings table, its meaning for this command in `help`. Not given: None."""
    from .config import _DEFAULTS, SETTINGS

    s = SETTINGS[name]
    how = {"dest": name, "default": None, "help": help.replace("%", "%%"), **more}
    if s.form == "switch":
        how.update(action="store_const", const=not _DEFAULTS[name])
    else:
        how.update(metavar=s.metavar, type=_flag_type(s.parse), choices=s.choices, action="append" if s.form == "repeat" else "store")
    return p.add_argument(s.flag, **how)


def add_setting_flags(p: argparse.ArgumentParser, before_command: bool = False) -> None:
    """The flags that configure a daemon, one per setting of ServiceConfig (config.py): `serve`
    takes them, `info` shows what they resolve to; the logging settings' flags come before any
    command (`before_command`). A flag not given is None: the setting's variable or default
    applies (ServiceConfig.resolve)."""
    from .config import SETTINGS

    groups = {}
    for name, s in SETTINGS.items():
        if s.before_command != before_command:
            continue
        into = p if s.group is None else groups.setdefault(s.group, p.add_argument_group(s.group))
        _add_setting_flag(into, name, _setting_help(name, s)).setting = True  # marked for cli_markdown, which lists settings apart


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line too, naming the command's --help."""

    def error(self, message: str):
        self.exit(2, f"kernel-service: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .config import POSITIVE_SECONDS, SETTINGS, SIZE_FORMS
    from .provenance import SIGNING_KEY  # light: names only

    parser = _Parser(prog="kernel-service", description="TileLang kernel-compilation daemon")
    parser.add_argument("--version", action="version", version=f"kernel-service {__version__}")
    add_setting_flags(parser, before_command=True)  # --log-level, --log-format
    sub = parser.add_subparsers(dest="command", required=True)
    cache_help = "cache root (default $KERNEL_SERVICE_CACHE_DIR, then $XDG_CACHE_HOME/kernel-service)"
    socket_help = "Unix socket path of the daemon (default $KERNEL_SERVICE_SOCKET, then the XDG path)"
    json_help = "machine-readable output"

    def command(name: str, run, help: str, parents=(), into=sub) -> argparse.ArgumentParser:
        p = into.add_parser(name, help=help, parents=list(parents))
        if run is not None:  # `bundle`: its subcommands run
            p.set_defaults(run=run)
        return p

    p = command("serve", daemon.serve, "run the daemon until SIGTERM or `kernel-service stop`")
    add_setting_flags(p)
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop (draining, as on SIGTERM) within a second of the process that started this one exiting: for launchers such as tests and benchmarks, never under a supervisor",
    )

    p = command("stop", daemon.stop, "stop the daemon gracefully: it refuses new requests and lets running compiles finish (its --grace)")
    _add_setting_flag(p, "socket", socket_help)
    p.add_argument("--timeout", type=_flag_type(POSITIVE_SECONDS.parse), default=60.0, help="seconds to wait for it to exit (default 60); exit 1 if it has not")

    p = command(
        "info", daemon.info, "the resolved configuration and where each value came from: the running daemon's, else what `serve` with these flags would use"
    )
    add_setting_flags(p)
    p.add_argument("--json", action="store_true", help=json_help)

    p = command("stats", daemon.stats, "print the daemon's counters (totals since the last zero-stats; they survive restarts) and its state now")
    _add_setting_flag(p, "socket", socket_help)
    p.add_argument("--json", action="store_true", help=json_help)

    p = command("zero-stats", daemon.zero_stats, "set the counters to zero: the running daemon's, else those the next daemon on --cache-dir starts from")
    _add_setting_flag(p, "socket", socket_help)
    _add_setting_flag(p, "cache_dir", cache_help + "; used when no daemon runs")

    p = command("kinds", cache.kinds, "list the kernel kinds the daemon serves, with each parameter's type, default and meaning")
    _add_setting_flag(p, "socket", "Unix socket path of the daemon (default: the default socket; without a daemon, the kinds installed here)")
    _add_setting_flag(p, "kernel_modules", "with no daemon: also list these modules' kinds")
    p.add_argument("--json", action="store_true", help=json_help)

    p = command("ls", cache.ls, "list the cache's entries, least recently used first: spec, size, last use, how built")
    _add_setting_flag(p, "cache_dir", cache_help)
    p.add_argument("--json", action="store_true", help=json_help)

    p = command("prune", cache.prune, "remove least recently used entries (and device binaries) until the cache fits; safe while a daemon serves it")
    _add_setting_flag(p, "max_bytes", f"the size to fit in: {SIZE_FORMS}", required=True)
    p.add_argument(
        "--min-age",
        type=_flag_type(SETTINGS["evict_min_age"].parse),
        default=300.0,
        metavar="SECONDS",
        help="keep entries used this recently, whatever the size (default 300, as serve --evict-min-age)",
    )
    _add_setting_flag(p, "cache_dir", cache_help)

    p = command(
        "clear", cache.clear, "remove every entry and device binary from the cache (torch.compile's directory is left alone); safe while a daemon serves it"
    )
    _add_setting_flag(p, "cache_dir", cache_help)

    p = command("verify", cache.verify, "check every cache entry against its manifest; exit 1 on damage left unrepaired")
    _add_setting_flag(p, "cache_dir", cache_help)
    p.add_argument("--repair", action="store_true", help="remove damaged entries and dead writers' staging dirs (safe while a daemon runs)")
    p.add_argument("--json", action="store_true", help=json_help)

    p = command("manifest", cache.manifest, "write the kernels an application asked for (recorded by the daemon) as a manifest")
    p.add_argument("--app", required=True, help="the application's name, as its clients pass it (client.connect(app=NAME), KERNEL_SERVICE_APP)")
    p.add_argument("-o", "--output", metavar="FILE", help="write here (atomically) instead of to stdout")
    _add_setting_flag(p, "cache_dir", cache_help)

    p = command("prewarm", prewarm.prewarm, "build what the manifests list and the cache lacks, at prefetch priority; exit 1 if any failed")
    p.add_argument("manifests", nargs="+", metavar="MANIFEST", help="manifest files (`kernel-service manifest -o FILE`)")
    _add_setting_flag(p, "socket", socket_help)
    p.add_argument("--timeout", type=_flag_type(POSITIVE_SECONDS.parse), default=3600.0, help="seconds the whole prewarm may take (default 3600)")
    _add_setting_flag(
        p,
        "remote",
        "fill this fleet tier (a redis:// URL with a writer's credentials) without any daemon: build here what it lacks and upload it; --socket is not used",
    )
    _add_setting_flag(p, "cache_dir", "with --remote: where the builds are kept (default: a temporary directory, removed at the end)")
    _add_setting_flag(p, "cuda_compiler", "with --remote: how CUDA kernels are compiled, as for serve (default auto)")
    _add_setting_flag(p, "workers", "with --remote: compile workers (default: the CPU quota)")
    _add_setting_flag(p, "worker_start", "with --remote: how compile workers start, as for serve (default: $KERNEL_SERVICE_WORKER_START, else zygote)")
    _add_setting_flag(p, "kernel_modules", "with --remote: also build these modules' kinds (repeatable)")

    bundles = command(
        "bundle", None, "pack cache entries for another host (signed, per arch, compressed), inspect such a pack, check it, or import it"
    ).add_subparsers(dest="bundle_command", required=True)
    keying = argparse.ArgumentParser(add_help=False)
    _add_setting_flag(keying, "cache_dir", cache_help)
    _add_setting_flag(keying, "cuda_compiler", "the CUDA compiler whose keys to use, as for serve (default auto)")
    _add_setting_flag(keying, "cuda_compiler_id", "key CUDA kernels as if built by this compiler (e.g. nvrtc-13.0): for a host that does not compile")
    _add_setting_flag(keying, "kernel_modules", "also know these modules' kinds (repeatable)")
    trusting = argparse.ArgumentParser(add_help=False)
    trusting.add_argument(
        "--trusted-key",
        action="append",
        default=[],
        metavar="PATH",
        help="accept bundles signed by this Ed25519 public key (PEM, as `bundle key` prints it; repeatable); "
        "default: the files $KERNEL_SERVICE_TRUSTED_KEYS lists, ':'-separated",
    )
    trusting.add_argument("--trust-unsigned", action="store_true", help="also accept a bundle that no trusted key signed: only from a builder you trust")
    _add_setting_flag(
        trusting,
        "target",
        "the CUDA arch this host serves (as its daemon's serve --target), for a host whose GPU nvidia-smi does not show: "
        "a CPU-only builder, an image build; default: the local GPU's, else only target c",
    )
    trusting.add_argument("--any-arch", action="store_true", help="accept kernels for arches this host cannot run")
    bundle_file = "a file made by `kernel-service bundle export`"

    p = command(
        "export",
        bundle.export,
        "pack exactly the manifest's entries, with their digests and toolchain, into one file signed by this cache's key",
        [keying],
        bundles,
    )
    p.add_argument("--manifest", required=True, metavar="FILE", help="the kernels to pack (`kernel-service manifest -o FILE`)")
    p.add_argument(
        "-o", "--output", required=True, metavar="BUNDLE", help="the bundle to write: .tar.xz/.txz xz-compressed (smallest), .tar.gz/.tgz gzip, else plain tar"
    )
    _add_setting_flag(p, "target", "pack only the manifest's kernels for this target (sm_90a, c, ...); default: all of them")
    p.add_argument(
        "--signing-key",
        metavar="PATH",
        help=f"sign with this Ed25519 private key (PEM, mode 0600); default: the cache's own, <cache dir>/{SIGNING_KEY}, made on first use",
    )
    p.add_argument("--no-sign", action="store_true", help="write an unsigned bundle (importers then need --trust-unsigned)")
    p = command(
        "import",
        bundle.import_,
        "check who wrote and signed the bundle, every digest, the toolchain and the arches, then publish its entries into the cache",
        [keying, trusting],
        bundles,
    )
    p.add_argument("bundle", metavar="BUNDLE", help=f"{bundle_file}, owned by you or root and writable by no one else")
    p.add_argument(
        "--layer",
        metavar="PATH",
        help="instead, lay the entries out at PATH (new or empty) as a read-only cache layer (dirs 0555, files 0444) for `serve --cache-layer`, e.g. in an image",
    )
    p = command("verify", bundle.verify, "make every check import makes (signature, digests, toolchain, arches); publish nothing", [keying, trusting], bundles)
    p.add_argument("bundle", metavar="BUNDLE", help=bundle_file)
    p = command("info", bundle.info, "list a bundle's entries and its size by kind and arch, from its index (nothing is checked)", into=bundles)
    p.add_argument("bundle", metavar="BUNDLE", help=bundle_file)
    p.add_argument("--json", action="store_true", help=json_help)
    p = command("key", bundle.key, "print the public key bundles exported here are signed with, for importers' --trusted-key", into=bundles)
    _add_setting_flag(p, "cache_dir", cache_help + "; its key is made on first use")
    p.add_argument("--signing-key", metavar="PATH", help="the public half of this private key instead")

    p = command(
        "explain",
        cache.explain,
        "say whether a kernel is in the cache, what its key is made of, and for a miss which fields the nearest entries differ in; exit 1 on a miss",
    )
    p.add_argument("kind", help="kernel kind, e.g. gemm")
    p.add_argument("params", nargs="*", metavar="NAME=VALUE", help="parameters, e.g. N=4096 dtype=float16 M=none")
    _add_setting_flag(p, "target", "c, auto or a CUDA arch such as sm_90a (default: the daemon's)")
    _add_setting_flag(p, "socket", socket_help)
    p.add_argument("--json", action="store_true", help=json_help)

    command(
        "flags-markdown", functools.partial(flags_markdown, parser), "print docs/cli.md: these commands, their flags and the daemon's settings, as markdown"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    try:  # first (the parser's defaults import proto): a foreign `proto` or `kernels` is said in one line, for every command
        from proto.clashes import check

        check()
    except ImportError as exc:
        return fail(str(exc))
    from . import logs
    from .config import resolve_setting

    args = build_parser().parse_args(argv)
    try:
        logs.configure(resolve_setting("log_level", args.log_level)[0], resolve_setting("log_format", args.log_format)[0])
    except ValueError as exc:  # a bad variable (argparse checked the flags)
        return fail(str(exc), 2)
    try:
        return args.run(args)
    except BrokenPipeError:  # `kernel-service stats | head -1`: the reader left, as with any Unix tool
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes at exit
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it


if __name__ == "__main__":
    sys.exit(main())
