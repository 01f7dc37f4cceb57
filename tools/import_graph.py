"""zstore's module map, import layers and import cycles, read from the code with :mod:`ast`.

Every module of ``zstore/`` and ``checkpoint/`` is parsed (nothing is imported). An
import counts wherever it is written: at the top of a module, inside a function
(marked *lazy*), or as ``importlib.import_module("literal")``. Relative imports are
resolved; ``from pkg import name`` is an import of ``pkg.name`` where that is a
module, of ``pkg`` otherwise. A package that imports its public names on first use
(a ``_SOURCES`` dict, name -> submodule, read by its ``__getattr__``: ``zstore``,
``zstore.dataset``) is resolved through it: ``from zstore import open`` and
``zstore.open`` (after ``import zstore``) import ``zstore.api``. Imports under ``if
TYPE_CHECKING:`` are left out (they never run). Importing ``a.b`` from outside package ``a`` runs ``a/__init__.py``
first: where that ``__init__`` imports modules, the import counts as one of ``a`` too
(marked *package*; a cycle through a package's ``__init__`` is as real as any).

It prints, as Markdown:

(a) the module map: one table row per module, its one job being the first sentence
    of its docstring (so module docstrings are where the jobs are written);
(b) the import graph as layers: layer 0 imports no zstore module, a module in layer
    ``n`` imports modules of layers below ``n`` only, listed top down, each module with
    the internal modules it imports;
(c) the import cycles: strongly connected components of more than one module, with
    and without the one allowed edge :data:`ALLOWED_EDGE` (a storage's default
    checkpointer, looked up in ``checkpoint`` by name at the first ``dumps``/``loads``);
(d) the private names (a leading underscore, not a dunder; or names from a private
    module) that ``checkpoint/`` imports from ``zstore``.

Usage::

    python tools/import_graph.py                               # print the block
    python tools/import_graph.py --check docs/architecture.md  # exit 1 if the doc's block differs
    python tools/import_graph.py --write docs/architecture.md  # rewrite the doc's block in place

The block sits between :data:`BEGIN` and :data:`END`; the rest of the file is left as is.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The top-level packages whose modules are mapped.
PACKAGES = ("zstore", "checkpoint")
#: The one import allowed to close a cycle: ``zstore._registry.make_checkpointer`` imports
#: ``checkpoint`` when a storage first needs its default checkpointer.
ALLOWED_EDGE = ("zstore._registry", "checkpoint")
BEGIN = "<!-- BEGIN GENERATED: tools/import_graph.py -->"
END = "<!-- END GENERATED -->"


@dataclasses.dataclass
class Module:
    """One module: its dotted name, file, first docstring sentence and internal imports."""

    name: str
    path: Path
    is_package: bool
    job: str = ""
    #: imported module -> True when every import of it is inside a function (lazy).
    imports: dict[str, bool] = dataclasses.field(default_factory=dict)
    #: packages imported only through one of their modules (their ``__init__`` runs first).
    packages: set[str] = dataclasses.field(default_factory=set)
    #: a lazy package's public names -> the submodules defining them (its ``_SOURCES``).
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    #: (source module, name) for each ``from X import name``, X resolved.
    names: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def find_modules(root: Path = ROOT) -> dict[str, Module]:
    """Every ``.py`` file under :data:`PACKAGES`, by dotted module name."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            name = ".".join(parts)
            found[name] = Module(name, path, is_package)
    return found


# -- the first sentence of a docstring, as Markdown ------------------------------------------

_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\betc)\.(?=\s|$)")


def first_sentence(docstring: str | None) -> str:
    """The docstring's first sentence (of its first paragraph), reST roles and literals as
    Markdown code, ``|`` escaped for a table."""
    if not docstring:
        return "(no docstring)"
    paragraph = " ".join(docstring.strip().split("\n\n", 1)[0].split())
    match = _SENTENCE_END.search(paragraph)
    sentence = paragraph[:match.start()] if match else paragraph
    sentence = _ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`",
                         sentence)
    sentence = sentence.replace("``", "`")
    return sentence.replace("|", "\\|")


# -- imports ---------------------------------------------------------------------------------

def lazy_sources(module: Module, tree: ast.Module) -> dict[str, str]:
    """A package's ``_SOURCES = {"Name": "submodule", **dict.fromkeys([...], "submodule")}``
    as name -> dotted submodule (empty where it has none)."""
    for node in tree.body:
        if not (isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "_SOURCES"
                        for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))):
            continue
        found = {}
        for key, value in zip(node.value.keys, node.value.values):
            if key is not None:
                found[ast.literal_eval(key)] = ast.literal_eval(value)
            elif (isinstance(value, ast.Call) and ast.unparse(value.func) == "dict.fromkeys"
                  and len(value.args) == 2):
                found.update(dict.fromkeys(ast.literal_eval(value.args[0]),
                                           ast.literal_eval(value.args[1])))
            else:
                raise ValueError(f"{module.path}: _SOURCES entry not understood: {ast.unparse(value)}")
        return {name: f"{module.name}.{source}" for name, source in found.items()}
    return {}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """Collects (target, lazy, names) for every import statement of one module."""

    def __init__(self, module: Module, known: dict[str, Module]):
        self.module = module
        self.known = known
        self.depth = 0  # function nesting
        self.bound: dict[str, str] = {}  # name bound by `import pkg` -> pkg

    def _known_prefix(self, dotted: str) -> str | None:
        parts = dotted.split(".")
        while parts:
            name = ".".join(parts)
            if name in self.known:
                return name
            parts.pop()
        return None

    def _add(self, target: str | None) -> None:
        if target is None or target == self.module.name:
            return
        lazy = self.depth > 0
        self.module.imports[target] = self.module.imports.get(target, True) and lazy

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            target = self._known_prefix(alias.name)
            self._add(target)
            if target is not None:
                if alias.asname:
                    self.bound[alias.asname] = target
                elif alias.name.split(".")[0] in self.known:
                    self.bound[alias.name.split(".")[0]] = alias.name.split(".")[0]

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id in self.bound:
            package = self.bound[node.value.id]
            target = f"{package}.{node.attr}"
            if target in self.known:
                self._add(target)
            elif node.attr in self.known[package].sources:
                self._add(self.known[package].sources[node.attr])
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            package = self.module.name.split(".")
            if not self.module.is_package:
                package.pop()
            package = package[:len(package) - (node.level - 1)]
            base = ".".join(package + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            if submodule in self.known:
                self._add(submodule)
            elif base in self.known and alias.name in self.known[base].sources:
                self._add(self.known[base].sources[alias.name])
                self.module.names.append((base, alias.name))
            else:
                source = self._known_prefix(base)
                self._add(source)
                if source is not None:
                    self.module.names.append((base, alias.name))

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr == "import_module"
                and isinstance(func.value, ast.Name) and func.value.id == "importlib"
                and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            self._add(self._known_prefix(node.args[0].value))
        self.generic_visit(node)


def read_graph(root: Path = ROOT) -> dict[str, Module]:
    """Parse every module: its job and its imports of other modules of :data:`PACKAGES`."""
    modules = find_modules(root)
    trees = {name: ast.parse(module.path.read_text(encoding="utf-8"), str(module.path))
             for name, module in modules.items()}
    for name, module in modules.items():
        module.job = first_sentence(ast.get_docstring(trees[name]))
        if module.is_package:
            module.sources = lazy_sources(module, trees[name])
    for name, module in modules.items():
        _Imports(module, modules).visit(trees[name])
    for module in modules.values():  # a.b imported from outside a: a/__init__.py runs too
        own = module.name if module.is_package else module.name.rpartition(".")[0]
        for target, lazy in list(module.imports.items()):
            parts = target.split(".")
            for n in range(1, len(parts)):
                package = ".".join(parts[:n])
                if (own + ".").startswith(package + ".") or not modules[package].imports:
                    continue  # already running (an ancestor of this module), or imports nothing
                if package not in module.imports:
                    module.packages.add(package)
                    module.imports[package] = lazy
                elif package in module.packages:
                    module.imports[package] = module.imports[package] and lazy
    return modules


# -- cycles and layers -----------------------------------------------------------------------

def edges(modules: dict[str, Module], *, allowed: bool = True) -> dict[str, set[str]]:
    """Module -> the modules it imports (without :data:`ALLOWED_EDGE` unless ``allowed``)."""
    graph = {name: set(module.imports) for name, module in modules.items()}
    if not allowed and ALLOWED_EDGE[0] in graph:
        graph[ALLOWED_EDGE[0]].discard(ALLOWED_EDGE[1])
    return graph


def components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative), each sorted; every module in one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    found.append(sorted(component))
    return found


def cycles(modules: dict[str, Module], *, allowed: bool = True) -> list[list[str]]:
    """The components of more than one module, largest first."""
    found = [c for c in components(edges(modules, allowed=allowed)) if len(c) > 1]
    return sorted(found, key=lambda c: (-len(c), c))


def layers(modules: dict[str, Module]) -> dict[str, int]:
    """Module -> its layer, on the graph without :data:`ALLOWED_EDGE` (a cycle, if any, is one
    node: its modules share a layer)."""
    graph = edges(modules, allowed=False)
    of = {}
    for component in components(graph):  # Tarjan yields a component after all it imports
        members = set(component)
        below = [of[dep] for name in component for dep in graph[name] if dep not in members]
        layer = 1 + max(below) if below else 0
        for name in component:
            of[name] = layer
    return of


def private_imports(modules: dict[str, Module]) -> list[tuple[str, str, str]]:
    """(checkpoint module, zstore module, name) for each private name checkpoint/ imports."""
    def private(part: str) -> bool:
        return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))

    found = []
    for module in modules.values():
        if module.name.split(".")[0] != "checkpoint":
            continue
        for source, name in module.names:
            if source.split(".")[0] == "zstore" and (
                    private(name) or any(private(part) for part in source.split("."))):
                found.append((module.name, source, name))
    return sorted(found)


# -- the Markdown block ----------------------------------------------------------------------

def _code(name: str) -> str:
    return f"`{name}`"


def render(modules: dict[str, Module]) -> str:
    """The generated block (without its markers)."""
    layer = layers(modules)
    order = sorted(modules, key=lambda name: (-layer[name], name))
    out = ["## 1. Modules", "",
           "Each module has one job: the first sentence of its docstring. Top layer first "
           "(§2); generated by `tools/import_graph.py` (`python tools/import_graph.py --write "
           "docs/architecture.md` after changing a module docstring or an import).", "",
           "| Module | Layer | Its one job |", "|---|---|---|"]
    for name in order:
        module = modules[name]
        path = module.path.relative_to(ROOT).as_posix()
        out.append(f"| `{path}` | {layer[name]} | {module.job} |")
    top = max(layer.values(), default=0)
    out += ["", "## 2. Imports (arrows point down; nothing imports upward)", "",
            "Layer 0 imports no module of `zstore/` or `checkpoint/`; a module imports only "
            "modules of lower layers. Each module is listed with the internal modules it "
            "imports; *lazy* ones are imported inside a function only, at first use; a "
            "*package* is one whose `__init__` runs (and imports its modules) because one of "
            "its modules is imported.", ""]
    for n in range(top, -1, -1):
        out.append(f"**Layer {n}**")
        out.append("")
        for name in order:
            if layer[name] != n:
                continue
            imports = modules[name].imports
            packages = modules[name].packages
            listed = ", ".join(_code(dep) + (" *package*" if dep in packages else "")
                               + (" *lazy*" if imports[dep] else "") for dep in sorted(imports))
            out.append(f"* {_code(name)}" + (f" → {listed}" if listed else ""))
        out.append("")
    source, target = ALLOWED_EDGE
    lazy = modules[source].imports.get(target) if source in modules else None
    out += ["### Import cycles", "",
            f"The one allowed edge: {_code(source)} → {_code(target)}"
            + (" *lazy*" if lazy else " (not lazy!)" if lazy is not None else " (absent)")
            + " — `make_checkpointer(name)`, a storage's default checkpointer, imported at the "
            "first `dumps`/`loads`, so `import zstore` never imports `checkpoint`.", ""]
    bad = cycles(modules, allowed=False)
    if bad:
        out.append(f"Cycles without it ({len(bad)}; there should be none):")
        out.append("")
        out += [f"* {len(c)} modules: " + ", ".join(map(_code, c)) for c in bad]
    else:
        out.append("Cycles without it: none.")
    out.append("")
    through = [c for c in cycles(modules, allowed=True) if c not in bad]
    if through:
        out.append("Cycles it closes (the storages' checkpointers import the storages they save):")
        out.append("")
        out += [f"* {len(c)} modules: " + ", ".join(map(_code, c)) for c in through]
        out.append("")
    out += ["### Private names `checkpoint/` imports from `zstore`", ""]
    private = private_imports(modules)
    if private:
        out += [f"* {_code(user)} imports {_code(name)} from {_code(source)}"
                for user, source, name in private]
    else:
        out.append("None.")
    return "\n".join(out)


def _block(text: str, where: str) -> tuple[int, int]:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{where}: no {BEGIN} ... {END} block")
    return start + len(BEGIN), end


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", metavar="DOC", help="exit 1 if DOC's generated block differs")
    mode.add_argument("--write", metavar="DOC", help="rewrite DOC's generated block in place")
    args = parser.parse_args(argv)
    block = "\n\n" + render(read_graph()) + "\n\n"
    doc = args.check or args.write
    if doc is None:
        print(block.strip())
        return 0
    path = Path(doc)
    text = path.read_text(encoding="utf-8")
    start, end = _block(text, doc)
    if args.write:
        if text[start:end] != block:
            path.write_text(text[:start] + block + text[end:], encoding="utf-8")
        return 0
    if text[start:end] == block:
        return 0
    diff = difflib.unified_diff(text[start:end].splitlines(), block.splitlines(),
                                f"{doc} (generated block)", "tools/import_graph.py", lineterm="")
    print("\n".join(diff))
    print(f"{doc} is out of date: run `python tools/import_graph.py --write {doc}`",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
