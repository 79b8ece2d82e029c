"""The private pool each segment of a snapshot belongs to, on the simulated
GPU under the allocator named by ``QUILT_SIM_ALLOCATOR`` (see
``test_simulated_gpu.py``); torch's own allocator and Quilt answer alike:

* a segment of a private pool (``torch.cuda.MemPool``, a CUDA graph's pool)
  carries the pool's id (``segment_pool_id``), and the stream it was
  allocated on; any other carries ``(0, 0)``;
* a pool's segments hold only the pool's blocks, the others only blocks
  outside pools, even when the two are allocated in turn;
* a graph captured on a stream that another joins has segments on both
  streams, all of its one pool;
* a pool released with nothing live in it owns no segment once the cache
  is emptied;
* ``MemPool.snapshot()`` lists only that pool's segments, also when
  several threads each used a pool of their own.
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


def segments():
    return torch.cuda.memory._snapshot()["segments"]


def holding(segs, ptr):
    """The segment whose range holds `ptr`."""
    found = [s for s in segs if s["address"] <= ptr < s["address"] + s["total_size"]]
    assert len(found) == 1, (hex(ptr), segs)
    return found[0]


class PoolIds(unittest.TestCase):
    def setUp(self):
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def test_mempool_segments_carry_the_pool_id_and_hold_only_its_blocks(self):
        pool = torch.cuda.MemPool()
        stream = torch.cuda.current_stream().cuda_stream
        before = torch.empty(MiB, dtype=torch.int8, device="cuda")
        with torch.cuda.use_mem_pool(pool):
            pooled = torch.empty(MiB, dtype=torch.int8, device="cuda")
            big = torch.empty(24 * MiB, dtype=torch.int8, device="cuda")
        after = torch.empty(MiB, dtype=torch.int8, device="cuda")
        segs = segments()
        self.assertTrue(all(s["segment_pool_id"] in {(0, 0), pool.id} for s in segs), segs)
        for t in (pooled, big):
            s = holding(segs, t.data_ptr())
            self.assertEqual(s["segment_pool_id"], pool.id)
            self.assertEqual(s["stream"], stream)
        for t in (before, after):
            self.assertEqual(holding(segs, t.data_ptr())["segment_pool_id"], (0, 0))
        of_pool = [s for s in segs if s["segment_pool_id"] == pool.id]
        self.assertEqual(sum(s["active_size"] for s in of_pool), 25 * MiB)
        of_none = [s for s in segs if s["segment_pool_id"] == (0, 0)]
        self.assertEqual(sum(s["active_size"] for s in of_none), 2 * MiB)
        del pooled, big, before, after, pool
        gc.collect()
        torch.cuda.empty_cache()
        self.assertEqual([s for s in segments() if s["segment_pool_id"] != (0, 0)], [])

    @unittest.skipIf(
        ALLOCATOR == "expandable",
        "torch's expandable segments map memory inside the capture, which the driver refuses (operation not permitted when stream is capturing)",
    )
    def test_a_pools_own_snapshot_lists_only_its_segments(self):
        pools = [torch.cuda.MemPool() for _ in range(4)]
        outside = torch.empty(MiB, dtype=torch.uint8, device="cuda")

        def use(pool):
            with torch.cuda.use_mem_pool(pool):
                x = torch.empty(16, device="cuda")
                del x
                torch.cuda.empty_cache()

        threads = [threading.Thread(target=use, args=(p,)) for p in pools]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for p in pools:
            own = p.snapshot()
            self.assertEqual(len(own), 1, own)
            self.assertEqual(tuple(own[0]["segment_pool_id"]), tuple(p.id))
        del outside

    @unittest.skipIf(
        ALLOCATOR == "expandable",
        "torch's expandable segments map a graph pool's memory during the capture, which the "
        "driver refuses under global capture mode (test_simulated_gpu: "
        "test_expandable_growth_under_global_capture_is_refused)",
    )
    def test_a_graph_captured_across_two_streams_has_segments_of_its_pool_on_both(self):
        x = torch.ones(4 * MiB, device="cuda")
        existing = {s["segment_pool_id"] for s in segments()}
        g = torch.cuda.CUDAGraph()
        s0, s1 = torch.cuda.Stream(), torch.cuda.Stream()
        s0.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s0):
            g.capture_begin()
            z = x + x
        with torch.cuda.stream(s1):
            s1.wait_stream(s0)
            w = z + x
        s0.wait_stream(s1)
        with torch.cuda.stream(s0):
            g.capture_end()
        new = [s for s in segments() if s["segment_pool_id"] not in existing]
        self.assertEqual(len({s["segment_pool_id"] for s in new}), 1, new)
        self.assertEqual(new[0]["segment_pool_id"], g.pool())
        self.assertEqual({s["stream"] for s in new}, {s0.cuda_stream, s1.cuda_stream})
        segs = segments()
        self.assertEqual(holding(segs, z.data_ptr())["stream"], s0.cuda_stream)
        self.assertEqual(holding(segs, w.data_ptr())["stream"], s1.cuda_stream)
        torch.cuda.synchronize()
        del g, z, w
        gc.collect()
        torch.cuda.empty_cache()
        self.assertEqual([s for s in segments() if s["segment_pool_id"] not in existing], [])


if __name__ == "__main__":
    unittest.main()
