"""The package's shape: no module reads a private attribute of an object it does not own (a name
that hytrain itself defines with a leading underscore -- an attribute set on ``self``, a method, a
module-level function -- reached through anything but ``self``/``cls``, or imported from another
module); the optimizer face stays thin."""

import ast
from pathlib import Path

import hytrain

PACKAGE = Path(hytrain.__file__).parent


def _modules():
    return {f: ast.parse(f.read_text(), str(f)) for f in sorted(PACKAGE.rglob("*.py"))}


def _private_names(trees) -> set:
    """Every private name hytrain defines: attributes assigned on self, methods, module functions,
    classes and module-level variables."""
    names = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_reads_a_private_attribute_of_an_object_it_does_not_own():
    trees = _modules()
    private = _private_names(trees)
    assert {"_engine", "_make_parts", "_chain"} <= private  # the walk sees the package's own names
    found = []
    for f, tree in trees.items():
        where = f.relative_to(PACKAGE)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in private:
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name.startswith("_") and alias.name in private:
                        found.append(f"{where}:{node.lineno}: imports {alias.name} from {node.module}")
    assert not found, "\n".join(found)


def test_the_walk_catches_a_private_read():
    tree = ast.parse("def f(opt):\n    return opt._engine\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.Attribute))
    assert node.attr in _private_names(_modules()) and node.value.id == "opt"


def test_the_optimizer_face_is_thin():
    import torch

    # Thin in code: its docstrings are the API reference (torch's whole contract, argument by
    # argument), so they are not what is counted.
    src = (PACKAGE / "hybrid" / "optimizer.py").read_text()
    docs = set()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    code = [ln for i, ln in enumerate(src.splitlines(), 1)
            if i not in docs and ln.strip() and not ln.strip().startswith("#")]
    assert len(code) < 175, len(code)
    mro = [c for c in hytrain.HybridAdamW.__mro__ if c.__module__.startswith("hytrain")]
    assert mro == [hytrain.HybridAdamW]  # no hytrain mixins
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = hytrain.HybridAdamW([p], workers=1)
    p.grad = torch.randn(8, 8)
    opt.step()
    base = torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.1)
    own = set(vars(opt)) - set(vars(base)) - {"grad_scale", "found_inf"}
    assert len(own) <= 15, sorted(own)


def test_no_module_is_over_about_500_lines():
    # A module that outgrows this holds more than one thing: split it along what its parts own.
    sizes = {f.relative_to(PACKAGE): len(f.read_text().splitlines()) for f in _modules()}
    over = sorted(f"{f}: {n} lines" for f, n in sizes.items() if n > 520)
    assert not over, "modules over 520 lines:\n" + "\n".join(over)


def test_no_function_of_the_job_is_over_80_lines():
    # Counted as the modules are: every line a definition spans (its decorators, docstring, comments
    # and blank lines included), a method or a nested function as well as the function around it.
    job = PACKAGE / "job"
    over = []
    for f, tree in _modules().items():
        if job not in f.parents:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                n = node.end_lineno - first + 1
                if n > 80:
                    over.append(f"{f.relative_to(PACKAGE)}:{first}: {node.name}, {n} lines")
    assert not over, "functions over 80 lines:\n" + "\n".join(sorted(over))


def _module_name(f) -> str:
    parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(trees, *, in_functions) -> dict:
    """Module -> the hytrain modules it imports: at module level (what runs on import, class bodies
    included), or ``in_functions`` only. Relative imports are resolved; ``from pkg import name``
    counts the submodule where ``name`` is one, else the package."""
    names = {_module_name(f): f for f in trees}
    out = {m: set() for m in names}

    def target(name):
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name

    for f, tree in trees.items():
        mod = _module_name(f)
        here = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, (ast.Import, ast.ImportFrom)) and inside == in_functions:
                    if isinstance(child, ast.Import):
                        found = [target(a.name) for a in child.names]
                    else:
                        base = child.module or ""
                        if child.level:
                            parent = here[:len(here) - child.level + 1]
                            base = ".".join(parent + ([child.module] if child.module else []))
                        found = [target(f"{base}.{a.name}") if f"{base}.{a.name}" in names else target(base)
                                 for a in child.names]
                    out[mod].update(t for t in found if t and t != mod)
                visit(child, inside)

        visit(tree, False)
    return out


def _cycles(graph) -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_no_import_cycle_through_module_level_imports():
    graph = _imports(_modules(), in_functions=False)
    # The walk resolves relative imports (``from . import budgets``, ``from ..pool import ...``).
    assert "hytrain.hybrid.budgets" in graph["hytrain.hybrid.store"] and "hytrain.pool" in graph["hytrain.hybrid.budgets"]
    assert "hytrain.job.processes" in graph["hytrain.job.torchrun"]
    cycles = _cycles(graph)
    assert not cycles, "import cycles through module-level imports:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_walk_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
