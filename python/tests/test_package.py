"""The package as installed: every Python module of the source tree is in it (the build copies
and installs the files python/CMakeLists.txt lists, W4A8MOE_PY_FILES)."""

from pathlib import Path

import pytest

import w4a8moe

SOURCE = Path(__file__).resolve().parents[1] / "w4a8moe"


@pytest.mark.skipif(not SOURCE.is_dir(), reason="not run from the source tree")
def test_every_module_of_the_source_is_installed():
    installed = Path(w4a8moe.__file__).resolve().parent
    if installed == SOURCE:
        pytest.skip("the package is imported from the source tree itself")
    missing = sorted(str(p.relative_to(SOURCE)) for p in SOURCE.rglob("*.py")
                     if not (installed / p.relative_to(SOURCE)).is_file())
    assert not missing, (f"{', '.join(missing)}: not in the installed package; list them in "
                         f"python/CMakeLists.txt (W4A8MOE_PY_FILES)")
