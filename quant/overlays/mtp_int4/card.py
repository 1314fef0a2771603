"""The model card's "Quantization report" section of an MTP INT4 overlay, from its report alone
(the Hub upload renders it long after the build, from overlay.json)."""

from __future__ import annotations


def card_section(report: dict) -> list[str]:
    if not report.get("projections"):
        return []
    lines = ["## Quantization report", "",
             f"INT{report.get('bits')} symmetric, group size {report.get('group_size')}, "
             f"scales in {report.get('scale_dtype')}, "
             + report.get("quantizer_description", "MSE-searched scales, round-to-nearest")
             + (" (positive scales only)" if report.get("positive_scales") else " (signed scales)") + ".", ""]
    calib = report.get("calibration")
    calibrated = str(report.get("mode", "")).startswith("calibrated")
    if calibrated and calib:
        tokens = next(iter(calib["layers"].values()))["tokens"]
        gptq = (" Codes are then chosen by GPTQ against each expert's routed Gram matrix XᵀX."
                if report.get("rounding") == "gptq" else "")
        lines += [f"Mode: **{report['mode']}** on {tokens:,} tokens ({calib['file']}, sha256 "
                  f"{calib['sha256'][:12]}): each expert's scales minimise the output error on the tokens "
                  f"its router sends it (diag(XᵀX)-weighted scale search).{gptq}", ""]
    else:
        lines += ["Mode: **weight-only** (no calibration data): scales minimise the weight error.", ""]
    lines += ["| projection | matrices | relative MSE | vs absmax RTN | negative scales | all-zero groups |",
              "|---|---|---|---|---|---|"]
    for proj, s in report["projections"].items():
        ratio = f"{s['ratio_to_absmax_rtn']:.3f}x" if s.get("ratio_to_absmax_rtn") else "—"
        lines.append(f"| {proj} | {s['matrices']} | {s['rel_mse']:.4e} | {ratio} | "
                     f"{s['negative_scales']} | {s['zero_groups']} |")
    if calibrated:
        lines += ["", "Output error on held-out calibration tokens (relative, routing-weighted ||XΔWᵀ||²):", "",
                  "| projection | this overlay | weight-only default | absmax RTN |", "|---|---|---|---|"]
        for proj, s in report["projections"].items():
            if "output_rel_mse" in s:
                lines.append(f"| {proj} | {s['output_rel_mse']:.4e} | {s['weight_only_output_rel_mse']:.4e} | "
                             f"{s['absmax_rtn_output_rel_mse']:.4e} |")
    return lines
