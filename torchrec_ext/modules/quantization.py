"""TorchRec's inference quantization and our modules: refused with a clear error.

``torchrec.inference.modules.quantize_inference_model`` quantizes the modules whose type name is
in its ``quantization_mapping`` (``DEFAULT_QUANT_MAPPING`` by default) and silently leaves any
other embedding module in float, so a model holding ours would come out half quantized. Our
type names are registered in that default mapping, mapped to ``DynamicTablesNotQuantizable``,
whose ``from_float`` (what the quantization pass calls to convert a module) raises, naming the
module and how to keep it in float instead.
"""

from __future__ import annotations

from typing import Any

import torch


class DynamicTablesNotQuantizable:
    """The 'quantized form' of our modules in TorchRec's quantization mapping: there is none."""

    @classmethod
    def from_float(cls, module: Any, *args: Any, **kwargs: Any) -> Any:
        name = type(module).__name__
        raise TypeError(
            f"quantize_inference_model: {name} has no quantized (int8 / int4) form; torchrec_ext's dynamic "
            f"tables are float32. To quantize the rest of the model and keep the dynamic tables in float, pass "
            f"quantization_mapping={{k: v for k, v in DEFAULT_QUANT_MAPPING.items() if not k.startswith('torchrec_ext.')}}"
        )


def install_quantization_refusal() -> None:
    """Registers our modules in TorchRec's default inference quantization mapping (idempotent)."""
    try:
        from torchrec.inference.modules import DEFAULT_QUANT_MAPPING, trim_torch_package_prefix_from_typename
    except ImportError:  # TorchRec built without its inference package: nothing to refuse
        return
    from torchrec_ext.modules.embedding_bag_collection import DynamicEmbeddingBagCollection
    from torchrec_ext.modules.embedding_collection import DynamicEmbeddingCollection

    for cls in (DynamicEmbeddingBagCollection, DynamicEmbeddingCollection):
        DEFAULT_QUANT_MAPPING[trim_torch_package_prefix_from_typename(torch.typename(cls))] = (
            DynamicTablesNotQuantizable
        )
