"""The quantizer registry: the built-in table agrees with what the modules register, listing the
names costs no torch, GPTQ is a quantizer like the others, and docs/extending.md's recipe for a new
one is true (its code block, run here, gives a quantizer that ``make-mtp-int4 --quantizer`` builds
an overlay with)."""

import importlib
import json
import re
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from flashnext.errors import FlashnextError
from flashnext.quant.overlays.mtp_int4 import MtpInt4Builder
from flashnext.quant.quantizers import base
from flashnext.quant.quantizers.gptq import gptq_codes
from flashnext.quant.quantizers.mse_rtn import MseSearch, calibrated_grid, quantize_mse_rtn
from flashnext.tools.make_mtp_int4 import main as make_mtp_int4_cli
from support import ROOT


def test_builtin_table_is_what_the_modules_register():
    for module in set(base.BUILTIN.values()):
        importlib.import_module(module)
        registered = {name for name, cls in base._REGISTRY.items() if cls.__module__ == module}
        assert registered == {name for name, m in base.BUILTIN.items() if m == module}, module
    assert base.available_quantizers() == ["gptq", "mse", "rtn"]


def test_listing_and_refusing_quantizers_imports_no_torch():
    """``--quantizer``'s choices and help come from base.py, which imports neither torch nor a
    concrete quantizer (the old base <-> mse_rtn cycle)."""
    probe = ("import sys\nfrom flashnext.quant.quantizers.base import available_quantizers\n"
             "import flashnext.tools.make_mtp_int4\nfrom flashnext.quant.overlays.mtp_int4 import MtpInt4Options\n"
             "names = available_quantizers()\ntry:\n    MtpInt4Options(quantizer='nope')\nexcept Exception as e:\n"
             "    print(type(e).__name__, e)\n"
             "print(names, 'torch' in sys.modules, 'flashnext.quant.quantizers.mse_rtn' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    refusal, listing = done.stdout.strip().splitlines()
    assert refusal == "UsageError quantizer 'nope': no such quantizer; available: gptq, mse, rtn"
    assert listing == "['gptq', 'mse', 'rtn'] False False"


def test_gptq_is_the_calibrated_search_then_gptq_codes():
    g = torch.Generator().manual_seed(3)
    b, rows, cols = 3, 16, 256
    w = torch.randn(b * rows, cols, generator=g)
    x = torch.randn(b, 400, cols, generator=g)
    gram = x.transpose(1, 2) @ x
    importance = torch.rand(b * rows, cols, generator=g) + 0.1
    q = base.get_quantizer("gptq", calibrated=True).quantize(w, 4, 128, torch.bfloat16, importance=importance,
                                                             gram=gram)
    scales = quantize_mse_rtn(w, 4, 128, torch.bfloat16, MseSearch(grid=calibrated_grid()), importance=importance)
    assert torch.equal(q.scale, scales.scale)
    codes = gptq_codes(w.view(b, rows, cols), gram, scales.scale.view(b, rows, -1), 128)
    assert torch.equal(q.codes, codes.view(b * rows, cols))
    assert not torch.equal(q.codes, scales.codes)  # the rounding did change codes
    with pytest.raises(FlashnextError, match="calibration activations") as needs:
        base.get_quantizer("gptq").quantize(w, 4, 128, torch.bfloat16)
    assert needs.value.field == "calib"
    with pytest.raises(FlashnextError, match="does not fit"):
        base.get_quantizer("gptq").quantize(w, 4, 128, torch.bfloat16, gram=gram[:, :128, :128])


def _recipe() -> str:
    text = (ROOT / "docs" / "extending.md").read_text()
    section = text[text.index("## A quantizer\n"):text.index("## An overlay builder\n")]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return block


def test_the_extending_recipe_gives_a_quantizer_make_mtp_int4_can_choose(demo_snapshot, tmp_path, monkeypatch):
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))  # the recipe's class leaves with the test
    namespace: dict = {}
    exec(compile(_recipe(), "docs/extending.md", "exec"), namespace)
    name = namespace["Absmax7"].name
    assert name in base.available_quantizers()
    out = tmp_path / "ov"
    done = CliRunner().invoke(make_mtp_int4_cli, ["--src", str(demo_snapshot), "--out", str(out), "--quantizer",
                                                  name, "--no-progress", "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads(done.output)
    assert report["quantizer"] == name and report["quantizer_description"] == namespace["Absmax7"].description
    assert namespace["Absmax7"].description in "\n".join(MtpInt4Builder.card_section(report))
    # absmax mapped to 7 is compressed-tensors' observer but for its 7.5: so close to rtn, not equal.
    for s in report["projections"].values():
        assert 0.9 < s["ratio_to_absmax_rtn"] < 1.2 and s["negative_scales"] == 0
    help_text = CliRunner().invoke(make_mtp_int4_cli, ["--help"]).output
    assert name in help_text


def test_quantizer_and_the_older_flags_agree_or_are_refused(demo_snapshot, tmp_path):
    from flashnext.quant.overlays.mtp_int4 import MtpInt4Options

    assert MtpInt4Options(quantizer="rtn").scale_search is False
    assert MtpInt4Options(quantizer="gptq", calib=tmp_path / "c").rounding == "gptq"
    assert MtpInt4Options().quantizer == "mse"
    for argv, message in ((["--quantizer", "mse", "--no-scale-search"],
                           "Error: --quantizer mse and --no-scale-search choose different quantizers"),
                          (["--no-scale-search", "--rounding", "gptq"],
                           "Error: --no-scale-search and --rounding gptq choose different quantizers"),
                          (["--quantizer", "gptq", "--rounding", "nearest"],
                           "Error: --quantizer gptq and --rounding nearest choose different quantizers"),
                          (["--quantizer", "gptq"], "Error: --calib is needed by quantizer gptq"),
                          (["--rounding", "gptq"], "Error: --calib is needed by quantizer gptq"),
                          (["--quantizer", "nope"], "'nope' is not one of")):
        done = CliRunner().invoke(make_mtp_int4_cli, ["--src", str(demo_snapshot), "--out", str(tmp_path / "o"),
                                                      "--no-progress", *argv])
        assert done.exit_code == 2 and message in done.output, done.output
    assert not (tmp_path / "o").exists()
