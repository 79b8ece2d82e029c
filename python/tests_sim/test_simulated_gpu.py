"""Real PyTorch on the project's simulated GPU: the CUDA runtime face
(crates/cuda-runtime) over the strict driver double (crates/cuda-double).

Run by ``crates/cuda-runtime/tests/simulated_torch.rs`` through
``scripts/simulated-gpu.sh``, once per allocator, each in one process
(importing torch costs seconds), the allocator named by ``QUILT_SIM_ALLOCATOR``:

* ``classic``: torch's caching allocator;
* ``expandable``: torch's expandable segments
  (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, set by the runner),
  over the double's ``cuMem*`` calls, which torch resolves at run time;
* ``quilt``: ``quilt_torch.enable()`` with ``QUILT_ALLOC_CONF=backend:cuda``
  (set by the runner): Quilt's CUDA backend over the same double.

Kernels compute nothing on the double, so every byte checked here is moved
by copies (``.to``, ``.cpu``, ``clone``, ``copy_``) or memsets; ops that are
kernels only shape the allocation pattern. Only torch's public API and
``quilt_torch.enable()`` are used; ``test_allocator_scenarios.py`` (beside
this file) compares torch's allocator and Quilt on more scenarios.
"""

import gc
import os
import unittest

ALLOCATOR = os.environ.get("QUILT_SIM_ALLOCATOR", "classic")

if ALLOCATOR == "quilt":
    import quilt_torch

    quilt_torch.enable()

import torch  # noqa: E402  (after enable(), which must come first)

MiB = 1 << 20


def pattern(n, seed):
    """``n`` bytes that differ from every other seed's and position's."""
    return torch.tensor(
        [(i * 131 + seed * 17 + (i >> 8)) % 251 for i in range(min(n, 4096))],
        dtype=torch.uint8,
    ).repeat((n + 4095) // 4096)[:n]


def device_free():
    """Free bytes of device 0 as the driver counts them."""
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info(0)[0]


class SimulatedGpu(unittest.TestCase):
    def test_device_count_is_the_doubles(self):
        expected = int(os.environ.get("QUILT_CUDA_DOUBLE_DEVICES", "1"))
        self.assertTrue(torch.cuda.is_available())
        self.assertEqual(torch.cuda.device_count(), expected)
        props = torch.cuda.get_device_properties(0)
        self.assertIn("Quilt CUDA double", props.name)
        self.assertEqual((props.major, props.minor), (9, 0))

    def test_bytes_survive_copies_of_many_sizes(self):
        for i, n in enumerate([1, 7, 512, 4097, 65536 + 3, MiB + 5, 3 * MiB, 21 * MiB + 1]):
            host = pattern(n, i)
            dev = host.to("cuda")
            self.assertEqual(dev.device.type, "cuda")
            self.assertTrue(torch.equal(dev.cpu(), host), n)
            twin = dev.clone()  # device to device
            del dev
            other = torch.empty(n, dtype=torch.uint8, device="cuda")
            other.copy_(twin)
            self.assertTrue(torch.equal(other.cpu(), host), n)
            half = twin[n // 2 :].clone()  # an offset inside a block
            self.assertTrue(torch.equal(half.cpu(), host[n // 2 :]), n)

    def test_pinned_and_non_blocking_copies(self):
        host = pattern(2 * MiB, 3).pin_memory()
        dev = host.to("cuda", non_blocking=True)
        back = torch.empty_like(host).pin_memory()
        back.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        self.assertTrue(torch.equal(back, host))

    def test_second_device(self):
        if torch.cuda.device_count() < 2:
            self.skipTest("one device")
        host = pattern(MiB + 17, 5)
        with torch.cuda.device(1):
            dev = host.to("cuda")
            self.assertEqual(dev.device, torch.device("cuda", 1))
            self.assertTrue(torch.equal(dev.clone().cpu(), host))

    def test_copies_between_devices(self):
        if torch.cuda.device_count() < 2:
            self.skipTest("needs two devices (QUILT_CUDA_DOUBLE_DEVICES=2 or more)")
        one = torch.device("cuda", 1)
        # .to between devices, both ways, on the source device's stream, after
        # torch enables peer access: a cudaMemcpyAsync under torch's
        # allocators (expandable segments first map their memory for the
        # peer), a cudaMemcpyPeerAsync under Quilt's.
        for i, n in enumerate([1, 4097, MiB + 5, 9 * MiB + 3]):
            host = pattern(n, 50 + i)
            on0 = host.to("cuda:0")
            on1 = on0.to("cuda:1")
            self.assertEqual(on1.device, one)
            back = on1.to("cuda:0")
            self.assertTrue(torch.equal(on1.cpu(), host), n)
            self.assertTrue(torch.equal(back.cpu(), host), n)
        # copy_ both ways, non-blocking, on a side stream of the source
        # device: the destination device's stream waits for it by event.
        host = pattern(3 * MiB, 60)
        on0 = host.to("cuda:0")
        into1 = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda:1")
        side = torch.cuda.Stream(device=0)
        with torch.cuda.stream(side):
            into1.copy_(on0, non_blocking=True)
        into0 = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda:0")
        into0.copy_(into1, non_blocking=True)
        self.assertTrue(torch.equal(into0.cpu(), host))
        self.assertTrue(torch.equal(into1.cpu(), host))
        # A transposed (dense) tensor is one memcpy, its bytes kept; a
        # strided slice goes through torch's copy kernel on the source device
        # (peer access is on), which computes nothing on the double: only
        # accepted, its bytes unspecified.
        grid = pattern(1 << 20, 61).view(1024, 1024)
        moved = grid.to("cuda:0").t().to("cuda:1")
        self.assertTrue(torch.equal(moved.cpu(), grid.t()))
        strided = grid.to("cuda:0")[:, ::2].to("cuda:1")
        self.assertEqual((strided.device, strided.shape), (one, (1024, 512)))
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)

    def test_side_streams_events_and_record_stream(self):
        main = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        low = torch.cuda.Stream(priority=-1)
        self.assertEqual(low.priority, -1)
        host = pattern(5 * MiB, 7)
        start = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True)
        start.record(main)
        with torch.cuda.stream(side):
            side.wait_stream(main)
            on_side = host.to("cuda", non_blocking=True)
            copy = on_side.clone()
            done.record(side)
        main.wait_event(done)
        copy.record_stream(main)
        on_side.record_stream(main)
        result = copy.cpu()
        done.synchronize()
        self.assertTrue(done.query())
        self.assertGreaterEqual(start.elapsed_time(done), 0.0)
        self.assertTrue(torch.equal(result, host))
        del copy, on_side
        again = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
        again.copy_(host.to("cuda"))
        self.assertTrue(torch.equal(again.cpu(), host))

    def test_graph_of_copies_replays_and_computes(self):
        n = 3 * MiB
        static_in = pattern(n, 11).to("cuda")
        static_out = torch.empty_like(static_in)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_out.copy_(static_in)
            static_out[: n // 2].copy_(static_in[n // 2 :])
        for seed in (12, 13):
            new = pattern(n, seed)
            static_in.copy_(new.to("cuda"))
            g.replay()
            torch.cuda.synchronize()
            expected = new.clone()
            expected[: n // 2] = new[n // 2 :]
            self.assertTrue(torch.equal(static_out.cpu(), expected), seed)
        del g

    # Under every allocator (Quilt's private pools since issue 36's fix).
    def test_graph_keeps_memory_it_freed_while_it_lives(self):
        self._graph_keeps_memory_it_freed_while_it_lives()

    def _graph_keeps_memory_it_freed_while_it_lives(self):
        # Relaxed capture: the double refuses VMM calls under a global-mode
        # capture (see test_expandable_growth_under_global_capture_is_refused),
        # and a graph's private pool may need a new segment; what this test
        # checks is which memory the allocator hands out, not that rule.
        n = 4 * MiB
        a, b = pattern(n, 21), pattern(n, 22)
        static_in = a.to("cuda")
        torch.cuda.empty_cache()
        free_before = device_free()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="relaxed"):
            tmp = static_in.clone()  # allocated and written inside the capture
            freed_at = tmp.data_ptr()
            del tmp  # freed inside the capture: the graph still writes there
        after = torch.empty(n, dtype=torch.uint8, device="cuda")
        after.copy_(b.to("cuda"))
        g.replay()
        torch.cuda.synchronize()
        overlaps = freed_at < after.data_ptr() + n and after.data_ptr() < freed_at + n
        self.assertFalse(overlaps, "a tensor allocated after capture got memory the live graph writes")
        self.assertTrue(torch.equal(after.cpu(), b), "replaying the graph overwrote a later tensor")
        del after, g
        gc.collect()
        torch.cuda.empty_cache()
        self.assertGreaterEqual(device_free(), free_before, "the graph's memory did not come back after del g")

    @unittest.skipIf(ALLOCATOR != "expandable", "torch's expandable segments only")
    def test_expandable_growth_under_global_capture_is_refused(self):
        # A graph's private pool that needs a new expandable segment makes
        # torch reserve and map memory (cuMemAddressReserve, cuMemCreate,
        # cuMemMap) inside the capture; the double refuses those calls under
        # a global-mode capture and invalidates it, and torch reports it.
        static_in = torch.ones(4 * MiB, dtype=torch.uint8, device="cuda")
        g = torch.cuda.CUDAGraph()
        with self.assertRaisesRegex(RuntimeError, "capturing|capture"):
            with torch.cuda.graph(g):
                static_in.clone()
        del g
        gc.collect()
        host = pattern(MiB, 41)
        self.assertTrue(torch.equal(host.to("cuda").cpu(), host))

    def test_training_loop_allocation_pattern(self):
        torch.manual_seed(0)
        weights = [pattern(s, i).to("cuda") for i, s in enumerate([MiB, 3 * MiB, 7 * MiB + 4096])]
        base = device_free()
        for step in range(6):
            acts = [torch.empty((step % 3 + 1) * MiB + 512 * k, dtype=torch.uint8, device="cuda") for k in range(4)]
            grads = [w.clone() for w in weights]  # "backward": same sizes as the weights
            for g_, w in zip(grads, weights):
                g_.add_(1)  # a kernel: queued, computes nothing on the double
                w.copy_(w)  # the "update": a device copy
            scratch = torch.zeros(2 * MiB, device="cuda")  # a memset or a fill kernel
            del acts, grads, scratch
        torch.cuda.synchronize()
        for i, s in enumerate([MiB, 3 * MiB, 7 * MiB + 4096]):
            self.assertTrue(torch.equal(weights[i].cpu(), pattern(s, i)))
        del weights, g_, w  # the loop's names hold the last tensors too
        gc.collect()
        torch.cuda.empty_cache()
        self.assertGreaterEqual(device_free(), base)

    def test_snapshot_shows_live_tensors_and_their_history(self):
        torch.cuda.memory._record_memory_history(max_entries=1000)
        try:
            x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                y = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
            snap = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        live = set()
        for seg in snap["segments"]:
            at = seg["address"]
            for block in seg["blocks"]:
                if block["state"] == "active_allocated":
                    live.add(at)
                at += block["size"]
        self.assertIn(x.data_ptr(), live)
        self.assertIn(y.data_ptr(), live)
        allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
        self.assertTrue(any(e["addr"] == y.data_ptr() for e in allocs))
        del x, y

    def test_out_of_memory_raises_and_recovers(self):
        total = torch.cuda.get_device_properties(0).total_memory
        with self.assertRaises(torch.OutOfMemoryError):
            torch.empty(total + 64 * MiB, dtype=torch.uint8, device="cuda")
        host = pattern(MiB, 31)
        self.assertTrue(torch.equal(host.to("cuda").cpu(), host))

    def test_empty_cache_gives_memory_back(self):
        torch.cuda.empty_cache()
        base = device_free()
        blocks = [torch.empty(32 * MiB, dtype=torch.uint8, device="cuda") for _ in range(4)]
        self.assertLess(device_free(), base)
        del blocks
        gc.collect()
        torch.cuda.empty_cache()
        self.assertGreaterEqual(device_free(), base)

    def test_memory_fraction_limits_allocation(self):
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(0.25, 0)
        try:
            with self.assertRaises(torch.OutOfMemoryError):
                torch.empty(total // 2, dtype=torch.uint8, device="cuda")
            small = torch.empty(total // 16, dtype=torch.uint8, device="cuda")
            del small
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)
        gc.collect()
        torch.cuda.empty_cache()

    def test_memory_fraction_below_live_memory_is_taken(self):
        # torch takes any fraction in [0, 1], whatever is allocated now:
        # live tensors keep their memory, no more is mapped, and the
        # fraction reads back as set.
        live = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        try:
            torch.cuda.set_per_process_memory_fraction(0.0, 0)
            self.assertEqual(torch.cuda.get_per_process_memory_fraction(0), 0.0)
            with self.assertRaises(torch.OutOfMemoryError):
                torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
            self.assertEqual(live.device.type, "cuda")
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)
        grown = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        del grown, live
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    unittest.main()
