"""The code names a doc cites in backticks, and whether each exists in this repository's code.

Only tokens that are unmistakably code are checked, so prose in backticks (values, commands, other
projects' names) never fails: a dotted path into one of our packages (``deployments.config.AppArgs``),
``Class.member`` of a class defined here, a call ``name(...)``, a repo path (``routing/plan.py``, with an
optional ``:function``), an UPPER_SNAKE constant and a lower_snake name (a setting, function or metric). Definitions are read with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

PACKAGES = ("pool", "engine", "routing", "deployments", "benchmarks", "testkit", "manifests", "tests", "examples")
CODE_SUFFIXES = (".py", ".yaml", ".yml", ".sh", ".toml", ".json")
BACKTICKED = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = re.compile(rf"^{IDENT}(?:\.{IDENT})+(?:\(.*\))?$")
CALL = re.compile(rf"^({IDENT})\(.*\)(?:\s*->.*)?$")
CONSTANT = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+$")
SNAKE = re.compile(r"^_?[a-z][a-z0-9]*(?:_[a-z0-9]+)+$")  # a setting, function or metric name
CAMEL = re.compile(r"^[A-Z][a-z0-9]+[A-Z]\w*$")
FILE_NAME = re.compile(r"^[\w.-]+\.(?:py|md|json|ya?ml|txt|csv|sh|toml)(?::\w+)?$")
PATH = re.compile(r"^([\w.-]+(?:/[\w.-]+)*/?)(?::(\w+))?$")


@dataclass
class CodeIndex:
    """What the repository's Python defines: modules, their top-level names, each class's members and bases."""

    root: Path
    modules: dict[str, set[str]] = field(default_factory=dict)        # module -> top-level names
    classes: dict[str, list[tuple[set[str], list[str]]]] = field(default_factory=dict)  # name -> [(members, bases)]
    names: set[str] = field(default_factory=set)                      # every name defined anywhere
    text: str = ""                                                    # all code text (constants, env vars)

    @classmethod
    def build(cls, root: Path) -> "CodeIndex":
        index = cls(root)
        texts = []
        for path in sorted(root.rglob("*")):
            rel = path.relative_to(root)
            if rel.parts[0] not in PACKAGES + (".ci",) and len(rel.parts) > 1 or "results" in rel.parts:
                continue
            if path.is_file() and (path.suffix in CODE_SUFFIXES or path.name in ("run", "Dockerfile")):
                texts.append(path.read_text(encoding="utf-8", errors="replace"))
            if path.suffix == ".py" and rel.parts[0] in PACKAGES:
                index._add_module(rel, ast.parse(texts[-1]))
        index.text = "\n".join(texts)
        return index

    def _add_module(self, rel: Path, tree: ast.Module) -> None:
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        top = self.modules.setdefault(".".join(parts), set())
        for node in tree.body:
            top |= defined(node)
        for node in ast.walk(tree):
            self.names |= defined(node)
            if isinstance(node, ast.ClassDef):
                members = set().union(*(defined(item) for item in node.body)) if node.body else set()
                members |= {a.attr for a in ast.walk(node) if isinstance(a, ast.Attribute)
                            and isinstance(a.ctx, ast.Store) and isinstance(a.value, ast.Name) and a.value.id == "self"}
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                self.classes.setdefault(node.name, []).append((members, bases))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.names |= {a.arg for a in node.args.args + node.args.kwonlyargs}

    def has_member(self, cls_name: str, member: str, seen: Optional[set] = None) -> bool:
        seen = seen if seen is not None else set()
        if cls_name in seen:
            return False
        seen.add(cls_name)
        return any(member in members or any(self.has_member(b, member, seen) for b in bases if b in self.classes)
                   for members, bases in self.classes.get(cls_name, []))


def defined(node: ast.AST) -> set[str]:
    """Names one statement defines: functions, classes, assignments, annotated fields, imports."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    return set()


def cited(text: str) -> Iterator[str]:
    """Each backticked span of a markdown text, outside fenced code blocks."""
    outside = re.sub(r"```.*?```", "", text, flags=re.S)
    for match in BACKTICKED.finditer(outside):
        yield match.group(1).strip()


def problem(token: str, index: CodeIndex, doc_dir: Path) -> Optional[str]:
    """Why ``token`` names no code here, or None (it exists, or it is not a code name this check reads)."""
    if any(c in token for c in "*<>{}[] ") and not CALL.match(token):
        return None
    if CONSTANT.match(token) or SNAKE.match(token):
        return None if re.search(rf"\b{token}\b", index.text) else "no such name in the code"
    if "/" in token or FILE_NAME.match(token):
        return _path_problem(token, index, doc_dir)
    call = CALL.match(token)
    if call:
        return None if call.group(1) in index.names else f"no function {call.group(1)!r} is defined"
    if DOTTED.match(token):
        return _dotted_problem(token.split("(")[0], index)
    return None


def _path_problem(token: str, index: CodeIndex, doc_dir: Path) -> Optional[str]:
    match = PATH.match(token)
    if not match or re.search(r"\b[A-Z]{3,}\b", token):
        return None  # a URL, a command, a placeholder (docs/results/NAME.json): not a path to check
    if "/" not in match.group(1):  # a bare file name may be another project's (SGLang's eviction_policy.py)
        return None
    if match.group(1).split("/")[0] not in PACKAGES + ("docs", ".ci"):
        return None  # another project's path: not ours to check
    path, func = match.groups()
    found = next((p for p in (index.root / path, doc_dir / path) if p.exists()), None)
    if found is None:
        return "no such file"
    if func and found.suffix == ".py" and func not in {n for node in ast.walk(ast.parse(found.read_text()))
                                                      for n in defined(node)}:
        return f"{path} defines no {func!r}"
    return None


def _dotted_problem(token: str, index: CodeIndex) -> Optional[str]:
    parts = token.split(".")
    if parts[0] in PACKAGES:
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if module in index.modules:
                rest = parts[cut:]
                if not rest:
                    return None
                if rest[0] not in index.modules[module] and f"{module}.{rest[0]}" not in index.modules:
                    return f"{module} defines no {rest[0]!r}"
                if len(rest) > 1 and rest[0] in index.classes and not index.has_member(rest[0], rest[1]):
                    return f"{rest[0]} has no member {rest[1]!r}"
                return None
        return "no such module"
    if CAMEL.match(parts[0]) and parts[0] in index.classes and len(parts) == 2:
        return None if index.has_member(parts[0], parts[1]) else f"{parts[0]} has no member {parts[1]!r}"
    return None  # another library's name (ray.serve, torch.cuda): not ours to check
