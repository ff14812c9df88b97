"""The cluster proof's phases: one enum, whose members are the names reports and figures print."""

from __future__ import annotations

import json

from art_mega.runtime.runtime import Phase, PreflightReport


def test_the_phases_run_in_this_order_under_these_names():
    assert [p.value for p in Phase] == ["admission", "fs_probe", "metadata_store", "collective"]


def test_a_report_prints_as_it_did_with_string_keys():
    report = PreflightReport(phases_s={Phase.ADMISSION: 0.25, Phase.FS_PROBE: 0.5, Phase.COLLECTIVE: 0.0})
    assert json.dumps(report.phases_s) == '{"admission": 0.25, "fs_probe": 0.5, "collective": 0.0}'
    assert report.phases_s["fs_probe"] == 0.5 and "metadata_store" not in report.phases_s
    assert f"preflight {Phase.METADATA_STORE}, 2 hosts" == "preflight metadata_store, 2 hosts"
    assert Phase("collective") is Phase.COLLECTIVE
