"""The daemon's settings, resolved once from flags and environment; nothing reads them later.

Each setting is declared once, as a field of ServiceConfig whose metadata holds its flag, its
environment variable (named from the flag by one rule, env_name) and its help: the command line (`cli.add_setting_flags`), the
environment lookup (`ServiceConfig.resolve`), `kernel-service info` and docs/cli.md are made
from those fields.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from proto.paths import default_cache_dir, default_socket

from . import logs, memory
from .build import devices
from .cpus import usable_cpus

WORKER_STARTS = ("zygote", "spawn")  # how compile workers start (workers.process_pool)


def remote_url(text: str | None) -> str | None:
    """A Redis URL redis-py can open: redis://[user:password@]host[:port][/db], rediss:// (TLS)
    or unix://[user:password@]/path/to/redis.sock[?db=N]."""
    if text is None:
        return None
    parts = urlsplit(text)
    shown = without_password(text)  # errors never echo a password
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"--remote {shown!r}: expected a redis://, rediss:// or unix:// URL (e.g. redis://user:password@cache-host:6379/0)")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise ValueError(f"--remote {shown!r}: the port is not a number from 1 to 65535") from None
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"--remote {shown!r}: no host; expected {parts.scheme}://host:port/db")
    if parts.scheme == "unix" and not parts.path:
        raise ValueError(f"--remote {shown!r}: no socket path; expected unix:///path/to/redis.sock")
    return text


def without_password(url: str) -> str:
    """A URL as stats, logs and errors may show it: any password replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    userinfo, _, where = parts.netloc.rpartition("@")
    return urlunsplit((parts.scheme, f"{userinfo.split(':', 1)[0]}:***@{where}", parts.path, parts.query, parts.fragment))


MAX_SOCKET_PATH = 107  # bytes of a Unix socket path, the terminating NUL excluded (sun_path is 108)


def check_socket_path(path: Path) -> None:
    length = len(os.fsencode(os.path.abspath(path)))
    if length > MAX_SOCKET_PATH:
        raise ValueError(f"--socket {path}: {length} bytes, but a Unix socket path may have at most {MAX_SOCKET_PATH}; choose a shorter path (e.g. under /tmp)")


def check_target(text: str) -> None:
    import kernels

    try:
        kernels.parse_target(text)
    except kernels.InvalidSpec as exc:
        raise ValueError(f"--target: {str(exc).removeprefix('target: ')}") from None


_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


SIZE_FORMS = "bytes, or 512M, 10G: binary units, 10G is 10 GiB"  # how every size flag's help says what parse_size reads


def parse_size(text: str) -> int:
    """Bytes from "123", "512M", "10G" or "10GiB" (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot read {text!r} as a size; use {SIZE_FORMS}")
    return int(float(match.group(1)) * _SUFFIXES[match.group(2).upper()])


def tcp_address(text: str, allow_remote: bool = False, flag: str = "--tcp") -> str:
    """A listen address from "PORT", ":PORT", "HOST:PORT" or "[V6]:PORT"; the host
    defaults to 127.0.0.1 and must be loopback unless `allow_remote`."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} {text!r}: expected HOST:PORT with a port from 1 to 65535")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not allow_remote:
        raise ValueError(
            f"{flag} {text!r}: {host} is not a loopback address; pass --allow-remote to expose it on a trusted network (--tcp: with --tls-cert and --tls-key to encrypt it)"
        )
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def absolute_path(text: str) -> Path:
    """A path made absolute against the working directory (not resolved: a link stays one, and is refused)."""
    return Path(os.path.abspath(text))


def octal_mode(text: str) -> int:
    """A directory mode from its octal text: "0750" -> 0o750."""
    try:
        return int(text, 8)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as an octal mode; use 0700 or 0750") from None


# ----- checks a value must pass, whether a flag, a variable or a caller gave it (value, flag -> ValueError)


@dataclass(frozen=True)
class Range:
    """The numbers a setting (or another command's flag) accepts: finite, whole when `whole`,
    from `low` (excluded when `above_low`) to `high`. Its messages say what is accepted."""

    low: int
    high: int | None = None
    whole: bool = False
    above_low: bool = False
    unit: str = ""  # "seconds": said in its messages

    def __str__(self) -> str:
        number = f"{'a whole number' if self.whole else 'a number'}{f' of {self.unit}' if self.unit else ''}"
        if self.high is None:
            return f"{number} above {self.low}" if self.above_low else f"{number}, {self.low} or more"
        return f"{number} above {self.low}, at most {self.high}" if self.above_low else f"{number} from {self.low} to {self.high}"

    def accepts(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.whole else (int, float)):
            return False
        if isinstance(value, float) and not math.isfinite(value):  # NaN passes every comparison below
            return False
        return (value > self.low if self.above_low else value >= self.low) and (self.high is None or value <= self.high)

    def parse(self, text: str) -> int | float:
        """The number `text` says (what a flag or a variable gives); ValueError says what is accepted."""
        try:
            value = int(text) if self.whole else float(text)
        except ValueError:
            value = None
        if not self.accepts(value):
            raise ValueError(f"expected {self}, got {text!r}")
        return value

    def check(self, value, flag: str) -> None:
        if not self.accepts(value):
            raise ValueError(f"{flag}: expected {self}, got {value!r}")


MOST_WORKERS = 1024  # each a process of hundreds of MB: more is a typo, not a host
# Longer waits than threading.TIMEOUT_MAX raise OverflowError mid-build; ten years is far inside it.
MOST_SECONDS = 10 * 365 * 86400
WORKERS = Range(1, MOST_WORKERS, whole=True)
AT_LEAST_ONE = Range(1, whole=True)
COUNT = Range(0, whole=True)
SECONDS = Range(0, MOST_SECONDS, unit="seconds")
POSITIVE_SECONDS = Range(0, MOST_SECONDS, above_low=True, unit="seconds")
BYTES = Range(0, whole=True, unit="bytes")
POSITIVE_BYTES = Range(0, whole=True, above_low=True, unit="bytes")


def _mode(value: int, flag: str) -> None:
    if value not in (0o700, 0o750):
        raise ValueError(f"{flag} must be 0700 (owner only) or 0750 (group may read, never write), got {value:04o}")


def _target(value: str, flag: str) -> None:
    if value != "auto":
        check_target(value)


def _remote(value: str, flag: str) -> None:
    remote_url(value)


def _pem_file(value: Path, flag: str) -> None:
    """A certificate or key the daemon can read now: a refusal at start, not at the first TLS call."""
    try:
        text = value.read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {value}: cannot read it ({exc.strerror or exc}); give a PEM file the daemon's user can read") from None
    if b"-----BEGIN " not in text:
        raise ValueError(f"{flag} {value}: not a PEM file (no -----BEGIN line); give a PEM certificate or key")


ENV_PREFIX = "KERNEL_SERVICE_"
SWITCH_ON = ("1", "true", "yes", "on")  # what a switch's variable sets it with
SWITCH_OFF = ("0", "false", "no", "off")


def env_name(flag: str, form: str = "value") -> str:
    """A setting's variable: KERNEL_SERVICE_ and its flag in capitals (--max-size:
    KERNEL_SERVICE_MAX_SIZE); a repeatable flag's variable holds several, so its name is
    plural (--cache-layer: KERNEL_SERVICE_CACHE_LAYERS)."""
    return ENV_PREFIX + flag.removeprefix("--").upper().replace("-", "_") + ("S" if form == "repeat" else "")


def switch_on(text: str) -> bool:
    """Whether a switch's variable sets it: 1, true, yes, on; 0, false, no, off leave it off."""
    if text.strip().lower() in SWITCH_ON:
        return True
    if text.strip().lower() in SWITCH_OFF:
        return False
    raise ValueError(f"expected 1 (or true, yes, on) to set it or 0 (or false, no, off), got {text!r}")


@dataclass(frozen=True)
class Setting:
    """How one ServiceConfig field is set: a flag, else an environment variable, else its default."""

    flag: str  # "--max-size"
    help: str  # what it does; the default and the variable are added where it is shown
    env: str = ""  # read when the flag is not given; "": env_name(flag), the one rule
    metavar: str | None = None
    parse: Callable[[str], Any] = str  # the flag's (or the variable's) text -> the value
    check: Callable[[Any, str], None] | None = None  # (value, flag): raises ValueError naming the flag
    choices: tuple[str, ...] | None = None
    form: str = "value"  # "value"; "switch": no argument, sets the opposite of the default; "repeat": one item per flag
    split: str = ","  # a "repeat" setting's variable: its items, joined by this (":" for paths)
    computed: Callable[[Any], Any] | None = None  # env -> the default, when it depends on the host (socket, workers)
    default_text: str | None = None  # how a computed default is named (in `info`, --help and docs/cli.md)
    group: str | None = None  # a heading in --help ("fleet tier")
    before_command: bool = False  # a flag of every command, given before it (`kernel-service --log-level DEBUG serve`)

    def __post_init__(self):
        if not self.env:
            object.__setattr__(self, "env", env_name(self.flag, self.form))


def setting(default: Any = MISSING, accepts: Range | None = None, **how) -> Any:
    """A ServiceConfig field that is a setting: its default (none when computed) and its Setting.
    `accepts`: the numbers it takes, which parse its text (unless `parse` is given) and check its value."""
    if accepts is not None:
        how = {"parse": accepts.parse, **how, "check": accepts.check}
    return field(default=default, metadata={"setting": Setting(**how)})


FLEET = "fleet tier"


@dataclass(frozen=True)
class ServiceConfig:
    socket: Path = setting(  # noqa: RUF009 - setting() returns a dataclasses.field
        flag="--socket", metavar="PATH", parse=Path, computed=default_socket,
        default_text="$XDG_RUNTIME_DIR/kernel-service/kernel-service.sock, else /tmp/kernel-service-<uid>/kernel-service.sock",
        help="Unix socket path the daemon listens on",
    )  # fmt: skip
    cache_dir: Path = setting(  # noqa: RUF009
        flag="--cache-dir", metavar="DIR", parse=Path, computed=default_cache_dir,
        default_text="$XDG_CACHE_HOME/kernel-service, else ~/.cache/kernel-service", help="root of the kernel cache",
    )  # fmt: skip
    workers: int = setting(
        flag="--workers", metavar="N", accepts=WORKERS, computed=lambda env: usable_cpus(),
        default_text=f"CPUs usable here (affinity and cgroup quota), at most one per {memory.DEFAULT_PEAK >> 30} GiB of --memory-limit", help="compile processes",
    )  # fmt: skip
    compile_timeout: float = setting(
        600.0, flag="--compile-timeout", metavar="SECONDS", accepts=SECONDS,
        help="seconds one build may run in its worker; past it the worker is killed and replaced, and the request fails "
        "with a compile timeout, remembered for --failure-ttl (0: no limit)",
    )  # fmt: skip
    memory_limit: int | None = setting(
        None, flag="--memory-limit", metavar="BYTES", parse=parse_size, accepts=POSITIVE_BYTES,
        computed=lambda env: memory.memory_limit(), default_text="the cgroup memory limit or MemAvailable, whichever is smaller",
        help=f"memory the compile workers may use ({SIZE_FORMS}): a build starts only while the measured peaks of the builds "
        "running and its own fit it, else it waits",
    )  # fmt: skip
    target: str = setting("auto", flag="--target", check=_target, help="target for requests that name none: auto, c, sm_90a, ...")
    grace: float = setting(
        30.0, flag="--grace", metavar="SECONDS", accepts=SECONDS, help="seconds SIGTERM (or `kernel-service stop`) waits for running compiles"
    )
    queue_limit: int = setting(4096, flag="--queue-limit", metavar="N", accepts=AT_LEAST_ONE, help="compiles queued or running before RESOURCE_EXHAUSTED")
    kernel_modules: tuple[str, ...] = setting(
        (), flag="--kernel-module", metavar="MODULE[:ATTR]", form="repeat",
        help="import MODULE to register extra kernel kinds, or serve MODULE's kind class or @tilelang.jit factory ATTR (the kind is named ATTR); "
        "the daemon must be able to import it: set PYTHONPATH or install it; its file and every directory on the way to it must be yours or root's "
        "and not writable by group or others, else it is refused before it runs",
    )  # fmt: skip
    entry_points: bool = setting(
        True, flag="--no-entry-points", form="switch", help="load no installed kinds (entry-point group kernel_service.kinds), only the zoo and --kernel-module"
    )
    plugins: tuple[str, ...] | None = setting(
        None, flag="--plugin", metavar="NAME", form="repeat", default_text="all",
        help="load only these installed kinds (entry-point group kernel_service.kinds)",
    )  # fmt: skip
    failure_ttl: float = setting(
        60.0,
        flag="--failure-ttl",
        metavar="SECONDS",
        accepts=SECONDS,
        help="seconds a failed compile is answered from memory before it is retried (0: never remembered)",
    )
    max_bytes: int | None = setting(
        None, flag="--max-size", metavar="BYTES", parse=parse_size, accepts=BYTES, default_text="unbounded",
        help=f"cache budget: evict least recently used entries above this size ({SIZE_FORMS})",
    )  # fmt: skip
    max_entries: int | None = setting(None, flag="--max-entries", metavar="N", accepts=COUNT, default_text="unbounded", help="cache budget in entries")
    evict_min_age: float = setting(300.0, flag="--evict-min-age", metavar="SECONDS", accepts=SECONDS, help="never evict an entry used this recently")
    mode: int = setting(
        0o700, flag="--mode", metavar="0700|0750", parse=octal_mode, check=_mode, default_text="0700",
        help="cache and socket directory mode: 0700 owner only, 0750 group may read and connect, never write (agents of other users then pass daemon_uid)",
    )  # fmt: skip
    allow_remote: bool = setting(
        False,
        flag="--allow-remote",
        form="switch",
        help="allow --tcp and --metrics-address on a non-loopback address (trusted networks only: /metrics is plaintext, and so is --tcp without --tls-cert)",
    )
    tcp: str | None = setting(
        None, flag="--tcp", metavar="HOST:PORT", default_text="off",
        help="also listen on TCP (host defaults to 127.0.0.1; loopback only unless --allow-remote); clients must present the token the daemon writes to <cache dir>/tcp-token",
    )  # fmt: skip
    cache_layers: tuple[Path, ...] = setting(
        (), flag="--cache-layer", metavar="PATH", parse=absolute_path, form="repeat", split=":",
        help="a read-only cache (one baked into an image: `bundle import --layer`), searched after --cache-dir, in order, and served from as it is, "
        "never written; owned by root or the daemon's uid, writable by no one else; --cache-layer flags replace the variable's",
    )  # fmt: skip
    cuda_compiler: str = setting(
        "auto", flag="--cuda-compiler", choices=("auto", devices.NVRTC, devices.NVCC),
        help="how CUDA device code is compiled: nvrtc in process (fast), nvcc as a subprocess; auto takes NVRTC where it can run",
    )  # fmt: skip
    worker_start: str = setting(
        "zygote", flag="--worker-start", choices=WORKER_STARTS,
        help="how compile workers start: zygote forks each from one process that imported TileLang once (ready at once), "
        "spawn starts each as a fresh interpreter that imports TileLang itself (seconds each; a way out should forking ever fail)",
    )  # fmt: skip
    metrics_address: str | None = setting(
        None, flag="--metrics-address", metavar="HOST:PORT", default_text="off",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (host defaults to 127.0.0.1; loopback only unless --allow-remote)",
    )  # fmt: skip
    tls_cert: Path | None = setting(
        None, flag="--tls-cert", metavar="PEM", parse=absolute_path, check=_pem_file, default_text="none: --tcp is plaintext",
        help="serve --tcp over TLS with this certificate (chain), PEM, with --tls-key; clients verify it against KERNEL_SERVICE_TLS_CA (client.connect(tls_ca=...))",
    )  # fmt: skip
    tls_key: Path | None = setting(
        None, flag="--tls-key", metavar="PEM", parse=absolute_path, check=_pem_file, default_text="none", help="the private key of --tls-cert, PEM"
    )
    log_level: str = setting(
        "INFO", flag="--log-level", metavar="LEVEL", parse=logs.level, before_command=True, help=f"logging level: {', '.join(logs.LEVELS)}"
    )
    log_format: str = setting(
        "text", flag="--log-format", metavar="text|json", choices=logs.FORMATS, before_command=True,
        help="text lines, or json: one JSON object per line (time, level, logger, message, pid, exception)",
    )  # fmt: skip
    no_compile: bool = setting(
        False,
        flag="--no-compile",
        form="switch",
        help="serve only what the cache holds (fed by `bundle import` or another daemon): a miss answers NOT_FOUND with why; no compile workers start",
    )
    cuda_compiler_id: str | None = setting(
        None, flag="--cuda-compiler-id", metavar="ID", default_text="none",
        help="with --no-compile: key CUDA kernels as if built by this compiler, e.g. nvrtc-13.0 (the builder's, as its bundle records it); no compiler is looked for",
    )  # fmt: skip
    remote: str | None = setting(
        None, flag="--remote", metavar="URL", check=_remote, group=FLEET, default_text="none: this host alone",
        help="the fleet tier, a Redis shared by every host (each kernel compiled once per fleet): redis://[user:password@]host:port/db, rediss:// for TLS, or unix:///path",
    )  # fmt: skip
    remote_read_only: bool = setting(
        False,
        flag="--remote-read-only",
        form="switch",
        group=FLEET,
        help="read kernels from the tier and wait on other hosts' builds, never write (pair with a read-only ACL user)",
    )
    remote_lease_seconds: float = setting(
        30.0, flag="--remote-lease-seconds", metavar="S", accepts=POSITIVE_SECONDS, group=FLEET,
        help="a build lease lasts this long unless its holder renews it; a dead holder's build is taken over after it",
    )  # fmt: skip
    remote_timeout: float = setting(
        1.0,
        flag="--remote-timeout",
        metavar="S",
        accepts=POSITIVE_SECONDS,
        group=FLEET,
        help="seconds any one Redis call may take before the host goes on alone",
    )
    remote_ttl: float = setting(
        7 * 86400.0,
        flag="--remote-ttl",
        metavar="S",
        accepts=POSITIVE_SECONDS,
        group=FLEET,
        default_text="604800 (7 days)",
        help="seconds an entry stays in the tier after it was last written",
    )
    sources: dict = field(default_factory=dict, compare=False)  # field -> where its value came from (describe)

    @property
    def plugin_args(self) -> dict:
        """What the daemon and each compile worker load beyond the zoo (kernels.plugins.load)."""
        return {"modules": self.kernel_modules, "entry_points": self.entry_points, "allow": self.plugins}

    @property
    def device(self) -> devices.DeviceCompiler:
        """The device compiler CUDA keys name: the named one on a serve-only host, else the one that runs."""
        return devices.named(self.cuda_compiler_id) if self.cuda_compiler_id else devices.get(self.cuda_compiler)

    def describe(self) -> dict:
        """Every setting with where it came from: {"name": {"value": ..., "source": ...}} (`kernel-service info`)."""
        out = {}
        for f in fields(self):
            if f.name == "sources":
                continue
            value = getattr(self, f.name)
            value = (
                f"{value:04o}"
                if f.name == "mode"
                else str(value)
                if isinstance(value, Path)
                else [str(v) if isinstance(v, Path) else v for v in value]
                if isinstance(value, tuple)
                else value
            )
            if f.name == "remote" and value:
                value = without_password(value)
            out[f.name] = {"value": value, "source": self.sources.get(f.name, "default")}
        return out

    @classmethod
    def resolve(cls, env=os.environ, **given) -> ServiceConfig:
        """The configuration these settings resolve to. `given`: setting name -> the value a flag
        gave (None: not given). Each setting takes its flag, else its environment variable, else its
        default. Raises ValueError naming the flag and what to give instead."""
        unknown = sorted(set(given) - set(SETTINGS))
        if unknown:
            raise TypeError(f"not settings: {', '.join(unknown)}")
        values, sources = {}, {}
        for name in SETTINGS:
            values[name], source = resolve_setting(name, given.get(name), env)
            if source != "default":
                sources[name] = source
        # Rules that join settings.
        if sources["workers"] == SETTINGS["workers"].default_text:  # the default: the CPUs, as many as the memory limit holds
            values["workers"] = memory.pool_size(values["workers"], values["memory_limit"])
        if values["tcp"] is not None:
            values["tcp"] = tcp_address(values["tcp"], values["allow_remote"])
        if values["metrics_address"] is not None:
            values["metrics_address"] = tcp_address(values["metrics_address"], values["allow_remote"], flag="--metrics-address")
        if (values["tls_cert"] is None) != (values["tls_key"] is None):
            raise ValueError("--tls-cert and --tls-key go together: pass both (the certificate and its private key), or neither")
        if values["tls_cert"] is not None and values["tcp"] is None:
            raise ValueError("--tls-cert: TLS is for the TCP listener; pass --tcp HOST:PORT too")
        if values["remote_read_only"] and not values["remote"]:
            raise ValueError(f"--remote-read-only needs a tier to read: pass --remote URL (or set {SETTINGS['remote'].env})")
        if values["cuda_compiler_id"]:
            if not values["no_compile"]:
                raise ValueError("--cuda-compiler-id needs --no-compile: a daemon that compiles keys its entries by the compiler it runs")
            values["cuda_compiler"] = devices.named(values["cuda_compiler_id"]).name  # named, never looked for: nothing compiles
            sources["cuda_compiler"] = "--cuda-compiler-id"
        else:
            requested = values["cuda_compiler"]
            values["cuda_compiler"] = devices.choose(requested, env).name
            if requested == "auto":
                sources["cuda_compiler"] = f"{sources.get('cuda_compiler', 'default')} (auto: NVRTC where it can run)"
        for layer in values["cache_layers"]:
            if layer == Path(os.path.abspath(values["cache_dir"])):
                raise ValueError(f"--cache-layer {layer} is the cache directory itself; a layer is another, read-only cache")
        check_socket_path(values["socket"])
        return cls(**values, sources=sources)


SETTINGS: dict[str, Setting] = {f.name: f.metadata["setting"] for f in fields(ServiceConfig) if "setting" in f.metadata}
_DEFAULTS = {f.name: None if f.default is MISSING else f.default for f in fields(ServiceConfig)}


def shown_default(name: str) -> str:
    """A setting's default as --help and docs/cli.md name it."""
    if SETTINGS[name].default_text:
        return SETTINGS[name].default_text
    value = _DEFAULTS[name]
    return "none" if value in (None, ()) else f"{value:g}" if isinstance(value, float) else str(value)


def resolve_setting(name: str, given: Any, env=os.environ) -> tuple[Any, str]:
    """(value, where it came from) of one setting: the value a flag gave (None: not given), else
    its environment variable, else its default; checked. For commands other than serve that take
    one of the daemon's settings (prewarm's --worker-start), by the same rule. Raises ValueError
    naming the flag or variable."""
    s = SETTINGS[name]
    value, source = given, s.flag
    if value == "":  # an empty flag is no flag, as an empty variable is no variable
        value = None
    elif isinstance(value, str) and s.parse is not str:  # text from a caller, as a flag gives it
        try:
            value = s.parse(value)
        except ValueError as exc:
            raise ValueError(f"{s.flag}: {exc}") from None
    if value is None and env.get(s.env):
        value, source = env[s.env], f"${s.env}"
        try:
            if s.form == "switch":
                value = not _DEFAULTS[name] if switch_on(value) else _DEFAULTS[name]
            else:
                value = [s.parse(item) for item in value.split(s.split) if item] if s.form == "repeat" else s.parse(value)
        except ValueError as exc:
            raise ValueError(f"${s.env}: {exc}") from None
    if value is None:
        value, source = (s.computed(env), s.default_text) if s.computed else (_DEFAULTS[name], "default")
    elif s.form == "repeat":
        value = tuple(s.parse(v) if isinstance(v, str) else v for v in value) or _DEFAULTS[name]  # no item given: the default (all plugins)
    if value is not None and s.choices and value not in s.choices:  # a flag's were checked by argparse, a variable's are here
        raise ValueError(f"{source} must be {', '.join(s.choices[:-1])} or {s.choices[-1]}, got {value!r}")
    if value is not None and s.check and source != "default":
        s.check(value, source)  # names the flag or the variable the value came from
    return value, source
