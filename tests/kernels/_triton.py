"""Helpers of the Triton kernel tests: a case script run under Triton's interpreter in a fresh
process, and an sm_90 compile of a kernel without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(module: str, *args: str) -> str:
    """Run ``python -m module args`` with ``TRITON_INTERPRET=1`` (it must be set before triton is
    first imported, hence the fresh process); assert it exits 0 and reports 0 mismatches."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "0 mismatches" in proc.stdout
    return proc.stdout


def compile_sm90(kernel, signature: dict, constexprs: dict, num_warps: int) -> bytes:
    """The kernel compiled for the H200's sm_90 by Triton's own toolchain (no device needed);
    skips where this triton build cannot compile (no bundled ptxas)."""
    import triton
    from triton.backends.compiler import GPUTarget

    src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": num_warps})
    except FileNotFoundError as err:
        pytest.skip(f"triton cannot compile here: {err}")
    return compiled.asm["cubin"]
