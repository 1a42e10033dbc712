"""The package's floors: every import, function-level ones included, runs down or sideways.

A part may import the parts on floors below its own (and its own package), never one above: the
engine never imports the CLI, the models take the cache from ``kvcache`` (never from the engine),
``distributed`` knows nothing of the engine or the models. A new package must be given a floor
here, which is where a newcomer reads the order.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvledger

PACKAGE = Path(kvledger.__file__).parent

FLOORS: tuple[tuple[str, ...], ...] = (
    ("__init__",),  # the package: its version; ``LLM`` and ``SamplingParams`` are looked up lazily
    ("errors",),
    ("units",),
    ("progress",),
    ("plotting",),
    ("spec",),
    ("config",),
    ("workload", "metrics"),
    ("planner",),
    ("loader",),
    ("kvcache",),
    ("kernels",),
    ("distributed",),
    ("layers",),
    ("models",),
    ("engine",),
    ("sim",),
    ("evaluate",),
    ("server",),
    ("loadgen",),
    ("cluster",),
    ("cli",),
)
"""Low to high. Parts on one floor do not import each other."""

FLOOR = {part: level for level, parts in enumerate(FLOORS) for part in parts}


def _part(module: str) -> str:
    """``kvledger.engine.llm_engine`` -> ``engine``; the package itself -> ``__init__``."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "__init__"


def _module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_part(name: str) -> bool:
    return (PACKAGE / name / "__init__.py").exists() or (PACKAGE / f"{name}.py").exists()


def _imports(path: Path, name: str) -> list[tuple[int, str]]:
    """(line, module) of every kvledger import in ``path`` (module ``name``), at any depth
    (inside functions too), relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "kvledger":  # ``from kvledger import engine``: a part; ``__version__``: the package
                found += [(node.lineno, f"kvledger.{alias.name}" if _is_part(alias.name) else "kvledger")
                          for alias in node.names]
            else:
                found.append((node.lineno, target))
    return [(line, module) for line, module in found if module == "kvledger" or module.startswith("kvledger.")]


def test_every_part_has_a_floor():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py")}
    assert parts - set(FLOOR) == set(), "give each new part a floor in FLOORS"


def test_no_import_climbs_a_floor():
    climbs = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = _part(_module_name(path))
        for line, module in _imports(path, _module_name(path)):
            imported = _part(module)
            if imported == importer:
                continue
            if FLOOR[imported] >= FLOOR[importer]:
                climbs.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({importer}, floor {FLOOR[importer]}) "
                              f"imports {module} ({imported}, floor {FLOOR[imported]})")
    assert not climbs, "imports that climb:\n" + "\n".join(climbs)


def test_the_walk_sees_function_level_and_relative_imports(tmp_path):
    """Loops hide in imports inside functions and in relative ones: the walk reads both."""
    probe = tmp_path / "probe.py"
    probe.write_text("import os\n\ndef f():\n    from kvledger.cli import main\n\n"
                     "class C:\n    def g(self):\n        from ..models import llama\n        from . import sampler\n")
    assert _imports(probe, "kvledger.engine.probe") == [(4, "kvledger.cli"), (8, "kvledger.models"),
                                                        (9, "kvledger.engine")]


def test_the_engine_is_built_in_a_page():
    """``LLMEngine.__init__`` only wires the parts (runner, pool, manager, scheduler): at most 40 lines."""
    import inspect

    from kvledger.engine.llm_engine import LLMEngine

    lines = inspect.getsource(LLMEngine.__init__).splitlines()
    assert len(lines) <= 40, f"LLMEngine.__init__ is {len(lines)} lines"
