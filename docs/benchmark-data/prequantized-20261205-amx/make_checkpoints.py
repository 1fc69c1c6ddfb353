import pathlib, sys
sys.path.insert(0, "tests")
from actorlm.models import gguf_file
from actorlm.models.loader import default_gguf_path
from prequantized_files import write, write_compressed_tensors
dense = pathlib.Path("/tmp/smollm2-dense")
if not dense.exists():
    gguf_file.write_dense_copy(default_gguf_path(), dense)
import shutil
shutil.rmtree("/tmp/smol-gptq", ignore_errors=True); shutil.rmtree("/tmp/smol-ct", ignore_errors=True)
q, _ = write(dense, pathlib.Path("/tmp/smol-gptq"), "gptq", group=64, symmetric=True)
print(q)
q, _ = write_compressed_tensors(dense, pathlib.Path("/tmp/smol-ct"), group=64)
print(q)
