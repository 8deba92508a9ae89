"""Compiles each Triton kernel h2okv launches for a Hopper GPU (sm_90), on a machine without one.

Triton's interpreter, which the kernel tests run on CPU, types a program as numpy does, not as the
compiler does: a float literal below 2**-126 is float64 to the compiler, and the fused decode step
compiled under the interpreter for months, then failed on an H100 for every ``rkv`` rule. This
compiles the real programs (front end to PTX) for every rule the policies ask the fused step for,
in both float dtypes. Run as a script (the interpreter must be off when triton is imported); it
prints one JSON object: ``{"failed": [...], "compiled": N, "total": N, "skipped": reason or null}``.
"""

from __future__ import annotations

import inspect
import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run with TRITON_INTERPRET unset"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.errors import CompilationError  # noqa: E402

from h2okv.core import triton_kernels as kernels  # noqa: E402
from h2okv.core.native.rules import KEY_RKV, c_decode_rule  # noqa: E402
from h2okv.policies import POLICIES, make_policy  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
# the pointers' element types as the launchers pass them (core/triton_step.py, triton_attention.py)
FLOAT32 = {"SCORE", "LSE", "WEIGHT", "MASS"}
INT64 = {"ORDINAL", "SLOT", "VICTIM", "N_REAL", "RECENT_START", "SINKS", "HEAVY", "RECENT"}
SCALARS_FLOAT = {"scaling", "decay", "weight"}


def signature(fn, constants: dict, data: str, valid: str) -> dict:
    """Every argument's Triton type: constexprs by name, pointers by their upper-case names."""
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constants:
            sig[name] = "constexpr"
        elif name in FLOAT32:
            sig[name] = "*fp32"
        elif name in INT64:
            sig[name] = "*i64"
        elif name in ("VALID", "ALLOWED"):
            sig[name] = valid
        elif name.isupper():
            sig[name] = data
        else:
            sig[name] = "fp32" if name in SCALARS_FLOAT else "i32"
    return sig


def compile_one(fn, constants: dict, data: str, valid: str) -> None:
    names = list(inspect.signature(fn.fn).parameters)
    source = triton.compiler.ASTSource(fn=fn, signature=signature(fn, constants, data, valid),
                                       constexprs={(names.index(k),): v for k, v in constants.items()})
    triton.compile(source, target=HOPPER)


def decode_rules() -> set[tuple[int, int]]:
    """The (fold, rank) codes that some policy runs the fused decode step with."""
    specs = [*POLICIES, "h2o:decay=0.8", "rkv:weight=0.5,decay=0.7"]
    return {(rule.acc, rule.key) for rule in map(c_decode_rule, map(make_policy, specs)) if rule is not None}


def jobs():
    """bf16 (what a GPU runs) for every rule, both layouts; float32 (IEEE products) for the attention
    kernels and the rkv rank, the one with the most float arithmetic of its own. About 30 s uncached."""
    for data, ieee in (("*bf16", False), ("*fp32", True)):
        blocks = dict(IEEE=ieee, BLOCK_N=64, BLOCK_D=64)
        for acc, key in sorted(decode_rules()):
            for general in (False, True) if data == "*bf16" else (True,):
                if data == "*fp32" and key != KEY_RKV:
                    continue
                yield (f"decode_step acc={acc} key={key} general={general} {data}", kernels.decode_step_kernel,
                       dict(GENERAL=general, ACC=acc, KEY=key, HAS_SINKS=True, BLOCK_G=16, BLOCK_DV=64, **blocks),
                       data, "*u8")
        yield (f"decode_mass {data}", kernels.decode_mass_kernel,
               dict(HAS_MASK=True, HAS_WEIGHT=True, BLOCK_G=16, BLOCK_DV=64, **blocks), data, "*i1")
        yield (f"chunk_lse {data}", kernels.chunk_lse_kernel, dict(HAS_MASK=True, BLOCK_M=64, BLOCK_DV=64, **blocks),
               data, "*i1")
        yield (f"column_mass {data}", kernels.column_mass_kernel,
               dict(HAS_MASK=True, HAS_WEIGHT=True, BLOCK_M=64, **blocks), data, "*i1")


def main() -> int:
    failed, compiled, todo = [], 0, list(jobs())
    for label, fn, constants, data, valid in todo:
        try:
            compile_one(fn, constants, data, valid)
        except CompilationError as exc:  # the program itself: what this check is for
            failed.append(f"{label}: {str(exc).strip().splitlines()[-1]}")
        except Exception as exc:  # noqa: BLE001 - no backend toolchain here (ptxas): nothing to say
            skipped = f"{label}: {type(exc).__name__}: {exc}"
            print(json.dumps({"failed": failed, "compiled": compiled, "total": len(todo), "skipped": skipped}))
            return 0
        else:
            compiled += 1
    print(json.dumps({"failed": failed, "compiled": compiled, "total": len(todo), "skipped": None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
