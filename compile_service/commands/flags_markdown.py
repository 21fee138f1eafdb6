"""docs/cli.md, generated from the parser itself: every command and its flags, and the daemon's
settings (`kernel-service flags-markdown`; tests/test_cli.py fails when the two disagree)."""

from __future__ import annotations

import argparse
import sys


def _cell(text: str) -> str:
    """Text in a markdown table's cell."""
    return text.replace("|", "\\|")


def settings_markdown() -> str:
    """The daemon settings as a markdown table: setting, flag, variable, default, meaning."""
    from ..config import SETTINGS, shown_default

    rows = ["| setting | flag | variable | default | meaning |", "|---|---|---|---|---|"]
    for name, s in SETTINGS.items():
        flag = f"{s.flag} {s.metavar}" if s.metavar else s.flag
        flag += " (repeatable)" if s.form == "repeat" else ""
        flag += " (before the command)" if s.before_command else ""
        default = "off" if s.form == "switch" else shown_default(name)
        env = f"`{s.env}=1`" if s.form == "switch" else f"`{s.env}` (`{s.split}`-separated)" if s.form == "repeat" else f"`{s.env}`"
        rows.append(f"| `{name}` | `{_cell(flag)}` | {env} | {_cell(default)} | {_cell(s.help)} |")
    return "\n".join(rows) + "\n"


def _flag_line(action: argparse.Action) -> str:
    flag = " ".join(action.option_strings) or action.metavar or action.dest
    if action.option_strings and action.nargs != 0:
        flag += f" {action.metavar or action.dest.upper()}"
    return f"| `{_cell(flag)}` | {_cell((action.help or '') % {'default': action.default})} |"


def _commands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of every command, `bundle export` and the like included."""
    commands = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                sub = action.choices[choice.dest]
                nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
                if nested:
                    for inner in nested[0]._choices_actions:
                        commands.append((f"{choice.dest} {inner.dest}", inner.help, nested[0].choices[inner.dest]))
                else:
                    commands.append((choice.dest, choice.help, sub))
    return commands


def cli_markdown(parser: argparse.ArgumentParser) -> str:
    """docs/cli.md: every command and its flags, and the daemon's settings, from the parser itself
    (cli.build_parser's, passed in: the parser runs this command)."""
    out = [
        "# `kernel-service`: commands, flags and settings",
        "",
        "<!-- Generated: `python -m compile_service.cli flags-markdown > docs/cli.md`. tests/test_cli.py fails when it and the command line disagree. -->",
        "",
        "Every failure is one line on stderr, naming the problem and the fix, and a non-zero exit (2: a bad flag).",
        "",
        "## Commands",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    commands = _commands(parser)
    for name, help, _ in commands:
        out.append(f"| `{name}` | {help} |")
    out += [
        "",
        "## Daemon settings",
        "",
        "`serve` takes these flags; `info` takes them too and shows what they resolve to and where each value came from.",
        "Each setting takes its flag, else its environment variable, else its default. The variable is the flag's name in capitals after",
        "`KERNEL_SERVICE_` (plural for a repeatable flag); a switch's is set by `1`, `true`, `yes` or `on`. The logging settings'",
        "flags come before the command, for every command: `kernel-service --log-format json serve`.",
        "",
        settings_markdown().rstrip("\n"),
        "",
        "## Flags of each command",
    ]
    for name, _, sub in commands:
        own = [a for a in sub._actions if not isinstance(a, argparse._HelpAction) and not getattr(a, "setting", False)]
        out += ["", f"### `kernel-service {name}`", ""]
        if any(getattr(a, "setting", False) for a in sub._actions):
            out += ["Every daemon setting's flag (above), and:" if own else "Every daemon setting's flag (above).", ""]
        out += ["| flag or argument | meaning |", "|---|---|", *(_flag_line(a) for a in own)] if own else ["No flags."]
    return "\n".join(out).rstrip("\n") + "\n"


def flags_markdown(parser: argparse.ArgumentParser, args) -> int:
    sys.stdout.write(cli_markdown(parser))
    return 0
