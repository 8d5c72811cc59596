"""The code blocks and links of README.md and docs/*.md, checked against the code.

- Every ```python block parses (ast.parse). A block that is a fragment on purpose (an excerpt
  that does not parse on its own) starts with the comment line `# fragment` (anything may follow
  on that line, e.g. `# fragment: the loop only`) and is skipped.
- Every shell command that runs dynemb: `dynemb SUB ...`, `.venv/bin/dynemb ...`, or
  `python -m dynemb...` / `torchrun ... -m dynemb...`, found in ```bash, ```sh and ```shell
  blocks (every line), in ```console blocks (the `$ ` lines) and in inline `code` spans that
  start with such a command (after any VAR=value). Its subcommand exists in the parser of
  dynemb.cli.build_parser(), and every `--flag` it uses is an option that subcommand's --help
  shows. `-m dynemb.trainer` is checked against the parser dynemb/trainer/cli.py builds for it;
  any other `-m dynemb.X` module must exist.
- Every relative link [text](path) points to an existing file, and a `#anchor` into a markdown
  page names one of its headings (GitHub's heading ids).

In-process and without a subprocess: the whole module takes a few seconds.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "zsh"}
FRAGMENT = "# fragment"


@dataclass
class Block:
    lang: str
    line: int  # the line number of the block's first line in its page
    lines: list[str] = field(default_factory=list)


@dataclass
class Page:
    name: str  # the path from the repository root
    blocks: list[Block]
    prose: str  # the page with its code blocks blanked (line numbers kept)


def read_page(path: Path, text: str | None = None) -> Page:
    """The page's fenced code blocks, and the rest of it."""
    text = path.read_text() if text is None else text
    blocks, prose, fence, block = [], [], "", Block("", 0)
    for number, line in enumerate(text.split("\n"), 1):
        stripped = line.strip()
        if not fence:
            opening = re.match(r"(`{3,}|~{3,})\s*([\w+-]*)", stripped)
            if opening:
                fence, block = opening.group(1), Block(opening.group(2).lower(), number + 1)
                prose.append("")
            else:
                prose.append(line)
            continue
        prose.append("")
        if stripped.startswith(fence) and not stripped.strip(fence[0]):
            blocks.append(block)
            fence = ""
        else:
            block.lines.append(line)
    name = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name
    return Page(name, blocks, "\n".join(prose))


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


# ---------------------------------------------------------------- python blocks


def python_errors(page: Page) -> list[str]:
    errors = []
    for block in page.blocks:
        if block.lang not in ("python", "py"):
            continue
        first = next((line.strip() for line in block.lines if line.strip()), "")
        if first.startswith(FRAGMENT):
            continue
        try:
            ast.parse("\n".join(block.lines))
        except SyntaxError as exc:
            errors.append(f"{page.name}:{block.line + (exc.lineno or 1) - 1}: python block does not parse: {exc.msg}")
    return errors


# ---------------------------------------------------------------- commands


def commands(page: Page) -> list[tuple[int, str]]:
    """(line, command text) of every shell command in the page's blocks and inline spans."""
    found = []
    for block in page.blocks:
        if block.lang not in SHELL and block.lang != "console":
            continue
        text, start = "", 0
        for offset, line in enumerate(block.lines):
            if not text:
                if block.lang == "console" and not line.startswith("$ "):
                    continue
                start, line = block.line + offset, line.removeprefix("$ ")
            if line.rstrip().endswith("\\"):
                text += line.rstrip()[:-1] + " "
                continue
            found.append((start, text + line))
            text = ""
    command_start = re.compile(r"\s*(\w+=\S*\s+)*(\S*/)?(dynemb|python3?|torchrun)\s")
    for span in re.finditer(r"(?<!`)`([^`]+)`(?!`)", page.prose):
        text = span.group(1)
        if "\n\n" not in text and command_start.match(text):
            found.append((_line_of(page.prose, span.start()), text.replace("\n", " ")))
    return sorted(found)


def simple_commands(text: str) -> list[list[str]]:
    """The words of each command of a shell line (split at ;, &&, ||, |, &), comments left out,
    and without leading VAR=value words or sudo."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    out: list[list[str]] = [[]]
    for word in lexer:
        if set(word) <= set(";&|"):
            out.append([])
        elif out[-1] or not (re.match(r"[A-Za-z_]\w*=", word) or word == "sudo"):
            out[-1].append(word)
    return [words for words in out if words]


@functools.cache
def dynemb_parser() -> argparse.ArgumentParser:
    from dynemb.cli import build_parser

    return build_parser()


@functools.cache
def trainer_module_parser() -> argparse.ArgumentParser:
    """The parser of `python -m dynemb.trainer`, made as dynemb/trainer/cli.py's main makes it."""
    from dynemb.trainer import cli

    parser = argparse.ArgumentParser(prog="python -m dynemb.trainer")
    cli.configure(parser)
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser] | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return None


def _shown_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The options the parser's --help shows."""
    return {flag for a in parser._actions if a.help != argparse.SUPPRESS for flag in a.option_strings}


def _check_args(parser: argparse.ArgumentParser, prog: str, args: list[str]) -> list[str]:
    i = 0
    while (subs := _subcommands(parser)) is not None and i < len(args) and not args[i].startswith("-"):
        word = args[i]
        if word == "...":  # `dynemb ps ...`: any subcommand
            return []
        if word not in subs:
            return [f"`{prog} {word}`: no such command ({prog} has {', '.join(subs)})"]
        parser, prog, i = subs[word], f"{prog} {word}", i + 1
    shown = _shown_flags(parser)
    flags = [word.split("=", 1)[0] for word in args[i:] if word.startswith("--") and word != "--"]
    return [f"`{prog}`: {flag} is not in `{prog} --help`" for flag in flags if flag not in shown]


def command_errors(words: list[str]) -> list[str] | None:
    """What is wrong with one command's words against the real CLI; None: it runs no dynemb."""
    if words[0] == "dynemb" or words[0].endswith("/dynemb"):
        return _check_args(dynemb_parser(), "dynemb", words[1:])
    if "-m" in words[:-1]:
        at = words.index("-m")
        module, args = words[at + 1], words[at + 2 :]
        if module == "dynemb.trainer":
            return _check_args(trainer_module_parser(), "python -m dynemb.trainer", args)
        if module == "dynemb.cli":
            return _check_args(dynemb_parser(), "dynemb", args)
        if module.startswith("dynemb."):
            return [] if importlib.util.find_spec(module) else [f"`-m {module}`: no such module"]
    return None


def cli_errors(page: Page) -> tuple[list[str], int]:
    """The page's commands that do not match the CLI, and how many dynemb commands it has."""
    errors, checked = [], 0
    for line, text in commands(page):
        try:
            parts = simple_commands(text)
        except ValueError as exc:  # unbalanced quotes
            errors.append(f"{page.name}:{line}: `{text}`: {exc}")
            continue
        for words in parts:
            found = command_errors(words)
            if found is not None:
                checked += 1
                errors += [f"{page.name}:{line}: {error}" for error in found]
    return errors, checked


# ---------------------------------------------------------------- links


def heading_ids(page: Page) -> set[str]:
    """GitHub's ids of the page's headings: lower case, punctuation dropped, spaces to hyphens,
    a repeated one numbered."""
    ids: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", page.prose, re.MULTILINE):
        base = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        slug, n = base, 0
        while slug in ids:
            n += 1
            slug = f"{base}-{n}"
        ids.add(slug)
    return ids


def link_errors(page: Page, path: Path) -> list[str]:
    prose = re.sub(r"`[^`]*`", lambda m: re.sub(r"[^\n]", " ", m.group(0)), page.prose)
    errors = []
    for link in re.finditer(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose):
        target = link.group(1)
        if re.match(r"[A-Za-z][\w+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        where = f"{page.name}:{_line_of(prose, link.start())}: link {target}"
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            errors.append(
                f"{where}: no file {resolved.relative_to(REPO) if resolved.is_relative_to(REPO) else resolved}"
            )
        elif anchor and resolved.suffix == ".md" and anchor not in heading_ids(read_page(resolved)):
            errors.append(f"{where}: no heading #{anchor} in {resolved.name}")
    return errors


# ---------------------------------------------------------------- the tests

IDS = [str(p.relative_to(REPO)) for p in PAGES]


@pytest.mark.parametrize("path", PAGES, ids=IDS)
def test_python_blocks_parse(path):
    errors = python_errors(read_page(path))
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("path", PAGES, ids=IDS)
def test_commands_match_the_cli(path):
    errors, _ = cli_errors(read_page(path))
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("path", PAGES, ids=IDS)
def test_links_resolve(path):
    errors = link_errors(read_page(path), path)
    assert not errors, "\n".join(errors)


def test_the_pages_are_checked():
    """The checks find what the pages hold (a parse that found nothing would pass any page)."""
    pages = [read_page(p) for p in PAGES]
    assert REPO / "README.md" in PAGES and len(PAGES) >= 10
    checked = sum(cli_errors(page)[1] for page in pages)
    python = sum(block.lang == "python" for page in pages for block in page.blocks)
    links = sum(len(re.findall(r"\]\((?!https?:)", page.prose)) for page in pages)
    assert checked >= 60 and python >= 4 and links >= 30, (checked, python, links)


def test_the_checks_see_mistakes(tmp_path):
    page_path = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# There\n\n## A part: `dynemb ps`\n")
    text = "\n".join(
        [
            "# Page",
            "See [there](there.md#a-part-dynemb-ps), [gone](gone.md), [part](there.md#nope), [web](https://x.org/a).",
            "Inline: `dynemb train --stepz 3`, and `DYNEMB_PS_AUTH_TOKEN=t dynemb ps serve --auth-token x`.",
            "```bash",
            "dynemb ps serv --address 0.0.0.0:1   # a comment with --not-a-flag",
            "torchrun --nproc_per_node 2 -m dynemb.trainer --steps 3 \\",
            "    --capacity-fractoin 0.1",
            "sudo useradd --system dynemb; .venv/bin/dynemb table export --ps a:1 --out t && dynemb tf nope",
            "python -m dynemb.protos.generate && python -m dynemb.nothing_here",
            "```",
            "```console",
            "$ dynemb checkpoint inspect ck --verify --quiet",
            "dynemb: error: output, not a command --xyz",
            "```",
            "```python",
            "x = (1,",
            "```",
            "```python",
            "# fragment: not Python on its own",
            "    x = (1,",
            "```",
        ]
    )
    page = read_page(page_path, text)
    errors, checked = cli_errors(page)
    assert checked == 9, (checked, errors)
    assert errors == [
        "page.md:3: `dynemb train`: --stepz is not in `dynemb train --help`",
        "page.md:5: `dynemb ps serv`: no such command (dynemb ps has serve, plan, tables, create-table, lifecycle, "
        "changes, describe, drop, pull, stats, health)",
        "page.md:6: `python -m dynemb.trainer`: --capacity-fractoin is not in `python -m dynemb.trainer --help`",
        "page.md:8: `dynemb tf nope`: no such command (dynemb tf has ls, migrate)",
        "page.md:9: `-m dynemb.nothing_here`: no such module",
    ]
    assert python_errors(page) == ["page.md:16: python block does not parse: '(' was never closed"]
    assert link_errors(page, page_path) == [
        "page.md:2: link gone.md: no file " + str(tmp_path / "gone.md"),
        "page.md:2: link there.md#nope: no heading #nope in there.md",
    ]
