"""The selftest's "is this the patched vLLM?" question runs the series' own probes through the same
runner as ``patches check``: on the patched tree every probe passes, on stock vLLM 0.34.0 every
diff's fails, and the selftest names the first."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_the_selftest_asks_the_series_probes(patched_tree, monkeypatch):
    from flashnext.serving import patch_series
    from flashnext.serving.selftest import runner

    series = patch_series.load_series()
    # A plugin entry (vLLM 0.34.0 took int6-bitplane through its own extension point) is no change to
    # the tree: flashnext's vllm.general_plugins entry point registers it wherever flashnext is
    # installed, so its probe passes on stock vLLM here too. Every diff's probe tells the trees apart.
    ids = [p.id for p in series if p.verdict == "diff"]
    assert ids
    assert patch_series.probe_tree(patched_tree) == {}
    stock = patch_series.probe_tree()
    assert list(stock) == ids, "a diff's probe passed against stock vLLM: it does not tell the trees apart"

    monkeypatch.setattr(patch_series, "probe_tree", lambda root=None: stock)
    patched, why = runner.installed_vllm_is_patched()
    assert not patched and why.startswith(f"{ids[0]} (") and why.endswith(f"and {len(ids) - 1} more")
