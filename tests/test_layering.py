"""The dependency direction of docs/architecture.md, read from every file's imports with
``ast`` (lazy imports inside functions count): folders only import down the map
(clients <- apps <- gateway; clients <- actors -> engine -> kernels), every import of the
project goes through the one root `conveyor`, no two files import each other in a circle,
and the light client loads neither torch nor the HTTP gateway's server."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("conveyor", "clients", "apps", "gateway", "actors", "engine", "kernels")
ALLOWED = {  # folder -> the folders its files may import (`conveyor` is the root package's own files)
    "kernels": {"kernels"},
    "engine": {"engine", "kernels"},
    "clients": {"clients"},
    "apps": {"apps", "clients"},
    "gateway": {"gateway", "apps", "clients"},
    "actors": {"actors", "clients", "engine"},
    "conveyor": set(FOLDERS),  # the `conveyor` command's room and the lazy `from conveyor import LLM`
}


def module_name(path: Path) -> str:
    """The installed name: each folder is a subpackage of `conveyor` (pyproject's package-dir)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(parts if parts[0] == "conveyor" else ["conveyor", *parts])


def folder_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FOLDERS else "conveyor"


def project_modules() -> dict[str, Path]:
    return {
        module_name(p): p
        for folder in FOLDERS
        if (ROOT / folder).is_dir()
        for p in sorted((ROOT / folder).rglob("*.py"))
    }


def imports_of(path: Path, name: str, modules: dict) -> set[str]:
    """The project modules ``path`` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
            found.update(submodules)  # `from pkg import submodule` needs the submodule, not pkg's names
            if len(submodules) < len(node.names):
                found.add(base)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def test_folders_import_only_down_the_map():
    wrong = [
        f"{name} imports {target}"
        for name, targets in import_graph().items()
        for target in targets
        if folder_of(target) not in ALLOWED[folder_of(name)]
    ]
    assert not wrong, "\n".join(wrong)


def test_every_import_of_the_project_goes_through_the_conveyor_root():
    """`import engine` would find the checkout's folder (not the installed package) and load
    a second copy of the code: no file of the product, its tests or benchmarks does it."""
    roots = set(FOLDERS) - {"conveyor"}
    files = [
        p for folder in (*FOLDERS, "tests", "benchmarks", "scripts") for p in sorted((ROOT / folder).rglob("*.py"))
    ]
    wrong = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            wrong += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in roots]
    assert not wrong, "\n".join(wrong)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_file_of_a_subpackage_imports_one_that_uses_that_subpackage():
    """A subpackage (engine/distributed/, kernels/cpu/, ...) stands below the files that use it:
    none of its files imports a file outside it that imports the subpackage (an upward import,
    even where no circle closes, as when the upper file starts the lower one as a process)."""
    graph = import_graph()
    wrong = []
    for name, targets in graph.items():
        package = name.rpartition(".")[0]
        if package.count(".") < 1:
            continue  # top-level files of a folder: the folder rule covers them
        for target in targets:
            outside = not target.startswith(package + ".") and target != package
            if outside and any(t == package or t.startswith(package + ".") for t in graph[target]):
                wrong.append(f"{name} imports {target}, which uses {package}")
    assert not wrong, "\n".join(wrong)


def test_no_import_circle_between_files():
    assert not cycles(import_graph()), cycles(import_graph())


def test_the_light_client_loads_neither_torch_nor_the_gateway_server():
    code = (
        "import sys, conveyor, conveyor.clients, conveyor.clients.cli, conveyor.clients.client, "
        "conveyor.clients.async_client, conveyor.cli; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'fastapi', "
        "'uvicorn', 'starlette') or m.split('.')[:2] in (['conveyor', f] for f in ('gateway', 'engine', 'actors', "
        "'kernels', 'apps'))); print(heavy); sys.exit(bool(heavy))"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT.parent, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
