"""SmolLM2-135M-Instruct's weights (the shipped GGUF dequantized) in FP8 three ways, written by
the compressed-tensors package as llm-compressor saves FP8_DYNAMIC and FP8_BLOCK (blocks of
32 here, the tiny-model tests' size), and the block one rewritten as the fp8 method saves it."""
import pathlib, shutil, sys
sys.path.insert(0, "tests")
from actorlm.models import gguf_file
from actorlm.models.loader import default_gguf_path
from fp8_files import as_fp8_method, write_fp8

dense = pathlib.Path("/tmp/smollm2-dense")
if not dense.exists():
    gguf_file.write_dense_copy(default_gguf_path(), dense)
for name, weights, inputs in [("channel", "channel", "token"), ("block", "block", "group")]:
    out = pathlib.Path(f"/tmp/smol-fp8-{name}")
    shutil.rmtree(out, ignore_errors=True)
    write_fp8(dense, out, weights, inputs)
shutil.rmtree("/tmp/smol-fp8-method", ignore_errors=True)
as_fp8_method(pathlib.Path("/tmp/smol-fp8-block"), pathlib.Path("/tmp/smol-fp8-method"))
