"""Prints docs/formats.md's table of every compressed-tensors preset scheme with quantkit's verdict per chip.

Each preset is taken from the compressed-tensors library itself (`preset_name_to_scheme`), with the storage
format the library picks for a Linear (`infer_module_format`, what its compressors write), serialized as a
config group and parsed by quantkit; its verdict is quantkit's own (`runtime.validate.weight_path`) for a
Llama-3-8B down projection [out 4096, in 14336] on each chip: served on `gmm_v2` (weights packed in HBM), on
the XLA path, or refused with the reason `inspect` gives.

Usage: .venv/bin/python scripts/scheme_table.py   (a few seconds; imports torch and compressed-tensors)
"""

from __future__ import annotations

import torch
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES, preset_name_to_scheme

from quantkit.formats.compressed_tensors import (activation_group, activation_qtype, parse_quantization_config,
                                                 weight_qtype)
from quantkit.kernels.dispatch import mxu_type, row_codes, row_group
from quantkit.kernels.tiling import CHIPS
from quantkit.formats.ct_tensors import kernel_shapes
from quantkit.runtime.validate import weight_path

SHAPE = (4096, 14336)  # Llama-3-8B down_proj [out, in]
CHIP_COLUMNS = ("v5e", "v6e", "v7x", "cpu")
EXTRA = {"W8A16_ASYM": ("W8A16", {"symmetric": False})}  # written by `quantkit convert`; no preset of the library


def library_scheme(name: str):
    """The library's scheme of preset `name` (or an EXTRA variant) and the format it stores a Linear in."""
    base, change = EXTRA.get(name, (name, {}))
    scheme = preset_name_to_scheme(base, ["Linear"])
    if change:
        scheme = scheme.model_copy(update={"weights": scheme.weights.model_copy(update=change)})
    return scheme, infer_module_format(torch.nn.Linear, scheme).value


def activations(scheme, cells: list[str]) -> str:
    """How the runtime computes the activations of a served scheme (or "" when refused)."""
    a = scheme.input_activations if scheme is not None else None
    if cells[0].startswith("refused") or a is None:
        return "" if cells[0].startswith("refused") else "bf16"
    qtype = kernel_shapes(scheme, SHAPE).qtype if scheme is not None and scheme.weights is not None else ""
    if (act := activation_qtype(scheme)) and not row_codes(act, qtype):
        kind = act.split("_g")[0]
        scale = " (fp8 scales under input_global_scale)" if act == "nvfp4" else ""
        return (f"{kind} per group of {activation_group(act)}{scale}: quantize-dequantized exactly, then the weights' "
                "bf16 path")
    if act:
        rows = row_codes(act, qtype)
        native = [c for c in CHIP_COLUMNS[:3] if mxu_type(qtype, act, CHIPS[c]) == rows]
        exact = [c for c in CHIP_COLUMNS[:3] if c not in native]
        how = [f"{rows} MXU on {', '.join(native)}"] * bool(native) + [f"exact in bf16 on {', '.join(exact)}"] * bool(exact)
        per = f"per group of {row_group(act)}" if row_group(act) else "per token"
        return f"{rows} {per}: {'; '.join(how)}; fake-quantized on cpu"
    return f"{a.type}{a.num_bits} {a.strategy}: computed in bf16 (a warning)"


def verdicts(name: str) -> tuple[str, str, list[str], str]:
    """(format, stored weight type, verdict per chip, activations) of preset `name`."""
    lib, fmt = library_scheme(name)
    group = lib.model_dump(exclude_none=True, exclude={"targets", "format"})
    qc = parse_quantization_config({"quant_method": "compressed-tensors", "format": fmt,
                                    "config_groups": {"g": {"targets": ["Linear"], "format": fmt, **group}}})
    scheme = qc.groups[0] if qc.groups and qc.groups[0].weights is not None else None
    out = []
    for chip in CHIP_COLUMNS:
        v = weight_path(scheme, SHAPE, CHIPS[chip])
        out.append(f"`{v.path}`" if v.path else f"refused: {v.reason.split(';')[0]}")
    return fmt, weight_qtype(scheme), out, activations(scheme, out)


def main() -> None:
    print("| scheme | format (the library's) | weights | v5e, v6e, v7x | cpu | activations |")
    print("|---|---|---|---|---|---|")
    for name in [*sorted(PRESET_SCHEMES), *EXTRA]:
        fmt, qtype, cells, acts = verdicts(name)
        tpu = cells[0] if len(set(cells[:3])) == 1 else "; ".join(f"{c}: {v}" for c, v in zip(CHIP_COLUMNS, cells))
        print(f"| {name} | `{fmt}` | {qtype} | {tpu} | {'same' if cells[3] == cells[0] else cells[3]} | {acts} |")


if __name__ == "__main__":
    main()
