"""docs/ against the code: the configuration reference lists exactly the
dataclass fields, troubleshooting covers every error class, the README's
commands name what exists."""

from __future__ import annotations

import dataclasses
import inspect
import re

import tierd.errors
from tierd.cli import build_parser
from tierd.client.attach import AttachConfig
from tierd.config import ServeConfig
from tests.conftest import ROOT

DOCS = ROOT / "docs"


def section_fields(text: str, section: str) -> list[str]:
    body = re.search(rf"^## {section}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert body, f"no '## {section}' section"
    return re.findall(r"^### `(\w+)`$", body.group(1), re.M)


def test_configuration_reference_lists_exactly_the_dataclass_fields():
    text = (DOCS / "configuration.md").read_text()
    for cls in (ServeConfig, AttachConfig):
        documented = section_fields(text, cls.__name__)
        assert documented == [f.name for f in dataclasses.fields(cls)], cls.__name__


def test_troubleshooting_has_a_section_per_error_class():
    text = (DOCS / "troubleshooting.md").read_text()
    classes = [c for _, c in inspect.getmembers(tierd.errors, inspect.isclass)
               if issubclass(c, tierd.errors.TierdError)]
    assert len(classes) >= 9
    for cls in classes:
        body = re.search(rf"^## {cls.__name__}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
        assert body, f"troubleshooting.md has no section for {cls.__name__}"
        assert f"code `{cls.code}`" in body.group(1), cls.__name__


def test_docs_name_only_commands_that_exist():
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    for path in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for cmd in re.findall(r"`tierd ([a-z-]+)", path.read_text()):
            assert cmd in commands, f"{path.name} mentions `tierd {cmd}`"


def test_architecture_names_the_state_machines_that_exist():
    from tierd.client.planner import PlanState
    from tierd.client.tiered_param import ParamState
    from tierd.server.catalog import Residency
    text = (DOCS / "architecture.md").read_text()
    for enum in (Residency, ParamState, PlanState):
        assert f"`{enum.__name__}`" in text
        for member in enum:
            assert f"`{member.name}`" in text, f"{enum.__name__}.{member.name}"
