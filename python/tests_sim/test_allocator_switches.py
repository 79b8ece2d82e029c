"""Two switches of torch's allocator interface on the simulated GPU, under
the allocator named by ``QUILT_SIM_ALLOCATOR`` (see
``test_simulated_gpu.py``); torch's own allocator and Quilt answer alike:

* ``torch.cuda.caching_allocator_enable(False)``: memory then comes
  straight from the runtime (``cudaMalloc``), outside the allocator's
  statistics, and goes back with ``cudaFree``;
* ``torch.cuda.memory._set_memory_metadata``: the history entries that the
  calling thread's allocations, frees and ``empty_cache`` record carry it
  (``user_metadata``), and no other thread's.
"""

import gc
import os
import threading
import unittest

ALLOCATOR = os.environ.get("QUILT_SIM_ALLOCATOR", "classic")

if ALLOCATOR == "quilt":
    import quilt_torch

    quilt_torch.enable()

import torch  # noqa: E402  (after enable(), which must come first)

MiB = 1 << 20


def stat(key):
    return torch.cuda.memory_stats()[key]


class CachingDisabled(unittest.TestCase):
    def test_raw_alloc_and_tensors_bypass_the_allocator_while_it_is_disabled(self):
        gc.collect()
        torch.cuda.empty_cache()
        stream = torch.cuda.current_stream().cuda_stream
        requested = stat("requested_bytes.all.allocated")
        allocated = stat("allocated_bytes.all.current")
        free_before = torch.cuda.mem_get_info()[0]
        torch.cuda.caching_allocator_enable(False)
        try:
            p = torch._C._cuda_cudaCachingAllocator_raw_alloc(MiB, stream)
            t = torch.full((MiB,), 7, dtype=torch.uint8).to("cuda")
            self.assertEqual(stat("requested_bytes.all.allocated"), requested)
            self.assertEqual(stat("allocated_bytes.all.current"), allocated)
            self.assertLess(torch.cuda.mem_get_info()[0], free_before, "the runtime's memory")
            torch._C._cuda_cudaCachingAllocator_raw_delete(p)
        finally:
            torch.cuda.caching_allocator_enable(True)
        # A tensor made while disabled is freed by cudaFree, whenever it dies.
        self.assertEqual(int(t[5].item()), 7)
        del t
        torch.cuda.synchronize()
        self.assertEqual(torch.cuda.mem_get_info()[0], free_before)
        # Enabled again: the allocator answers, and counts.
        p = torch._C._cuda_cudaCachingAllocator_raw_alloc(MiB, stream)
        self.assertEqual(stat("requested_bytes.all.allocated") - requested, MiB)
        torch._C._cuda_cudaCachingAllocator_raw_delete(p)


class UserMetadata(unittest.TestCase):
    def tearDown(self):
        torch.cuda.memory._record_memory_history(None)
        torch.cuda.memory._set_memory_metadata("")

    def entries(self):
        return torch.cuda.memory._snapshot()["device_traces"][0]

    def test_entries_carry_the_metadata_their_thread_set(self):
        self.assertTrue(torch.cuda.memory._memory_metadata_supported())
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.memory._record_memory_history(context=None, max_entries=1000)
        torch.cuda.memory._set_memory_metadata("phase one")
        self.assertEqual(torch.cuda.memory._get_memory_metadata(), "phase one")
        x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
        x_ptr = x.data_ptr()
        torch.cuda.memory._set_memory_metadata("phase two")
        del x

        other = {}

        def elsewhere():
            # Another thread's entries carry its own (no) metadata.
            self.assertEqual(torch.cuda.memory._get_memory_metadata(), "")
            y = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
            other["ptr"] = y.data_ptr()
            del y

        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
        torch.cuda.memory.empty_cache()
        torch.cuda.memory._set_memory_metadata("")
        z = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        z_ptr = z.data_ptr()
        del z

        entries = self.entries()
        # In recording order: x, then the other thread's y (which may take
        # x's address), then z.
        allocs = [(e["addr"], e["user_metadata"]) for e in entries if e["action"] == "alloc"]
        frees = [(e["addr"], e["user_metadata"]) for e in entries if e["action"] == "free_requested"]
        self.assertEqual(allocs, [(x_ptr, "phase one"), (other["ptr"], ""), (z_ptr, "")])
        self.assertEqual(frees, [(x_ptr, "phase two"), (other["ptr"], ""), (z_ptr, "")])
        freed = [e["user_metadata"] for e in entries if e["action"] in ("segment_free", "segment_unmap")]
        self.assertTrue(freed, "empty_cache recorded segment frees")
        self.assertIn("phase two", freed)


if __name__ == "__main__":
    unittest.main()
