"""Who may import whom: ignition -> flare_contract <- helios (DESIGN.md, "Rules that keep this readable").

``ignition`` writes catalogs and ``helios`` reads them; what both must agree
on lives in ``flare_contract``, which imports neither side and no torch.
Every import statement is read from the source, function-local ones too, so
a lazy import cannot slip across unnoticed. The few crossings that remain
are listed here by file and module, each with the reason it exists.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# ignition -> helios: the custom ops its programs call, and two commands that hand a catalog to the runtime.
IGNITION_MAY_IMPORT = ("helios.ops",)
IGNITION_CROSSINGS = {
    ("ignition/cli.py", "helios.direct.serve"),  # `ignition debug-serve --direct` runs the runtime's engine
    ("ignition/capture/inspect.py", "helios.catalog.load"),  # `ignition inspect` validates with the reader itself
}
# helios -> ignition: `flare run` with no catalog captures the bundled model, inside that function only.
HELIOS_CROSSINGS = {
    ("helios/launch.py", "ignition.capture.pipeline"),
    ("helios/launch.py", "ignition.capture.render"),
}


def imports(package: str) -> set[tuple[str, str]]:
    """(file relative to the repository, imported module) for every import statement under ``package``."""
    found = set()
    for path in sorted((ROOT / package).rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), where)):
            if isinstance(node, ast.Import):
                found |= {(where, alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add((where, node.module))
    return found


def reaching(package: str, other: str) -> set[tuple[str, str]]:
    return {(where, module) for where, module in imports(package) if module.split(".")[0] == other}


def test_ignition_reaches_helios_only_for_its_ops_and_the_listed_commands():
    crossings = {(w, m) for w, m in reaching("ignition", "helios") if not m.startswith(IGNITION_MAY_IMPORT)}
    assert crossings == IGNITION_CROSSINGS


def test_helios_reaches_ignition_only_to_capture_the_bundled_model():
    assert reaching("helios", "ignition") == HELIOS_CROSSINGS


def test_the_contract_imports_neither_side():
    assert reaching("flare_contract", "helios") == set()
    assert reaching("flare_contract", "ignition") == set()


def test_importing_the_contract_does_not_import_torch():
    code = ("import sys, flare_contract.graphs, flare_contract.manifest; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'helios', 'ignition')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "[]"


def test_finding_the_bundled_catalog_imports_no_capture_or_model_code(tmp_path):
    """``flare run`` with no catalog: the cached catalog is found from the recipe's files alone."""
    code = f"""
import sys
from pathlib import Path
from helios import launch
launch._capture_bundled = lambda folder: (folder.mkdir(), (folder / "catalog.yaml").write_text(""))
launch.bundled_catalog(Path({str(tmp_path)!r}))
print(sorted(m for m in sys.modules if m.startswith(("ignition.capture", "ignition.models"))))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "[]"


def test_only_the_server_package_and_the_launcher_reach_the_server_package():
    """The engine, executor, scheduler and the rest of helios never depend on the HTTP layer (issue 19,
    part 5): ``flare run``'s launcher and CLI start the server, the server imports the engine, not back."""
    users = {where for where, module in imports("helios")
             if module.startswith("helios.server") and not where.startswith("helios/server/")}
    assert users <= {"helios/launch.py", "helios/cli.py", "helios/direct/serve.py"}, users
