"""README.md's environment-variable table is generated from collective/config.py's OPTIONS."""
from __future__ import annotations

import pathlib

from collective.config import markdown_table

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_config_table_matches_the_options():
    assert markdown_table() in README.read_text(), (
        "README.md's configuration table is stale: regenerate it with "
        "`python -m collective.config` and paste it under '## Configuration'")


def test_readme_gives_the_two_commands():
    text = README.read_text()
    assert "bash scripts/setup.sh" in text and "python3 -m pytest -q" in text
