"""No command takes a flag for an abbreviation of a longer one: `dynemb ps serve --port 8000`
was read as `--port-file 8000` (a PS on its default port, writing a file named 8000)."""

from __future__ import annotations

import argparse

import pytest

from dynemb.cli import build_parser, main


def _parsers(parser: argparse.ArgumentParser, name: str = "dynemb"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from _parsers(child, f"{name} {sub}")


def test_no_parser_takes_abbreviations():
    parsers = dict(_parsers(build_parser()))
    assert {"dynemb ps serve", "dynemb train", "dynemb table import", "dynemb checkpoint"} <= parsers.keys()
    assert [name for name, parser in parsers.items() if parser.allow_abbrev] == []


@pytest.mark.parametrize(
    "argv,flag",
    [(["ps", "serve", "--port", "8000"], "--port"), (["train", "--step", "3"], "--step")],
)
def test_an_abbreviated_flag_is_refused_by_name(argv, flag, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    assert f"unrecognized arguments: {flag}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no file named after the value


def test_the_trainer_module_refuses_an_abbreviated_flag(capsys):
    from dynemb.trainer.cli import main as trainer_main

    with pytest.raises(SystemExit) as exit:
        trainer_main(["--step", "3"])
    assert exit.value.code == 2 and "unrecognized arguments: --step" in capsys.readouterr().err
