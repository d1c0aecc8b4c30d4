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

    src = (PACKAGE / "hybrid" / "optimizer.py").read_text()
    assert len(src.splitlines()) < 300
    mro = [c for c in hytrain.HybridAdamW.__mro__ if c.__module__.startswith("hytrain")]
    assert mro == [hytrain.HybridAdamW]  # no hytrain mixins
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = hytrain.HybridAdamW([p], workers=1)
    p.grad = torch.randn(8, 8)
    opt.step()
    base = torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.1)
    own = set(vars(opt)) - set(vars(base)) - {"grad_scale", "found_inf"}
    assert len(own) <= 15, sorted(own)
