"""The library's shape, as docs/architecture.md describes it: subpackages that are layers, one
boundary to Redis, and no import cycles (imports under ``TYPE_CHECKING`` included)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers import ROOT

PACKAGE = ROOT / "keyserial"
LIBRARY = sorted(PACKAGE.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in LIBRARY}


def imported_modules(path: Path) -> set[str]:
    """The top-level packages ``path`` imports (``redis`` for ``from redis.asyncio import x``)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def library_imports(path: Path) -> set[str]:
    """The keyserial modules ``path`` imports, relative imports resolved."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                candidate = f"{module}.{alias.name}"
                found.add(candidate if candidate in MODULES else module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {module for module in found if module in MODULES and module != name}


GRAPH = {name: library_imports(path) for name, path in MODULES.items()}


def layer(module: str) -> str:
    """``_client`` for ``keyserial._client.appender``; the module itself at the top level."""
    return module.split(".")[1] if "." in module else module


def imports_between(importers: set[str], imported: set[str]) -> list[tuple[str, str]]:
    return sorted(
        (name, target)
        for name, targets in GRAPH.items()
        for target in targets
        if layer(name) in importers and layer(target) in imported
    )


def test_only_the_redis_boundary_imports_redis() -> None:
    assert LIBRARY, "no library modules found"
    importing = {module_name(path) for path in LIBRARY if "redis" in imported_modules(path)}
    assert importing and all(layer(name) == "_backend" for name in importing), importing


def test_the_client_and_the_worker_never_import_each_other() -> None:
    assert imports_between({"_client"}, {"_worker"}) == []
    assert imports_between({"_worker"}, {"_client"}) == []


def test_the_wire_format_and_the_scripts_import_no_layer_above_them() -> None:
    above = {"_backend", "_client", "_worker", "_local", "_operator", "cli", "testing"}
    assert imports_between({"_wire", "_scripts"}, above) == []


def test_the_wire_format_imports_nothing_of_keyserial_but_its_errors() -> None:
    """``_wire`` is the floor every layer stands on (``_ops`` included, which imports it): it
    may name keyserial's errors, and nothing else outside itself."""
    outside = {
        target
        for name, targets in GRAPH.items()
        if layer(name) == "_wire"
        for target in targets
        if layer(target) != "_wire"
    }
    assert outside <= {"keyserial.errors"}, outside


def test_the_dashboard_and_the_operator_layer_never_import_the_cli() -> None:
    """The command line is the top: the dashboard calls what it calls, in ``_operator``."""
    assert imports_between({"_dashboard", "_operator"}, {"cli"}) == []


def test_the_operator_layer_sits_between_its_callers_and_the_backend() -> None:
    """``cli`` and ``_dashboard`` call ``_operator``; it calls ``_backend``, ``_scripts`` and
    ``_wire`` (never a client or a worker), and none of those calls it back."""
    assert imports_between({"cli"}, {"_operator"}) != []
    assert imports_between({"_dashboard"}, {"_operator"}) != []
    assert imports_between({"_operator"}, {"_backend"}) != []
    assert imports_between({"_operator"}, {"_dashboard", "_client", "_worker"}) == []
    below = {"_wire", "_scripts", "_backend", "_client", "_worker", "_reshard", "_local"}
    assert imports_between(below, {"_operator"}) == []


def test_no_module_imports_itself_back() -> None:
    """No import cycle, through any number of modules."""
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(module: str, path: tuple[str, ...]) -> None:
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", f"import cycle: {' -> '.join((*path, module))}"
        state[module] = "open"
        for target in sorted(GRAPH[module]):
            visit(target, (*path, module))
        state[module] = "done"
        order.append(module)

    for module in sorted(GRAPH):
        visit(module, ())
    assert len(order) == len(GRAPH)


#: The most modules one chain of imports may pass through (``keyserial.__main__`` -> … ->
#: ``keyserial.errors``). It was 18 (issue #48): a change at the bottom of a long chain reaches
#: every module above it, and a reader tracing what a module rests on opens every file of it.
LONGEST_CHAIN = 14


def _longest_chain(module: str, found: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The longest chain of imports that starts at ``module`` (``found``: those known)."""
    if module not in found:
        found[module] = (module,)  # (an import cycle ends here; the test above reports it)
        chains = [(module, *_longest_chain(target, found)) for target in sorted(GRAPH[module])]
        found[module] = max(chains, key=len, default=(module,))
    return found[module]


def test_no_chain_of_imports_passes_through_more_than_14_modules() -> None:
    """Every import counts, under ``TYPE_CHECKING`` or in a function too: a type a module names
    is a module its reader opens. A longer chain is cut by moving a name to where it belongs
    (docs/architecture.md, Layers and modules), never by hiding its import."""
    found: dict[str, tuple[str, ...]] = {}
    longest = max((_longest_chain(module, found) for module in sorted(GRAPH)), key=len)
    assert len(longest) <= LONGEST_CHAIN, f"{len(longest)} modules: " + " -> ".join(longest)


def test_every_layer_imports_only_the_layers_listed_before_it() -> None:
    """docs/architecture.md lists the layers lowest first; none imports one listed after it."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    order = re.findall(r"^\| \*\*`(\w+)/`\*\* \|", text, re.MULTILINE)
    assert sorted(order) == sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))
    upward = [
        (name, target)
        for name, targets in sorted(GRAPH.items())
        for target in sorted(targets)
        if layer(name) in order
        and layer(target) in order
        and order.index(layer(target)) > order.index(layer(name))
    ]
    assert upward == []


def test_every_layer_is_a_package_of_its_own() -> None:
    layers = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    assert layers == {
        "_wire",
        "_scripts",
        "_backend",
        "_client",
        "_worker",
        "_local",
        "cli",
        "_dashboard",
        "_operator",
        "_reshard",
    }


def _named_in(text: str, module: str) -> bool:
    """Whether a line of ``text`` names ``module`` (``_client/api.py``): by its path, or by its
    file name on a line that names its package's folder."""
    package, _, name = module.rpartition("/")
    return any(
        f"`{module}`" in line or (package and f"`{package}/" in line and f"`{name}`" in line)
        for line in text.splitlines()
    )


def test_the_architecture_page_names_every_module() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    modules = [
        path.relative_to(PACKAGE).as_posix()
        for path in LIBRARY
        if path.name not in ("__init__.py", "__main__.py")
    ]
    assert [module for module in modules if not _named_in(text, module)] == []


def _defined_names(module: str, tree: ast.Module) -> set[str]:
    """The dotted names ``module`` defines: its functions, classes, their members (``self.x``
    assignments included) and its module-level names."""
    names: set[str] = set()

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                names.add(f"{prefix}.{node.name}")
                visit(node.body, f"{prefix}.{node.name}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(f"{prefix}.{node.name}")
                names.update(
                    f"{prefix}.{sub.attr}"
                    for sub in ast.walk(node)
                    if isinstance(sub, ast.Attribute)
                    and isinstance(sub.ctx, ast.Store)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                )
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(
                    f"{prefix}.{name.id}"
                    for target in targets
                    for name in ast.walk(target)
                    if isinstance(name, ast.Name)
                )
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body, prefix)

    visit(tree.body, module)
    return names


def _library_names() -> set[str]:
    """Every dotted name in the library, with the names a module imports standing for what
    they import (``keyserial.Client.submit`` is ``keyserial._client.api.Client.submit``)."""
    trees = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}
    names = set().union(*(_defined_names(name, tree) for name, tree in trees.items()))
    under: dict[str, list[str]] = {}
    for found in names:
        parts = found.split(".")
        for end in range(1, len(parts) + 1):
            under.setdefault(".".join(parts[:end]), []).append(found)
    for name, tree in trees.items():
        package = name.split(".") if MODULES[name].name == "__init__.py" else name.split(".")[:-1]
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    local = f"{name}.{alias.asname or alias.name}"
                    names.update(local + found[len(target) :] for found in under.get(target, []))
    return names


def _suffixes(names: set[str]) -> set[str]:
    """Every name a reference may use for one of ``names``: it, or any dotted tail of it."""
    split = [name.split(".") for name in names]
    return {".".join(parts[start:]) for parts in split for start in range(len(parts))}


#: A role and its target: ``:mod:`._chains```, ``:meth:`~.backend.Backend.stored```. A
#: leading dot asks for any name that ends so, as Sphinx reads it.
_ROLE = re.compile(r":(mod|class|func|meth|attr|data|exc|obj):`(~?\.?([^`<]+?))(?:\(\))?`")


def test_every_cross_reference_names_something_that_exists() -> None:
    """A docstring's ``:mod:``, ``:class:``, ``:meth:``… names a module or object of the
    library, so renaming or moving one leaves no reference to its old name behind."""
    modules, objects = _suffixes(set(MODULES)), _suffixes(_library_names())
    broken = []
    for path in LIBRARY:
        text, where = path.read_text(), path.relative_to(ROOT).as_posix()
        for match in _ROLE.finditer(text):
            role, written, name = match.groups()
            if name in (modules if role == "mod" else objects):
                continue
            line = text.count("\n", 0, match.start()) + 1
            broken.append(f"{where}:{line}: {written}")
    assert broken == []


def test_the_architecture_page_lists_every_record_of_a_shard() -> None:
    """Every name ``ShardKeys`` gives a shard's records is a row of the records table."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("### The records", 1)[1]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`([^`]+)`", row)}
    layout = (PACKAGE / "_wire" / "layout.py").read_text()
    records = set(re.findall(r'= _ShardKey\("([^"]+)"\)', layout))
    assert records and sorted(records - listed) == []
