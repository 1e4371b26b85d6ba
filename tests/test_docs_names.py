"""Every code name the docs cite in backticks exists in the code (``doc_names`` says which tokens count)."""

from __future__ import annotations

from pathlib import Path

import pytest
from doc_names import CodeIndex, cited, problem

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md", REPO / "manifests" / "README.md"]


@pytest.fixture(scope="module")
def index() -> CodeIndex:
    return CodeIndex.build(REPO)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_cited_name_exists(doc, index):
    wrong = sorted({f"`{token}`: {why}" for token in cited(doc.read_text(encoding="utf-8"))
                    if (why := problem(token, index, doc.parent))})
    assert not wrong, f"{doc.relative_to(REPO)} cites names the code does not have:\n" + "\n".join(wrong)


@pytest.mark.parametrize("token, wrong", [
    ("RETIRE_" + "GRACE_S", True), ("version_retire_grace_s", False), ("version_retire_" + "grace_seconds", True), ("deployments.config.AppArgs", False),
    ("deployments.config.NoSuchThing", True), ("AppArgs.engine_config()", False), ("AppArgs.no_such()", True),
    ("routing/plan.py", False), ("routing/no_such.py", True), ("routing/plan.py:planned_on", False),
    ("mark_used(uid)", False), ("no_such_function(x)", True), ("ray.serve.run", False), ("torch.cuda.is_available()", False),
    ("eviction_policy.py", False), ("serve run serve_config.yaml", False),
])
def test_the_scanner_reads_code_names_and_leaves_prose_alone(token, wrong, index):
    assert (problem(token, index, REPO / "docs") is not None) == wrong, token
