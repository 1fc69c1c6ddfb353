"""The C ABI is declared once (``kernels/cpu/abi.py``): the library exports exactly the table's
functions, and a definition that strays from the header generated from it does not compile."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from actorlm.kernels.cpu import abi, native

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def _exported(library_path: str) -> set[str]:
    done = subprocess.run(["nm", "-D", "--defined-only", library_path], capture_output=True,
                          text=True, check=True)
    return {line.split()[-1] for line in done.stdout.splitlines()
            if line.split()[-1].startswith("actorlm_")}


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_the_library_exports_exactly_the_table():
    library = native.library()
    assert library is not None
    declared = {name for name in abi.header().split() if name.startswith("actorlm_")}
    functions = {name.split("(")[0] for name in declared if "(" in name}
    assert _exported(library._name) == functions
    for name in functions:  # and ctypes knows each one's signature
        assert native.function(name) is not None


@needs_compiler
def test_a_definition_that_strays_from_the_header_does_not_compile(tmp_path):
    (tmp_path / "actorlm_abi.h").write_text(abi.header())
    source = tmp_path / "stray.cpp"

    def compiles(definition: str) -> bool:
        source.write_text(f'#include "actorlm_abi.h"\nextern "C" {definition}\n')
        done = subprocess.run(["g++", "-c", "-std=c++17", f"-I{tmp_path}", str(source), "-o",
                               str(tmp_path / "stray.o")], capture_output=True, text=True)
        return done.returncode == 0

    assert compiles("void actorlm_argmax_f32(const float* x, int64_t* out, int64_t rows, "
                    "int64_t n) {}")
    assert not compiles("void actorlm_argmax_f32(const float* x, int64_t* out, int rows, "
                        "int64_t n) {}")  # a parameter's type changed
    assert not compiles("void actorlm_rms_norm_bf16(const uint16_t* x, int64_t x_stride, "
                        "uint16_t* out, const uint16_t* weight, int64_t rows, int dim, "
                        "float eps) {}")  # a parameter missing


def test_the_structs_of_ctypes_and_the_header_come_from_one_table():
    header = abi.header()
    for name, fields in abi.STRUCTS.items():
        assert f"typedef struct {name} {{" in header
        assert [f for f, _ in abi.STRUCT_TYPES[name]._fields_] == [f for _, f in fields]
