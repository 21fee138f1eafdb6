"""The README is what a user reads first, and these tests hold it to its word: at most 300
lines, the title and then the two set-up commands, its Quickstart run as written (with the
README's other CPU snippets and commands run against the Quickstart's daemon), every
`kernel-service` command in it and in docs/ accepted by the CLI's own parser, every Python
snippet valid, every `make` target real, and every relative link, anchors included, resolving."""

from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from compile_service import cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# docs/cli.md is generated from the CLI's parser: its synopses are not command lines to parse.
GENERATED = {ROOT / "docs" / "cli.md"}
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent  # the environment running the tests: `.venv/bin/` in the README
MAX_LINES = 300


# ----------------------------------------------------------------------------- reading markdown


def _blocks(path: Path) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block, list items' indented ones too."""
    return _blocks_of(path.read_text())


def _blocks_of(text: str) -> list[tuple[str, str]]:
    found = re.findall(r"^( *)```(\w*)\n(.*?)^\1```$", text, re.DOTALL | re.MULTILINE)
    return [(lang, textwrap.dedent(body)) for _, lang, body in found]


def _shell_blocks(path: Path) -> list[str]:
    return [body for lang, body in _blocks(path) if lang in ("sh", "bash", "shell")]


def _prose(path: Path) -> str:
    return re.sub(r"^( *)```.*?^\1```$", "", path.read_text(), flags=re.DOTALL | re.MULTILINE)


def _commands(block: str) -> list[list[str]]:
    """Each simple command of a shell block as argv: heredoc bodies, comments, redirections,
    control words and leading VAR=value assignments left out."""
    lines, heredoc = [], None
    for line in block.replace("\\\n", " ").splitlines():
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        if m := re.search(r"<<-?\s*'?(\w+)'?", line):
            heredoc = m.group(1)
        line = re.sub(r"\$\([^)]*\)", "0", line)  # a command substitution stands for one word
        lines.append(re.sub(r"<<-?\s*'?\w+'?|\d*>&\d+|\d*>>?\s*[^\s;&|]+", " ", line))
    commands = []
    for line in lines:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split, lexer.commenters = True, "#"
        argv: list[str] = []
        for token in [*lexer, ";"]:
            if token in (";", "&", "&&", "|", "||"):
                while argv and (argv[0] in ("until", "while", "do", "done", "if", "then", "else", "fi", "export") or re.match(r"^\w+=", argv[0])):
                    argv.pop(0)
                if argv:
                    commands.append(argv)
                argv = []
            else:
                argv.append(token)
    return commands


def _kernel_service_argv(argv: list[str]) -> list[str] | None:
    return argv[1:] if argv and os.path.basename(argv[0]) == "kernel-service" else None


# ----------------------------------------------------------------------------- the CLI's parser


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _parse(argv: list[str]) -> str | None:
    """kernel-service's own parser run on argv, and nothing run: None when it accepts the
    line, else argparse's complaint. It stops `main` right after its parse_args."""
    real = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        real(self, args, namespace)
        raise _Parsed(self)

    err = io.StringIO()
    argparse.ArgumentParser.parse_args = parse_and_stop
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            cli.main(argv)
    except _Parsed:
        return None
    except SystemExit as exc:
        return None if exc.code == 0 else err.getvalue().strip().splitlines()[-1]
    finally:
        argparse.ArgumentParser.parse_args = real
    raise AssertionError(f"kernel-service main({argv}) never parsed its arguments")


def _parser() -> argparse.ArgumentParser:
    real = argparse.ArgumentParser.parse_args

    def stop(self, args=None, namespace=None):
        raise _Parsed(self)

    argparse.ArgumentParser.parse_args = stop
    try:
        cli.main(["--version"])
    except _Parsed as exc:
        return exc.parser
    finally:
        argparse.ArgumentParser.parse_args = real
    raise AssertionError("kernel-service main() never parsed its arguments")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


# ----------------------------------------------------------------------------- the README's shape


def test_the_readme_is_short_and_starts_with_its_title_then_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; at most {MAX_LINES}: move detail to docs/"
    assert lines[0] == "# kernel-service", "the README starts with its title (no code block before it)"
    first = next(i for i, line in enumerate(lines[1:], 1) if line.strip())
    assert lines[first] == "```sh", "right after the title: the set-up commands"
    body = "\n".join(lines[first + 1 : lines.index("```", first + 1)])
    assert _commands(body) == [["make", "demo"], ["make", "test"]], "the README's first commands are exactly `make demo` and `make test`"


def _make_targets() -> dict[str, list[str]]:
    """Makefile targets and their prerequisites."""
    found = re.findall(r"^([\w.$()/-]+):([^=\n]*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    return {target: prereqs.split() for target, prereqs in found}


def test_the_two_commands_set_up_first_and_every_make_target_named_exists():
    targets = _make_targets()
    for name in ("demo", "test"):
        assert "setup" in targets.get(name, []), f"`make {name}` must do all the set-up on a fresh machine (depend on setup)"
    named = [argv for page in PAGES for block in _shell_blocks(page) for argv in _commands(block) if argv[0] == "make"]
    assert named
    for argv in named:
        for target in argv[1:]:
            assert target in targets, f"`make {target}` is named in the docs but the Makefile has no such target"


def _prerequisites(target: str, targets: dict[str, list[str]]) -> set[str]:
    """Every target `make target` runs before its own recipe, transitively."""
    found, todo = set(), list(targets.get(target, []))
    while todo:
        if (name := todo.pop()) not in found:
            found.add(name)
            todo += targets.get(name, [])
    return found


def test_make_demo_installs_no_system_package_and_make_test_installs_redis():
    """Issue 49 item 6: redis-server (an apt-get as root) is for the fleet tests only, and the
    set-up says in one line what its time goes on before it starts."""
    targets = _make_targets()
    assert "redis-server" not in _prerequisites("demo", targets) | {"demo"}, "`make demo` must not install redis-server"
    assert "redis-server" in _prerequisites("test", targets), "`make test` installs redis-server for the fleet tests"
    recipe = (ROOT / "Makefile").read_text().split("$(VENV)/.installed: pyproject.toml\n", 1)[1]
    assert recipe.startswith("\t@echo ") and "pip installs torch" in recipe.splitlines()[0], "set-up says first what its minute goes on"


@pytest.mark.slow
def test_the_demo_runs_on_a_private_socket_and_cache_and_leaves_nothing_behind(tmp_path):
    """Issue 49 item 6: `make demo` says first what its time goes on, uses neither the default
    cache nor the default socket, and removes its own (with its log and compilers' scratch)."""
    home = tmp_path / "home"
    home.mkdir()
    tmp = Path(tempfile.mkdtemp(prefix="ks-t-", dir="/tmp"))  # short: the demo's socket lies under it
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_SERVICE_")}
    env.update(HOME=str(home), TMPDIR=str(tmp), XDG_CACHE_HOME=str(tmp_path / "xdg-cache"), XDG_RUNTIME_DIR=str(tmp_path / "run"))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "devtools.demo", "--cpu-only"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
        )
        left = sorted(tmp.rglob("*"))
    finally:
        shutil.rmtree(tmp)
    assert done.returncode == 0 and "demo ok" in done.stdout, f"{done.stdout}\n{done.stderr}"
    first = done.stdout.splitlines()[0]
    assert first.startswith("demo, about ") and "compiles 6 CPU kernels" in first and "removed at the end" in first, first
    assert not (tmp_path / "xdg-cache").exists() and not (tmp_path / "run").exists(), "the default cache and socket stay untouched"
    assert not list(home.rglob("kernel-service*")), sorted(home.rglob("*"))
    assert not left, f"the demo left {left}"


# ----------------------------------------------------------------------------- commands and snippets


def test_every_kernel_service_command_line_in_the_docs_is_accepted_by_the_cli():
    checked = 0
    for page in PAGES:
        if page in GENERATED:
            continue
        for block in _shell_blocks(page):
            for argv in _commands(block):
                if (args := _kernel_service_argv(argv)) is not None:
                    problem = _parse(args)
                    assert problem is None, f"{page.relative_to(ROOT)}: `kernel-service {' '.join(args)}`: {problem}"
                    checked += 1
    assert checked >= 15, f"only {checked} kernel-service command lines found in the docs"


def test_every_kernel_service_command_named_in_prose_exists_with_its_flags():
    """`kernel-service [--log-format F] SUB [--flag ...]` in running text: SUB is a subcommand
    (bundle's too), each --flag one of its options, and each flag before it one of every command's."""
    parser = _parser()
    checked = 0
    for page in PAGES:
        if page in GENERATED:
            continue
        for span in re.findall(r"`kernel-service ([^`]+)`", _prose(page)):
            words = span.replace("[", " ").replace("]", " ").replace("|", " ").split()
            current, path = parser, []
            while words and words[0].startswith("--") and words[0] not in ("--help", "--version"):  # flags of every command, before it
                word = words.pop(0)
                flag = word.split("=", 1)[0]
                assert flag in parser._option_string_actions, f"{page.relative_to(ROOT)}: `kernel-service {span}`: no {flag} before a command"
                if "=" not in word and parser._option_string_actions[flag].nargs != 0 and words:
                    words.pop(0)  # its value
            while words and words[0] in _subcommands(current):
                path.append(words[0])
                current = _subcommands(current)[words.pop(0)]
            if words and words[0] in ("--help", "--version"):
                continue
            assert path, f"{page.relative_to(ROOT)}: `kernel-service {span}` names no subcommand of {sorted(_subcommands(parser))}"
            options = set(current._option_string_actions)
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", " ".join(words)):
                assert flag in options, f"{page.relative_to(ROOT)}: `kernel-service {span}`: {' '.join(path)} has no {flag}"
            checked += 1
    assert checked >= 10, f"only {checked} kernel-service commands found in the docs' prose"


def test_every_python_snippet_in_the_readme_and_docs_is_valid_python():
    for page in PAGES:
        for i, (lang, body) in enumerate(_blocks(page)):
            if lang == "python":
                compile(body, f"{page.relative_to(ROOT)} python block {i}", "exec")


def test_the_readmes_connect_signature_is_the_real_one():
    """The README's `client.connect(...)` line: the parameters, defaults and keyword-only
    marker of Client (which connect's options are), and of connect itself once it spells them
    out; each option its table describes is one of them."""
    import client

    text = README.read_text()
    documented = re.search(r"`client\.connect\((socket=None, \*,[^`]*)\)`", text, re.DOTALL).group(1)
    fn = ast.parse(f"def connect({' '.join(documented.split())}): pass").body[0]
    names = [a.arg for a in fn.args.args] + ["*"] + [a.arg for a in fn.args.kwonlyargs]
    defaults = [ast.literal_eval(d) for d in fn.args.defaults + fn.args.kw_defaults]
    real = [p for p in inspect.signature(client.Client.__init__).parameters.values() if p.name != "self"]
    signatures = [real]
    if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(client.connect).parameters.values()):
        signatures.append(list(inspect.signature(client.connect).parameters.values()))
    for params in signatures:
        positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert names == positional + ["*"] + [p.name for p in params if p.kind is p.KEYWORD_ONLY], f"README: connect({documented})"
        assert defaults == [p.default for p in params], f"README's defaults: {defaults}"
    table = text[text.index(documented) :].split("\n\n", 2)[1]
    options = re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE)
    assert options == [p.name for p in real], f"the README's option table: {options}"


def _readme_quickstart() -> str:
    text = README.read_text()
    section = text[text.index("## Quickstart") :]
    return next(body for lang, body in _blocks_of(section) if lang == "sh")


@pytest.mark.slow
def test_the_quickstart_runs_as_written_with_the_readmes_cpu_snippets_and_commands(tmp_path):
    """The Quickstart's block in bash, on a private socket and cache: its `make setup` line is
    what the test environment already did, `.venv/bin/` is this environment's. Before its last
    line (which stops the daemon) run the README's other snippets that need no GPU and the
    Deploy section's commands, against the Quickstart's daemon."""
    lines = _readme_quickstart().splitlines()
    assert lines[0].startswith("make setup"), "the Quickstart starts with the set-up"
    assert "setup" in _make_targets()
    exports = [i for i, line in enumerate(lines) if line.startswith("export KERNEL_SERVICE_SOCKET=")]
    assert len(exports) == 1 and "KERNEL_SERVICE_CACHE_DIR=" in lines[exports[0]], "the Quickstart shows a private socket and cache"
    assert _kernel_service_argv(shlex.split(lines[-1], comments=True)) == ["stop"], "the Quickstart ends by stopping its daemon"
    lines[exports[0]] = f"export KERNEL_SERVICE_SOCKET={tmp_path}/run/ks.sock KERNEL_SERVICE_CACHE_DIR={tmp_path}/cache"
    extra = []
    for lang, body in _blocks(README):
        if lang == "python" and "cuda" not in body:
            extra += [".venv/bin/python - <<'PY'", body.rstrip("\n"), "PY"]
    deploy = README.read_text().split("## Deploy", 1)[1]
    extra += [body.rstrip("\n") for lang, body in _blocks_of(deploy.split("\n## ", 1)[0]) if lang == "sh"]
    # A step that fails must not leave the daemon behind (nor this test waiting on its output).
    cleanup = "trap 'kill $(jobs -p) 2>/dev/null || true; wait' EXIT"  # no job left: stop waited for the daemon
    script = "\n".join(["set -euo pipefail", cleanup, *lines[1:-1], *extra, lines[-1], "wait"]).replace(".venv/bin/", f"{BIN}/")
    assert (BIN / "kernel-service").exists(), f"no kernel-service script beside {sys.executable}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_SERVICE_")}
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"the Quickstart failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    out = done.stdout
    assert "torch.Size([8, 4096]) compiled" in out, out
    assert re.search(r"^hit$", out, re.MULTILINE), f"a later process finds the kernel in the cache:\n{out}"
    assert (
        re.search(r"^\s*compiles: 1$", out, re.MULTILINE)
        and re.search(r"^\s*hits: 1$", out, re.MULTILINE)
        and re.search(r"^\s*direct_hits: 1$", out, re.MULTILINE)
    ), f"stats as the README explains it:\n{out}"
    assert not (tmp_path / "run" / "ks.sock").exists(), "the daemon stopped"


def test_a_plugin_module_is_served_with_pythonpath_as_the_kernels_page_says(tmp_path):
    """docs/kernels.md: without PYTHONPATH the daemon cannot import a module of tests/; its
    `PYTHONPATH=. ... kinds --kernel-module tests.routed_kind` line lists the kind, named after
    the class's `name`."""
    line = next(
        line
        for block in _shell_blocks(ROOT / "docs" / "kernels.md")
        for line in block.splitlines()
        if line.startswith("PYTHONPATH=. .venv/bin/kernel-service kinds --kernel-module tests.routed_kind")
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("KERNEL_SERVICE_")}
    env["KERNEL_SERVICE_SOCKET"] = str(tmp_path / "none" / "ks.sock")  # no daemon: the kinds installed here
    listed = subprocess.run(["bash", "-c", line.replace(".venv/bin/", f"{BIN}/")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert listed.returncode == 0, listed.stderr
    assert re.search(r"^routed_scale\b", listed.stdout, re.MULTILINE), listed.stdout
    bare = subprocess.run(
        [str(BIN / "kernel-service"), "kinds", "--kernel-module", "tests.routed_kind"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert bare.returncode != 0 and "no module named 'tests'" in (bare.stdout + bare.stderr).lower(), bare.stdout + bare.stderr


# ----------------------------------------------------------------------------- links


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"^#{1,6} (.+)$", _prose(path), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_in_the_readme_and_docs_resolves():
    checked = 0
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page)):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            assert dest.exists(), f"{page.relative_to(ROOT)} links to {target}: no such file"
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest), f"{page.relative_to(ROOT)} links to {target}: {dest.name} has no heading with that anchor"
            checked += 1
    assert checked >= 50
