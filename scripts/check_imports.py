"""The import graph's contract: layers whose arrows point down, no cycle, and the forbidden arrows named.

Reads every `import` in runner/ with `ast`, function-local ones included (a local import closes a cycle as surely
as a top-level one; it only moves the failure to run time). Importing `a.b.c` also runs `a/__init__.py` and
`a/b/__init__.py`, so an import counts as an arrow to each enclosing package too.

    python scripts/check_imports.py [ROOT]     # exit 1 with one line per broken rule; ROOT defaults to runner/

A module's layer is its first matching prefix in LAYERS; it may import its own layer and those below it, never a
cycle. FORBIDDEN names the arrows the layers alone would allow but the design does not.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

# Lowest first: (layer, module prefixes). A prefix `runner.x` matches runner.x and runner.x.*.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "runner.errors",
            "runner.randomness",
            "runner.ranking",
            "runner.stats",
            "runner.fused_stats",
            "runner.tables",
            "runner.rows",
            "runner.host_copy",
            "runner.progress",
            "runner.interrupts",
            "runner.cpu_sharing",
            "runner.distributed",
            "runner.chunks",
            "runner.chunk_sizing",
            "runner.frames",
            "runner.fingerprints",
            "runner.analysis",
            "runner.site_kinds",
        ),
    ),
    ("schema", ("runner.schema", "runner.options.registry")),
    ("options", ("runner.options",)),
    ("store", ("runner.store", "runner.results")),
    (
        "sources",
        (
            "runner.runtime",
            "runner.configure",
            "runner.models",
            "runner.data",
            "runner.targets",
            "runner.layers",
            "runner.dictionaries",
        ),
    ),
    ("viz", ("runner.viz",)),
    ("hooks", ("runner.hooks",)),
    ("metrics", ("runner.metrics",)),
    ("methods", ("runner.methods",)),
    ("app", ("runner.app", "runner.loop", "runner.ids", "runner.shard_stats", "runner.plan")),
    ("commands", ("runner.commands", "runner.__main__")),
]

# Modules that import no torch anywhere (not even inside a function): what `--cfg job`, `--help` and `runner ls`
# load, so that they answer in well under the second torch takes to import.
TORCH_FREE = (
    "runner.errors",
    "runner.cpu_sharing",
    "runner.fingerprints",
    "runner.schema",
    "runner.site_kinds",
    "runner.options",
    "runner.store.layout",
    "runner.store.runs",
    "runner.store.sweeps",
    "runner.commands.cli",
    "runner.commands.ls",
    "runner.__main__",
)
# ... and those that may import torch inside functions only (an option's implementation runs only when chosen).
TORCH_AT_RUN_TIME_ONLY = ("runner.options",)
# Option modules whose functions may import the layers above them: an option's implementation may live in its one
# module and runs only when chosen. Their top level imports only what is below them; cycles still count.
RUN_TIME_UPWARD = ("runner.options.model", "runner.options.data", "runner.options.target", "runner.options.method",
                   "runner.options.metric")  # fmt: skip

# (importer prefix, imported prefix, why): arrows the layer order would allow but the design forbids.
FORBIDDEN: list[tuple[str, str, str]] = [
    ("runner.viz", "runner.methods", "viz draws what the store holds; it runs no method"),
    ("runner.viz", "runner.hooks", "viz draws what the store holds; it touches no hook"),
    ("runner.viz", "runner.metrics", "viz draws what the store holds; it computes no metric"),
    ("runner.store", "runner.models", "the store knows files, not models"),
    (
        "runner.store",
        "runner.data.base",
        "the store knows files, not data sources (a source fingerprints its own files)",
    ),
    ("runner.store", "runner.viz", "the store is below the pictures"),
]


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    local: bool  # inside a function or class body


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str, modules: set[str]) -> list[Import]:
    """Every runner (and torch) import in `path`, resolved to modules (a `from pkg import mod` names pkg.mod)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(name, alias.name, child.lineno, local))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                for alias in child.names:
                    sub = f"{target}.{alias.name}"
                    found.append(Import(name, sub if sub in modules else target, child.lineno, local))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                continue  # annotations only: never runs
            visit(child, inner)

    visit(tree, False)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int | None:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(matches(module, p) for p in prefixes):
            return index
    return None


def enclosing(module: str) -> list[str]:
    """`module` and the packages whose __init__ importing it runs (runner itself excepted: it is empty)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts) + 1)]


def check(root: Path) -> tuple[list[str], dict[str, int]]:
    """The broken rules, one line each, and counts for the summary line."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(paths)
    problems: list[str] = []
    edges: dict[str, set[str]] = {m: set() for m in modules}
    local_imports = 0
    for name, path in paths.items():
        if layer_of(name) is None and name != root.name:
            problems.append(f"{name}: in no layer (add its prefix to LAYERS in scripts/check_imports.py)")
        for imp in imports_of(path, name, modules):
            where = f"{path}:{imp.line}"
            if imp.imported.split(".")[0] == "torch" and any(matches(name, p) for p in TORCH_FREE):
                if not imp.local or not any(matches(name, p) for p in TORCH_AT_RUN_TIME_ONLY):
                    problems.append(f"{where}: {name} imports torch; it must load without torch")
            if not matches(imp.imported, root.name):
                continue
            local_imports += imp.local
            for target in enclosing(imp.imported):
                if target not in modules or target == name or matches(name, target):
                    continue  # a package importing its own submodules is its own business
                edges[name].add(target)
                mine, theirs = layer_of(name), layer_of(target)
                upward_ok = imp.local and any(matches(name, p) for p in RUN_TIME_UPWARD)
                if mine is not None and theirs is not None and theirs > mine and not upward_ok:
                    problems.append(
                        f"{where}: {name} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]}), a layer above it"
                    )
                for importer, imported, why in FORBIDDEN:
                    if matches(name, importer) and matches(target, imported):
                        problems.append(f"{where}: {name} imports {target}: forbidden ({why})")
    cycles = strongly_connected(edges)
    for cycle in cycles:
        problems.append(f"import cycle of {len(cycle)} modules: {' -> '.join(sorted(cycle))}")
    return problems, {"modules": len(modules), "cycles": len(cycles), "local": local_imports}


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """The graph's cycles as strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                if len(component) > 1:
                    components.append(component)
    return components


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else Path(__file__).resolve().parent.parent / "runner")
    problems, counts = check(root)
    for line in problems:
        print(line)
    print(
        f"import check: {counts['modules']} modules, {counts['cycles']} cycles, {counts['local']} function-local runner"
        f" imports, {len(problems)} problems"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
