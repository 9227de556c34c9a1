"""Every exception class jaxtorch defines lives in `bridge/core/_errors.py` and is a `JaxtorchError`
(issue 32, item 4): one module holds every error, each naming the problem and the way out, and
`except jaxtorch.JaxtorchError` catches all of them. Warnings (categories for `warnings.warn`) are
not errors and are not counted."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import jax

import jaxtorch

ROOT = pathlib.Path(jaxtorch.__file__).resolve().parent
ERRORS = "jaxtorch.bridge.core._errors"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _class_defs() -> list[tuple[str, str, bool]]:
    """`(module, class name, at module level)` of every class statement under `jaxtorch/`."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                out.append((_module_name(path), node.name, id(node) in top))
    return out


def _exception_classes() -> list[tuple[str, type]]:
    """`(module, class)` of the exception classes (warnings aside) defined at module level under `jaxtorch/`."""
    out = []
    for mod, name, top in _class_defs():
        cls = getattr(importlib.import_module(mod), name) if top else None
        if inspect.isclass(cls) and issubclass(cls, BaseException) and not issubclass(cls, Warning):
            out.append((mod, cls))
    return out


def test_every_exception_class_is_in_errors_and_a_jaxtorch_error():
    found = _exception_classes()
    assert len(found) >= 20, found  # (the walk found the package's errors)
    elsewhere = sorted(f"{m}.{c.__name__}" for m, c in found if m != ERRORS)
    assert elsewhere == [], f"define these in {ERRORS}: {elsewhere}"
    not_ours = sorted(c.__name__ for _, c in found if not issubclass(c, jaxtorch.JaxtorchError))
    assert not_ours == [], f"make these JaxtorchError subclasses: {not_ours}"


def test_no_exception_class_is_defined_inside_a_function():
    """A class statement inside a function body whose bases name an exception escapes the check above."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and id(node) not in top:
                bases = [ast.unparse(b) for b in node.bases]
                if any(b.endswith(("Error", "Exception")) for b in bases):
                    bad.append(f"{_module_name(path)}.{node.name}({', '.join(bases)})")
    assert bad == []


def test_moved_errors_keep_their_public_names_and_torch_compatible_bases():
    """Where users import them from, and the builtin bases they had (an `except ValueError` still works)."""
    from jaxtorch.bridge.core import _errors
    from jaxtorch.train import CheckpointError, CheckpointKeysError, DonatedStateError

    assert jaxtorch.ParamsError is _errors.ParamsError and issubclass(jaxtorch.ParamsError, ValueError)
    assert CheckpointError is _errors.CheckpointError and issubclass(CheckpointError, ValueError)
    assert issubclass(CheckpointKeysError, CheckpointError) and issubclass(CheckpointKeysError, KeyError)
    assert DonatedStateError is _errors.DonatedStateError
    assert issubclass(_errors.TracedSizesError, jax.errors.ConcretizationTypeError)  # (eager: runs unjitted)
    for cls in (CheckpointError, CheckpointKeysError, DonatedStateError, jaxtorch.ParamsError, _errors.MetaBufferError):
        assert issubclass(cls, jaxtorch.JaxtorchError), cls
