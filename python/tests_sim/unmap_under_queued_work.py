"""The double refuses, through the runtime face, an unmap under work that
torch's stream still has queued.

A side stream is kept busy by ``torch.cuda._sleep`` (a kernel: queued work
of unknown footprint, so the stream stays busy until the double runs it),
then a copy into a tensor is queued behind it. Unmapping the tensor's memory
through the driver (``cuMemUnmap`` of the double, the ``libcuda.so.1`` this
process loaded) is accepted, as CUDA's reference allows, but the queued copy
faults when it runs: the context is poisoned and torch's next
synchronisation raises "an illegal memory access was encountered". Run by
``crates/cuda-runtime/tests/simulated_torch.rs``, which checks the lines
this prints and the double's report on stderr.
"""

import ctypes

import torch

MiB = 1 << 20

cuda = ctypes.CDLL("libcuda.so.1")
src = torch.ones(MiB, dtype=torch.uint8, device="cuda")
dst = torch.empty(MiB, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()

side = torch.cuda.Stream()
with torch.cuda.stream(side):
    torch.cuda._sleep(1_000_000)
    dst.copy_(src)
print("side stream busy:", not side.query())

base, size = ctypes.c_uint64(), ctypes.c_size_t()
rc = cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(dst.data_ptr()))
print("cuMemGetAddressRange:", rc)
rc = cuda.cuMemUnmap(base, size)
print("cuMemUnmap under queued work:", rc)
try:
    torch.cuda.synchronize()
    print("synchronize: no error")
except Exception as exc:  # torch.AcceleratorError / RuntimeError
    print("synchronize raised:", type(exc).__name__, str(exc).splitlines()[0])
