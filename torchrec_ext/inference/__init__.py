"""Serving: read-only forms of the dynamic collections, converted from a trained model
(``convert_to_inference``) or a checkpoint (``load_inference_checkpoint``), exportable with
``torch.export``, following training through its deltas while they serve."""

from torchrec_ext.inference.convert import convert_to_inference, load_inference_checkpoint
from torchrec_ext.inference.modules import InferenceEmbeddingBagCollection, InferenceEmbeddingCollection

__all__ = [
    "convert_to_inference",
    "load_inference_checkpoint",
    "InferenceEmbeddingBagCollection",
    "InferenceEmbeddingCollection",
]
