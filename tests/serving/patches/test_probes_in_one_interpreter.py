"""`flashnext patches check` runs every probe in one interpreter that imports the shadow tree: a
failing probe among passing ones is named by its own patch, and the tree is what it imports."""

import dataclasses
import os
import sys
import textwrap

import pytest

from flashnext.errors import FlashnextError
from flashnext.serving import patch_series as ps
from flashnext.serving.patches.series import SERIES

pytestmark = pytest.mark.slow  # minutes in all on 2 cores: tests/conftest.py sends it to a worker first

pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")


def _series_with(tmp_path, monkeypatch, probes: dict[str, str]):
    """The series with some probes replaced by functions of a module written to ``tmp_path``, which
    the probe interpreter finds on its path as it finds ``serving/patches/probes.py``."""
    source = "import inspect\n" + "".join(
        f"\n\ndef {pid.replace('-', '_')}():\n{textwrap.indent(body, '    ')}\n" for pid, body in probes.items())
    (tmp_path / "other_probes.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("other_probes", None)
    import other_probes

    real_env = ps._probe_env
    monkeypatch.setattr(ps, "_probe_env", lambda root: {
        **real_env(root), "PYTHONPATH": real_env(root)["PYTHONPATH"] + os.pathsep + str(tmp_path)})
    return [dataclasses.replace(p, probe=getattr(other_probes, p.id.replace("-", "_"))) if p.id in probes else p
            for p in SERIES]


def test_a_failing_probe_among_passing_ones_is_named_with_its_error(tmp_path, monkeypatch):
    # mtp-01's probe asks the opposite of what the patched tree has; its neighbours are unchanged
    wrong = ("import vllm.models.qwen4_exp.nvidia.mtp as m\n"
             "assert 'draft_embedding_method(' not in inspect.getsource(m.Qwen4ExpMTP.__init__), 'the patched source'")
    with pytest.raises(FlashnextError) as failed:
        ps.check_series(series=_series_with(tmp_path, monkeypatch, {"mtp-01": wrong}))
    assert str(failed.value) == ("patch mtp-01 applied but its probe failed: AssertionError: the patched source "
                                 "(other_probes.py line 6: assert 'draft_embedding_method(' not in "
                                 "inspect.getsource(m.Qwen4ExpMTP.__init__), 'the patched source')")


def test_probes_after_a_failing_one_still_run_and_each_is_named(tmp_path, monkeypatch):
    probes = {"decode-06": "raise RuntimeError('first')", "decode-05": "import vllm.no_such_module"}
    with pytest.raises(FlashnextError) as failed:
        ps.check_series(series=_series_with(tmp_path, monkeypatch, probes))
    assert str(failed.value) == ("patch decode-06 applied but its probe failed: RuntimeError: first (other_probes.py "
                                 "line 5: raise RuntimeError('first')) (and 1 more failed: decode-05)")


def test_the_probes_refuse_a_vllm_that_is_not_the_shadow_tree(tmp_path, monkeypatch):
    installed = str(ps.installed_vllm_root())
    real_env = ps._probe_env
    monkeypatch.setattr(ps, "_probe_env", lambda root: {**real_env(root), "PYTHONPATH": installed})
    with pytest.raises(FlashnextError, match=r"the patch probes could not start: ImportError: the probes import vllm "
                                             r"from .*site-packages/vllm/__init__.py, not from the patched shadow tree"):
        ps.check_series()
