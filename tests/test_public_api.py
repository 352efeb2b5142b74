"""`tierkv/__init__.py` keeps one list of public names (`_EXPORTS`); the eager imports
for type checkers must say the same, and every name must resolve lazily."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import tierkv

INIT = Path(tierkv.__file__)


def _type_checking_imports() -> dict[str, str]:
    tree = ast.parse(INIT.read_text())
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.module
                for alias in stmt.names:
                    assert alias.asname == alias.name, "re-export as the same name"
                    found[alias.name] = stmt.module
    return found


def test_the_type_checking_block_repeats_the_export_table_exactly() -> None:
    assert _type_checking_imports() == tierkv._EXPORTS


def test_every_public_name_resolves_from_its_module() -> None:
    for name, module in tierkv._EXPORTS.items():
        assert getattr(tierkv, name) is getattr(importlib.import_module(module), name), name
    assert sorted(tierkv.__all__) == sorted([*tierkv._EXPORTS, "__version__"])


def test_tierkv_tier_re_exports_the_contracts_names_for_plugin_authors() -> None:
    """Plugins import `tierkv.tier`; the contract itself lives in `tierkv.contract`."""
    import tierkv.contract.tier as contract
    import tierkv.tier as plugin_api

    assert plugin_api.__all__ == contract.__all__
    for name in contract.__all__:
        assert getattr(plugin_api, name) is getattr(contract, name), name
