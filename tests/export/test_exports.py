"""The export package's public surface is pinned."""

from __future__ import annotations

import kserve_trio.export as export


def test_export_exports_exactly_its_public_surface():
    assert set(export.__all__) == {
        "ArityReport",
        "IOSpec",
        "ModuleArity",
        "assert_bundle_arity",
        "bundle_arity_report",
        "bundle_entry_arity",
        "collect_provenance",
        "export_bundle",
        "write_bundle",
    }
    for name in export.__all__:
        assert getattr(export, name) is not None
