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
    ["jaxtorch", "jaxtorch.bridge"],  # the package docstrings / the public API
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
    print(f"\n{len(g)} modules, {sum(map(len, g.values()))} imports")
    for line in unplaced:
        print("no layer:", line)
    for line in up:
        print("upward:", line)
    for c in cyc:
        print("cycle:", " <-> ".join(c))
    sys.exit(1 if unplaced or up or cyc else 0)
