"""One Gated DeltaNet layer's decode step (runtime/models/gdn.py `gdn_block`), compiled deviceless for a
TPU: XLA's bytes accessed against the analytic minimum (the layer's weights once, each row's conv and
recurrent state read once and written once, the activations in and out), per published Qwen3.5 shape; as the
plain step program has it (the one-token recurrence and the chunked rule beside it, chosen on device) and as
the Runner's DECODE program (one token a row: the recurrence alone).

An estimate of traffic from the compiler's cost analysis, not a measurement on a TPU.

Usage: .venv/bin/python benchmarks/gdn_decode.py [--rows 16] [--target v6e]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from quantkit.runtime.aot import compile_for  # noqa: E402
from quantkit.runtime.cache import cache_layout  # noqa: E402
from quantkit.runtime.models import from_hf  # noqa: E402
from quantkit.runtime.loader import abstract  # noqa: E402
from quantkit.runtime.models.common import layer_params  # noqa: E402
from quantkit.runtime.models.gdn import gdn_block  # noqa: E402
from quantkit.runtime.ops import dense_as_qtensor  # noqa: E402
from quantkit.runtime.step import empty_batch  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
MODELS = {"Qwen3.5-35B-A3B": "qwen3.5-35B-A3B.json", "Qwen3.5-397B-A17B": "qwen3.5-397B-A17B.json"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16, help="decode rows (sequences) in the step")
    ap.add_argument("--target", default="v6e")
    args = ap.parse_args()
    n = args.rows
    print("| model | rows | GDN weights MB | state r+w MB | analytic minimum MB | XLA bytes accessed MB, step "
          "program | ratio | XLA bytes accessed MB, DECODE program | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, file in MODELS.items():
        cfg = from_hf(json.loads((CONFIGS / file).read_text()))
        stack = {k: v for k, v in abstract(cfg, None)["layers"]["linear"].items()
                 if k in ("in_qkv", "in_z", "in_b", "in_a", "out", "conv", "A_log", "dt_bias", "gdn_norm",
                          "attn_norm")}
        layout = cache_layout(cfg, 2048, n, 16, n)
        state = layout.cache(lambda k, s, d: jax.ShapeDtypeStruct(s, d or jnp.bfloat16))["linear"]
        batch = empty_batch(n, n, layout, n, cfg.vocab_size)
        batch = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
        x = jax.ShapeDtypeStruct((n, cfg.hidden_size), jnp.bfloat16)

        def counted(decode: bool) -> float:
            def layer(stack, state, x, batch):  # dense weights through gmm_v2, as the TPU step reads them
                p = dense_as_qtensor({"layers": {"linear": stack}}, cfg)["layers"]["linear"]
                return gdn_block(layer_params(p, 0), x, state, 0, {**batch, "decode": decode}, cfg)

            ca = compile_for(args.target, layer, stack, state, x, batch, donate=(1,), pinned=(0,))[0].cost_analysis()
            return (ca[0] if isinstance(ca, (list, tuple)) else ca)["bytes accessed"]

        got, decode = counted(False), counted(True)
        weights = sum(a.size * a.dtype.itemsize for k, a in stack.items() if k != "attn_norm") / stack["in_qkv"].shape[0]
        per_row = sum(s.size // (s.shape[0] * s.shape[1]) * 4 for s in state)  # one layer, one slot, float32
        floor = weights + 2 * n * per_row + 2 * n * cfg.hidden_size * 2
        print(f"| {name} | {n} | {weights / 1e6:.1f} | {2 * n * per_row / 1e6:.1f} | {floor / 1e6:.1f} | "
              f"{got / 1e6:.1f} | {got / floor:.2f}× | {decode / 1e6:.1f} | {decode / floor:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
