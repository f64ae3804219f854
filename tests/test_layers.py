"""Imports run one way: every first-party import of the daemons, checked against the
layer order written below (module-level and function-level imports alike)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES: tuple[str, ...] = ("protocol", "router", "agent", "sim")
ROUTER_CORE: tuple[str, ...] = (
    "router.policy",
    "router.session",
    "router.capacity",
    "router.peers",
)


@dataclass(frozen=True)
class Rule:
    """Modules under `importers` may not import anything under `forbidden`."""

    importers: tuple[str, ...]
    forbidden: tuple[str, ...]
    why: str
    # True: only a module-level import breaks the rule (a lazy one inside a function is
    # allowed, so the dependency is optional at run time).
    module_level_only: bool = False


# The allowed order, bottom first: protocol; then sim (protocol at most); then the two
# daemons, which never import each other. Inside the router: documents.py (protocol
# only) under policy/ and tenants/, the core under the link, HTTP and providers, and
# http/ above tenants/ and policy/.
RULES: tuple[Rule, ...] = (
    Rule(("protocol",), ("router", "agent", "sim"), "protocol/ is the bottom layer"),
    Rule(("sim",), ("router", "agent"), "sim/ imports protocol/ at most"),
    Rule(("router",), ("agent",), "the router never imports the agent"),
    Rule(("router",), ("sim",), "the router never imports the simulator"),
    Rule(("agent",), ("router",), "the agent never imports the router"),
    Rule(("agent",), ("sim",), "the agent imports sim/ only lazily", module_level_only=True),
    Rule(
        ROUTER_CORE,
        ("router.link", "router.http", "router.providers"),
        "the routing core never imports the link, HTTP or providers",
    ),
    Rule(
        ("router.tenants", "router.policy"),
        ("router.http",),
        "router/tenants/ and router/policy/ never import router/http/",
    ),
    Rule(
        ("router.documents",),
        ("router", "agent", "sim"),
        "router/documents.py imports only protocol/, the standard library and third parties",
    ),
)


@dataclass(frozen=True)
class Edge:
    path: str  # relative to the repository
    line: int
    importer: str
    module: str
    name: str | None  # `from module import name`; None for `import module`
    module_level: bool

    @property
    def imported(self) -> str:
        return self.module if self.name is None else f"{self.module}.{self.name}"


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(importer: str, is_package: bool, module: str | None, level: int) -> str:
    """The absolute module a (possibly relative) `from … import` names."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


class _Imports(ast.NodeVisitor):
    def __init__(self, path: str, importer: str, is_package: bool) -> None:
        self.path = path
        self.importer = importer
        self.is_package = is_package
        self.depth = 0  # functions (or `__main__` blocks) enclosing the node visited
        self.edges: list[Edge] = []

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_If(self, node: ast.If) -> None:
        # `if __name__ == "__main__":` runs only when the file is run as a script: its
        # imports are as lazy as a function's.
        script = (
            isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__"
            and any(
                isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators
            )
        )
        self.depth += script
        for child in node.body:
            self.visit(child)
        self.depth -= script
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.add(node, alias.name, None)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = resolve(self.importer, self.is_package, node.module, node.level)
        # One edge per name: `from router import http` imports router.http.
        for alias in node.names:
            self.add(node, module, alias.name)

    def add(self, node: ast.stmt, module: str, name: str | None) -> None:
        if module.split(".")[0] in PACKAGES:
            edge = Edge(self.path, node.lineno, self.importer, module, name, self.depth == 0)
            self.edges.append(edge)


def imports(root: Path) -> list[Edge]:
    """Every first-party import of every module under `root`'s packages."""
    edges: list[Edge] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            importer = module_name(path, root)
            visitor = _Imports(str(path.relative_to(root)), importer, path.name == "__init__.py")
            visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
            edges.extend(visitor.edges)
    return edges


def violations(edges: list[Edge], rules: tuple[Rule, ...] = RULES) -> list[str]:
    found = []
    for edge in edges:
        for rule in rules:
            if rule.module_level_only and not edge.module_level:
                continue
            if any(under(edge.importer, p) for p in rule.importers) and any(
                under(edge.imported, p) for p in rule.forbidden
            ):
                # `from router.http.asgi import Scope, Send` is one edge, to router.http.asgi.
                shown = (
                    edge.module
                    if any(under(edge.module, p) for p in rule.forbidden)
                    else edge.imported
                )
                found.append(
                    f"{edge.path}:{edge.line}: {edge.importer} imports {shown} ({rule.why})"
                )
                break  # one line per import, naming the first rule it breaks
    return sorted(set(found))


def private_imports(edges: list[Edge]) -> list[str]:
    """`from other import _name`: a private name of another module."""
    found = []
    for edge in edges:
        if edge.name is not None and edge.name.startswith("_") and edge.module != edge.importer:
            found.append(
                f"{edge.path}:{edge.line}: {edge.importer} imports {edge.name} from"
                f" {edge.module} (promote it to a public name of a shared module)"
            )
    return found


def test_imports_run_one_way() -> None:
    problems = violations(imports(ROOT))
    assert not problems, "forbidden imports:\n" + "\n".join(problems)


def test_no_module_imports_another_modules_private_names() -> None:
    problems = private_imports(imports(ROOT))
    assert not problems, "private names imported:\n" + "\n".join(problems)


def test_every_rule_names_modules_that_exist() -> None:
    # A misspelt prefix would make its rule pass whatever the code does. sim/ is the
    # one package that may be absent (it leaves agent/engines/ in a branch of its own).
    modules = {module_name(p, ROOT) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    for rule in RULES:
        for prefix in (*rule.importers, *rule.forbidden):
            if prefix == "sim" and not (ROOT / "sim").is_dir():
                continue
            assert any(under(m, prefix) for m in modules), f"{prefix} names no module"


def test_the_check_names_the_file_line_and_edge_of_each_forbidden_import(
    tmp_path: Path,
) -> None:
    files = {
        "protocol/__init__.py": "",
        "protocol/errors.py": "import json\n",
        "router/__init__.py": "",
        "router/documents.py": "from protocol.errors import x\n",
        "router/http/__init__.py": "",
        "router/http/asgi.py": "from router.documents import DocumentError\n",
        "router/tenants/__init__.py": "",
        "router/tenants/gate.py": (
            "from router.documents import _hint\n\ndef later():\n    from ..http import asgi\n"
        ),
        "router/policy/__init__.py": "",
        "router/policy/schema.py": "from router import http\n",
        "agent/__init__.py": "",
        "agent/app.py": "def start():\n    import sim.app\n",
        "agent/engines/__init__.py": "",
        "agent/engines/sim.py": (
            'from sim import app\n\nif __name__ == "__main__":\n    from sim.__main__ import main\n'
        ),
        "sim/__init__.py": "",
        "sim/app.py": "from protocol import errors\nimport agent.engines\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges = imports(tmp_path)
    assert violations(edges) == [
        "agent/engines/sim.py:1: agent.engines.sim imports sim"
        " (the agent imports sim/ only lazily)",
        "router/policy/schema.py:1: router.policy.schema imports router.http"
        " (the routing core never imports the link, HTTP or providers)",
        "router/tenants/gate.py:4: router.tenants.gate imports router.http"
        " (router/tenants/ and router/policy/ never import router/http/)",
        "sim/app.py:2: sim.app imports agent.engines (sim/ imports protocol/ at most)",
    ]
    assert private_imports(edges) == [
        "router/tenants/gate.py:1: router.tenants.gate imports _hint from router.documents"
        " (promote it to a public name of a shared module)"
    ]
