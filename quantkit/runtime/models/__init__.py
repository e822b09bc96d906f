"""Model families: each module exposes forward(params, cfg, tokens, kv, batch) -> (hidden [T, hidden],
kv) over the flattened tokens of one ragged step (runtime/step.py)."""

from quantkit.runtime.models import llama


def forward_for(family: str):
    """The forward function of a family (see runtime/config.py ARCHITECTURES)."""
    if family in ("llama", "qwen3"):
        return llama.forward
    if family == "qwen3_moe":
        from quantkit.runtime.models import qwen3_moe

        return qwen3_moe.forward
    if family == "qwen3_5":
        from quantkit.runtime.models import qwen3_5

        return qwen3_5.forward
    if family in ("gemma3", "gemma4"):
        from quantkit.runtime.models import gemma

        return gemma.forward
    raise KeyError(family)
