"""The project's own documents stay true and self-contained (issue 14, item 1).

docs/contract.md is compared with the real CLI (commands and options), the config dataclasses
(every key documented with its default, no stale key), the result schema and the exit codes.
Every relative link in README.md and docs/*.md must resolve inside the repository: a user's
clone has nothing beside it, so no document, script or module may point outside it.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import typer.main

from pipeline.cli import app
from pipeline.errors import ConfigError, Interrupted, StepFailed
from pipeline.run.config import Config
from steps.generate import LOGPROBS, PROMPT_LOGPROBS, PROMPT_TOKEN_IDS, SCHEMA, TOP_LOGPROBS, TOP_TOKEN_IDS

REPO = Path(__file__).resolve().parent.parent
CONTRACT = REPO / "docs" / "contract.md"
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section (up to the next `## `)."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"docs/contract.md has no '## {heading}' section"
    return match.group(1)


def table_rows(text: str) -> list[list[str]]:
    """Cells of every markdown table row in `text` (header and separator rows dropped)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"^\|[-| ]+\|$", line):
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return [r for r in rows if r[0] not in ("key", "column", "code", "option", "variable")]


# --- commands and options ------------------------------------------------------------------


def cli_commands() -> dict[str, set[str]]:
    """'run all' -> {'--config', '-c', '--set', ...} for every command of the real CLI."""
    found: dict[str, set[str]] = {}

    def walk(command, path: list[str]) -> None:
        if hasattr(command, "commands"):  # a group (typer vendors its own click)
            for name, sub in command.commands.items():
                walk(sub, path + [name])
        else:
            found[" ".join(path)] = {o for p in command.params for o in p.opts + p.secondary_opts
                                     if o.startswith("-")}

    walk(typer.main.get_command(app), [])
    return found


def documented_commands() -> dict[str, str]:
    """'run all' -> the text of the `### ...` section that documents it."""
    text = section(CONTRACT.read_text(), "Commands")
    found = {}
    for match in re.finditer(r"^### ([^\n]*)\n(.*?)(?=^### |\Z)", text, re.S | re.M):
        for command in re.findall(r"`pipeline ([a-z ]+)`", match.group(1)):
            found[command] = match.group(2)
    return found


def test_every_command_is_documented_and_no_documented_command_is_gone():
    assert sorted(documented_commands()) == sorted(cli_commands())


@pytest.mark.parametrize("command", sorted(cli_commands()))
def test_every_option_of_a_command_is_documented_in_its_section(command):
    body = documented_commands()[command]
    options = {o for row in table_rows(body) for o in re.findall(r"`(--?[a-z][a-z-]*)`", row[0])}
    assert options == cli_commands()[command] - {"--help"}


# --- config keys and defaults --------------------------------------------------------------


def config_keys(cls: type = Config, prefix: str = "") -> dict[str, object]:
    """Every dotted key a config file may hold -> its default (`required`, or `factory`)."""
    keys: dict[str, object] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        sections = [o for o in options if dataclasses.is_dataclass(o)]
        if cls is Config:  # the top level holds sections only
            keys.update(config_keys(sections[0], f"{f.name}."))
            continue
        if f.default is not dataclasses.MISSING:
            keys[prefix + f.name] = f.default
        else:
            keys[prefix + f.name] = "factory" if f.default_factory is not dataclasses.MISSING else "required"
        for sub in sections:
            keys.update(config_keys(sub, f"{prefix}{f.name}."))
    return keys


def as_documented(default: object) -> str:
    if default is None:
        return "null"
    if isinstance(default, bool):
        return str(default).lower()
    if default == ():
        return "[]"
    return str(default)


def documented_keys() -> dict[str, str]:
    return {row[0].strip("`"): row[1] for row in table_rows(section(CONTRACT.read_text(), "Config"))}


def test_every_config_key_is_documented_and_no_stale_key_is():
    assert sorted(documented_keys()) == sorted(config_keys())


def test_documented_defaults_are_the_real_defaults():
    documented = documented_keys()
    for key, default in config_keys().items():
        if default == "factory":  # wandb.mode: depends on WANDB_API_KEY, the cell says how
            continue
        assert documented[key].strip("`") == as_documented(default), key


# --- result columns and exit codes ---------------------------------------------------------


def test_result_columns_are_the_schema_merge_writes():
    """The section's four tables: every result's columns, then the one `sampling.logprobs` adds,
    the two `sampling.top_logprobs` adds and the two `sampling.prompt_logprobs` adds."""
    rows = table_rows(section(CONTRACT.read_text(), "Result"))
    documented = [(name.strip("`"), tp) for name, tp, _ in rows]
    assert documented == [(f.name, str(f.type).replace("item: ", ""))
                          for f in [*SCHEMA, LOGPROBS, TOP_TOKEN_IDS, TOP_LOGPROBS, PROMPT_TOKEN_IDS, PROMPT_LOGPROBS]]


def test_exit_codes_are_the_ones_the_code_uses():
    from pipeline.pod.preemption import EXIT_INTERRUPTED

    rows = table_rows(section(CONTRACT.read_text(), "Exit codes"))
    codes = [int(row[0].strip("`")) for row in rows]
    assert codes == [0, StepFailed.exit_code, ConfigError.exit_code, Interrupted.exit_code]
    assert EXIT_INTERRUPTED == Interrupted.exit_code


# --- links stay inside the repository ------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves_inside_the_repository(document):
    for link in links(document):
        if re.match(r"^[a-z]+:", link):  # https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        resolved = (document.parent / target).resolve() if target else document
        assert resolved.is_relative_to(REPO), f"{document.name}: {link} leaves the repository"
        assert resolved.exists(), f"{document.name}: {link} does not exist"
        if anchor:
            assert anchor in anchors(resolved), f"{document.name}: {link}: no such heading"


def test_no_tracked_file_points_outside_the_repository():
    """Issue 14: the README and code pointed to a shared folder beside the clone that users lack."""
    outside = ".." + "/shared"  # spelt in two parts so this file does not find itself
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    offenders = [name for name in tracked if (REPO / name).is_file()
                 and outside in (REPO / name).read_text(errors="replace")]
    assert offenders == []


def test_the_readmes_python_example_runs(demo_model, tmp_path):
    """The README's engine example, as a user pastes it (demo/model: the test's demo checkpoint)."""
    (example,) = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    script = tmp_path / "example.py"
    script.write_text(example.replace('"demo/model"', repr(demo_model)))
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split(" ", 3)[:3] for line in done.stdout.splitlines()]
    assert sorted((p, s) for p, s, _ in rows) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")], done.stdout
    assert {reason for _, _, reason in rows} <= {"length", "stop", "eos"}, done.stdout
