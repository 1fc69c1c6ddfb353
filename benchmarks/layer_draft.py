"""A draft model for speculative decoding cut from its target: some of a GGUF file's layers.

    python benchmarks/layer_draft.py --keep 0-9,24-29 [--model M.gguf] [-o draft.gguf]

The copy keeps the target's metadata (tokenizer included: the vocabularies match, as a draft's
must), its embedding, final norm and LM head, and the blocks of the kept layers byte for byte,
renumbered in order; only ``<arch>.block_count`` changes. Dropping layers is the cheapest draft
there is to get (no training, no second download) and a weak one: the layers that remain were
never trained to work without the others (Draft & Verify drops middle layers, as ``--keep``
does; an early exit, the first layers alone, predicts worse). It is what ``actorlm bench
latency --speculative-config '{"model": "draft.gguf", ...}'`` measures a draft model with where
no smaller model of the same family is at hand (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import pathlib
import re


def parse_layers(text: str) -> list[int]:
    """"0-9,24-29" -> [0, 1, ..., 9, 24, ..., 29]"""
    layers = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        layers += range(int(first), int(last or first) + 1)
    return layers


def write_layer_draft(source: pathlib.Path, out: pathlib.Path, keep: list[int]) -> None:
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    total = reader.fields[f"{arch}.block_count"].contents()
    if not keep or sorted(set(keep)) != keep or keep[-1] >= total or len(keep) == total:
        raise SystemExit(f"--keep must name some of layers 0..{total - 1}, in order, once each")
    renumber = {old: new for new, old in enumerate(keep)}
    writer = gguf.GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # (the writer writes these itself)
        value = len(keep) if name == f"{arch}.block_count" else field.contents()
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, value, field.types[0], sub_type)
    for tensor in reader.tensors:
        name = tensor.name
        if layer := re.match(r"blk\.(\d+)\.", name):
            if int(layer.group(1)) not in renumber:
                continue
            name = f"blk.{renumber[int(layer.group(1))]}.{name[layer.end():]}"
        quantized = tensor.tensor_type not in (gguf.GGMLQuantizationType.F32,
                                               gguf.GGMLQuantizationType.F16)
        # (a block format's data is [rows, bytes per row]: the writer reads the shape off it)
        writer.add_tensor(name, tensor.data,
                          raw_dtype=tensor.tensor_type if quantized else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    from actorlm.models.loader import default_gguf_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", required=True, help="the layers to keep, e.g. 0-9,24-29")
    parser.add_argument("--model", type=pathlib.Path, default=None,
                        help="the target's GGUF file (default: the default model's)")
    parser.add_argument("-o", "--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    source = args.model or default_gguf_path()
    out = args.out or pathlib.Path(f"/tmp/{source.stem}.layers{args.keep}.gguf")
    write_layer_draft(source, out, parse_layers(args.keep))
    print(out)


if __name__ == "__main__":
    main()
