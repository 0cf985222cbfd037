"""Triton kernels compiled for an H100 (sm_90) on a machine without a GPU: Triton compiles to PTX
for any target, and its wheel carries NVIDIA's ptxas, whose ``-v`` says how many registers a
thread of the kernel takes and how many bytes it spills. The register budgets of
tests/test_triton_kernels.py and count_pooled_registers.py read them here. Importing triton
here must happen without TRITON_INTERPRET (the callers run it in a child process)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_for_sm90(kernel, signature: dict[str, str], const: dict[str, object], num_warps: int, aligned=()):
    """``kernel`` compiled for sm_90 with the argument types ``signature`` (the constexprs
    ``const`` left out of it), every pointer 16-byte aligned and the arguments named in
    ``aligned`` divisible by 16, as Triton's launcher specializes them."""
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if signature.get(name, "").startswith("*")
    }
    attrs.update({(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned})
    src = ASTSource(
        fn=kernel,
        signature=dict(signature, **dict.fromkeys(const, "constexpr")),
        constexprs={(kernel.arg_names.index(name),): value for name, value in const.items()},
        attrs=attrs,
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def registers_and_spills(compiled) -> tuple[int, int]:
    """(registers a thread, bytes spilled) of a compiled kernel, from ptxas -v for sm_90a."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        said = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True
        )
    finally:
        os.unlink(f.name)
    registers = int(re.search(r"Used (\d+) registers", said.stderr).group(1))
    return registers, sum(int(n) for n in re.findall(r"(\d+) bytes spill", said.stderr))


def compile_pooled_lookup(const: dict[str, object], num_warps: int):
    """The pooled lookup kernel compiled for sm_90 with the constexprs ``const``. Its pointers: the
    float32/float16/bfloat16 views of the weights; table offsets, dtypes and dims, feature tables
    and columns as int64; the means as bool; rows and bag offsets as int64; per-sample weights and
    the output as float32."""
    from torchrec_ext.triton_kernels import embedding_lookup as el

    kernel = el._pooled_lookup_fwd_kernel
    pointers = ["*fp32", "*fp16", "*bf16"] + ["*i64"] * 5 + ["*i1", "*i64", "*i64", "*fp32", "*fp32"]
    signature = dict(zip(kernel.arg_names, pointers), num_bags="i32", batch_size="i32", total_dim="i32")
    return compile_for_sm90(kernel, signature, const, num_warps)


def pooled_lookup_registers(max_dim: int, mean_bag: float, has_dtypes: bool, align: int) -> list[int]:
    """[registers a thread, warps, bytes spilled] of the pooled lookup kernel at the tile
    ``pooled_lookup`` launches for a widest dim, mean bag length and ALIGN (half tables among
    its tables or not), unweighted."""
    from torchrec_ext.triton_kernels import embedding_lookup as el

    block_b, block_l, block_d, num_warps = el._pooled_blocks(max_dim, mean_bag, align)
    const = dict(
        HAS_WEIGHTS=False, HAS_DTYPES=has_dtypes, ALIGN=align, BLOCK_B=block_b, BLOCK_L=block_l, BLOCK_D=block_d
    )
    registers, spilled = registers_and_spills(compile_pooled_lookup(const, num_warps))
    return [registers, num_warps, spilled]
