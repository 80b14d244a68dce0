"""The documentation agrees with the code, and stays so (README, docs/design.md):

* every ``<file>.md#<anchor>`` cited in code, docs and tests, and every ``(#anchor)`` link,
  names a heading that exists (GitHub's heading slugs);
* every repository path the README and docs/ name exists, and every ``path::name`` and dotted
  ``dpmerge.module.name`` they name is defined there;
* what they say about ``method: auto`` and the dev stack's S3 is what the code does.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("*.py", "*.md", "*.yaml", "*.yml", "*.toml", "*.sh")
SKIPPED = {".venv", ".git", ".stack", ".dpmerge", "results", "node_modules"}
TOP_LEVEL = ("dpmerge", "flows", "tasks", "devstack", "deployments", "docs", "tests")
TOP_LEVEL += ("benchmarks", "scripts", ".ci")
NOT_MODULES = {"dpmerge.policy", "dpmerge.drift"}
"""Dotted names that are not module paths: the Prefect event and resource namespace
(``dpmerge.policy.updated``, ``dpmerge.policy.<name>``)."""


def _files(*patterns: str) -> list[Path]:
    found = set()
    for pattern in patterns:
        for path in REPO.rglob(pattern):
            if not SKIPPED.intersection(path.relative_to(REPO).parts) and path.is_file():
                found.add(path)
    return sorted(found)


def _docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _without_code_blocks(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        lines.append("" if fenced else line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters, digits, '_',
    '-' and spaces kept), each space a '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors of a Markdown file's headings (a repeated one gets ``-1``, ``-2``, …)."""
    seen: dict[str, int] = {}
    found = set()
    for line in _without_code_blocks(path.read_text()):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        base = slug(heading.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def test_slugs_follow_github() -> None:
    assert slug("RS secrecy") == "rs-secrecy"
    assert slug("`dpmerge stack up | down | status | env`") == "dpmerge-stack-up--down--status--env"
    assert slug("1. Mean estimation") == "1-mean-estimation"
    assert slug("Time to policy") == "time-to-policy"


CITATION = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)#([\w-]+)")
LOCAL_LINK = re.compile(r"\]\(#([\w-]+)\)")


def _target(cited: str, where: Path) -> Path | None:
    for base in (where.parent, REPO):
        if (base / cited).is_file():
            return base / cited
    return None


def test_every_cited_anchor_resolves() -> None:
    broken = []
    for path in _files(*SCANNED):
        text = path.read_text(errors="replace")
        where = path.relative_to(REPO)
        for match in CITATION.finditer(text):
            cited, anchor = match.groups()
            target = _target(cited, path)
            if target is None:
                broken.append(f"{where}: {cited}#{anchor} (no file {cited})")
            elif anchor not in anchors(target):
                broken.append(f"{where}: {cited}#{anchor} (no such heading)")
        if path.suffix == ".md":
            for match in LOCAL_LINK.finditer(text):
                if match.group(1) not in anchors(path):
                    broken.append(f"{where}: #{match.group(1)} (no such heading)")
    assert broken == []


PATH = re.compile(
    r"(?<![\w./<-])((?:" + "|".join(re.escape(t) for t in TOP_LEVEL) + r")/[\w./-]*)"
    r"(?:::(\w+))?"
)
TOP_FILES = re.compile(r"(?<![\w./-])(README\.md|pyproject\.toml)\b")


def _named_paths(text: str) -> list[tuple[str, str | None]]:
    found = []
    for line in text.splitlines():
        for match in PATH.finditer(line):
            path, name = match.group(1).rstrip(".,;:"), match.group(2)
            after = line[match.end(1) : match.end(1) + 1]
            if after in ("<", "*", "{", "…"):  # a pattern (results/<study>/, tests/test_*.py)
                continue
            found.append((path, name))
        found.extend((m.group(1), None) for m in TOP_FILES.finditer(line))
    return found


def _defines(path: Path, name: str) -> bool:
    source = path.read_text()
    return (
        re.search(rf"^\s*(async\s+def|def|class)\s+{name}\b|^{name}\s*[:=]", source, re.M)
        is not None
    )


def test_every_path_the_docs_name_exists() -> None:
    missing = []
    for doc in _docs():
        for path, name in _named_paths(doc.read_text()):
            where = f"{doc.relative_to(REPO)}: {path}"
            if not (REPO / path).exists():
                missing.append(where)
            elif name is not None and not _defines(REPO / path, name):
                missing.append(f"{where}::{name} (not defined there)")
    assert missing == []


DOTTED = re.compile(r"(?<![\w.])((?:dpmerge|flows|tasks|devstack)(?:\.[A-Za-z_]\w*)+)")


def _module_file(parts: list[str]) -> Path | None:
    package = REPO.joinpath(*parts)
    if (package / "__init__.py").is_file():
        return package / "__init__.py"
    module = REPO.joinpath(*parts[:-1], f"{parts[-1]}.py")
    return module if module.is_file() else None


def _defined_in(name: str, module: Path) -> Path | None:
    """The file that defines ``name``: ``module`` itself, or (for a name it only imports, as a
    package re-exports) the file of its top package that defines it."""
    if _defines(module, name):
        return module
    package = REPO / module.relative_to(REPO).parts[0]
    return next((p for p in sorted(package.rglob("*.py")) if _defines(p, name)), None)


def test_every_module_path_the_docs_name_exists() -> None:
    """``dpmerge.publication.public_record``: a module, then names defined there (an attribute
    of a class: in the class's file)."""
    wrong = []
    for doc in _docs():
        for match in DOTTED.finditer(doc.read_text()):
            dotted = match.group(1).rstrip(".")
            parts = dotted.split(".")
            if ".".join(parts[:2]) in NOT_MODULES:
                continue
            depth = max(
                (i for i in range(1, len(parts) + 1) if _module_file(parts[:i]) is not None),
                default=0,
            )
            where: Path | None = _module_file(parts[:depth]) if depth else None
            names = parts[depth:]
            if where is not None and names:
                where = _defined_in(names[0], where)
            if where is None or any(
                re.search(rf"\b{n}\b", where.read_text()) is None for n in names
            ):
                wrong.append(f"{doc.relative_to(REPO)}: {dotted}")
    assert wrong == []


def _sentences(text: str) -> list[str]:
    """Sentences of prose: blocks (paragraphs, list items, table rows, comment lines) split
    at full stops."""
    blocks, current = [], []
    for line in text.splitlines():
        bare = line.strip().lstrip("#").strip()
        if not bare or re.match(r"^([*-]|\d+\.|\|)\s", line.strip()) or line.lstrip()[:1] in "|#":
            blocks.append(" ".join(current))
            current = []
        if bare:
            current.append(bare)
    blocks.append(" ".join(current))
    return [s for block in blocks for s in re.split(r"(?<=\.)\s+(?=[A-Z`*(])", block) if s]


AUTO = re.compile(r"`(?:method: )?auto`|method: auto|\bauto\b[^.]{0,30}\b(RS|LC)\b")
STEERED_BY_ACCURACY = re.compile(
    r"(better|higher|best)( expected)? validation accuracy"
    r"|RS \(utilities: (the )?candidates' validation accurac"
)


@pytest.mark.parametrize(
    "path",
    [
        "README.md",
        "docs/design.md",
        "docs/workflow.md",
        "deployments/policies.yaml",
        "dpmerge/policies.py",
        "dpmerge/vocabulary.py",
        "dpmerge/policy_merge/__init__.py",
        "dpmerge/policy_merge/calibration.py",
    ],
)
def test_auto_is_described_as_the_code_chooses(path: str) -> None:
    """``method: auto`` keeps the release with the smaller noise proxy, a data-independent
    choice (dpmerge/policy_merge/calibration.py; tests/test_policy_merge.py checks the choice
    itself); no text may say it picks by validation accuracy."""
    text = (REPO / path).read_text()
    about_auto = [s for s in _sentences(text) if AUTO.search(s)]
    assert about_auto, f"{path} no longer describes method auto: update this list"
    wrong = [s for s in about_auto if STEERED_BY_ACCURACY.search(s)]
    assert wrong == []
    assert any(re.search("noise[- ]proxy", s) for s in about_auto), about_auto


def test_the_dev_stacks_s3_is_described_as_the_stack_runs_it() -> None:
    """The stack runs SeaweedFS on disk (devstack/services.py); no document may call its S3
    moto or in-memory."""
    services = (REPO / "devstack" / "services.py").read_text()
    assert '"weed"' in services or "'weed'" in services or "weed mini" in services
    claims = []
    for doc in _docs():
        for sentence in _sentences(doc.read_text()):
            about_s3 = re.search(r"stack'?s? S3|dev S3|S3 server", sentence)
            in_memory = re.search(r"\bmoto\b[^.]*(memory|in-memory)|in memory", sentence)
            past = re.search(r"\bbefore\b|\bused to\b|Why not moto", sentence)
            if about_s3 and in_memory and not past:
                claims.append(f"{doc.relative_to(REPO)}: {sentence}")
    assert claims == []
    security = (REPO / "docs" / "design.md").read_text().split("## Security", 1)[1]
    assert "SeaweedFS" in security.split("## Sharp edges", 1)[0]
