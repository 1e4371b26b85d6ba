"""The README's commands are what CI runs (serve configs are checked in tests/test_manifests.py)."""

from pathlib import Path

REPO = Path(__file__).parents[1]


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    blocks = text.split("```bash\n")[1:3]
    return [b.split("\n```")[0].strip() for b in blocks]


def test_readme_opens_with_run_and_test_commands_and_ci_runs_the_test_one():
    run, test = readme_commands()
    assert "serve run serve_config.yaml" in run and "pip install" in run
    assert "pytest" in test and "pip install" in test and "'.[test]'" in test
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert test in ci

