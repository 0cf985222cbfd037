"""Triton GPU kernels of the embedding ops: the lookups (embedding_lookup) and the backward fused
with the optimizer step (embedding_update). torchrec_ext.ops registers them as the ops' CUDA
kernels; importing them needs Triton."""
