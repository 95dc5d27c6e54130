"""docs/ against the code: the configuration reference lists exactly the
dataclass fields, troubleshooting covers every error class, the README's
commands name what exists, and the examples in docstrings run."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import inspect
import os
import pkgutil
import re
import shlex

import pytest

import tierd.errors
from tierd.cli import build_parser, main
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


def shown_commands(text: str) -> list[str]:
    """Every ``tierd ...`` command line in a page: in code blocks (also after
    ``&&``, ``;``, ``|`` or ``--``, as in ``kubectl exec ... -- tierd status``)
    and in inline code spans."""
    found = [" ".join(span.split()) for span in re.findall(r"`(tierd [a-z-][^`]*)`", text)]
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S):
        for line in block.splitlines():
            for part in re.split(r"&&|;|\|(?!\|)", line.split("  #")[0]):
                m = re.search(r"(?:^|\s--\s|^\s*(?:[A-Z_]+=\S+\s+)*)(tierd (?:[a-z-]|--).*)",
                              part)
                if m:
                    found.append(m.group(1).strip())
    return found


def test_every_command_in_the_readme_and_docs_runs(monkeypatch, capsys):
    """Each command line shown is parsed by the real CLI (a changed flag or
    command fails here); ``--help`` lines run; ``serve`` lines run as a dry
    run with ``--print-config``, which also reads every value they give. A
    bare ``tierd CMD`` in prose names the command: it must exist."""
    for k in [k for k in os.environ if k.startswith("TIERD_")]:
        monkeypatch.delenv(k)
    sample = str(ROOT / "deploy" / "tierd.toml")
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    seen = []
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for line in shown_commands(path.read_text()):
            argv = [sample if a == "/etc/tierd/tierd.toml" else a for a in shlex.split(line)[1:]]
            where = f"{path.name}: {line}"
            if len(argv) == 1 and not argv[0].startswith("--"):
                assert argv[0] in commands, where
                seen.append(argv[0])
                continue
            if "--help" in argv or argv == ["--version"]:
                with pytest.raises(SystemExit) as exit_:
                    main(argv)
                assert exit_.value.code == 0, where
                continue
            try:
                args = build_parser().parse_args(argv)
            except SystemExit:
                raise AssertionError(f"{where}: {capsys.readouterr().err}") from None
            if args.command == "serve":
                assert main([*argv, "--print-config"]) == 0, f"{where}: {capsys.readouterr().err}"
            seen.append(args.command)
    capsys.readouterr()
    assert {"serve", "status", "top", "health", "export", "import", "demo", "drop-job",
            "bench"} <= \
        set(seen), seen


def test_architecture_names_the_state_machines_that_exist():
    from tierd.client.planner import PlanState
    from tierd.client.tiered_param import ParamState
    from tierd.server.catalog import Residency
    text = (DOCS / "architecture.md").read_text()
    for enum in (Residency, ParamState, PlanState):
        assert f"`{enum.__name__}`" in text
        for member in enum:
            assert f"`{member.name}`" in text, f"{enum.__name__}.{member.name}"


MODULES = sorted(m.name for m in pkgutil.walk_packages(tierd.__path__, "tierd."))


@pytest.mark.parametrize("name", [n for n in MODULES if not n.endswith("__main__")])
def test_docstring_examples_run(name):
    """Examples not marked ``+SKIP`` are run as written (plain-code parts)."""
    runner, out = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS), []
    for test in doctest.DocTestFinder().find(importlib.import_module(name)):
        runner.run(test, out=out.append)
    assert runner.failures == 0, "".join(out)


# [Note: ...] blocks (STYLE.md 11): a block's header is a line that holds only
# ``[Note: TITLE]`` (after a ``#`` or ``#:`` in a comment); every other
# ``[Note: TITLE]`` is a reference to one, and may name the module that holds
# it ("[Note: X] in ``tierd.client.registry``", "in `registry.py`").
NOTE = re.compile(r"\[Note:\s*(?P<title>[^\]]*)\]")
NOTE_HEADER = re.compile(r"^\s*(?:#:?\s*)?\[Note:\s*(?P<title>[^\]]*)\]\s*$")
NOTE_MODULE = re.compile(r"\]\s*(?:#:?\s*)?in\s+(?::mod:)?`*(?P<module>[\w./]+?)\.?`*(?=[\s),;:`]|$)")


def note_title(raw: str) -> str:
    """A title as written, less the comment markers of a wrapped line."""
    return " ".join(re.sub(r"\n\s*#:?", " ", raw).split())


def note_sources() -> list:
    return sorted((ROOT / "tierd").rglob("*.py"))


def note_headers() -> dict[str, list[str]]:
    """Title -> the ``path:line`` of each block with that header in tierd/."""
    found: dict[str, list[str]] = {}
    for path in note_sources():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = NOTE_HEADER.match(line)
            if m:
                found.setdefault(note_title(m.group("title")), []).append(
                    f"{path.relative_to(ROOT)}:{n}")
    return found


def note_references() -> list[tuple[str, str, str | None, object]]:
    """(``path:line``, title, module named or None, path) of every reference
    in tierd/, docs/ and the README."""
    refs = []
    for path in [*note_sources(), *sorted(DOCS.glob("*.md")), ROOT / "README.md"]:
        text = path.read_text()
        lines = text.splitlines()
        for m in NOTE.finditer(text):
            n = text.count("\n", 0, m.start()) + 1
            if NOTE_HEADER.match(lines[n - 1]) or m.group("title") == "...":
                continue   # a block's header, or the form named in prose
            named = NOTE_MODULE.match(text, m.end() - 1)
            refs.append((f"{path.relative_to(ROOT)}:{n}", note_title(m.group("title")),
                         named.group("module") if named else None, path))
    return refs


def module_files(module: str, where) -> set[str]:
    """The files of tierd/ a reference's module name can mean: a dotted name
    (``tierd.client.registry``, relative ``.plan``), a path
    (``tierd/client/placement.py``) or a file's name (``registry.py``, ``bigmodel``)."""
    files = [p.relative_to(ROOT) for p in note_sources()]
    if module.startswith("."):
        package = where.parent.relative_to(ROOT)
        return {str(package / f"{module[1:]}.py")} & {str(p) for p in files}
    if module.startswith("tierd.") and not module.endswith(".py"):
        base = module.replace(".", "/")
        return {str(p) for p in files if str(p) in (f"{base}.py", f"{base}/__init__.py")}
    if "/" in module:
        return {module} & {str(p) for p in files}
    name = module if module.endswith(".py") else f"{module}.py"
    return {str(p) for p in files if p.name == name}


def test_every_note_reference_resolves_to_one_note():
    """Each ``[Note: TITLE]`` cited in the code, the docs or the README is
    defined by exactly one block in tierd/, in the module the reference
    names if it names one."""
    headers = note_headers()
    assert len(headers) >= 50, sorted(headers)
    wrong = [f"{', '.join(where)}: [Note: {title}] is defined {len(where)} times"
             for title, where in headers.items() if len(where) > 1]
    refs = note_references()
    assert len(refs) >= 200
    for where, title, module, path in refs:
        defined = headers.get(title)
        if not defined:
            wrong.append(f"{where}: [Note: {title}] is defined nowhere in tierd/")
        elif module is not None and defined[0].rsplit(":", 1)[0] not in module_files(module, path):
            wrong.append(f"{where}: [Note: {title}] is not in {module} (it is at {defined[0]})")
    for path in [*note_sources(), *sorted(DOCS.glob("*.md")), ROOT / "README.md"]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b(?:the|its|'s) Notes? (?:on|in)\b", line):
                wrong.append(f"{path.relative_to(ROOT)}:{n}: a Note cited in prose; "
                             "write [Note: TITLE] so this test checks it")
    assert not wrong, "unresolved Note references:\n" + "\n".join(wrong)
