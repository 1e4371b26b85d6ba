"""Every command in the README runs as pasted, against the session's live demo app.

The README's ```bash and ```python blocks are read from the file: the first two are the
install-and-run and test commands (tests/test_repo_hygiene.py checks those against .ci/run);
every other block runs here, with ``localhost:8000`` pointed at the session's HTTP proxy.
curl runs with ``--fail-with-body``, so an HTTP error (a form body where JSON is wanted, a
wrong route) fails the test with the server's answer.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from deployments.config import AppArgs

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(bash|python)\n(.*?)\n```$", re.S | re.M)
README_HOST = "localhost:8000"
CURL_FAILS_ON_HTTP_ERRORS = 'curl() { command curl --fail-with-body --show-error --max-time 120 "$@"; echo; }\n'


def readme_blocks() -> list[tuple[str, str]]:
    return FENCE.findall((REPO / "README.md").read_text(encoding="utf-8"))


def run(argv: list[str], env: dict, what: str) -> str:
    proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_every_readme_snippet_runs_against_the_demo_app(fleet, http_base, ray_cluster, tmp_path):
    (_, install_and_run), (_, test_command), *snippets = readme_blocks()
    assert "serve run serve_config.yaml" in install_and_run and "pytest" in test_command
    host = http_base.removeprefix("http://")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    token_var = AppArgs().admin_token_env
    assert env.get(token_var), f"the session cluster runs with {token_var} set (tests/conftest.py)"
    ran = {"bash": 0, "python": 0}
    for i, (language, text) in enumerate(snippets):
        if README_HOST not in text and "ray.init" not in text:
            # the one block that is neither a client call nor a driver: the server's token, exported
            assert re.fullmatch(rf"export {token_var}=\S+\s+#.*", text), text
            continue
        code = text.replace(README_HOST, host)
        if language == "bash":
            out = run(["bash", "-euo", "pipefail", "-c", CURL_FAILS_ON_HTTP_ERRORS + code], env, f"bash block {i}")
        else:
            script = tmp_path / f"block_{i}.py"
            script.write_text(code)
            out = run([sys.executable, str(script)], env, f"python block {i}")
        assert out.strip(), f"block {i} printed nothing"
        ran[language] += 1
    assert ran["bash"] >= 2 and ran["python"] >= 2, ran  # the HTTP calls, the admin calls, OpenAI and the handle
    names = [e["name"] for e in fleet.list_adapters.remote().result(timeout_s=30)["data"]]
    assert not [n for n in names if n == "mine" or n.startswith("mine@")], names  # the admin block cleaned up
