import time, collections, ctypes
from actorlm.kernels.cpu import decode_step as ds, native
T = collections.defaultdict(list)
orig = ds.DecodeStep.__call__
lib = None
def timed(self, x, ropes, kv, metas, lora_slots=None):
    global lib
    if lib is None:
        lib = ctypes.CDLL(str(native._build()))
        for n in ("actorlm_lora_seconds", "actorlm_linear_seconds"): getattr(lib, n).restype = ctypes.c_double
    lib.actorlm_lora_seconds(); lib.actorlm_linear_seconds()
    t0 = time.perf_counter()
    r = orig(self, x, ropes, kv, metas, lora_slots)
    d = time.perf_counter() - t0
    key = "lora" if lora_slots is not None and int(lora_slots.max()) >= 0 else "base"
    if r is not None:
        T[key].append((d, lib.actorlm_lora_seconds(), lib.actorlm_linear_seconds()))
    return r
ds.DecodeStep.__call__ = timed
