"""The import graph of `jaxtorch/`: layers only look down, and no module imports itself back.

Every import counts, module-level or inside a function, absolute or relative, including
`from package import submodule`. Layers, bottom first (a module may import its own layer
and the ones below):

    python tests/test_architecture.py        # prints the layers and any violation
"""

from __future__ import annotations

import ast
import pathlib
import sys

import jaxtorch._compat

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxtorch"

LAYERS = [
    ["jaxtorch._compat"],  # every private or version-dependent torch/JAX name (tests/test_private_names.py)
    ["jaxtorch.bridge.core"],
    ["jaxtorch.ops"],
    ["jaxtorch.bridge.tensor", "jaxtorch.bridge._device_guard"],  # (the C++ device guard)
    ["jaxtorch.bridge.dispatch"],
    ["jaxtorch.bridge.state"],
    ["jaxtorch.bridge.api"],
    ["jaxtorch.train"],
    ["jaxtorch.generation", "jaxtorch.xla", "jaxtorch.coverage"],
    ["jaxtorch", "jaxtorch.bridge", "jaxtorch._install"],  # the package docstrings / the public API / installs
]


def _name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    mods = {_name(p): p for p in ROOT.rglob("*.py")}
    mods.update({_name(p): p for p in ROOT.rglob("*.cpp")})  # compiled extensions import nothing
    return mods


def layer(mod: str) -> int:
    best, depth = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > depth:
                best, depth = i, len(p)
    return best


def imports(mod: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The jaxtorch modules `mod` imports (anywhere in its body)."""
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out: set[str] = set()
    if path.suffix != ".py":
        return set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "jaxtorch")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "jaxtorch":
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(target)
    return {m for m in out if m in known and m != mod}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(m, p, set(mods)) for m, p in mods.items()}


def upward_imports(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in sorted(g.items()):
        for d in sorted(deps):
            if layer(d) > layer(m):
                bad.append(f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})")
    return bad


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
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
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


# ---- what changes torch or JAX at import: only `jaxtorch/_install.py` (called from `__init__.py`) ----------
INSTALLER = "jaxtorch._install"
ALLOWED_INSTALLS = {("jaxtorch", "install_all")}  # `jaxtorch/__init__.py` runs the installation, once
FOREIGN = {"torch", "jax", "jaxlib", "sys"}  # changing an attribute of these is an install
KERNEL_METHODS = {"impl", "fallthrough", "fallback", "py_impl", "define"}  # torch.library / HOP registrations
KERNEL_DECORATORS = {"impl", "register_kernel", "py_impl", "register_fake", "register_autograd", "custom_op"}


def _dotted(node: ast.AST) -> str:
    """`torch.library.Library` for that attribute chain ("" when it does not end in a name)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Call):
        return _dotted(node.func) + "()." + ".".join(reversed(parts)) if parts else _dotted(node.func) + "()"
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([node.id, *reversed(parts)])


def _foreign_names(tree: ast.Module) -> set[str]:
    """The local names bound by the module's imports of torch, JAX or sys (`torch`, `nn`, `_tc`, `GradScaler`)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in FOREIGN:
                    out.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in FOREIGN:
            out.update(a.asname or a.name for a in node.names)
    return out


def _module_level(body: list[ast.stmt]):
    """The statements run at import: the module body, into `if`/`try`/`with`/`for`/`while`, not into defs or classes."""
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from ((d, stmt) for d in stmt.decorator_list)  # decorators run at import
            continue
        yield stmt, stmt
        for field in ("body", "orelse", "finalbody"):
            yield from _module_level(getattr(stmt, field, []) or [])
        for handler in getattr(stmt, "handlers", []) or []:
            yield from _module_level(handler.body)


def _calls_in(node: ast.AST):
    """The calls made by evaluating `node` (not inside lambdas, which run later)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Lambda):
            continue
        if isinstance(n, ast.Call):
            yield n
        stack.extend(ast.iter_child_nodes(n))


def _root(node: ast.AST) -> str:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


COMPAT_SETTERS = {n for n in dir(jaxtorch._compat) if n.startswith("set_")}


def module_level_installs(mod: str, source: str) -> list[str]:
    """What `source` (the module `mod`) changes in torch, JAX or sys when it is imported: calls named
    `install*`, `torch.library.Library(...)`, `setattr(...)`, kernel registrations (`.impl(`,
    `.fallthrough(`, `.fallback(`, `.py_impl(`, `@torch.library.impl`/`register_kernel`), `sys.meta_path`
    edits, and assignments, augmented assignments or `del` of an attribute or item of an imported
    torch/JAX/sys object. Each as `"mod:line: what"`.

    **Example:** for a module `m` whose second line is `torch.Tensor.foo = 1` (after `import torch`),
    `module_level_installs("m", source)` is `["m:2: assigns torch.Tensor.foo"]`.
    """
    tree = ast.parse(source)
    foreign = _foreign_names(tree)
    bad: list[str] = []
    for node, stmt in _module_level(tree.body):
        where = f"{mod}:{node.lineno}"
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        for t in targets:
            for leaf in t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]:
                if isinstance(leaf, (ast.Attribute, ast.Subscript)) and _root(leaf) in foreign:
                    bad.append(f"{where}: assigns {_dotted(leaf.value if isinstance(leaf, ast.Subscript) else leaf)}")
        # the statement's own expressions (a compound statement's body is visited on its own)
        parts = [
            v
            for f, value in ast.iter_fields(node)
            if f not in ("body", "orelse", "finalbody", "handlers")
            for v in (value if isinstance(value, list) else [value])
            if isinstance(v, ast.AST)
        ]
        if stmt is not node:  # a decorator of a def or class
            name = _dotted(node.func if isinstance(node, ast.Call) else node)
            if name.rsplit(".", 1)[-1] in KERNEL_DECORATORS and "." in name:
                bad.append(f"{where}: decorator {name}")
            continue
        for part in parts:
            for call in _calls_in(part):
                name = _dotted(call.func)
                last = name.rsplit(".", 1)[-1]
                if last.startswith("install") and (mod, last) not in ALLOWED_INSTALLS:
                    bad.append(f"{where}: calls {name}")
                elif last.startswith("set_") and last in COMPAT_SETTERS:  # _compat's patches of private methods
                    bad.append(f"{where}: calls {name}")
                elif last == "setattr" or (last == "Library" and name.split(".")[0] in foreign | {"Library"}):
                    bad.append(f"{where}: calls {name}")
                elif last in KERNEL_METHODS and "." in name:
                    bad.append(f"{where}: registers a kernel ({name})")
                elif "meta_path" in name:
                    bad.append(f"{where}: edits {name}")
    return sorted(set(bad))


def installs_outside_installer() -> list[str]:
    """Every module-level install in `jaxtorch/` outside `jaxtorch/_install.py`."""
    bad: list[str] = []
    for mod, path in sorted(modules().items()):
        if path.suffix == ".py" and mod != INSTALLER:
            bad.extend(module_level_installs(mod, path.read_text()))
    return bad


def bridge_imports_of_ops(g: dict[str, set[str]]) -> list[str]:
    """`jaxtorch.bridge.*` modules importing `jaxtorch.ops*` (the lowerings sit above the bridge's core only)."""
    return [
        f"{m} imports {d}"
        for m, deps in sorted(g.items())
        if m.startswith("jaxtorch.bridge")
        for d in sorted(deps)
        if d == "jaxtorch.ops" or d.startswith("jaxtorch.ops.")
    ]


def test_no_module_level_install_outside_the_installer():
    assert installs_outside_installer() == []


PLANTED = """
import sys
import torch
import torch.utils.checkpoint as _tc
from torch.amp import GradScaler
from .x import install

install()
if True:
    torch.Tensor.foo = 1
try:
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("add", print, "PrivateUse1")
except Exception:
    pass
setattr(torch, "cond", print)
GradScaler.scale = print
_tc.CheckpointFunction += 1
del torch.nn.Module.cpu
sys.meta_path.insert(0, object())
torch.ops.aten.add.default.py_impl(1)(print)
for _ in range(1):
    torch._C._dispatch_keys[0] = 1
set_backward_hook_apply_on_tensors(print)


@torch.library.impl("aten::add", "PrivateUse1")
def f():
    torch.Tensor.bar = 2  # (inside a def: runs when called, not at import)


@torch.library.custom_op("planted::op", mutates_args=())
def g(x: torch.Tensor) -> torch.Tensor:
    return x


class C:
    torch.Tensor.baz = 3  # (a class body is left to review)


local = {}
local["a"] = torch.ones(1)
"""


def test_the_install_checker_finds_planted_installs():
    found = module_level_installs("planted", PLANTED)
    assert sorted(line.split(": ", 1)[1] for line in found) == sorted(
        [
            "calls install",
            "assigns torch.Tensor.foo",
            "calls torch.library.Library",
            "registers a kernel (_lib.impl)",
            "calls setattr",
            "assigns GradScaler.scale",
            "assigns _tc.CheckpointFunction",
            "assigns torch.nn.Module.cpu",
            "edits sys.meta_path.insert",
            "registers a kernel (torch.ops.aten.add.default.py_impl)",
            "assigns torch._C._dispatch_keys",
            "calls set_backward_hook_apply_on_tensors",
            "decorator torch.library.impl",
            "decorator torch.library.custom_op",
        ]
    )
    assert module_level_installs("jaxtorch", "from ._install import install_all\ninstall_all()\n") == []
    assert module_level_installs("jaxtorch.x", "from ._install import install_all\ninstall_all()\n") != []


def test_bridge_never_imports_ops():
    assert bridge_imports_of_ops(graph()) == []
    planted = {"jaxtorch.bridge.core._x": {"jaxtorch.ops.nn"}, "jaxtorch.ops.nn": set()}
    assert bridge_imports_of_ops(planted) == ["jaxtorch.bridge.core._x imports jaxtorch.ops.nn"]


def test_every_module_has_a_layer():
    assert [m for m in modules() if layer(m) < 0] == []


def test_layers_only_look_down():
    assert upward_imports(graph()) == []


def test_no_import_cycle():
    assert cycles(graph()) == []


if __name__ == "__main__":
    g = graph()
    for i, prefixes in enumerate(LAYERS):
        print(f"layer {i}: {', '.join(prefixes)}")
    unplaced = [m for m in g if layer(m) < 0]
    up, cyc = upward_imports(g), cycles(g)
    installs, ops_imports = installs_outside_installer(), bridge_imports_of_ops(g)
    print(f"\n{len(g)} modules, {sum(map(len, g.values()))} imports")
    for line in unplaced:
        print("no layer:", line)
    for line in up:
        print("upward:", line)
    for c in cyc:
        print("cycle:", " <-> ".join(c))
    for line in installs:
        print("module-level install:", line)
    for line in ops_imports:
        print("bridge imports ops:", line)
    sys.exit(1 if unplaced or up or cyc or installs or ops_imports else 0)
