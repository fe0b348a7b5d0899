"""helios/direct composes the Helios scheduler and engine through their public methods only (issue 19, part 4).

The direct scheduler used to subclass ``Scheduler`` and reach into nine private
members (``_observe_cost``, ``_timings``, ``_normalizer``, ``_frames``,
``_slots``, ``_snapshot``, ``_queue_accepts_more``, ``_plan_trace``, and the
engine's ``_lock`` and ``_waiting``). Read from the source: every ``x._name``
in helios/direct must be ``self._name`` of a class in the same file that
defines ``_name`` itself; no ``_name`` is imported from another module; and at
run time no class there overrides a private member of a base class from
elsewhere.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIRECT = ROOT / "helios" / "direct"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_members(cls: ast.ClassDef) -> set[str]:
    """Names a class body defines: its methods and attributes, and what its methods assign to ``self``."""
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in cls.body:
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
                    elif isinstance(t, ast.Name) and node in cls.body:
                        names.add(t.id)
    return names


def private_reaches(source: str, where: str = "<source>") -> list[str]:
    """Every private access in ``source`` that is not ``self._name`` of the enclosing class's own member."""
    tree = ast.parse(source, where)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [(node.lineno, node.col_offset, f"{where}:{node.lineno}: from {node.module} import {a.name}")
                      for a in node.names if _private(a.name)]
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]:
        own = _own_members(scope) if isinstance(scope, ast.ClassDef) else set()
        nested = {id(n) for c in ast.walk(scope) if isinstance(c, ast.ClassDef) and c is not scope
                  for n in ast.walk(c)}
        for node in ast.walk(scope):
            if id(node) in nested or not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            is_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            if is_self and isinstance(scope, ast.ClassDef) and node.attr in own:
                continue
            if is_self and not isinstance(scope, ast.ClassDef):
                continue  # judged within its class
            found.append((node.lineno, node.col_offset, f"{where}:{node.lineno}: {ast.unparse(node)}"))
    return [text for _, _, text in sorted(found)]


def test_the_check_finds_what_the_old_direct_scheduler_did():
    old = '''
from helios.scheduler.core import Scheduler, _helper

class DirectScheduler(Scheduler):
    def __init__(self):
        self._mine = 1

    def plan(self):
        if not self._queue_accepts_more():
            return None
        return self._mine, engine._lock, pol._Selector
'''
    assert [f.split(": ", 1)[1] for f in private_reaches(old)] == [
        "from helios.scheduler.core import _helper", "self._queue_accepts_more", "engine._lock", "pol._Selector"]


@pytest.mark.parametrize("path", sorted(DIRECT.glob("*.py")), ids=lambda p: p.name)
def test_direct_reaches_into_no_private_member(path):
    assert private_reaches(path.read_text(), path.relative_to(ROOT).as_posix()) == []


@pytest.mark.parametrize("module", sorted(p.stem for p in DIRECT.glob("*.py")))
def test_no_direct_class_overrides_a_private_member_of_another_module(module):
    mod = importlib.import_module(f"helios.direct.{module}")
    for _, cls in inspect.getmembers(mod, inspect.isclass):
        if cls.__module__ != mod.__name__:
            continue
        foreign = [base for base in cls.__mro__[1:] if not base.__module__.startswith("helios.direct")]
        overridden = {name for name in vars(cls) if _private(name)
                      and any(hasattr(base, name) for base in foreign)}
        assert overridden == set(), f"{cls.__name__} overrides private members {overridden}"
