"""Private and version-dependent torch/JAX names live in `jaxtorch/_compat.py` alone.

A *private name* is an import or attribute chain rooted at `torch` or `jax` with a component
that starts with one underscore (`torch._C._nn`, `torch.utils._pytree`, `jax._src.core`,
`torch.nn.Module._apply`, `getattr(torch, "_foo")`), anything under `jax.core` or
`jax.interpreters`, and `torch.__version__` / `jax.__version__`. ATen op handles
(`torch.ops.aten._softmax`) are ATen's op set, not Python privates, and do not count.
Names are resolved through the module's import aliases (`import torch.utils.checkpoint as tc`
makes `tc._checkpoint_hook` a private use).

    python tests/test_private_names.py      # the sites per module, and the names _compat uses
"""

from __future__ import annotations

import ast
import collections
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxtorch"
COMPAT = ROOT / "_compat.py"
_ROOTS = ("torch", "jax")


def is_private(dotted: str) -> bool:
    """Whether the dotted name `dotted` (`"torch._C._nn"`) is private per the rule above.

    Example: `is_private("torch.utils._pytree.tree_map")` is True, `is_private("torch.ops.aten._softmax")`
    is False.
    """
    parts = dotted.split(".")
    if parts[0] not in _ROOTS or len(parts) < 2:
        return False
    if parts[:2] == ["torch", "ops"]:
        return False
    if parts[:2] in (["jax", "core"], ["jax", "interpreters"]) or "__version__" in parts:
        return True
    return any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def _chain(node: ast.expr) -> list[str] | None:
    """`a.b.c` as `["a", "b", "c"]`; None when the chain does not start at a plain name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


class _Finder(ast.NodeVisitor):
    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}  # local name -> the torch/jax dotted name it stands for
        self.sites: list[tuple[int, str]] = []

    def _hit(self, node: ast.AST, dotted: str) -> None:
        self.sites.append((getattr(node, "lineno", 0), dotted))

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.split(".")[0] not in _ROOTS:
                continue
            if is_private(a.name):
                self._hit(node, a.name)
            if a.asname:
                self.aliases[a.asname] = a.name
            else:
                root = a.name.split(".")[0]
                self.aliases[root] = root

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level or module.split(".")[0] not in _ROOTS:
            return
        for a in node.names:
            dotted = f"{module}.{a.name}"
            if is_private(dotted):
                self._hit(node, dotted)
            self.aliases[a.asname or a.name] = dotted

    def _resolve(self, parts: list[str]) -> tuple[str, str] | None:
        base = self.aliases.get(parts[0])
        if base is None:
            return None
        return base, ".".join([base, *parts[1:]])

    def visit_Attribute(self, node: ast.Attribute) -> None:
        parts = _chain(node)
        found = self._resolve(parts) if parts else None
        if found is None:
            self.generic_visit(node)
            return
        base, dotted = found
        if is_private(dotted) and not is_private(base):  # (a private import was counted where it was made)
            self._hit(node, dotted)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2:
            target, name = node.args[0], node.args[1]
            parts = _chain(target) if isinstance(target, (ast.Name, ast.Attribute)) else None
            found = self._resolve(parts) if parts else None
            if found and isinstance(name, ast.Constant) and isinstance(name.value, str):
                dotted = f"{found[1]}.{name.value}"
                if is_private(dotted) and not is_private(found[1]):
                    self._hit(node, dotted)
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in ("import_module", "__import__") and node.args:  # `importlib.import_module("torch._C")`
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and is_private(arg.value):
                self._hit(node, arg.value)
        self.generic_visit(node)


def private_names(source: str) -> list[tuple[int, str]]:
    """The private-name sites of one module's source, as `(line, dotted name)` in source order.

    Example: `private_names("import torch\\nx = torch._C._nn")` is `[(2, "torch._C._nn")]`.
    """
    finder = _Finder()
    finder.visit(ast.parse(source))
    return sorted(finder.sites)


def sites(root: pathlib.Path = ROOT) -> dict[str, list[tuple[int, str]]]:
    """Every module under `root` (relative path) with its private-name sites."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        found = private_names(path.read_text())
        if found:
            out[str(path.relative_to(root.parent))] = found
    return out


def compat_names() -> list[str]:
    """The private names `jaxtorch/_compat.py` uses (sorted, each once)."""
    return sorted({name for _, name in private_names(COMPAT.read_text())})


def test_the_checker_finds_planted_names():
    source = """
import torch
import jax
import torch.utils._pytree as pytree
import torch.utils.checkpoint as tc
from torch._C import DispatchKey
from torch.utils import checkpoint
from jax import core
from jax._src import core as jcore
a = torch._C._nn
b = tc._checkpoint_hook
c = getattr(torch, "_lazy_clone")
d = jax.core.Tracer
e = torch.__version__
f = torch.nn.Module._apply
g = checkpoint._checkpoint_without_reentrant_generator
h = importlib.import_module("torch._higher_order_ops.cond")
"""
    names = [name for _, name in private_names(source)]
    assert names == [
        "torch.utils._pytree",
        "torch._C.DispatchKey",
        "jax.core",
        "jax._src.core",
        "torch._C._nn",
        "torch.utils.checkpoint._checkpoint_hook",
        "torch._lazy_clone",
        "jax.core.Tracer",
        "torch.__version__",
        "torch.nn.Module._apply",
        "torch.utils.checkpoint._checkpoint_without_reentrant_generator",
        "torch._higher_order_ops.cond",
    ]


def test_the_checker_leaves_public_names_alone():
    source = """
import torch
import jax
import jax.numpy as jnp
from torch.utils.checkpoint import checkpoint
a = torch.ops.aten._softmax.default
b = torch.__future__.get_swap_module_params_on_conversion()
c = jax.lax.scan
d = jnp.float32
e = _local._private  # not rooted at torch or jax
f = torch.nn.functional.gelu
g = "torch._C"  # strings are not uses
"""
    assert private_names(source) == []


def test_a_planted_module_is_found(tmp_path):
    pkg = tmp_path / "jaxtorch"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "_compat.py").write_text("import torch\nDispatchKey = torch._C.DispatchKey\n")
    (pkg / "ops" / "planted.py").write_text("import torch\n\n\ndef f():\n    return torch._C._nn\n")
    assert sites(pkg) == {
        "jaxtorch/_compat.py": [(2, "torch._C.DispatchKey")],
        "jaxtorch/ops/planted.py": [(5, "torch._C._nn")],
    }


def test_no_private_name_outside_compat():
    found = {mod: s for mod, s in sites().items() if mod != "jaxtorch/_compat.py"}
    lines = [f"{mod}:{line}: {name}" for mod, s in found.items() for line, name in s]
    assert lines == [], "import these through jaxtorch._compat (and list them there):\n" + "\n".join(lines)


def test_compat_lists_each_private_name_it_uses():
    doc = ast.get_docstring(ast.parse(COMPAT.read_text())) or ""
    names = compat_names()
    assert names, "jaxtorch/_compat.py uses no private name; this test would check nothing"
    last = {n: [p for p in n.split(".") if not (p.startswith("__") and p != "__version__")][-1] for n in names}
    missing = [n for n in names if f"`{last[n]}" not in doc and f".{last[n]}" not in doc]
    assert missing == [], f"jaxtorch/_compat.py's docstring inventory lacks: {missing}"


if __name__ == "__main__":
    found = sites()
    per_module = collections.Counter({mod: len(s) for mod, s in found.items()})
    for mod, n in sorted(per_module.items()):
        print(f"{n:4d}  {mod}")
    print(f"{sum(per_module.values()):4d}  total sites in {len(per_module)} modules")
    outside = sum(n for mod, n in per_module.items() if mod != "jaxtorch/_compat.py")
    print(f"{outside:4d}  outside jaxtorch/_compat.py")
    if COMPAT.exists():
        names = compat_names()
        print(f"\n{len(names)} private names used by jaxtorch/_compat.py:")
        for name in names:
            print("  ", name)
    sys.exit(1 if outside else 0)
